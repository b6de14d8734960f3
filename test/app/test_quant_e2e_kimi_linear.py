"""`msmodelslim quant` end to end with the real service on the real trained kimi-linear-mini (transformers' native
Kimi-Linear, MXFP4 experts, text service) with the same adapter as Kimi-K3. References: the schemes the shipped
practice assigns to each kind of tensor (exact strings) and the byte copy of the practice; no numeric tolerance is
involved here (numerics are tested by their owners)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from msmodelslim.cli.main import main
from msmodelslim.core.resources import resource_path

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

REPO = Path(__file__).resolve().parents[2]
MINI = REPO / ".." / "shared" / "models" / "kimi-linear-mini"


def scheme_of(description: dict[str, str], pattern: str) -> set[str]:
    found = {v for k, v in description.items() if re.search(pattern, k)}
    assert found, f"no tensor matches {pattern}"
    return found


@pytest.mark.skipif(not (MINI / "config.json").is_file(), reason=f"{MINI} not available")
def test_quant_w4a8_kimi_linear_mini(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MSMODELSLIM_ASCEND_CHECK", "1")  # the shipped practice, every device op held to A2/A3's rules
    # The shipped Kimi-Linear practice, cut to 4 calibration records of <= 128 tokens to keep the suite fast (the
    # lookup of this file by --quant_type is test_practice_lookup.py::test_shipped_lookup).
    shipped = resource_path("lab_practice") / "kimi_k3" / "kimi_linear_w4a8.yaml"
    practice = tmp_path / "kimi_linear_w4a8_fast.yaml"
    text = shipped.read_text()
    assert "  max_seq_len: 512\n" in text
    practice.write_text(text.replace("  max_seq_len: 512\n", "  max_seq_len: 128\n  max_samples: 4\n"))
    save = tmp_path / "kl-w4a8"
    code = main(["quant", "--model_path", str(MINI), "--save_path", str(save), "--device", "cpu",
                 "--model_type", "Kimi-Linear", "--config_path", str(practice)])
    assert code == 0, capsys.readouterr().err
    description = json.loads((save / "quant_model_description.json").read_text())
    assert scheme_of(description, r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$") == {"W4A8_DYNAMIC"}
    assert scheme_of(description, r"shared_experts\.\w+_proj\.weight$") == {"W8A8_DYNAMIC"}
    assert scheme_of(description, r"layers\.0\.mlp\.(gate|up|down)_proj\.weight$") == {"W8A8_DYNAMIC"}
    assert scheme_of(description, r"self_attn\.(q|k|v|o)_proj\.weight$") == {"W8A8_DYNAMIC"}
    assert scheme_of(description, r"lm_head\.weight$|embed_tokens\.weight$|kv_b_proj\.weight$") == {"FLOAT"}
    assert (save / "Kimi-Linear_best_practice.yaml").read_bytes() == practice.read_bytes()
