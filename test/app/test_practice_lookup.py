"""app.practice: --quant_type lookup in lab_practice/<group>/ (highest score wins, ties are errors, sub-folders
are ignored, the hardware is Atlas A2/A3 unless --tag asks for another) and the shipped practices themselves.
References: the literal file names expected to win."""

from __future__ import annotations

from pathlib import Path

import pytest

from msmodelslim.app.practice import choose_practice, find_practice
from msmodelslim.core.resources import resource_path
from msmodelslim.errors import UserError
from msmodelslim.processor.catalog import registries

HEADER = """\
apiversion: modelslim_v1
metadata:
  config_id: {name}
  score: {score}
  verified_model_types: [{models}]
  label: {{w_bit: {w}, a_bit: {a}}}
spec: {{}}
"""


def practice(root: Path, name: str, score: float, w: int = 4, a: int = 8, models: str = "M", sub: str = "",
             tags: list[list[str]] | None = None) -> Path:
    folder = root / "grp" / sub
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    text = HEADER.format(name=name, score=score, w=w, a=a, models=models)
    if tags is not None:
        text = text.replace(f"  verified_model_types: [{models}]\n", f"  verified_tags: {{{models}: {tags}}}\n")
    path.write_text(text)
    return path


def test_highest_score_wins(tmp_path):
    practice(tmp_path, "low", 10)
    best = practice(tmp_path, "best", 95)
    practice(tmp_path, "other_model", 99, models="N")
    practice(tmp_path, "other_quant", 99, w=8)
    practice(tmp_path, "in_recipes", 100, sub="recipes")  # sub-folders are not searched
    assert find_practice("M", "w4a8", "grp", tmp_path) == best


def test_quant_type_is_case_insensitive_and_suffixes_count(tmp_path):
    plain = practice(tmp_path, "w8a8", 50, w=8)
    assert find_practice("M", "W8A8", "grp", tmp_path) == plain
    with pytest.raises(UserError, match=r"available: w8a8 \(default hardware\)"):
        find_practice("M", "w8a8s", "grp", tmp_path)


def test_tied_top_score_names_both_files(tmp_path):
    a = practice(tmp_path, "a", 90)
    b = practice(tmp_path, "b", 90)
    practice(tmp_path, "c", 10)
    with pytest.raises(UserError) as info:
        find_practice("M", "w4a8", "grp", tmp_path)
    assert str(a) in str(info.value) and str(b) in str(info.value) and "top score 90" in str(info.value)


def test_no_match_lists_available(tmp_path):
    practice(tmp_path, "x", 1, w=8, a=16)
    with pytest.raises(UserError, match=r"available: w8a16 \(default hardware\)"):
        find_practice("M", "w4a8", "grp", tmp_path)
    with pytest.raises(UserError, match=r"available: \(none\)"):
        find_practice("Unverified", "w4a8", "grp", tmp_path)


def test_without_tags_the_atlas_a2_a3_practice_is_chosen_and_tags_choose_another_hardware(tmp_path):
    a3 = practice(tmp_path, "int", 90, tags=[["vLLM_Ascend", "Atlas_A2_Inference"], ["vLLM_Ascend", "Atlas_A3_Inference"]])
    a5 = practice(tmp_path, "mx", 95, tags=[["vLLM_Ascend", "Ascend_950"], ["vLLM_Ascend", "Atlas_350"]])
    assert find_practice("M", "w4a8", "grp", tmp_path) == a3  # the higher score serves other hardware
    assert find_practice("M", "w4a8", "grp", tmp_path, ("ascend_950",)) == a5  # tags match case-insensitively
    assert find_practice("M", "w4a8", "grp", tmp_path, ("vLLM_Ascend", "Atlas_350")) == a5
    assert find_practice("M", "w4a8", "grp", tmp_path, ("Atlas_A3_Inference",)) == a3
    with pytest.raises(UserError, match=r"on --tag Ascend_950 Atlas_A3_Inference .*available: w4a8 \(default hardware\); w4a8 with --tag Ascend_950 \| Atlas_350"):
        find_practice("M", "w4a8", "grp", tmp_path, ("Ascend_950", "Atlas_A3_Inference"))  # one scenario holds all


def test_an_untagged_practice_serves_the_default_hardware_only(tmp_path):
    plain = practice(tmp_path, "plain", 50)
    assert find_practice("M", "w4a8", "grp", tmp_path) == plain
    with pytest.raises(UserError, match="no practice for --model_type M --quant_type w4a8 on --tag Ascend_950"):
        find_practice("M", "w4a8", "grp", tmp_path, ("Ascend_950",))


def test_a_shipped_practice_is_taken_by_name(tmp_path):
    chosen = choose_practice("Kimi-K3", "kimi_k3", None, "kimi_k3_w4a8_pergroup")
    assert chosen.path == resource_path("lab_practice") / "kimi_k3" / "kimi_k3_w4a8_pergroup.yaml"
    with pytest.raises(UserError, match="not found"):
        choose_practice("Kimi-K3", "kimi_k3", None, "kimi_k3_no_such_practice")


@pytest.mark.parametrize(
    ("model_type", "quant_type", "file"),
    [("Kimi-K3", "w4a8", "kimi_k3_w4a8.yaml"), ("Kimi-K3", "w8a8", "kimi_k3_w8a8.yaml"),
     ("Kimi-Linear", "w4a8", "kimi_linear_w4a8.yaml"), ("Kimi-Linear", "w8a8", "kimi_linear_w8a8.yaml"),
     ("Kimi-K3", "w4a8c8", "kimi_k3_w4a8c8.yaml"), ("Kimi-Linear", "W4A8C8", "kimi_linear_w4a8c8.yaml")],
)
def test_shipped_lookup(model_type, quant_type, file):
    assert find_practice(model_type, quant_type, "kimi_k3") == resource_path("lab_practice") / "kimi_k3" / file


@pytest.mark.parametrize(("quant_type", "stem"), [("w4a16", "w4a16_mxfp4"), ("w4a8", "w4a8_mxfp"),
                                                  ("w4a4c8", "w4a4c8_mxfp")])
@pytest.mark.parametrize(("model_type", "prefix"), [("Kimi-K3", "kimi_k3"), ("Kimi-Linear", "kimi_linear")])
@pytest.mark.parametrize("tag", ["Ascend_950", "Atlas_350"])
def test_shipped_ascend_950_lookup(model_type, prefix, quant_type, stem, tag):
    found = find_practice(model_type, quant_type, "kimi_k3", tags=(tag,))
    assert found == resource_path("lab_practice") / "kimi_k3" / f"{prefix}_{stem}.yaml"


SHIPPED = sorted((resource_path("lab_practice")).rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name if p.parent.name == "kimi_k3" else f"recipes/{p.name}"
                                               for p in SHIPPED])
def test_shipped_practices_validate_against_the_real_processors(path):
    from msmodelslim.core.config import load_practice

    practice = load_practice(path, *registries())  # the real PROCESSORS / SAVERS
    assert practice.quant_type in ("w4a8", "w8a8", "w4a4", "w4a8c8", "w4a16", "w4a4c8")
    expected_api = "multimodal_vlm_modelslim_v1" if "Kimi-K3" in practice.metadata.model_types else "modelslim_v1"
    assert practice.apiversion == expected_api
    types = [e.type for e in practice.spec.process]
    assert set(types[types.index("linear_quant"):]) <= {"linear_quant", "fa3_quant"}  # float transforms first
    if path.parent.name == "recipes":
        assert practice.metadata.score == 0


@pytest.mark.parametrize("practice", ["kimi_k3_w4a8", "kimi_k3_w8a8", "kimi_k3_w4a8_mxfp"])
def test_shipped_k3_practices_give_every_fused_serving_layer_one_scheme(practice, tiny_k3_checkpoint):
    # reference: the fused groups of the default target vllm-ascend-0.27 (serving/fused.py);
    # every shard of a group must get the scheme of the first shard (no split), and the quantized groups must
    # include the KDA in_proj and the experts
    from msmodelslim.core.config import load_practice
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter
    from msmodelslim.processor.plan import linear_plan
    from msmodelslim.serving.rules import check_plan

    spec = load_practice(resource_path("lab_practice") / "kimi_k3" / f"{practice}.yaml", *registries()).spec
    with KimiK3ModelAdapter(tiny_k3_checkpoint, trust_remote_code=True) as adapter:
        processors = [step.build() for step in spec.process]
        linears = linear_plan(processors, adapter)
        check_plan(linears, adapter.target, adapter)
        plan = linears.schemes
        groups = dict(adapter.target.fused_groups(adapter))
    w8 = "W8A8_MXFP8" if practice.endswith("mxfp") else "W8A8_DYNAMIC"
    kda = next(g for g in groups if g.endswith("in_proj_qkvgfab"))
    assert {plan[s] for s in groups[kda]} == {w8} and len(groups[kda]) == 6  # q k v g b f_a
    mla = next(g for g in groups if g.endswith("fused_qkv_a_proj"))  # the output gate: a layer of its own in 0.27
    assert {plan[s] for s in groups[mla]} == {w8} and len(groups[mla]) == 2  # q_a kv_a
    moe = next(g for g in groups if g.endswith("experts"))
    assert len({plan[s] for s in groups[moe]}) == 1 and plan[groups[moe][0]] != "FLOAT"


def test_a_practice_with_a_serving_note_says_it_when_chosen(caplog):
    # the per-group W4A8 practices name the vllm-ascend versions that serve them; the plain W4A8 one has no note
    import logging

    with caplog.at_level(logging.WARNING, logger="msmodelslim.app.practice"):
        choose_practice("Kimi-K3", "kimi_k3", None, "kimi_k3_w4a8_pergroup")
    assert "kimi_k3_w4a8_pergroup: per-group W4A8 MoE is served by vllm-ascend 0.23.x and releases/v0.26.0rc" \
        in caplog.text and "refuses group_size > 0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="msmodelslim.app.practice"):
        choose_practice("Kimi-K3", "kimi_k3", "w4a8", None)
    assert not caplog.records
