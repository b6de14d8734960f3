"""The serving target (serving/profiles.py): a run is checked against the engine it is written for, before compute.

References: vllm-ascend's own acceptance rules as read in docs/dev/facts/vllm_ascend_0.27_kimi_k3.md, written out
again here (not imported): 0.27 loads KDA's packed in_proj_qkvgfab when all six shards share one type, or when
q/k/v share one type that is not FLOAT and g/f_a/b are all FLOAT (`uses_kimi_k3_mixed_kda_projection`); it refuses
W4A8 MoE per group. Exact: these are strings and sets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from runner.dp_helpers import REPO, shrunken_practice

from msmodelslim.app.quant import QuantArgs, plan, quant

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

W4A8 = REPO / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml"
KDA_GATES = ("g_proj", "b_proj", "f_a_proj")


def edited_practice(tmp: Path, edit) -> Path:
    data = yaml.safe_load(W4A8.read_text())
    edit(data["spec"]["process"])
    source = tmp / "edited.yaml"
    source.write_text(yaml.safe_dump(data, sort_keys=False))
    return shrunken_practice(source, tmp / "practice.yaml", max_samples=2, max_seq_len=32, plain_numerics=True)


def per_group_experts(process: list) -> None:
    process[2]["qconfig"]["weight"] = {"scope": "per_group", "dtype": "int4", "symmetric": True, "method": "gptq",
                                       "ext": {"group_size": 32}}


def kda_gates_float(model: Path):
    """The QuaRot layout: KDA q/k/v W8A8, g/f_a/b FLOAT; MLA's g_proj stays W8A8 with q_a/kv_a (vLLM 0.33's
    fused_qkv_a_g_proj, which the 0.27 profile keeps)."""
    weights = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    kda = sorted({k[:-len(".b_proj.weight")] for k in weights if k.endswith(".self_attn.b_proj.weight")})

    def edit(process: list) -> None:
        process[3]["include"] = [g for g in process[3]["include"] if not g.endswith(("b_proj", "f_a_proj"))]
        process[3]["exclude"] += [f"{attention}.g_proj" for attention in kda]
    return edit


def args(model: Path, save: Path, practice: Path, target: str | None) -> QuantArgs:
    return QuantArgs(model_path=str(model), save_path=str(save), model_type="Kimi-K3", device="cpu",
                     config_path=str(practice), trust_remote_code=True, target=target)


def test_plan_gives_every_targets_verdict_and_the_chosen_one_decides(tiny_k3_checkpoint, tmp_path):
    practice = edited_practice(tmp_path, per_group_experts)
    result = plan(args(tiny_k3_checkpoint, tmp_path / "out", practice, "vllm-ascend-0.26"))
    verdicts = result["target"]["verdicts"]
    assert result["target"]["chosen"] == "vllm-ascend-0.26"
    assert verdicts["vllm-ascend-0.26"].startswith("loads")
    assert "per group of 32, which vllm-ascend-0.27 refuses at load" in verdicts["vllm-ascend-0.27"]
    assert not (tmp_path / "out").exists()


def accepted_by_0_27(types: dict[str, str]) -> bool:
    """vllm-ascend 0.27's rule for one KDA attention's six shard types (facts file, `:678-695`)."""
    if len(set(types.values())) == 1:
        return True
    qkv = {types[p] for p in ("q_proj", "k_proj", "v_proj")}
    gates = {types[p] for p in KDA_GATES}
    return len(qkv) == 1 and qkv != {"FLOAT"} and gates == {"FLOAT"}


def test_the_quarot_kda_layout_is_written_for_0_27_as_its_loader_accepts_it(tiny_k3_checkpoint, tmp_path):
    practice = edited_practice(tmp_path, kda_gates_float(tiny_k3_checkpoint))
    quant(args(tiny_k3_checkpoint, tmp_path / "out", practice, None))  # the default target: vllm-ascend-0.27
    description = json.loads((tmp_path / "out" / "quant_model_description.json").read_text())
    attentions = sorted(k[:-len(".b_proj.weight")] for k in description if k.endswith(".self_attn.b_proj.weight"))
    assert attentions, "the tiny Kimi-K3 has KDA layers"
    for attention in attentions:
        types = {p: description[f"{attention}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj", *KDA_GATES)}
        assert types == {"q_proj": "W8A8_DYNAMIC", "k_proj": "W8A8_DYNAMIC", "v_proj": "W8A8_DYNAMIC",
                         "g_proj": "FLOAT", "b_proj": "FLOAT", "f_a_proj": "FLOAT"}
        assert accepted_by_0_27(types)
        assert f"{attention}.in_proj_qkvgfab.weight" not in description  # a split layer is looked up by its shards
    practice_copy = yaml.safe_load(next((tmp_path / "out").glob("*_best_practice.yaml")).read_text())
    assert practice_copy["spec"].get("target") is None  # nothing was overridden: the practice's own bytes


def test_fa3_scales_are_written_only_for_the_target_that_loads_them(tiny_k3_checkpoint, tmp_path):
    """vllm-ascend 0.27 maps the FA3 scales' names twice (serving/profiles.py; bench/consumer_k3.py met the KeyError):
    the shipped W4A8C8 practice names vllm-ascend-0.26, and asked for 0.27 it is refused before compute in one line
    naming the rule and the target that loads it."""
    from msmodelslim.errors import UserError

    c8 = shrunken_practice(REPO / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8c8.yaml", tmp_path / "c8.yaml",
                           max_samples=2, max_seq_len=32, plain_numerics=True)
    result = plan(args(tiny_k3_checkpoint, tmp_path / "out", c8, None))
    assert result["target"]["chosen"] == "vllm-ascend-0.26"
    assert result["target"]["verdicts"]["vllm-ascend-0.26"].startswith("loads")
    assert "fa3_quant writes FA3 scales, which vllm-ascend-0.27 cannot load" in \
        result["target"]["verdicts"]["vllm-ascend-0.27"]
    with pytest.raises(UserError, match=r"fa3_quant .* vllm-ascend-0.27 cannot load .*; --target vllm-ascend-0.26 "
                                        r"loads it$"):
        plan(args(tiny_k3_checkpoint, tmp_path / "out", c8, "vllm-ascend-0.27"))
    assert not (tmp_path / "out").exists()


def test_the_mla_output_gate_apart_from_q_a_and_kv_a_loads_under_0_27(tiny_k3_checkpoint, tmp_path):
    """vLLM 0.27.1's MLA fuses q_a + kv_a only, its output gate is a layer of its own (models/kimi_k3/amd/linear.py
    :346-353, 404-411): the upstream practice (q_a / kv_a W8A8, the MLA gate FLOAT) loads there, as
    bench/consumer_k3.py measured with 0.27's own class."""
    upstream = shrunken_practice(REPO / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8_upstream.yaml",
                                 tmp_path / "upstream.yaml", max_samples=2, max_seq_len=32, plain_numerics=True)
    verdicts = plan(args(tiny_k3_checkpoint, tmp_path / "out", upstream, "vllm-ascend-0.27"))["target"]["verdicts"]
    assert verdicts["vllm-ascend-0.27"].startswith("loads"), verdicts
