"""MXFP4 (OCP microscaling FP4) decode and encode, compressed-tensors layout.

Layout (see ../shared/reference/mxfp4.md): a Linear weight W [out, in] is stored as
``weight_packed`` uint8 [out, in/2] (E2M1 codes, element 2j in the LOW nibble of byte j) and
``weight_scale`` uint8 [out, in/32] (E8M0 exponent e, group scale ``2 ** (e - bias)``, bias 127).

Decoding is pure torch on the tensors' own device (cpu, cuda, npu). Every decoded value is
``E2M1(code) * 2 ** (e - bias)`` correctly rounded to the output dtype; for bf16/fp32 that is exact
for every finite result (products that exceed the format overflow to +-inf, as IEEE arithmetic does).
"""

from __future__ import annotations

import functools
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from msmodelslim.core.placement import on_host

__all__ = [
    "E2M1_VALUES",
    "GROUP_SIZE",
    "MXFP4_EXPONENT_BIAS",
    "decode_mxfp4",
    "encode_mxfp4",
]

GROUP_SIZE = 32
MXFP4_EXPONENT_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E8M0_NAN = 255

# Word dtype holding the two decoded elements of one packed byte, by output element size.
_PAIR_WORD = {2: torch.int32, 4: torch.int64}
_ELEM_INT = {2: torch.int16, 4: torch.int32}

_table_lock = threading.Lock()
# Groups per CPU chunk: 2040 groups = 32640 index words, just under ATen's 32768-element parallel grain, so
# each op runs serially in the calling thread (per-op overhead is ~5% at this size).
_CPU_CHUNK_GROUPS = 2040
_CPU_SERIAL_ELEMS = 32000


def _check_decode_inputs(packed: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: weight_packed must be uint8, got {packed.dtype}")
    if scale.dtype != torch.uint8:
        raise ValueError(f"{name}: weight_scale must be uint8 (E8M0), got {scale.dtype}")
    if packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"{name}: expected 2-D weight_packed and weight_scale, got shapes "
            f"{tuple(packed.shape)} and {tuple(scale.shape)}"
        )
    rows, half_cols = packed.shape
    cols = 2 * half_cols
    if cols % GROUP_SIZE != 0:
        raise ValueError(f"{name}: in_features {cols} (weight_packed {tuple(packed.shape)}) is not divisible by {GROUP_SIZE}")
    if tuple(scale.shape) != (rows, cols // GROUP_SIZE):
        raise ValueError(
            f"{name}: weight_scale shape {tuple(scale.shape)} does not match weight_packed {tuple(packed.shape)} "
            f"(expected {(rows, cols // GROUP_SIZE)})"
        )
    if packed.device != scale.device:
        raise ValueError(f"{name}: weight_packed on {packed.device} but weight_scale on {scale.device}")


@functools.lru_cache(maxsize=32)
@on_host("the MXFP4 decode table is built once in float64, where every value is exact")
def _pair_table_cpu(dtype: torch.dtype, exponent_bias: int) -> torch.Tensor:
    """Table [256 * 256] indexed by ``e << 8 | byte``: the two decoded elements of ``byte``, as one word.

    Built in float64, where every ``E2M1 * 2**(e - bias)`` is exact, then rounded once to ``dtype``.
    Row 255 (E8M0 NaN) is never read: inputs containing it are rejected before the lookup.
    """
    elem_size = torch.empty((), dtype=dtype).element_size()
    if elem_size not in _PAIR_WORD:
        raise ValueError(f"decode_mxfp4: unsupported output dtype {dtype}")
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    code_vals = torch.cat([mags, -mags])  # index = 4-bit code (bit 3 = sign); code 8 is -0.0
    exps = torch.arange(256, dtype=torch.float64) - exponent_bias
    vals = code_vals[None, :] * torch.exp2(exps)[:, None]  # [e, code] exact in float64
    vals[_E8M0_NAN] = 0.0
    bits = vals.to(dtype).view(_ELEM_INT[elem_size]).to(torch.int64) & ((1 << (8 * elem_size)) - 1)
    byte = torch.arange(256)
    lo, hi = bits[:, byte & 0xF], bits[:, byte >> 4]  # [e, byte]
    if sys.byteorder != "little":  # element 2j must sit at the lower address
        lo, hi = hi, lo
    words = lo | (hi << (8 * elem_size))
    word_dtype = _PAIR_WORD[elem_size]
    if word_dtype == torch.int32:
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(-1).contiguous()


_device_tables: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}


def _pair_table(device: torch.device, dtype: torch.dtype, exponent_bias: int) -> torch.Tensor:
    key = (str(device), dtype, exponent_bias)
    table = _device_tables.get(key)
    if table is None:
        with _table_lock:
            table = _device_tables.get(key)
            if table is None:
                table = _pair_table_cpu(dtype, exponent_bias).to(device)
                _device_tables[key] = table
    return table


def decode_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    exponent_bias: int = MXFP4_EXPONENT_BIAS,
    *,
    name: str = "tensor",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize compressed-tensors MXFP4 to a dense [out, in] tensor on ``packed.device``.

    Args:
        packed: uint8 [out, in/2] E2M1 codes, element 2j in the low nibble of byte j.
        scale: uint8 [out, in/32] E8M0 exponents; 255 (NaN) is rejected.
        dtype: output dtype (bfloat16, float16 or float32).
        exponent_bias: 127 by the spec; 125 for checkpoints written by compressed-tensors 0.13.x.
        name: used in error messages (the checkpoint key).
        out: optional contiguous [out, in] tensor of ``dtype`` on the same device to decode into
            (e.g. a module's parameter, saving an allocation); returned.
    """
    _check_decode_inputs(packed, scale, name)
    rows, half_cols = packed.shape
    if out is None:
        out = torch.empty(rows, 2 * half_cols, dtype=dtype, device=packed.device)
    elif out.shape != (rows, 2 * half_cols) or out.dtype != dtype or out.device != packed.device or not out.is_contiguous():
        raise ValueError(
            f"{name}: out must be a contiguous {dtype} tensor of shape {(rows, 2 * half_cols)} on {packed.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if out.numel() == 0:
        return out
    table = _pair_table(packed.device, dtype, exponent_bias)
    # One gather per packed byte: index (e << 8 | byte) selects both decoded elements at once, scale
    # included, so there is no multiply and every value is the table's exactly rounded one.
    # Flat views: one row per 32-element group (16 packed bytes, one exponent).
    codes = packed.contiguous().view(-1, GROUP_SIZE // 2)
    flat_scale = scale.contiguous().view(-1, 1)
    words = out.view(table.dtype).view(-1, GROUP_SIZE // 2)  # one word = the two elements of one byte
    if packed.device.type == "cpu":
        _decode_cpu(codes, _shifted_scale_cpu(flat_scale, scale, name), table, words)
    else:
        index = torch.add(codes, flat_scale.to(torch.int32) << 8)  # == e << 8 | byte
        torch.index_select(table, 0, index.view(-1), out=words.view(-1))
        # after queueing the decode, so its one device sync overlaps it
        if int(scale.max()) == _E8M0_NAN:
            _check_no_nan_scale(scale, name)
    return out


def _check_no_nan_scale(scale: torch.Tensor, name: str) -> None:
    if bool((scale == _E8M0_NAN).any()):
        bad = (scale == _E8M0_NAN).nonzero()[0].tolist()
        raise ValueError(f"{name}: weight_scale holds E8M0 NaN (255) at {tuple(bad)}")


def _shifted_scale_cpu(flat_scale: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """``e << 8`` as int32 [groups, 1], rejecting e = 255; in pieces below ATen's parallel grain so no
    OpenMP region starts (its spinning workers would compete with the decode threads on a small host)."""
    n = flat_scale.shape[0]
    shifted = torch.empty(n, 1, dtype=torch.int32)
    for a in range(0, n, _CPU_SERIAL_ELEMS):
        piece = flat_scale[a : a + _CPU_SERIAL_ELEMS]
        if int(piece.max()) == _E8M0_NAN:
            _check_no_nan_scale(scale, name)
        dst = shifted[a : a + _CPU_SERIAL_ELEMS]
        dst.copy_(piece)
        dst.bitwise_left_shift_(8)
    return shifted


def _decode_groups(codes: torch.Tensor, shifted: torch.Tensor, table: torch.Tensor, words: torch.Tensor,
                   g0: int, g1: int) -> None:
    """Decode groups [g0, g1) chunk by chunk; each op stays below ATen's parallel grain (serial, no
    OpenMP barrier) and the int32 index chunk stays in L1/L2 between its two passes."""
    index_buf = torch.empty(min(_CPU_CHUNK_GROUPS, g1 - g0), GROUP_SIZE // 2, dtype=torch.int32)
    for c0 in range(g0, g1, _CPU_CHUNK_GROUPS):
        c1 = min(g1, c0 + _CPU_CHUNK_GROUPS)
        index = index_buf[: c1 - c0]
        torch.add(codes[c0:c1], shifted[c0:c1], out=index)
        torch.index_select(table, 0, index.view(-1), out=words[c0:c1].view(-1))


def _decode_cpu(codes: torch.Tensor, shifted: torch.Tensor, table: torch.Tensor, words: torch.Tensor) -> None:
    n_groups = codes.shape[0]
    workers = min(torch.get_num_threads(), n_groups // (4 * _CPU_CHUNK_GROUPS))
    if workers <= 1:
        _decode_groups(codes, shifted, table, words, 0, n_groups)
        return
    # Split the groups between `workers` threads (torch ops release the GIL); serial ops inside each.
    bounds = [n_groups * i // workers for i in range(workers + 1)]
    pool = _cpu_pool(workers)
    futures = [pool.submit(_decode_groups, codes, shifted, table, words, bounds[i], bounds[i + 1])
               for i in range(1, workers)]
    _decode_groups(codes, shifted, table, words, bounds[0], bounds[1])  # this thread takes the first part
    for future in futures:
        future.result()


_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _cpu_pool(workers: int) -> ThreadPoolExecutor:
    """Helper threads for `workers`-way CPU decode (the caller's thread is the first worker)."""
    global _pool, _pool_size
    with _table_lock:
        if _pool is None or _pool_size < workers - 1:
            _pool = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="mxfp4-decode")
            _pool_size = workers - 1
        return _pool


def encode_mxfp4(weight: torch.Tensor, *, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float [out, in] weight to MXFP4 exactly as compressed-tensors' compressor does.

    Scale: the group amax is rounded to a power of two P (up when its mantissa is >= 1.75) and
    ``e = 127 + log2(P) - 2`` (clamped at 0; an all-zero group gets e = 0). Elements: x / 2**(e-127),
    clamped to +-6, rounded to the nearest E2M1 value with ties to the even code; a negative value that
    rounds to zero keeps its sign (code 0x8), an exact -0.0 gives code 0 (compressed-tensors' torch.sign).
    Bit-exact with compressed-tensors 0.20 for bfloat16 and float32 weights.

    Returns:
        (packed uint8 [out, in/2], scale uint8 [out, in/32]) on ``weight.device``.
    """
    if weight.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {weight.dtype}")
    rows, cols = weight.shape
    if cols % GROUP_SIZE != 0:
        raise ValueError(f"{name}: in_features {cols} is not divisible by {GROUP_SIZE}")
    # float32 holds bf16/fp16/fp32 exactly and x / 2**k is exact there unless the quotient is far below
    # 0.25 (code 0 either way, sign kept), so the codes equal those of compressed-tensors' bf16 math.
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, cols // GROUP_SIZE, dtype=torch.uint8, device=weight.device)
    bounds = _rounding_bounds(work, weight.device)
    step = max(1, (1 << 20) // cols)  # ~1M elements per block bounds the float temporaries
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        _encode_block(weight[r0:r1], work, bounds, packed[r0:r1], scale[r0:r1], name)
    return packed, scale


def _rounding_bounds(work: torch.dtype, device: torch.device) -> torch.Tensor:
    """|q| >= bounds[i] counts toward the E2M1 magnitude code. Ties go to the even code: 0.75, 1.75, 3.5
    round up (>=), 0.25, 1.25, 2.5, 5.0 round down, i.e. need |q| > b, which is |q| >= nextafter(b)."""
    up = torch.tensor([0.25, 1.25, 2.5, 5.0], dtype=work)
    above = torch.nextafter(up, torch.full_like(up, 8.0))
    exact = torch.tensor([0.75, 1.75, 3.5], dtype=work)
    return torch.sort(torch.cat([above, exact])).values.to(device)


def _encode_block(weight: torch.Tensor, work: torch.dtype, bounds: torch.Tensor, packed_out: torch.Tensor,
                  scale_out: torch.Tensor, name: str) -> None:
    rows, cols = weight.shape
    x = weight.to(work).reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: weight contains NaN or inf")
    amax = x.abs().amax(dim=-1)
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    log2_p = torch.where(mant >= 0.875, exp, exp - 1)  # 2*mant >= 1.75 rounds up
    if bool((log2_p >= 128).any()):
        raise ValueError(f"{name}: group amax too large for an E8M0 scale (>= 1.75 * 2**127)")
    e = torch.where(amax == 0, 0, (log2_p + (MXFP4_EXPONENT_BIAS - 2)).clamp(min=0))
    scale_val = torch.exp2((e - MXFP4_EXPONENT_BIAS).to(torch.float64)).to(work)  # exact powers of two
    q = (x / scale_val.unsqueeze(-1)).clamp(-6.0, 6.0)
    # magnitude code = number of bounds <= |q|; sign bit for q < 0 (so -0.0 -> code 0)
    a = q.abs()
    code = (q < 0).to(torch.uint8) << 3
    for b in bounds.tolist():
        code += a >= b
    code = code.reshape(rows, cols // 2, 2)
    packed_out.copy_(code[..., 0] | (code[..., 1] << 4))
    scale_out.copy_(e)
