"""fa3_quant's practice entry: msModelSlim's keys, and the plans that would write nothing vllm-ascend reads refused.

Reference: msModelSlim 26.1.0's FA3QuantProcessorConfig (qconfig xor details, int8 per head by default) and
vllm-ascend 0.23's FAKQuant, which reads an MLA's KV-cache scale from `fa_k.scale` only and no offset.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from msmodelslim.core.config import PracticeError, load_practice
from msmodelslim.processor.catalog import registries
from msmodelslim.quant.attention import AttentionQuantSpec

REPO = Path(__file__).resolve().parents[2]
C8 = REPO / "lab_practice" / "kimi_k3" / "kimi_linear_w4a8c8.yaml"


def _with_fa3(tmp_path: Path, entry: dict) -> Path:
    practice = yaml.safe_load(C8.read_text())
    steps = practice["spec"]["process"]
    steps[[s["type"] for s in steps].index("fa3_quant")] = {"type": "fa3_quant", **entry}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(practice, sort_keys=False))
    return path


def _fa3(practice):
    return next(e.config for e in practice.spec.process if e.type == "fa3_quant")


def test_no_qconfig_means_int8_per_head_for_q_k_and_v(tmp_path):
    config = _fa3(load_practice(_with_fa3(tmp_path, {}), *registries()))
    assert config.specs == {b: AttentionQuantSpec("int8", "per_head") for b in ("fa_q", "fa_k", "fa_v")}


def test_details_quantize_the_points_they_name(tmp_path):
    details = {"fa_q": {"dtype": "fp8_e4m3", "scope": "per_token"}, "fa_k": {"dtype": "fp8_e4m3"}}
    config = _fa3(load_practice(_with_fa3(tmp_path, {"details": details}), *registries()))
    assert config.specs == {"fa_q": AttentionQuantSpec("fp8_e4m3", "per_token"),
                            "fa_k": AttentionQuantSpec("fp8_e4m3", "per_head")}


@pytest.mark.parametrize("entry, message", [
    ({"qconfig": {"scope": "per_token"}}, "fa_k must be quantized per_head"),
    ({"details": {"fa_q": {"dtype": "int8"}}}, "fa_k must be quantized per_head"),
    ({"qconfig": {"symmetric": False}}, "symmetric must be true"),
    ({"qconfig": {}, "details": {"fa_k": {}}}, "give one of qconfig and details"),
    ({"qconfig": {"dtype": "int4"}}, "'int4' is not allowed; expected one of int8, fp8_e4m3"),
    ({"qconfig": {"scope": "per_block"}}, "'per_block' is not allowed; expected one of per_head, per_token"),
    ({"details": {"fa_x": {}}}, "details.fa_x: unknown key"),
])
def test_a_plan_vllm_ascend_cannot_read_is_a_schema_error(tmp_path, entry, message):
    with pytest.raises(PracticeError, match="fa3_quant|spec.process") as err:
        load_practice(_with_fa3(tmp_path, entry), *registries())
    assert message in str(err.value)


class _Attentions:
    """What preflight asks an adapter: the checkpoint names of its attentions with FA3 points."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def fa3_attentions(self) -> list[str]:
        return self.names


@pytest.mark.parametrize("names, exclude, message", [
    (["model.layers.3.self_attn", "model.layers.7.self_attn"], ["*.layers.*"],
     r"fa3_quant: include \['\*'\] / exclude \['\*\.layers\.\*'\] match none of the model's 2 attentions"),
    ([], [], r"fa3_quant: _Attentions has no attention with FA3 points"),
])
def test_a_plan_that_quantizes_no_attention_is_refused_before_any_compute(names, exclude, message):
    from msmodelslim.errors import UserError
    from msmodelslim.processor.fa3_quant import FA3QuantConfig, FA3QuantProcessor

    adapter = _Attentions(names)
    with pytest.raises(UserError, match=message):
        FA3QuantProcessor(FA3QuantConfig.build(exclude=exclude)).preflight(adapter, {})
