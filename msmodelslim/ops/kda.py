"""Kimi Delta Attention (KDA) in plain PyTorch: chunked prefill, recurrent decode, the gate and l2-norm.

Runs on any device torch runs on (CPU, NPU, CUDA); no Triton. Call signatures follow fla (0.4 and 0.6) so the
functions can be swapped into model code at run time (see ``msmodelslim.model.kimi_k3.runtime_patches``).

Recurrence (per sequence and head, state S [K, V] in fp32)::

    S <- Diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - k_t^T S)^T;   o_t = S^T (scale * q_t)

Chunked form (chunk C=64, Gamma = in-chunk cumsum of g): intra-chunk scores need exp(Gamma_i - Gamma_j) for i >= j,
and Kimi's gates (per-step log-decay down to about -270) make exp(Gamma) alone overflow. The chunk is halved
recursively; each lower-left quadrant factors through the first row r of its lower half,
``(x_i e^{Gamma_i-Gamma_r}) @ (k_j e^{Gamma_r-Gamma_j})^T`` with j < r <= i, so every exponent is <= 0 and every
product is a plain matmul. The UT transform's unit-triangular inverse is built by the same recursive doubling.
Memory is O(T): no [C, C, K] pairwise tensor is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
GROUP_BUDGET = 1 << 17  # elements of q per group of chunks handled at once on CPU (keeps a group in cache)
GROUP_BUDGET_ACCEL = 1 << 26  # on accelerators (few, large launches)
LOG2E = 1.4426950408889634

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "fused_kda_gate",
    "kda_gate",
    "l2norm",
    "naive_recurrent_kda_fp64",
]


# ----------------------------------------------------------------------------------------------------------------------
# small pieces


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None, dim: int = -1) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` in fp32 (fla's l2norm: eps inside the sqrt, not a clamp)."""
    y = x.float()
    y = y * torch.rsqrt((y * y).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
    beta: float = 1.0,
    threshold: float = 20.0,
) -> torch.Tensor:
    """KDA log-decay from the raw gate ``g`` [..., H, K]: ``-exp(A_log[h]) * softplus(g + dt_bias)`` in fp32.

    ``A_log`` has H elements (any shape, e.g. [1, 1, H, 1]); ``dt_bias`` has H*K. softplus is linear above
    ``threshold`` (20, as fla and transformers). With ``lower_bound`` (fla's safe-gate form) the gate is
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (or without ``exp(A_log)`` when ``A_log`` is None).
    """
    H, K = g.shape[-2:]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(H, K)
    if lower_bound is not None:
        if A_log is not None:
            x = A_log.float().reshape(H, 1).exp() * x
        out = lower_bound * torch.sigmoid(x)
    else:
        if A_log is None:
            raise ValueError("kda_gate: A_log is required unless lower_bound is given")
        out = -A_log.float().reshape(H, 1).exp() * F.softplus(x, beta=beta, threshold=threshold)
    return out.to(output_dtype)


def fused_kda_gate(g: torch.Tensor, A_log: torch.Tensor | None = None, *args, **kwargs):
    """fla's ``fused_kda_gate`` in both call styles.

    * fla 0.4 (Kimi HF remote code): ``fused_kda_gate(g [..., H*K], A, head_k_dim, g_bias=None, [b=None,]
      beta=1.0, threshold=20.0)`` -> [..., H, K] (and ``sigmoid(b)`` as a second result when ``b`` is given).
    * fla 0.6: ``fused_kda_gate(g [..., H, K], A_log, dt_bias=None, lower_bound=None, output_dtype=fp32)``.
    """
    if "A" in kwargs:
        A_log = kwargs.pop("A")
    head_k_dim = kwargs.pop("head_k_dim", kwargs.pop("head_dim", None))
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        head_k_dim, args = args[0], args[1:]
    if head_k_dim is None:  # fla 0.6
        names = ("dt_bias", "lower_bound", "output_dtype")
        kwargs.update(zip(names, args))
        return kda_gate(g, A_log, **kwargs)
    # fla 0.4
    names = ("g_bias", "b", "beta", "threshold") if len(args) == 4 else ("g_bias", "beta", "threshold")
    kwargs.update(zip(names, args))
    b = kwargs.pop("b", None)
    out = kda_gate(
        g.unflatten(-1, (-1, head_k_dim)),
        A_log,
        kwargs.pop("g_bias", None),
        beta=kwargs.pop("beta", 1.0),
        threshold=kwargs.pop("threshold", 20.0),
    )
    if kwargs:
        raise TypeError(f"fused_kda_gate: unexpected arguments {sorted(kwargs)}")
    return out if b is None else (out, b.float().sigmoid())


# ----------------------------------------------------------------------------------------------------------------------
# variable length: packed [1, total, ...] <-> padded [N, T_max, ...] (zero padding is inert: g=0, beta=0, k=0)


def _seq_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    t_max = int(lengths.max().item()) if lengths.numel() else 0
    pos = torch.arange(t_max, device=cu_seqlens.device)
    valid = pos[None, :] < lengths[:, None]
    index = (cu_seqlens[:-1, None] + pos[None, :]).clamp(max=max(int(cu_seqlens[-1].item()) - 1, 0))
    return index, valid, t_max


def _to_padded(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    y = x[0][index]  # [N, T_max, ...]
    mask = valid.reshape(*valid.shape, *([1] * (y.dim() - 2)))
    return torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))


def _from_padded(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return y[valid].unsqueeze(0)


# ----------------------------------------------------------------------------------------------------------------------
# argument handling shared by chunk_kda and fused_recurrent_kda


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, lower_bound, A_log, dt_bias):
    H, HV = q.shape[2], v.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape, got q={tuple(q.shape)} k={tuple(k.shape)}")
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    K = q.shape[-1]
    if scale is None:
        scale = K**-0.5
    q, k, v = q.float(), k.float(), v.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if HV != H:  # grouped value attention: each q/k head serves HV/H value heads
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log (or lower_bound)")
        g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
    g = g.float()
    beta = beta.float()
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    elif allow_neg_eigval:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if beta.dim() != 3:
        raise ValueError(f"beta must be [B, T, HV] (head-wise), got {tuple(beta.shape)}")
    return q * scale, k, v, g, beta


def _run(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first, flags):
    out_dtype = q.dtype
    B = q.shape[0]
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (packed sequences), got {B}")
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, *flags)
    h0 = initial_state
    if h0 is not None:
        h0 = h0.float()
        if state_v_first:
            h0 = h0.transpose(-1, -2)
    if cu_seqlens is not None:
        if h0 is not None and h0.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(f"initial_state has {h0.shape[0]} states for {len(cu_seqlens) - 1} sequences")
        index, valid, _ = _seq_index(cu_seqlens)
        q, k, v, g, beta = (_to_padded(x, index, valid) for x in (q, k, v, g, beta))
        o, ht = core(q, k, v, g, beta, h0)
        o = _from_padded(o, valid)
    else:
        o, ht = core(q, k, v, g, beta, h0)
    if not output_final_state:
        ht = None
    elif state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o.to(out_dtype), ht


# ----------------------------------------------------------------------------------------------------------------------
# recurrent (decode) core


def _recurrent_core(q, k, v, g, beta, h0):
    """q (pre-scaled), k, v, g: [B, T, H, *] fp32; beta [B, T, H]; h0 [B, H, K, V] or None."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = h0 if h0 is not None else q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t].unsqueeze(-2)  # [B, H, 1, K]
        delta = (v[:, t] - (kt @ S).squeeze(-2)) * beta[:, t].unsqueeze(-1)
        S = S + kt.transpose(-1, -2) @ delta.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o, S


# ----------------------------------------------------------------------------------------------------------------------
# chunked (prefill) core


def _exp2_neg(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """2**x for an exponent known to be <= 0 (base 2: exp2 is ~3x cheaper than exp on CPUs).

    On CPUs clamped at -115 (2^-115 ~ e^-80) so results stay normal floats: denormals are very slow there, and the
    values cut off are zero for every purpose here (gradients below the clamp are zero, as the true ones are
    ~1e-35). Accelerators handle denormals at full speed and skip the extra pass.
    ``inplace`` reuses a temporary ``x`` (skipped when autograd records it).
    """
    if x.device.type != "cpu":
        return x.exp2_() if inplace and not x.requires_grad else torch.exp2(x)
    if inplace and not x.requires_grad:
        return x.clamp_(min=-115.0).exp2_()
    return torch.exp2(x.clamp(min=-115.0))


def _diag_blocks(A: torch.Tensor, s: int) -> torch.Tensor:
    """Writable view [.., s, s, C/s] of the s x s diagonal blocks of square matrices A [.., C, C]."""
    *lead, C, _ = A.shape
    return A.view(*lead, C // s, s, C // s, s).diagonal(dim1=-4, dim2=-2)


def _matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T for a [.., m, d], b [.., n, d]; for tiny blocks on CPUs a contiguous multiply-sum beats a batch of tiny
    GEMMs (accelerators batch them well)."""
    if a.shape[-2] >= 8 or a.device.type != "cpu":
        return a @ b.transpose(-1, -2)
    return (a.unsqueeze(-2) * b.unsqueeze(-3)).sum(-1)


def _intra_chunk_scores(X: torch.Tensor, G2: torch.Tensor) -> torch.Tensor:
    """Aqk (i >= j) and Akk (i > j) with entries sum_d x_id k_jd 2^(G_id - G_jd) (x = q for Aqk, k for Akk), for
    chunks X [.., C, 2, K] holding q and k rows interleaved; G2 [.., C, K] = in-chunk cumulative log2-decay
    (non-increasing along C). Returns A [.., C, 2, C]: A[.., i, 0, :] is row i of Aqk, A[.., i, 1, :] of Akk.

    Recursive halving: every s x s diagonal block (s = C, C/2, .., 2) contributes its lower-left quadrant through
    the first row r of its lower half, (x_i 2^(G_i - G_r)) @ (k_j 2^(G_r - G_j))^T with j < r <= i, so both
    exponents are <= 0 and nothing can overflow whatever the gates. The quadrants tile the strict lower triangle
    (each pair once); the diagonal of Aqk is q_i . k_i. A few passes over q and k per level and no pairwise
    [C, C, K] tensor; one matmul serves both matrices.
    """
    *lead, C, _, K = X.shape
    A = X.new_zeros(*lead, C, 2, C)
    s = C
    while s >= 2:
        h, nb = s // 2, C // s
        Gb = G2.reshape(*lead, nb, 2, h, K)
        Xb = X.reshape(*lead, nb, 2, h, 2, K)
        ref = Gb[..., 1, :1, :]  # [.., nb, 1, K]: first row of each lower half
        # (the contiguous factor first: elementwise kernels follow the first operand's layout, ~5x faster here)
        lower = _exp2_neg(Gb[..., 1, :, :] - ref, inplace=True).unsqueeze(-2) * Xb[..., 1, :, :, :]
        upper = _exp2_neg(ref - Gb[..., 0, :, :], inplace=True) * Xb[..., 0, :, 1, :]
        quad = _matmul_nt(lower.reshape(*lead, nb, 2 * h, K), upper)  # [.., nb, 2h, h]
        blocks = A.view(*lead, nb, s, 2, nb, s).diagonal(dim1=-5, dim2=-2)  # [.., s, 2, s, nb]
        blocks[..., h:, :, :h, :] = quad.reshape(*lead, nb, h, 2, h).movedim(-4, -1)
        s = h
    A[..., 0, :].diagonal(dim1=-2, dim2=-1).copy_((X[..., 0, :] * X[..., 1, :]).sum(-1))
    return A


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [.., C, C] (C a power of two), by recursive doubling:
    inv([[A, 0], [B, D]]) = [[A^-1, 0], [-D^-1 B A^-1, D^-1]] over block sizes 2, 4, .., C (matmuls only, no
    triangular-solve calls; the same arithmetic as blocked forward substitution)."""
    C = L.shape[-1]
    grad = torch.is_grad_enabled() and L.requires_grad
    inv = torch.zeros_like(L)
    inv.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    s = 2
    while s <= C:
        h = s // 2
        blocks = _diag_blocks(inv, s)  # [.., s, s, C/s]
        a_inv, d_inv = (blocks[..., sl, sl, :].movedim(-1, -3) for sl in (slice(None, h), slice(h, None)))
        if grad:  # autograd keeps them for backward while later levels write into `inv`
            a_inv, d_inv = a_inv.clone(), d_inv.clone()
        b = _diag_blocks(L, s)[..., h:, :h, :].movedim(-1, -3)  # [.., C/s, h, h]
        low = _matmul_nt(_matmul_nt(d_inv, b.transpose(-1, -2)), a_inv.transpose(-1, -2))
        blocks[..., h:, :h, :] = -low.movedim(-3, -1) if grad else low.neg_().movedim(-3, -1)
        s *= 2
    return inv


def _chunk_core(q, k, v, g, beta, h0, chunk_size: int = CHUNK_SIZE):
    """q (pre-scaled), k, v, g: [B, T, H, *] fp32 (g <= 0: log-decay); beta [B, T, H]; h0 [B, H, K, V] or None.

    Per chunk of C steps with state S at its start (G = in-chunk cumulative log2-decay):
        W = T (beta k 2^G),  U = T (beta v)  with  T = (I + strict(beta Akk))^-1   (UT transform)
        v_new = U - W S;  o = (q 2^G) S + Aqk v_new;  S <- 2^G_last S + (k 2^(G_last - G))^T v_new
    Everything but the last two lines is independent per chunk and computed for a group of chunks at once; the
    sequential walk over chunks is then 5 batched matmul-sized ops per chunk.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    BH = B * H

    def chunks(x):  # [B, T, H, D] -> [N, B*H, C, D]: chunk-major, so a chunk's slice is contiguous
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, N, C, H, x.shape[-1]).permute(1, 0, 3, 2, 4).reshape(N, BH, C, x.shape[-1])

    X = chunks(torch.stack([q, k], dim=-2).flatten(-2)).unflatten(-1, (2, K))  # [N, BH, C, 2, K] q/k interleaved
    v = chunks(v)
    b = chunks(beta.unsqueeze(-1))  # [N, BH, C, 1]
    # In-chunk cumulative log2-decay. torch's CPU cumsum over a middle dim is slow (~5x a running sum of C slices).
    G2 = chunks(g * LOG2E)
    if g.device.type == "cpu":
        for i in range(1, C):
            G2[..., i, :] += G2[..., i - 1, :]
    else:
        G2 = G2.cumsum(-2)

    budget = GROUP_BUDGET if q.device.type == "cpu" else GROUP_BUDGET_ACCEL
    group = max(1, budget // (BH * C * K))
    S = h0.reshape(BH, K, V) if h0 is not None else q.new_zeros(BH, K, V)
    o = q.new_empty(B, N * C, H, V)
    o_chunks = o.view(B, N, C, H, V).permute(1, 0, 3, 2, 4)  # written chunk by chunk, [N, B, H, C, V] view
    for n0 in range(0, N, group):
        sl = slice(n0, n0 + group)
        Xn, vn, bn, Gn = X[sl], v[sl], b[sl], G2[sl]
        A = _intra_chunk_scores(Xn, Gn)
        Aqk, Akk = A[..., 0, :], A[..., 1, :]
        XG = Xn * _exp2_neg(Gn).unsqueeze(-2)  # q 2^G and k 2^G, interleaved
        Tb = _unit_lower_inverse(Akk * bn) * bn.transpose(-1, -2)  # T diag(beta)
        W = Tb @ XG[..., 1, :]
        U = Tb @ vn
        QW = torch.stack([XG[..., 0, :], W], dim=-2).flatten(-3, -2)  # [.., 2C, K]: one matmul gives qg S and W S
        G_last = Gn[..., -1:, :]
        kd = (Xn[..., 1, :] * _exp2_neg(G_last - Gn, inplace=True)).transpose(-1, -2)  # [.., K, C]
        decay = _exp2_neg(G_last).transpose(-1, -2)  # [.., K, 1]
        for i in range(Xn.shape[0]):
            Y = (QW[i] @ S).unflatten(-2, (C, 2))  # [BH, C, 2, V]
            v_new = U[i] - Y[..., 1, :]
            o_chunks[n0 + i] = torch.baddbmm(Y[..., 0, :], Aqk[i], v_new).view(B, H, C, V)
            S = torch.baddbmm(decay[i] * S, kd[i], v_new)
    return o[:, :T], S.reshape(B, H, K, V)


# ----------------------------------------------------------------------------------------------------------------------
# public kernels (fla call signatures)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (prefill), fla 0.6 signature; also accepts fla 0.4 keyword calls.

    Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-decay, or the raw gate with
    ``use_gate_in_kernel=True`` and ``A_log`` [HV], ``dt_bias`` [HV*K] in kwargs); beta [B, T, HV];
    initial_state [N, HV, K, V] (fp32). Returns ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32
    or None)``. ``cu_seqlens`` [N+1] packs N sequences into B=1. Autograd works through every step.
    ``safe_gate``/``disable_recompute`` are performance hints of fla and are accepted and ignored.
    """
    del safe_gate, disable_recompute, cu_seqlens_cpu
    if return_intermediate_states:
        raise NotImplementedError("chunk_kda(return_intermediate_states=True) is not supported by the torch kernel")
    if kwargs.get("cp_context") is not None:
        raise NotImplementedError("chunk_kda: context parallelism is not supported by the torch kernel")
    chunk_size = kwargs.pop("chunk_size", CHUNK_SIZE)
    if chunk_size < 2 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 2, got {chunk_size}")
    flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
             kwargs.get("A_log"), kwargs.get("dt_bias"))

    def core(*a):
        return _chunk_core(*a, chunk_size=chunk_size)

    return _run(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first, flags)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (decode), fla 0.6 signature (A_log/dt_bias positional 6/7 as in fla 0.6).

    Same shapes and return convention as :func:`chunk_kda`; O(T) Python steps, meant for short T.
    """
    if beta is None:  # fla 0.4 allowed beta=None meaning 1
        beta = torch.ones(v.shape[:3], dtype=torch.float32, device=v.device)
    for name in ("ssm_state_indices", "num_accepted_tokens"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"fused_recurrent_kda({name}=...) is not supported by the torch kernel")
    flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
             A_log, dt_bias)
    return _run(_recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                state_v_first, flags)


def naive_recurrent_kda_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 reference recurrence (no l2-norm, no gate activation); returns (o, final_state) in float64."""
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    d = torch.float64
    h0 = None if initial_state is None else initial_state.to(d)
    return _recurrent_core(q.to(d) * scale, k.to(d), v.to(d), g.to(d), beta.to(d), h0)
