"""On a CUDA GPU the (compiled) MXFP4 decoder gives the CPU decoder's bits for every byte and exponent.

Reference: `decode_mxfp4` on CPU (itself bit-exact against compressed-tensors, test_mxfp4.py). Tolerance: none;
all 256 bytes x exponents 0..254, biases 127 (spec) and 125 (compressed-tensors 0.13), bf16/fp16/fp32, including
subnormal results (a flush-to-zero GPU path would fail here). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from msmodelslim.source.mxfp4 import decode_mxfp4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [127, 125])
def test_cuda_decode_equals_cpu_decode_for_every_byte_and_exponent(dtype: torch.dtype, bias: int):
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(255, 1).view(255, 256)
    scale = torch.arange(255, dtype=torch.uint8).view(255, 1).repeat(1, 16)
    ref = decode_mxfp4(packed, scale, dtype, bias)
    got = decode_mxfp4(packed.cuda(), scale.cuda(), dtype, bias).cpu()
    bits = {2: torch.int16, 4: torch.int32}[ref.element_size()]
    assert torch.equal(ref.view(bits), got.view(bits))
