"""`msmodelslim quant` end to end with the real service on the real trained kimi-linear-mini (transformers' native
Kimi-Linear, MXFP4 experts, text service) with the same adapter as Kimi-K3. References: the schemes the shipped
practice assigns to each kind of tensor (exact strings) and the byte copy of the practice; no numeric tolerance is
involved here (numerics are tested by their owners)."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)



def scheme_of(description: dict[str, str], pattern: str) -> set[str]:
    found = {v for k, v in description.items() if re.search(pattern, k)}
    assert found, f"no tensor matches {pattern}"
    return found


def test_quant_w4a8_kimi_linear_mini(mini_runs):
    # The shipped W4A8C8 practice (W4A8 plus fa3_quant), cut to 4 records of <= 64 tokens, on one CPU process with
    # every device op held to A2/A3's rules (the session's run, conftest.mini_runs; the lookup of the shipped file
    # by --quant_type is test_practice_lookup.py::test_shipped_lookup).
    save, practice = mini_runs.one, mini_runs.practice
    description = json.loads((save / "quant_model_description.json").read_text())
    assert scheme_of(description, r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$") == {"W4A8_DYNAMIC"}
    assert scheme_of(description, r"shared_experts\.\w+_proj\.weight$") == {"W8A8_DYNAMIC"}
    assert scheme_of(description, r"layers\.0\.mlp\.(gate|up|down)_proj\.weight$") == {"W8A8_DYNAMIC"}
    assert scheme_of(description, r"self_attn\.(q|k|v|o)_proj\.weight$") == {"W8A8_DYNAMIC"}
    assert scheme_of(description, r"lm_head\.weight$|embed_tokens\.weight$|kv_b_proj\.weight$") == {"FLOAT"}
    assert (save / "Kimi-Linear_best_practice.yaml").read_bytes() == practice.read_bytes()
