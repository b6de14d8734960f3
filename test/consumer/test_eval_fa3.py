"""`msmodelslim eval` on a W4A8C8 output simulates the quantized attention it describes.

Reference: the same evaluation with the attention quantizers left out (`install_attention_quantizers` a no-op);
expected: every quantized attention of the output's text units is simulated, and simulating them moves the
quantized perplexity (the stored int8 K cache, per-head Q) while the original perplexity stays bit-identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from msmodelslim.eval import perplexity

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO.parent / "shared" / "data" / "text" / "python_tutorial.txt"


def _eval(src: Path, out: Path) -> dict:
    if not TEXT.is_file():
        pytest.skip(f"{TEXT} not available")
    return perplexity.evaluate(src, out, TEXT, seq_len=32, max_windows=2, trust_remote_code=True)


def test_eval_simulates_every_quantized_attention(outputs, tiny_k3_checkpoint, monkeypatch):
    out = outputs[("tiny_k3", "w4a8c8")]
    description = json.loads((out / "quant_model_description.json").read_text())
    aliases = set(description["metadata"].get("lookup_aliases", ()))  # the MTP drafters' names of the same entries
    described = {k for k in description if k.endswith("self_attn.quant_type") and k not in aliases}
    with_fa = _eval(tiny_k3_checkpoint, out)
    assert with_fa["quantized_attentions"] == len(described) >= 1
    monkeypatch.setattr(perplexity, "install_attention_quantizers", lambda *a: sorted(
        k[: -len(".quant_type")] for k in described))  # claims them all, installs nothing
    without = _eval(tiny_k3_checkpoint, out)
    assert without["ppl_orig"] == with_fa["ppl_orig"]
    assert without["ppl_quant"] != pytest.approx(with_fa["ppl_quant"], rel=1e-9, abs=0)
