"""`msmodelslim quant` end to end with the real service on a generated tiny Kimi-K3 (stand-in remote code, MXFP4
experts): practice lookup, image+text calibration, quantization and the atomic publish (what `make demo` runs).
References: the schemes the shipped practice assigns to each kind of tensor (exact strings) and the byte copy of
the practice; no numeric tolerance is involved here (numerics are tested by their owners)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from msmodelslim.cli.main import main
from msmodelslim.core.resources import resource_path

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_k3(tiny_k3_checkpoint) -> Path:
    return tiny_k3_checkpoint


def scheme_of(description: dict[str, str], pattern: str) -> set[str]:
    found = {v for k, v in description.items() if re.search(pattern, k)}
    assert found, f"no tensor matches {pattern}"
    return found


def test_quant_w4a8_tiny_kimi_k3(tiny_k3, tmp_path, capsys):
    # the user's command, unchecked: test_data_parallel.py holds the shipped practices' device ops to A2/A3's rules
    save = tmp_path / "Kimi-K3-tiny-w4a8"
    code = main(["quant", "--model_path", str(tiny_k3), "--save_path", str(save), "--device", "cpu",
                 "--model_type", "Kimi-K3", "--quant_type", "w4a8", "--trust_remote_code", "True"])
    assert code == 0, capsys.readouterr().err
    assert "msmodelslim quant: done" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == [save.name]  # no temporary directory left
    practice = resource_path("lab_practice") / "kimi_k3" / "kimi_k3_w4a8.yaml"
    assert (save / "Kimi-K3_best_practice.yaml").read_bytes() == practice.read_bytes()
    description = json.loads((save / "quant_model_description.json").read_text())
    # msModelSlim 26.1.0 labels a W4A8 mix W8A8_DYNAMIC (its own W4A8 Kimi-K2 output, read 2026-12-01)
    assert description["model_quant_type"] == "W8A8_DYNAMIC" and description["version"] == "1.0.0"
    assert scheme_of(description, r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$") == {"W4A8_DYNAMIC"}
    for pattern in (r"shared_experts\.\w+_proj\.weight$", r"routed_expert_(down|up)_proj\.weight$",
                    r"self_attn\.(q|k|v|o|g)_proj\.weight$", r"mlp\.\w+_proj\.weight$",
                    r"kv_a_proj_with_mqa\.weight$", r"self_attn\.(b|f_a|q_a|q_b)_proj\.weight$",
                    r"layers\.4\.block_sparse_moe\.shared_experts\.\w+_proj\.weight$"):  # the MTP layer too
        assert scheme_of(description, pattern) == {"W8A8_DYNAMIC"}, pattern
    assert scheme_of(description, r"layers\.4\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$") == {"W4A8_DYNAMIC"}
    for pattern in (r"kv_b_proj\.weight$", r"self_attn\.f_b_proj\.weight$", r"_res_proj\.weight$",
                    r"eh_proj\.weight$", r"shared_head\.", r"output_attn_res_",
                    r"^vision_tower\.", r"^mm_projector\.", r"lm_head\.weight$", r"embed_tokens\.weight$",
                    r"norm\.weight$", r"block_sparse_moe\.gate\.weight$"):
        assert scheme_of(description, pattern) == {"FLOAT"}, pattern
    config = json.loads((save / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config.get("text_config", {})
    assert config["text_config"]["mla_use_nope"] is True  # vLLM's Kimi MLA asserts it
    # msModelSlim's summary keys, read by vllm-ascend from the text config (ascend_forward_context.py:335-339)
    assert {k: config["text_config"][k] for k in ("quantize", "moe_quantize", "mla_quantize")} == {
        "quantize": "w8a8_dynamic", "moe_quantize": "w4a8_dynamic", "mla_quantize": "w8a8_dynamic"}
    assert any(save.glob("quant_model_weights*.safetensors"))
    # the practice leaves the residual stream unrotated (the projector ends in an RMSNorm): nothing to publish
    assert "quarot" not in description["optional"] and not (save / "optional").exists()


def check_published_rotation(source: Path, save: Path, description: dict) -> None:
    """The residual Q under `optional`, as msModelSlim publishes it and vllm-ascend reads it: an orthogonal
    [hidden, hidden] tensor `global_rotation` with stored embedding = source embedding @ Q (reference: float64
    product of the source bf16 table; tolerance: the bf16 rounding of the stored table, 2^-8 relative)."""
    from safetensors.torch import load_file

    from msmodelslim.serving.ascendv1 import AscendV1Reader
    from msmodelslim.source.checkpoint import open_checkpoint

    rel = description["optional"]["quarot"]["rotation_map"]["global_rotation"]
    q = load_file(str(save / rel))["global_rotation"].double()
    assert torch.allclose(q @ q.T, torch.eye(q.shape[0], dtype=torch.float64), atol=1e-6)
    name = "language_model.model.embed_tokens.weight"
    src = open_checkpoint(source).get(name).double()
    out = AscendV1Reader(save).get(name, dtype=torch.float64)
    assert q.shape[0] == src.shape[1]
    assert float((out - src @ q).abs().max()) <= 2**-8 * float(src.abs().max()) * 2


def test_remote_code_refused_without_trust(tiny_k3, tmp_path, capsys):
    save = tmp_path / "out"
    code = main(["quant", "--model_path", str(tiny_k3), "--save_path", str(save), "--device", "cpu",
                 "--model_type", "Kimi-K3", "--quant_type", "w4a8"])
    assert code == 2 and "--trust_remote_code True" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
