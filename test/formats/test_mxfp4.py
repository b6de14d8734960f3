"""MXFP4 decode/encode against compressed-tensors 0.20 (MXFP4PackedCompressor), compared bit for bit."""

from __future__ import annotations

import pytest
import torch
from mxfp4_ct_reference import ct_decode, ct_encode, same_bits

from msmodelslim.source.mxfp4 import decode_mxfp4, encode_mxfp4

# ../shared/reference/mxfp4.md, worked example (compressed-tensors 0.18)
WORKED_ROW = [0, .05, -.1, .2, -.3, .4, .5, -.6, .7, .8, -.9, 1, 1.1, -1.2, 1.3, 1.4, -1.5, 1.55, .12, -.37, .63,
              -.88, .95, -1.05, .26, .74, -.18, .44, -.56, .31, -.69, .0625]
WORKED_PACKED = bytes.fromhex("00293AC4556EE6777FB1E5E652492C0D")


def _random_codes(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(100, 150, (rows, cols // 32), dtype=torch.uint8, generator=g)
    return packed, scale


def test_worked_example_encodes_to_documented_bytes():
    packed, scale = encode_mxfp4(torch.tensor([WORKED_ROW], dtype=torch.bfloat16))
    assert scale.tolist() == [[125]]
    assert bytes(packed.flatten().tolist()) == WORKED_PACKED


def test_worked_example_decodes_to_value_times_quarter():
    packed = torch.tensor([list(WORKED_PACKED)], dtype=torch.uint8)
    out = decode_mxfp4(packed, torch.tensor([[125]], dtype=torch.uint8))
    # first bytes: 0x00 -> (0, 0); 0x29 -> code 9 (-0.5), code 2 (1.0); times 0.25
    assert out[0, :4].tolist() == [0.0, 0.0, -0.125, 0.25]
    assert same_bits(out, ct_decode(packed, torch.tensor([[125]], dtype=torch.uint8)))


def test_decode_random_codes_bitexact_vs_compressed_tensors():
    packed, scale = _random_codes(128, 2048, seed=0)
    assert same_bits(decode_mxfp4(packed, scale), ct_decode(packed, scale))


def test_decode_every_exponent_0_to_254_and_every_byte_bitexact():
    # row e holds every byte value twice (512 bytes = 1024 elements = 32 groups), all groups at exponent e;
    # e >= 253 overflows bf16 for the larger codes: both sides give the same +-inf.
    packed = torch.arange(256, dtype=torch.uint8).repeat(255, 2)
    scale = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, 32).contiguous()
    ours = decode_mxfp4(packed, scale)
    ref = ct_decode(packed, scale)
    assert same_bits(ours, ref)
    assert not torch.isnan(ours).any()
    assert torch.isfinite(ours[:253]).all()


def test_decode_negative_zero_code_gives_negative_zero():
    packed = torch.full((1, 16), 0x88, dtype=torch.uint8)
    out = decode_mxfp4(packed, torch.full((1, 1), 127, dtype=torch.uint8))
    assert (out == 0).all() and torch.signbit(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_other_dtypes_equal_exact_value_rounded_once(dtype):
    packed, scale = _random_codes(16, 256, seed=1)
    scale[0, 0], scale[1, 0] = 0, 254
    ours = decode_mxfp4(packed, scale, dtype=dtype)
    exact = decode_mxfp4(packed, scale, dtype=torch.float32).double()  # fp32 holds these exactly (no overflow rows)
    ref64 = _decode_float64(packed, scale)
    assert same_bits(ours, ref64.to(dtype))
    assert torch.equal(exact[2:], ref64[2:])


def _decode_float64(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    return lut[codes] * torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)


def test_decode_exponent_bias_125_is_four_times_bias_127():
    packed, scale = _random_codes(8, 64, seed=2)
    assert torch.equal(decode_mxfp4(packed, scale, exponent_bias=125), decode_mxfp4(packed, scale) * 4)


def test_decode_rejects_e8m0_nan_naming_tensor():
    packed, scale = _random_codes(4, 64, seed=3)
    scale[2, 1] = 255
    with pytest.raises(ValueError, match=r"layers\.0\.w1.*255.*\(2, 1\)"):
        decode_mxfp4(packed, scale, name="layers.0.w1")


@pytest.mark.parametrize(
    "packed, scale, message",
    [
        (torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8), "weight_packed must be uint8"),
        (torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float32), "weight_scale must be uint8"),
        (torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8), "does not match"),
        (torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8), "does not match"),
        (torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), "not divisible by 32"),
        (torch.zeros(32, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), "2-D"),
    ],
)
def test_decode_rejects_bad_inputs_naming_tensor(packed, scale, message):
    with pytest.raises(ValueError, match=f"mytensor.*{message}|{message}.*mytensor"):
        decode_mxfp4(packed, scale, name="mytensor")


def test_encode_random_bf16_bitexact_vs_compressed_tensors():
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(256, 1024, generator=g) * torch.logspace(-20, 20, 256)[:, None]).bfloat16()
    packed, scale = encode_mxfp4(w)
    ref_packed, ref_scale = ct_encode(w)
    assert torch.equal(scale, ref_scale) and torch.equal(packed, ref_packed)


def _adversarial_weight() -> torch.Tensor:
    """Groups built to hit every rounding boundary, ties, signed zeros and the scale rounding threshold."""
    base = 0.25  # group scale 2**-2 when amax = 6 * base is in the group
    boundaries = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows = []
    for sign in (1.0, -1.0):
        vals = [6.0]
        for b in boundaries:  # the tie itself and its bf16 neighbours
            bb = torch.tensor(b, dtype=torch.bfloat16)
            vals += [b, torch.nextafter(bb.float(), torch.tensor(0.0)).item(), torch.nextafter(bb.float(), torch.tensor(9.0)).item()]
        vals += [0.0, -0.0, 1e-3, -1e-3, 0.1, 5.9, 6.0, 5.5, 4.5, 3.0]
        vals = (vals + [0.0] * 32)[:32]
        rows.append([sign * v * base for v in vals])
    rows.append([0.0] * 32)  # all-zero group -> e = 0
    rows.append([-0.0] * 32)
    rows.append([1.74 * 2**-3] + [-1e-2] * 31)  # amax mantissa < 1.75: rounds down
    rows.append([1.75 * 2**-3] + [-1e-2] * 31)  # mantissa == 1.75: rounds up
    rows.append([-1.9921875 * 2**120] + [2**100] * 31)  # large exponent
    rows.append([2**-130] + [-(2**-131)] * 31)  # subnormal group -> e clamped to 0
    rows.append([3e-39] * 16 + [-1e-40] * 16)
    w = torch.tensor(rows, dtype=torch.float32).bfloat16()
    return torch.cat([w, w.flip(1)], dim=1)


def test_encode_adversarial_bitexact_vs_compressed_tensors():
    w = _adversarial_weight()
    packed, scale = encode_mxfp4(w)
    ref_packed, ref_scale = ct_encode(w)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(packed, ref_packed)
    assert scale[2].tolist() == [0, 0] and scale[4, 0] != scale[5, 0]


def test_encode_float32_bitexact_vs_compressed_tensors():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 512, generator=g) * 0.02
    packed, scale = encode_mxfp4(w)
    ref_packed, ref_scale = ct_encode(w)
    assert torch.equal(scale, ref_scale) and torch.equal(packed, ref_packed)


def test_encode_small_negative_keeps_sign_code():
    w = torch.zeros(1, 32, dtype=torch.bfloat16)
    w[0, 0], w[0, 1] = 1.0, -1e-3
    packed, _ = encode_mxfp4(w)
    assert packed[0, 0].item() == 0x80 | 0x6  # 1.0 / 2**-2 = 4 -> code 6; -tiny -> code 8 (-0)


def test_encode_then_decode_roundtrip_error_bound():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(32, 256, generator=g)
    packed, scale = encode_mxfp4(w)
    back = decode_mxfp4(packed, scale, dtype=torch.float32)
    # relative error of E2M1 rounding is at most 1/4 of the group scale * 2 (step 2 near the top): |err| <= scale
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step).all()


@pytest.mark.parametrize(
    "weight, message",
    [
        (torch.zeros(4, 48), "not divisible by 32"),
        (torch.zeros(4, 32, dtype=torch.int32), "floating-point"),
        (torch.zeros(32), "2-D"),
        (torch.full((1, 32), float("nan")), "NaN or inf"),
    ],
)
def test_encode_rejects_bad_inputs_naming_tensor(weight, message):
    with pytest.raises(ValueError, match=f"w9.*{message}"):
        encode_mxfp4(weight, name="w9")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_on_cuda_matches_cpu_and_stays_on_device():
    packed, scale = _random_codes(64, 1024, seed=7)
    out = decode_mxfp4(packed.cuda(), scale.cuda())
    assert out.device.type == "cuda"
    assert same_bits(out.cpu(), decode_mxfp4(packed, scale))
    p2, s2 = encode_mxfp4(out)
    assert p2.device.type == "cuda"


def test_decode_large_tensor_uses_chunked_threaded_path_bitexact():
    # 512 x 1024 = 16384 groups: above the threshold where the CPU decode splits work across threads
    packed, scale = _random_codes(512, 1024, seed=8)
    scale[7, 3], scale[300, 31] = 0, 254
    assert same_bits(decode_mxfp4(packed, scale), ct_decode(packed, scale))


def test_decode_into_out_buffer_and_rejects_wrong_out():
    packed, scale = _random_codes(8, 64, seed=9)
    buf = torch.empty(8, 64, dtype=torch.bfloat16)
    assert decode_mxfp4(packed, scale, out=buf) is buf
    assert same_bits(buf, ct_decode(packed, scale))
    with pytest.raises(ValueError, match="w5: out must be"):
        decode_mxfp4(packed, scale, out=torch.empty(8, 64), name="w5")


def test_decode_non_contiguous_inputs():
    packed, scale = _random_codes(16, 128, seed=10)
    p_nc = packed.t().contiguous().t()
    s_nc = scale.t().contiguous().t()
    assert not p_nc.is_contiguous()
    assert same_bits(decode_mxfp4(p_nc, s_nc), ct_decode(packed, scale))
