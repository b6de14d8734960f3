"""int4 packing, two values per int8 byte, in the layout the AscendV1 format (vLLM-Ascend, "version" 1.0.0) loads.

Convention (the one msModelSlim writes and vLLM-Ascend's W4A8_DYNAMIC reads when the description's version is
"1.0.0"): a weight q [out, in] with values in [-8, 7] is packed along the OUTPUT dim (dim 0 by default):

    packed[j, k] = (q[2j + 1, k] << 4) | (q[2j, k] & 0x0F)      -> int8 [out / 2, in]

i.e. the low nibble holds the even row, the high nibble the odd row, both two's complement. vLLM-Ascend
transposes this to [in, out / 2] and views groups of four bytes as int32 for its int4 matmul, so output channels
2j and 2j+1 share a byte. `dim` lets callers pack along another dim (e.g. dim=-1 for the input dim).
"""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Pack int4 values (torch.int8 in [-8, 7]) two per byte along `dim`: low nibble = even index."""
    if q.dtype != torch.int8:
        raise TypeError(f"pack_int4 expects torch.int8 values, got {q.dtype}")
    dim = dim % q.dim()
    if q.shape[dim] % 2:
        raise ValueError(f"pack_int4: size {q.shape[dim]} of dim {dim} is odd")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError(f"pack_int4: values outside [-8, 7] (min {int(q.min())}, max {int(q.max())})")
    qt = q.movedim(dim, -1)
    pairs = qt.reshape(*qt.shape[:-1], qt.shape[-1] // 2, 2).to(torch.int16)
    byte = ((pairs[..., 1] & 0x0F) << 4) | (pairs[..., 0] & 0x0F)  # 0..255
    packed = torch.where(byte > 127, byte - 256, byte).to(torch.int8)
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of `pack_int4`: int8 bytes -> int8 values in [-8, 7], `dim` doubled."""
    if packed.dtype != torch.int8:
        raise TypeError(f"unpack_int4 expects torch.int8 bytes, got {packed.dtype}")
    dim = dim % packed.dim()
    b = packed.movedim(dim, -1).to(torch.int16) & 0xFF
    low, high = b & 0x0F, (b >> 4) & 0x0F
    low = torch.where(low > 7, low - 16, low)
    high = torch.where(high > 7, high - 16, high)
    out = torch.stack([low, high], dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2).to(torch.int8)
    return out.movedim(-1, dim).contiguous()
