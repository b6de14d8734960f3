"""Kimi Delta Attention (KDA) in plain PyTorch: chunked prefill, recurrent decode, the gate and l2-norm.

Runs on any device torch runs on (CPU, NPU, CUDA); no Triton. Call signatures follow fla (0.4 and 0.6) so the
functions can be swapped into model code at run time (see ``msmodelslim.model.kimi_k3.runtime_patches``).

Recurrence (per sequence and head, state S [K, V] in fp32)::

    S <- Diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - k_t^T S)^T;   o_t = S^T (scale * q_t)

Chunked form (chunk C=64, Gamma = in-chunk cumsum of g): intra-chunk scores use exp(Gamma_i - Gamma_j), which is only
ever formed with a non-positive exponent: 16-row diagonal blocks mask the exponent before ``exp``; off-diagonal
blocks factor through the first row r of the row block, ``(x_i e^{Gamma_i-Gamma_r}) @ (k_j e^{Gamma_r-Gamma_j})^T``,
both exponents <= 0, so they are plain matmuls. Kimi's gates (per-step log-decay down to about -270) cannot overflow.
Memory is O(T): no [C, C, K] pairwise tensor is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
SUB_CHUNK = 16
PAIRWISE_BUDGET = 1 << 20  # elements of the diagonal-block pairwise tensor built at once on CPU (cache-sized)
PAIRWISE_BUDGET_ACCEL = 1 << 27  # on accelerators (fewer, larger launches; ~512 MB fp32)
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


def _exp2_neg(x: torch.Tensor) -> torch.Tensor:
    """2**x for an exponent known to be <= 0 (base 2: exp2 is ~3x cheaper than exp on CPUs).

    Clamped at -115 (2^-115 ~ e^-80) so results stay normal floats: denormals are very slow on CPUs, and the values
    cut off are zero for every purpose here (gradients below the clamp are zero, as the true ones are ~1e-35).
    """
    return torch.exp2(x.clamp(min=-115.0))


def _intra_chunk_scores(q, k, G2):
    """Aqk (i >= j) and Akk (i > j) score matrices [.., C, C] for chunks [.., C, K] (q pre-scaled, G2 = log2-decay
    cumsum).

    Diagonal SUB_CHUNK blocks: all S x S pairs with exponent clamped to [-115, 0] before exp2 (never positive, so never
    overflows; pairs i < j are clamped to 0 and masked out of the small result). Off-diagonal blocks: reference point
    r = first row of the row block, (x_i 2^{G_i - G_r}) @ (k_j 2^{G_r - G_j})^T with j < r <= i: both exponents <= 0,
    plain matmuls.
    """
    *lead, C, K = q.shape
    S = SUB_CHUNK
    nb = C // S
    qb, kb, Gb = (x.reshape(*lead, nb, S, K) for x in (q, k, G2))
    X = torch.stack([qb, kb], dim=-4)  # [.., 2, nb, S, K]: q rows for Aqk, k rows for Akk

    # diagonal blocks, pairwise [nb, S(i), S(j), K]
    d = Gb.unsqueeze(-2) - Gb.unsqueeze(-3)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or G2.requires_grad):
        e = torch.exp2(d.clamp(-115.0, 0.0)) * kb.unsqueeze(-3)
    else:  # same arithmetic without temporaries (the pairwise tensor is the largest one built)
        e = d.clamp_(-115.0, 0.0).exp2_().mul_(kb.unsqueeze(-3))
    diag = torch.einsum("...xaik,...aijk->...xaij", X, e)  # [.., 2, nb, S, S]
    lower = torch.ones(S, S, dtype=q.dtype, device=q.device).tril()
    diag = diag * lower

    rows = [F.pad(diag[..., 0, :, :], (0, C - S))]
    for a in range(1, nb):
        r0 = a * S
        R = Gb[..., a, :1, :]  # [.., 1, K]
        xr = X[..., a, :, :] * _exp2_neg(Gb[..., a, :, :] - R).unsqueeze(-3)  # [.., 2, S, K]
        kc = k[..., :r0, :] * _exp2_neg(R - G2[..., :r0, :])  # [.., r0, K]
        off = xr @ kc.unsqueeze(-3).transpose(-1, -2)  # [.., 2, S, r0]
        rows.append(torch.cat([off, diag[..., a, :, :], off.new_zeros(*off.shape[:-1], C - r0 - S)], dim=-1))
    A = torch.cat(rows, dim=-2)  # [.., 2, C, C]
    return A[..., 0, :, :], A[..., 1, :, :]


def _chunk_core(q, k, v, g, beta, h0, chunk_size: int = CHUNK_SIZE):
    """q (pre-scaled), k, v, g: [B, T, H, *] fp32; beta [B, T, H]; h0 [B, H, K, V] or None."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def chunks(x):  # [B, T, H, D] -> [B, H, N, C, D]
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(B, H, N, C, x.shape[-1])

    q, k, v = chunks(q), chunks(k), chunks(v)
    b = chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]
    G2 = chunks(g).cumsum(-2) * LOG2E  # in-chunk cumulative log2-decay

    strict = torch.ones(C, C, dtype=q.dtype, device=q.device).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    # Chunks are processed in small groups (sized to stay in CPU cache): the intra-chunk part of a group (scores and
    # UT transform) is independent per chunk; the state then runs through the group's chunks in order.
    budget = PAIRWISE_BUDGET if q.device.type == "cpu" else PAIRWISE_BUDGET_ACCEL
    group = max(1, budget // (B * H * C * SUB_CHUNK * K))
    S = h0 if h0 is not None else q.new_zeros(B, H, K, V)
    outs = []
    for n0 in range(0, N, group):
        sl = slice(n0, n0 + group)
        qn, kn, vn, bn, Gn = q[:, :, sl], k[:, :, sl], v[:, :, sl], b[:, :, sl], G2[:, :, sl]
        Aqk, Akk = _intra_chunk_scores(qn, kn, Gn)
        # UT transform: (I + Akk)^-1 applied to [beta k 2^G | beta v] by one unit-triangular solve
        rhs = torch.cat([bn * kn * _exp2_neg(Gn), bn * vn], dim=-1)
        wu = torch.linalg.solve_triangular(Akk * bn * strict + eye, rhs, upper=False, unitriangular=True)
        W, U = wu[..., :K], wu[..., K:]
        G_last = Gn[..., -1:, :]  # [.., 1, K]
        qg = qn * _exp2_neg(Gn)
        kd = (kn * _exp2_neg(G_last - Gn)).transpose(-1, -2)  # [.., K, C]
        decay = _exp2_neg(G_last).transpose(-1, -2)  # [.., K, 1]
        for i in range(qn.shape[2]):
            v_new = U[:, :, i] - W[:, :, i] @ S
            outs.append(qg[:, :, i] @ S + Aqk[:, :, i] @ v_new)
            S = decay[:, :, i] * S + kd[:, :, i] @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T]
    return o.transpose(1, 2), S


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
    if chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK}, got {chunk_size}")
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
