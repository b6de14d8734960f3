"""`msmodelslim quant --plan`: what a run will do, from the headers, checked against what the run then did.

References: the real run's output for the same practice (its index's tensors with the scheme the description gives
each, and the index's `total_size`); the real run's own error line for the same bad input. Tolerances: the linear
and FLOAT counts exactly; the output size within 2 % (the plan does not size the few FA3 scale tensors). Every
shipped practice on the tiny Kimi-K3 and on kimi-linear-mini, with plain numerics (min/max weights, fixed smoothing:
what gets selected does not depend on them) and a small calibration set to keep the suite fast.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from runner.dp_helpers import REPO, shrunken_practice

from msmodelslim.app.quant import QuantArgs, plan, quant
from msmodelslim.cli.main import main
from msmodelslim.errors import UserError

pytestmark = pytest.mark.slow  # whole quantization runs (make test-fast leaves them out)

MINI = REPO.parent / "shared" / "models" / "kimi-linear-mini"
PRACTICES = REPO / "lab_practice" / "kimi_k3"
CASES = [("Kimi-K3", f"kimi_k3_{q}") for q in ("w4a8", "w8a8", "w4a8c8", "w4a4c8_mxfp")] + \
        [("Kimi-Linear", f"kimi_linear_{q}") for q in ("w4a8", "w8a8", "w4a8c8")]


def model_for(model_type: str, tiny_k3: Path) -> Path:
    if model_type == "Kimi-Linear" and not (MINI / "config.json").is_file():
        pytest.skip(f"{MINI} not available")
    return tiny_k3 if model_type == "Kimi-K3" else MINI


def args(model: Path, save: Path, model_type: str, practice: Path, device: str = "cpu") -> QuantArgs:
    return QuantArgs(model_path=str(model), save_path=str(save), model_type=model_type, device=device,
                     config_path=str(practice), trust_remote_code=model_type == "Kimi-K3")


def written(out: Path) -> tuple[Counter, int]:
    """(scheme -> count of the linears' weights and the FLOAT tensors the output holds, tensor bytes)."""
    index = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())
    description = json.loads((out / "quant_model_description.json").read_text())
    counts = Counter(description[k] for k in index["weight_map"]
                     if k.endswith(".weight") and description[k] != "FLOAT")
    counts["FLOAT"] = sum(description[k] == "FLOAT" for k in index["weight_map"])
    return counts, index["metadata"]["total_size"]


def planned(result: dict) -> Counter:
    counts = Counter()
    for selection in result["linear_quant"]:
        counts[selection["scheme"]] += selection["selected"]
    counts["FLOAT"] = result["float_tensors"]["count"]
    return counts


@pytest.mark.parametrize("model_type, name", CASES, ids=[name for _, name in CASES])
def test_the_plan_selects_what_the_run_quantizes_and_sizes_its_output(tiny_k3_checkpoint, tmp_path, model_type,
                                                                       name):
    model = model_for(model_type, tiny_k3_checkpoint)
    practice = shrunken_practice(PRACTICES / f"{name}.yaml", tmp_path / "p.yaml", max_samples=3, max_seq_len=64,
                                 plain_numerics=True)
    result = plan(args(model, tmp_path / "out", model_type, practice, "cpu:0,1"))
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["p.yaml"]  # the plan wrote nothing
    quant(args(model, tmp_path / "out", model_type, practice, "cpu:0,1"))
    counts, total = written(tmp_path / "out")
    assert planned(result) == counts
    assert abs(result["output"]["bytes"] - total) <= 0.02 * total
    assert sum(result["output"]["shards"]) == result["output"]["bytes"] == sum(result["output"]["bytes_per_rank"])
    assert [u["name"] for u in result["units"]][:2] in (["vision", "embed"], ["embed", "layers.0"])


def test_the_plan_reads_headers_only_and_takes_seconds(tiny_k3_checkpoint, tmp_path, capsys):
    # weights that cannot be read (zeroed shard bodies, headers intact) would fail any run that loads them
    model = tmp_path / "ckpt"
    shutil.copytree(tiny_k3_checkpoint, model)
    for shard in model.glob("*.safetensors"):
        data = bytearray(shard.read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        data[header:] = bytes(len(data) - header)
        shard.write_bytes(bytes(data))
    start = time.monotonic()
    code = main(["quant", "--model_path", str(model), "--save_path", str(tmp_path / "out"), "--device", "cpu",
                 "--model_type", "Kimi-K3", "--quant_type", "w4a8", "--trust_remote_code", "True", "--plan",
                 "--plan-json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert code == 0 and time.monotonic() - start < 60
    assert "linear_quant #0 W4A8_DYNAMIC (gptq)" in out and "memory per rank, largest unit" in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["calibration"]["tokens"] > 0 and saved["memory_per_rank"]["device_bytes"] > 0
    # the tiny K3: 16 experts, top-4, routed-expert inputs 64 wide: even routing gives each expert a quarter of the
    # tokens, and 64 x 16 / 4 = 256 calibration tokens fill their Hessians
    tokens = saved["calibration"]["tokens"]
    assert saved["calibration"]["expert_coverage"] == {
        "tokens_per_expert_even_routing": tokens * 4 // 16, "widest_expert_input": 64, "tokens_for_full_rank": 256,
        "all_tokens": False, "balanced": False,
        "full_rank": tokens * 4 // 16 >= 64}
    assert "expert coverage (even routing): ~" in out
    assert "no benchmark record for cpu" in saved["time"]["note"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "plan.json"]


def _error(call) -> str:
    with pytest.raises(UserError) as info:
        call()
    return str(info.value)


def test_a_practice_that_selects_nothing_fails_the_plan_with_the_run_s_line(tiny_k3_checkpoint, tmp_path):
    practice = shrunken_practice(PRACTICES / "kimi_k3_w8a8.yaml", tmp_path / "p.yaml", 2, 32, plain_numerics=True)
    data = yaml.safe_load(practice.read_text())
    for step in data["spec"]["process"]:
        if step["type"] == "linear_quant":
            step["include"] = ["*.no_such_linear"]
    practice.write_text(yaml.safe_dump(data, sort_keys=False))
    a = args(tiny_k3_checkpoint, tmp_path / "out", "Kimi-K3", practice)
    planned_error = _error(lambda: plan(a))
    assert "selects none of the model's" in planned_error
    assert _error(lambda: quant(a)) == planned_error


def test_a_missing_shard_fails_the_plan_with_the_run_s_line(tiny_k3_checkpoint, tmp_path):
    model = tmp_path / "ckpt"
    shutil.copytree(tiny_k3_checkpoint, model)
    next(iter(sorted(model.glob("*.safetensors")))).unlink()
    a = QuantArgs(model_path=str(model), save_path=str(tmp_path / "out"), model_type="Kimi-K3", device="cpu",
                  quant_type="w4a8", trust_remote_code=True)
    planned_error = _error(lambda: plan(a))
    assert _error(lambda: quant(a)) == planned_error
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _tensors(state: dict) -> list:
    import torch

    return [v for v in state.values() if isinstance(v, torch.Tensor)] + list(state.get("attn_res_blocks", []))


@pytest.fixture(scope="module")
def tiny_k3_blocks_of_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with attention-residual blocks of 3 layers: its 4 decoder layers leave 2 blocks, not 4 // 3."""
    from standin.standin_helpers import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "Kimi-K3-tiny-blocks-of-3",
                                sets=["text_config.attn_res_block_size=3"])


@pytest.mark.parametrize("blocks_of", [2, 3])
def test_the_host_state_per_token_is_what_the_unit_forwards_carry(blocks_of, request):
    # reference: the bytes of the state one token leaves after the last decoder unit of a real layer-wise forward
    # (hidden state, the finished attention-residual blocks, the MTP input embeddings, the token id), exact; and
    # every decoder unit returns all of its input state but a new hidden state as the same tensors, which the runner
    # then shares between inputs and outputs (HostCopies), and it drops each input as its output is made: one state
    import torch

    from msmodelslim.app.plan import host_state
    from msmodelslim.model.kimi_k3.adapter import KimiK3ModelAdapter

    checkpoint = request.getfixturevalue("tiny_k3_checkpoint" if blocks_of == 2 else "tiny_k3_blocks_of_3")
    with KimiK3ModelAdapter(checkpoint, trust_remote_code=True) as adapter:
        tokens = 40
        state = {"input_ids": torch.randint(10, 1000, (1, tokens))}
        last = [u for u in adapter.units() if u.kind == "decoder"][-1]
        for unit in adapter.units():
            if unit.kind == "vision":
                continue
            module = adapter.load_unit(unit, torch.device("cpu"))
            before = {id(t) for t in _tensors(state)}
            state = adapter.forward_unit(unit, module, state)
            adapter.free_unit(unit, module)
            if unit.kind == "decoder":
                new = [t for t in _tensors(state) if id(t) not in before]
                assert len(new) == 1 and new[0] is state["hidden_states"], unit.name
            if unit is last:
                break
        carried = sum(t.numel() * t.element_size() for t in _tensors(state))
        estimate = host_state(adapter, tokens, world=2)
    assert len(state["attn_res_blocks"]) > 0
    assert f"{len(state['attn_res_blocks'])} attention-residual blocks" in estimate["state_parts"]
    assert "MTP inputs" in estimate["state_parts"]
    assert estimate["bytes_per_token"] * tokens == carried
    hidden = state["hidden_states"].numel() // tokens * state["hidden_states"].element_size()
    assert estimate["bytes"] == estimate["bytes_per_token"] * (tokens // 2)  # per rank, in a unit
    # all ranks: a hidden state for each of 3 kept units, one being written, the unit in progress and the embedding
    # unit, and the passed-through tensors once
    assert estimate["disk_bytes"] == (6 * hidden + estimate["bytes_per_token"]) * tokens
    every = host_state(adapter, tokens, world=2, resume_every=4)  # + the states of 3 unkept units
    assert every["disk_bytes"] == estimate["disk_bytes"] + 3 * hidden * tokens


def test_a_calibration_state_above_the_host_budget_is_said_to_spill_before_compute(tiny_k3_checkpoint, tmp_path,
                                                                                     monkeypatch, caplog):
    # reference: the plan's own host_state (held to a real forward above) against $MSMODELSLIM_HOST_STATE_GIB
    import logging

    from msmodelslim.pipeline.spill import BUDGET_ENV

    args = QuantArgs(model_path=str(tiny_k3_checkpoint), save_path=str(tmp_path / "out"), device="cpu",
                     model_type="Kimi-K3", quant_type="w4a8", trust_remote_code=True)
    monkeypatch.setenv(BUDGET_ENV, "0")
    with caplog.at_level(logging.INFO, logger="msmodelslim.pipeline.assembly"):
        state = plan(args)["memory_per_rank"]["host_state"]
    assert re.search(rf"state between units takes ~\d+\.\d+ GiB of host memory per rank \(\d+ tokens x "
                     rf"{state['bytes_per_token']} bytes\) "
                     rf"and up to ~\d+\.\d+ GiB in the temporary output \(the "
                     rf"resumable state\); past 0\.00 GiB per rank .* it is kept on disk",
                     caplog.text)
    monkeypatch.setenv(BUDGET_ENV, "-1")
    with pytest.raises(UserError, match=rf"\${BUDGET_ENV}: expected a number of GiB >= 0, got '-1'"):
        plan(args)
    assert not (tmp_path / "out").exists()


def test_the_time_estimate_is_the_records_fixed_cost_plus_its_cost_per_token_per_decoder_unit():
    """A model that matches a benchmark record (device type, hidden size, experts per rank): per decoder or MTP unit
    the record's fixed seconds plus its milliseconds per calibration token times the run's tokens, and once the
    run's final flush of the resumable state at those tokens (reference: the record in plan_records.json, computed
    here); other units cost nothing; 4x the tokens costs more. No match: no number."""
    from msmodelslim.app.plan import RECORDS_FILE, _time_estimate
    from msmodelslim.model.base import Unit
    from msmodelslim.model.facts import ModelFacts

    record = json.loads(RECORDS_FILE.read_text())["records"][0]
    facts = ModelFacts(hidden_size=record["hidden_size"], num_experts=8 * record["experts_per_rank"], top_k=16,
                       dtype_bytes=2)
    units = [Unit(name="embed", kind="embed", prefix="", index=0)] + \
        [Unit(name=f"layers.{i}", kind="decoder", prefix="", index=i + 1) for i in range(3)] + \
        [Unit(name="layers.3", kind="mtp", prefix="", index=4)]
    tokens = 262144
    got = _time_estimate(facts, record["device_type"], 8, units, tokens)
    per_unit = record["seconds_fixed_per_decoder_unit"] + record["ms_per_token_per_decoder_unit"] * tokens / 1e3
    once = record["seconds_once_per_run"] + record["ms_per_token_once_per_run"] * tokens / 1e3
    assert got["seconds"] == round(4 * per_unit + once)
    assert _time_estimate(facts, record["device_type"], 8, units, 4 * tokens)["seconds"] > got["seconds"]
    assert _time_estimate(facts, "npu", 8, units, tokens)["seconds"] is None
