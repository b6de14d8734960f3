"""Kimi Delta Attention (KDA) in plain PyTorch: chunked prefill, recurrent decode, the gate and l2-norm.

Runs on any device torch runs on (CPU, NPU, CUDA); no Triton. Call signatures follow fla (0.4 and 0.6) so the
functions can be swapped into model code at run time (see ``msmodelslim.model.kimi_k3.runtime_patches``).

Recurrence (per sequence and head, state S [K, V] in fp32)::

    S <- Diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - k_t^T S)^T;   o_t = S^T (scale * q_t)

Chunked form (chunks of C steps; C=16 on CPUs, 64 on accelerators): intra-chunk scores need
prod_{j<t<=i} exp(g_t) for i >= j, and Kimi's gates (per-step log-decay down to about -270) make the usual
factorisation exp(Gamma_i) exp(-Gamma_j) of a cumsum Gamma overflow. Here every factor is a product of per-step
decays exp(g_t) <= 1, built level by level by recursive halving (see ``_intra_chunk_scores``): nothing can
overflow, and no [C, C, K] pairwise tensor is built, so memory is O(T). The UT transform's unit-triangular inverse
is one batched triangular solve on CPUs and recursive doubling (matmuls only) on accelerators. Chunks are processed
in cache-sized groups that reuse one set of buffers; per chunk only five small matmuls and a scaling are sequential
(the walk). With 16-bit inputs on accelerators the fp32 matmuls may use TF32/HF32 tensor cores (see
``tensor_core_fp32_matmuls``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from msmodelslim.core.device import tensor_core_fp32_matmuls

CHUNK_SIZE = 16  # on CPUs: the sequential work is the same for any chunk size, the in-chunk work grows with it
CHUNK_SIZE_ACCEL = 64  # on accelerators: fewer sequential steps (kernel launches)
GROUP_BUDGET = 1 << 18  # elements of q per group of chunks handled at once on CPU (a few MB: near the caches)
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


def _prepare(q, k, v, g, beta, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
             A_log, dt_bias):
    """Validate shapes; return q, k (grouped value heads expanded; dtype kept, the cores convert while copying),
    v, and g, beta in fp32 with the in-kernel gate / beta sigmoid applied."""
    H, HV = q.shape[2], v.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape, got q={tuple(q.shape)} k={tuple(k.shape)}")
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
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
    return q, k, v, g, beta


def _run(core, q, k, v, g, beta, scale, qk_l2norm, initial_state, output_final_state, cu_seqlens, state_v_first,
         gate_flags):
    out_dtype = q.dtype
    B = q.shape[0]
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (packed sequences), got {B}")
    q, k, v, g, beta = _prepare(q, k, v, g, beta, *gate_flags)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
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
        o, ht = core(q, k, v, g, beta, h0, scale, qk_l2norm)
        o = _from_padded(o, valid)
    else:
        o, ht = core(q, k, v, g, beta, h0, scale, qk_l2norm)
    if not output_final_state:
        ht = None
    elif state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o.to(out_dtype), ht


# ----------------------------------------------------------------------------------------------------------------------
# recurrent (decode) core


def _recurrent_core(q, k, v, g, beta, h0, scale, qk_l2norm):
    """q, k, v, g: [B, T, H, *]; beta [B, T, H]; h0 [B, H, K, V] or None. Computes in q's float precision (fp32,
    or fp64 for the reference)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = h0.to(dtype) if h0 is not None else q.new_zeros(B, H, K, V)
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


def _matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T for a [.., m, d], b [.., n, d] (n <= m here). Computed as (b @ a^T)^T: with the smaller block on the
    left cuBLAS picks faster kernels (4x for the 4 x 2 quadrants of the halving on an H200, 1.1x overall) and MKL is
    a few % faster. Tiny right-hand blocks (n * d <= 128: the one-column products of the first halving level, the
    small blocks of the UT inverse) are a multiply-sum instead: a batch of such GEMMs is slower."""
    if b.shape[-2] * b.shape[-1] <= 128:
        return (a.unsqueeze(-2) * b.unsqueeze(-3)).sum(-1)
    return (b @ a.transpose(-1, -2)).transpose(-1, -2)


def _intra_chunk_scores(X: torch.Tensor, D: torch.Tensor, bufs: _Workspace | None):
    """Intra-chunk scores and the decayed q and k, from per-step decays alone (no exponent of a cumsum).

    X [.., C, 2, K]: q and k rows interleaved; D [.., C, K]: per-step decays d_t = exp(g_t) in (0, 1].
    Aqk[i, j] (i >= j) and Akk[i, j] (i > j) = sum_d x_id k_jd prod_{j<t<=i} d_td  (x = q resp. k).

    Recursive halving, bottom-up over block sizes s = 2, 4, .., C: the lower-left quadrant of each s x s diagonal
    block (rows i in its second half, columns j in its first) is ``(x_i P_i) @ (k_j R_j)^T``, P_i the product of
    the decays from the half's boundary up to i, R_j from j up to the boundary. Both are products of factors <= 1
    (nothing overflows, whatever the gates). Going to the next level multiplies the second half of each block by the
    first half's total decay (P) and the first half by the second half's (R), a Sklansky prefix-product scan, so the
    scaled rows x P and k R are carried along; only the blocks' total decays are kept besides. The quadrants tile the
    strict lower triangle; the diagonal of Aqk is q_i . k_i.

    Returns A [.., C, 2, C] (A[.., i, 0, :] row i of Aqk, A[.., i, 1, :] of Akk), Y = X P [.., C, 2, K] (decay from
    the chunk start), Z = k R [.., C, K] (decay to the chunk end) and the chunk's total decay [.., 1, K].
    """
    *lead, C, _, K = X.shape
    A = X.new_zeros(*lead, C, 2, C)
    A[..., 0, :].diagonal(dim1=-2, dim2=-1).copy_((X[..., 0, :] * X[..., 1, :]).sum(-1))  # (vecdot: a GEMV on CUDA)
    inplace = bufs is not None
    Z = bufs.get("Z", X[..., 1, :].shape).copy_(X[..., 1, :]) if inplace else X[..., 1, :]  # (else cloned below)
    blk, Y = D, (X.mul_(D.unsqueeze(-2)) if inplace else X * D.unsqueeze(-2))  # blk: total decay of each block of
    # the current size; X (the caller's buffer) becomes Y on the in-place path
    s = 2
    while s <= C:
        h, nb = s // 2, C // s
        Yb, Zb = Y.view(*lead, nb, 2, h, 2, K), Z.reshape(*lead, nb, 2, h, K)
        quad = _matmul_nt(Yb[..., 1, :, :, :].reshape(*lead, nb, 2 * h, K), Zb[..., 0, :, :])  # [.., nb, 2h, h]
        blocks = A.view(*lead, nb, s, 2, nb, s).diagonal(dim1=-5, dim2=-2)  # [.., s, 2, s, nb]
        blocks[..., h:, :, :h, :] = quad.view(*lead, nb, h, 2, h).movedim(-4, -1)
        # to block size s: second halves of Y times the first half's total decay, first halves of Z times the second's
        halves = blk.view(*lead, nb, 2, 1, K)
        if not inplace:  # (autograd keeps the old values)
            Y, Z = Y.clone(), Z.clone()
        Y.view(*lead, nb, 2, h, 2, K)[..., 1, :, :, :] *= halves[..., 0, :, :].unsqueeze(-2)
        Z.view(*lead, nb, 2, h, K)[..., 0, :, :] *= halves[..., 1, :, :]
        blk = halves[..., 0, 0, :] * halves[..., 1, 0, :]
        s *= 2
    return A, Y, Z, blk


def _diag_blocks(A: torch.Tensor, s: int) -> torch.Tensor:
    """Writable view [.., s, s, C/s] of the s x s diagonal blocks of square matrices A [.., C, C]."""
    *lead, C, _ = A.shape
    return A.view(*lead, C // s, s, C // s, s).diagonal(dim1=-4, dim2=-2)


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower-triangular L [.., C, C] (C a power of two).

    On CPUs: the batched triangular solve against I (forward substitution; one library call, several times faster
    than many small ops). On accelerators: recursive doubling, inv([[A, 0], [B, D]]) = [[A^-1, 0], [-D^-1 B A^-1,
    D^-1]] over block sizes 2, 4, .., C (matmuls only; the same arithmetic as blocked forward substitution).

    (Not the shorter Neumann product prod_m (I + (-L)^(2^m)): with nearly parallel keys its powers of L grow large
    and cancel; see test_chunk_stays_accurate_with_correlated_keys_and_slow_decay.)"""
    C = L.shape[-1]
    if L.device.type == "cpu":  # (unitriangular: the zero diagonal of L is not read)
        eye = torch.eye(C, dtype=L.dtype, device=L.device)
        return torch.linalg.solve_triangular(L, eye.expand(L.shape), upper=False, unitriangular=True)
    grad = torch.is_grad_enabled() and L.requires_grad
    inv = torch.zeros_like(L)
    inv.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    inv.diagonal(-1, -2, -1)[..., ::2] = -L.diagonal(-1, -2, -1)[..., ::2]  # the 2 x 2 blocks: [[1, 0], [-l, 1]]
    s = 4
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


class _Workspace:
    """Float32 buffers reused by every group of chunks of one call (the in-place path: autograd not recording). A
    fresh multi-MB tensor per group faults its pages in again each time where the allocator hands large freed blocks
    back to the OS (glibc maps blocks over M_MMAP_THRESHOLD on their own; the layer-wise runner pins that at 1 MiB):
    that made the kernel 1.6x slower in a run."""

    def __init__(self, device: torch.device):
        self.device, self.buffers = device, {}

    def get(self, name: str, shape) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return buf[:numel].view(shape)


def _chunk_group(q, k, v, g, beta, S, n, C, scale, qk_l2norm, bufs: _Workspace | None):
    """One group of n consecutive chunks: q, k, v, g, beta are its time slice [B, <= n*C, H, *]; S [BH, K, V] the
    state at its start; ``bufs`` None when autograd records (then nothing is written in place). Returns
    (o [n, BH, C, V], S at its end).

    Per chunk with state S at its start, P = decay from the chunk start, R = decay to the chunk end:
        v_new = T diag(beta) (v - (k P) S)  with  T = (I + strict(beta Akk))^-1     (UT transform)
        o = (q P) S + Aqk v_new;  S <- P_last S + (k R)^T v_new
    The scores, decayed rows and T are computed for the n chunks at once; the walk is five small matmuls per chunk
    (T diag(beta) applied in the walk, not as W = T diag(beta) k P, U = T diag(beta) v beforehand: the same
    arithmetic on cache-hot blocks).
    """
    B, tg, H, K = q.shape
    V = v.shape[-1]
    BH, pad = B * H, n * C - tg
    f32 = torch.float32

    def chunked(x):  # [B, tg, H, D] -> strided view [n, B, H, C, D] (chunk-major; zero-padded to n*C steps)
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.unflatten(1, (n, C)).permute(1, 0, 3, 2, 4)

    def new(name, *shape):
        return bufs.get(name, (n, B, H, C, *shape))

    qc, kc, vc, gc = chunked(q), chunked(k), chunked(v), chunked(g)
    if qk_l2norm:  # fla's l2norm, x / sqrt(sum x^2 + eps), with the q scale folded into the same multiply
        rq, rk = (chunked((torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=f32).square() + 1e-6).rsqrt())
                  for x in (q, k))  # (norms over the [B, T, H, K] slice: 2.5x faster than over the chunked view)
        rq = rq * scale
    else:  # (one-element tensors, not scalars: they make the multiply run in fp32 for bf16 inputs)
        rq, rk = (torch.full((1,), c, dtype=f32, device=q.device) for c in (scale, 1.0))
    if bufs is not None:  # straight into cache-resident chunk-major buffers
        X = new("X", 2, K)
        torch.mul(qc, rq, out=X[..., 0, :])
        torch.mul(kc, rk, out=X[..., 1, :])
        if q.device.type == "cpu":  # (exp2 is ~4x cheaper than exp on CPUs)
            D = torch.mul(gc, LOG2E, out=new("D", K)).exp2_()
        else:  # (on accelerators the extra pass costs more than exp: 0.49 vs 0.71 ms on an H200)
            D = torch.exp(gc, out=new("D", K))
        v = new("v", V).copy_(vc)
    else:
        X = torch.stack([qc * rq, kc * rk], dim=-2).contiguous()
        D = (gc * LOG2E).exp2().contiguous()
        v = vc.float().contiguous()
    # X: q and k rows interleaved; D: per-step decays
    X, D, v = X.view(n, BH, C, 2, K), D.view(n, BH, C, K), v.view(n, BH, C, V)
    b = chunked(beta.unsqueeze(-1)).reshape(n, BH, C, 1).float()

    A, Y, Z, decay = _intra_chunk_scores(X, D, bufs)
    Aqk, Akk, qP, kP = A[..., 0, :], A[..., 1, :], Y[..., 0, :], Y[..., 1, :]
    kR_t, decay = Z.transpose(-1, -2), decay.transpose(-1, -2)  # [n, BH, K, C], [n, BH, K, 1]
    Tb = _unit_lower_inverse(Akk * b) * b.transpose(-1, -2)  # T diag(beta)
    if bufs is not None:
        o_grp, v_new = bufs.get("o", v.shape), torch.empty_like(v[0])
        for i in range(n):
            torch.bmm(Tb[i], v[i].baddbmm_(kP[i], S, alpha=-1), out=v_new)
            torch.bmm(qP[i], S, out=o_grp[i]).baddbmm_(Aqk[i], v_new)
            S = S.mul_(decay[i]).baddbmm_(kR_t[i], v_new)
    else:
        outs = []
        for i in range(n):
            v_new = Tb[i] @ torch.baddbmm(v[i], kP[i], S, alpha=-1)
            outs.append(torch.baddbmm(qP[i] @ S, Aqk[i], v_new))
            S = torch.baddbmm(S * decay[i], kR_t[i], v_new)
        o_grp = torch.stack(outs)
    return o_grp, S


def _chunk_core(q, k, v, g, beta, h0, scale, qk_l2norm, chunk_size: int):
    """q, k [B, T, H, K]; v [B, T, H, V]; g (log-decay, <= 0), beta: fp32 [B, T, H, K] / [B, T, H]; h0 [B, H, K, V]
    or None. Walks groups of chunks sized to stay in cache on CPUs (few, large launches on accelerators)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    BH = B * H
    records = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, h0))
    bufs = None if records else _Workspace(q.device)
    budget = GROUP_BUDGET if q.device.type == "cpu" else GROUP_BUDGET_ACCEL
    group = max(1, budget // (BH * C * K))
    S = h0.reshape(BH, K, V).clone() if h0 is not None else q.new_zeros(BH, K, V, dtype=torch.float32)
    o = q.new_empty(B, N * C, H, V)  # in the inputs' dtype: the copy out of each group rounds (no extra pass)
    for n0 in range(0, N, group):
        n = min(group, N - n0)
        t0, t1 = n0 * C, min((n0 + n) * C, T)
        o_grp, S = _chunk_group(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1], S, n, C, scale,
                            qk_l2norm, bufs)
        o[:, t0 : t0 + n * C].unflatten(1, (n, C)).permute(1, 0, 3, 2, 4).copy_(o_grp.unflatten(1, (B, H)))
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
    chunk_size = kwargs.pop("chunk_size", None) or (CHUNK_SIZE if q.device.type == "cpu" else CHUNK_SIZE_ACCEL)
    if chunk_size < 2 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 2, got {chunk_size}")
    gate_flags = (use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, kwargs.get("A_log"),
                  kwargs.get("dt_bias"))

    def core(*a):
        with tensor_core_fp32_matmuls(q.device, q.dtype in (torch.bfloat16, torch.float16)):
            return _chunk_core(*a, chunk_size=chunk_size)

    return _run(core, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, initial_state, output_final_state,
                cu_seqlens, state_v_first, gate_flags)


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
    gate_flags = (use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias)
    return _run(_recurrent_core, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, initial_state,
                output_final_state, cu_seqlens, state_v_first, gate_flags)


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
    d = torch.float64
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    h0 = None if initial_state is None else initial_state.to(d)
    return _recurrent_core(q.to(d), k.to(d), v.to(d), g.to(d), beta.to(d), h0, scale, qk_l2norm=False)
