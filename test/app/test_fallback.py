"""spec.fallback (processor/fallback.py): which linears move to which scheme, decided on the model's skeleton
before any compute, and the one-line errors of a fallback that cannot work. Reference: the schemes
`linear_plan` gives every linear of the tiny Kimi-K3 with the shipped W4A8 practice (exact strings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from msmodelslim.app.quant import QuantArgs, check_request
from msmodelslim.core.config import PracticeError, load_practice
from msmodelslim.errors import UserError
from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter
from msmodelslim.processor.catalog import registries
from msmodelslim.processor.fallback import apply_fallback
from msmodelslim.processor.plan import linear_plan
from msmodelslim.source.checkpoint import source_identity

REPO = Path(__file__).resolve().parents[2]
LM = "language_model.model.layers"


@pytest.fixture(scope="module")
def adapter(tiny_k3_checkpoint):
    a = KimiK3ModelAdapter(tiny_k3_checkpoint, trust_remote_code=True)  # meta skeleton, headers checked
    yield a
    a.close()


def practice_with(tmp_path: Path, fallback: list[dict]) -> Path:
    data = yaml.safe_load((REPO / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml").read_text())
    data["spec"]["fallback"] = fallback
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def schemes(adapter, path: Path) -> dict[str, str]:
    spec = load_practice(path, *registries()).spec
    processors = [s.build() for s in spec.process]
    return linear_plan(processors, adapter, apply_fallback(processors, spec.fallback, adapter)).schemes


def test_without_fallback_the_practice_decides(adapter, tmp_path):
    plain = schemes(adapter, practice_with(tmp_path, []))
    assert plain[f"{LM}.0.self_attn.q_proj"] == "W8A8_DYNAMIC"
    assert plain[f"{LM}.1.block_sparse_moe.experts.3.w2"] == "W4A8_DYNAMIC"


def test_float_fallback_moves_the_named_linear_with_its_fused_group_only(adapter, tmp_path):
    plain = schemes(adapter, practice_with(tmp_path, []))
    got = schemes(adapter, practice_with(tmp_path, [{"to": "FLOAT", "names": [f"{LM}.0.self_attn.q_proj"]}]))
    group = {f"{LM}.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj")}
    changed = {n for n in plain if plain[n] != got[n]}
    assert changed == group and {got[n] for n in group} == {"FLOAT"}


def test_w8a8_fallback_of_one_expert_moves_every_expert_of_its_layer(adapter, tmp_path):
    plain = schemes(adapter, practice_with(tmp_path, []))
    got = schemes(adapter, practice_with(tmp_path, [{"to": "W8A8_DYNAMIC",
                                                     "names": [f"{LM}.1.block_sparse_moe.experts.3.w2"]}]))
    changed = {n for n in plain if plain[n] != got[n]}
    assert changed and all(n.startswith(f"{LM}.1.block_sparse_moe.experts.") for n in changed)
    assert {got[n] for n in changed} == {"W8A8_DYNAMIC"}
    assert len(changed) == sum(n.startswith(f"{LM}.1.block_sparse_moe.experts.") for n in plain)


def test_float_wins_over_a_w8a8_fallback_of_the_same_linear(adapter, tmp_path):
    name = f"{LM}.2.self_attn.o_proj"
    got = schemes(adapter, practice_with(tmp_path, [{"to": "W8A8_DYNAMIC", "names": [name]},
                                                    {"to": "FLOAT", "names": [name]}]))
    assert got[name] == "FLOAT"


def test_a_reports_top_k_fall_back_its_worst_linears(adapter, tiny_k3_checkpoint, tmp_path):
    worst, second = f"{LM}.2.self_attn.o_proj", f"{LM}.1.self_attn.o_proj"
    report = {"version": 1, "source": source_identity(tiny_k3_checkpoint), "linears": {
        worst: {"error": 0.5}, second: {"error": 0.2}, f"{LM}.0.self_attn.o_proj": {"error": None}}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    got = schemes(adapter, practice_with(tmp_path, [{"to": "FLOAT", "report": "r.json", "top_k": 1}]))
    assert got[worst] == "FLOAT" and got[second] == "W8A8_DYNAMIC"


def test_a_reports_top_k_is_a_budget_of_linears_with_their_groups(adapter, tiny_k3_checkpoint, tmp_path):
    """The worst linear is a routed expert, whose layer's experts (more than top_k) move together: that group is
    skipped, and the next worst linears fill the budget with their groups."""
    expert, o_proj, q_proj = (f"{LM}.1.block_sparse_moe.experts.3.w2", f"{LM}.2.self_attn.o_proj",
                              f"{LM}.0.self_attn.q_proj")
    report = {"version": 1, "source": source_identity(tiny_k3_checkpoint), "linears": {
        expert: {"error": 0.9}, o_proj: {"error": 0.5}, q_proj: {"error": 0.4}}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    plain = schemes(adapter, practice_with(tmp_path, []))
    got = schemes(adapter, practice_with(tmp_path, [{"to": "FLOAT", "report": "r.json", "top_k": 7}]))
    changed = {n for n in plain if plain[n] != got[n]}
    assert changed == {o_proj} | {f"{LM}.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "g_proj",
                                                                     "b_proj", "f_a_proj")}


def test_a_names_file_of_analyze_is_read_relative_to_the_practice(adapter, tmp_path):
    (tmp_path / "disable.yaml").write_text(yaml.safe_dump({"metric": "error",
                                                           "disable_names": [f"{LM}.2.self_attn.o_proj"]}))
    got = schemes(adapter, practice_with(tmp_path, [{"to": "FLOAT", "names_file": "disable.yaml"}]))
    assert got[f"{LM}.2.self_attn.o_proj"] == "FLOAT"


def test_a_glob_that_names_no_quantized_linear_is_one_error_naming_it(adapter, tmp_path):
    for glob in ("*no_such_proj*", "vision_tower.*"):  # the vision tower is never quantized by this practice
        with pytest.raises(UserError, match=r"spec\.fallback\[0\]: .* names none of the model's \d+ quantized"):
            schemes(adapter, practice_with(tmp_path, [{"to": "FLOAT", "names": [glob]}]))


@pytest.mark.parametrize("entry,message", [
    ({"to": "W4A8_DYNAMIC", "names": ["x"]}, r"spec\.fallback\[0\]\.to"),
    ({"to": "FLOAT"}, r"names a linear in none of names, names_file or report"),
    ({"to": "FLOAT", "report": "r.json"}, r"report and top_k go together"),
    ({"to": "FLOAT", "report": "r.json", "top_k": 0}, r"top_k: must be a positive integer"),
    ({"to": "FLOAT", "names_file": "missing.yaml"}, r"names_file file not found: .*missing\.yaml"),
    ({"to": "FLOAT", "report": "missing.json", "top_k": 3}, r"missing\.json: no such quant report"),
])
def test_a_fallback_that_cannot_work_is_a_practice_error(tmp_path, entry, message):
    with pytest.raises(PracticeError, match=message):
        load_practice(practice_with(tmp_path, [entry]), *registries())


def test_a_report_of_another_checkpoint_is_refused_before_compute(tiny_k3_checkpoint, tmp_path):
    report = {"version": 1, "source": {"config_sha256": "0" * 64}, "linears": {f"{LM}.2.self_attn.o_proj": {"error": 1}}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    args = QuantArgs(model_path=str(tiny_k3_checkpoint), save_path=str(tmp_path / "out"), model_type="Kimi-K3",
                     device="cpu", config_path=str(practice_with(tmp_path, [{"to": "FLOAT", "report": "r.json",
                                                                            "top_k": 1}])),
                     trust_remote_code=True)
    with pytest.raises(UserError, match=r"spec\.fallback\[0\]\.report r\.json is the quant report of another"):
        check_request(args)
    assert not (tmp_path / "out").exists()
