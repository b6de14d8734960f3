"""`msmodelslim eval` on the Ascend 950 outputs simulates the MX activations their kernels quantize.

Reference: the tiny Kimi-K3's W4A16_MXFP4 and W4A8_MXFP outputs hold the same expert bytes (the checkpoint's) and
the same W8A8_MXFP8 linears (min/max weights, one calibration): the one difference is that W4A8_MXFP quantizes the
experts' inputs to MXFP8. Expected: identical original perplexity, different quantized perplexity, both finite.
"""

from __future__ import annotations

import math

import pytest
from safetensors import safe_open

from .test_eval_fa3 import _eval

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)


def _expert_bytes(out):
    with safe_open(str(next(out.glob("quant_model_weights-*.safetensors"))), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if ".experts." in k}


def test_eval_simulates_mxfp8_activations_of_w4a8_mxfp_experts(outputs, tiny_k3_checkpoint):
    w4a16, w4a8 = outputs[("tiny_k3", "w4a16_mxfp4")], outputs[("tiny_k3", "w4a8_mxfp")]
    a, b = _expert_bytes(w4a16), _expert_bytes(w4a8)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    weight_only, mx_acts = _eval(tiny_k3_checkpoint, w4a16), _eval(tiny_k3_checkpoint, w4a8)
    assert weight_only["ppl_orig"] == mx_acts["ppl_orig"]
    assert math.isfinite(mx_acts["ppl_quant"]) and mx_acts["ppl_quant"] != weight_only["ppl_quant"]
