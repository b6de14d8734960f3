"""app.quant: validation happens before anything is written, the output appears only by one rename after the
service succeeded, and every failure leaves neither the output nor the temporary directory. The service is a stub
(see quant_fixtures.py). References: literal expected paths, file bytes and error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from quant_fixtures import PRACTICE, DummyAdapter

from msmodelslim.app.quant import QuantArgs, quant
from msmodelslim.core.device import DeviceSpec
from msmodelslim.errors import UserError
from msmodelslim.pipeline import launch


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(".partial"))


def args(model_dir: Path, save: Path, **kw) -> QuantArgs:
    base = dict(model_path=str(model_dir), save_path=str(save), model_type="Kimi-K3", device="cpu",
                quant_type=None, config_path=None, trust_remote_code=False)
    base.update(kw)
    if base["quant_type"] is None and base["config_path"] is None:
        base["quant_type"] = "w4a8"
    return QuantArgs(**base)


def test_success_publishes_output_with_the_chosen_practice(tmp_path, model_dir, practice_file, stub_service):
    save = tmp_path / "out" / "Kimi-K3-w4a8"
    result = quant(args(model_dir, save, config_path=str(practice_file), quant_type=None, device="cpu:0,1",
                        trust_remote_code=True))
    assert result.save_path == save and save.is_dir()
    assert sorted(p.name for p in save.iterdir()) == ["Kimi-K3_best_practice.yaml", "config.json",
                                                      "quant_model_description.json"]
    assert (save / "Kimi-K3_best_practice.yaml").read_bytes() == practice_file.read_bytes()
    assert leftovers(save.parent) == []
    (request,) = stub_service
    assert request.model_path == model_dir.resolve()
    assert request.work_dir.parent == save.parent and request.work_dir.name == ".Kimi-K3-w4a8.partial"
    assert request.device == DeviceSpec("cpu", (0, 1))
    assert request.adapter_cls is DummyAdapter and request.trust_remote_code is True
    assert request.practice.metadata.config_id == "stub_w4a8"
    assert result.files == 3 and result.practice_path == practice_file


def test_lookup_by_quant_type_uses_lab_practice(tmp_path, model_dir, monkeypatch, stub_service):
    from msmodelslim.app import practice as practice_mod
    from msmodelslim.core.resources import resource_path

    # The shipped YAML needs the real processors; only the lookup is under test here, so parse a stub instead.
    stub = tmp_path / "stub.yaml"
    stub.write_text(PRACTICE.format(apiversion="multimodal_vlm_modelslim_v1", dataset="calibImages"))
    seen = []
    real = practice_mod.load_practice
    monkeypatch.setattr(practice_mod, "load_practice", lambda p, *reg: seen.append(Path(p)) or real(stub, *reg))
    save = tmp_path / "o"
    quant(args(model_dir, save, quant_type="w4a8"))
    assert seen == [resource_path("lab_practice") / "kimi_k3" / "kimi_k3_w4a8.yaml"]
    assert (save / "Kimi-K3_best_practice.yaml").read_bytes() == seen[0].read_bytes()


def test_existing_empty_save_path_is_replaced(tmp_path, model_dir, practice_file, stub_service):
    save = tmp_path / "empty"
    save.mkdir()
    quant(args(model_dir, save, config_path=str(practice_file), quant_type=None))
    assert (save / "quant_model_description.json").is_file()


def _fails(exc_type, tmp_path, model_dir, **kw) -> str:
    save = Path(kw.pop("save", tmp_path / "out" / "q"))
    before = set((tmp_path).rglob("*"))
    with pytest.raises(exc_type) as info:
        quant(args(model_dir, save, **kw))
    assert set(tmp_path.rglob("*")) == before  # nothing created, not even parents or temporary dirs
    return str(info.value)


def test_missing_model_path(tmp_path, model_dir, stub_service):
    assert "--model_path" in _fails(UserError, tmp_path, tmp_path / "nope")
    assert "no such directory" in _fails(UserError, tmp_path, tmp_path / "nope")


def test_model_path_without_config_json(tmp_path, model_dir, stub_service):
    (model_dir / "config.json").unlink()
    assert "no config.json" in _fails(UserError, tmp_path, model_dir)


def test_invalid_config_json(tmp_path, model_dir, stub_service):
    (model_dir / "config.json").write_text("{oops")
    assert "config.json: invalid JSON" in _fails(UserError, tmp_path, model_dir)


def test_save_path_inside_model_path(tmp_path, model_dir, stub_service):
    message = _fails(UserError, tmp_path, model_dir, save=model_dir / "out")
    assert "is inside --model_path" in message


def test_save_path_equal_to_model_path(tmp_path, model_dir, stub_service):
    assert "is inside --model_path" in _fails(UserError, tmp_path, model_dir, save=model_dir)


def test_save_path_not_empty(tmp_path, model_dir, stub_service):
    save = tmp_path / "full"
    save.mkdir()
    (save / "x").write_text("keep me")
    message = _fails(UserError, tmp_path, model_dir, save=save)
    assert f"--save_path {save} exists and is not empty" in message
    assert (save / "x").read_text() == "keep me"


def test_save_path_is_a_file(tmp_path, model_dir, stub_service):
    save = tmp_path / "file"
    save.write_text("x")
    assert "exists and is not a directory" in _fails(UserError, tmp_path, model_dir, save=save)


def test_remote_code_needs_trust_remote_code(tmp_path, model_dir, stub_service):
    (model_dir / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    message = _fails(UserError, tmp_path, model_dir)
    assert "ships its own model code" in message and "--trust_remote_code True" in message


def test_unknown_model_type(tmp_path, model_dir, stub_service):
    assert "known model types: Kimi-K3, Kimi-Linear" in _fails(UserError, tmp_path, model_dir, model_type="Kimi")


def test_quant_type_without_practice(tmp_path, model_dir, stub_service):
    message = _fails(UserError, tmp_path, model_dir, quant_type="w4a4")
    assert "no practice for --model_type Kimi-K3 --quant_type w4a4" in message
    assert "available: w4a8, w4a8c8, w8a8 (default hardware); w4a16, w4a4c8, w4a8 with --tag Ascend_950 | Atlas_350" \
        in message


def test_quant_type_and_config_path_exclude_each_other(tmp_path, model_dir, practice_file, stub_service):
    message = _fails(UserError, tmp_path, model_dir, quant_type="w4a8", config_path=str(practice_file))
    assert "exactly one of --quant_type and --config_path" in message


def test_bad_device(tmp_path, model_dir, practice_file, stub_service):
    message = _fails(UserError, tmp_path, model_dir, config_path=str(practice_file), device="gpu:0")
    assert "unknown device type 'gpu'" in message


def test_bad_practice_yaml(tmp_path, model_dir, practice_file, stub_service):
    practice_file.write_text(practice_file.read_text().replace("{type: noop}", "{type: noop, levle: 1}"))
    message = _fails(UserError, tmp_path, model_dir, config_path=str(practice_file))
    assert f"{practice_file}: spec.process[0].levle: unknown key" in message


def test_text_practice_with_image_dataset(tmp_path, model_dir, practice_file, stub_service):
    practice_file.write_text(PRACTICE.format(apiversion="modelslim_v1", dataset="calibImages"))
    message = _fails(UserError, tmp_path, model_dir, config_path=str(practice_file))
    assert "is the text service" in message and "20 image records" in message


def test_more_devices_than_records(tmp_path, model_dir, practice_file, stub_service):
    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "only one"}\n')
    practice_file.write_text(PRACTICE.format(apiversion="modelslim_v1", dataset=str(data)))
    message = _fails(UserError, tmp_path, model_dir, config_path=str(practice_file), device="cpu:0,1")
    assert "has 1 records, fewer than the 2 devices" in message


def test_expert_count_not_divisible_by_devices(tmp_path, model_dir, practice_file, stub_service):
    (model_dir / "config.json").write_text(json.dumps({"text_config": {"num_experts": 16}}))
    message = _fails(UserError, tmp_path, model_dir, config_path=str(practice_file), device="cpu:0,1,2")
    assert "num_experts=16 is not divisible by the 3 devices of --device cpu:0,1,2" in message


def test_bad_calibration_dataset(tmp_path, model_dir, practice_file, stub_service):
    practice_file.write_text(PRACTICE.format(apiversion="modelslim_v1", dataset="noSuchSet"))
    assert "unknown calibration dataset 'noSuchSet'" in _fails(UserError, tmp_path, model_dir,
                                                               config_path=str(practice_file))


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_service_failure_removes_the_temporary_directory(tmp_path, model_dir, practice_file, stub_service,
                                                         monkeypatch, exc):
    def failing(request):
        (request.work_dir / "quant_model_description.json").write_text("{}")  # looks complete, but failed
        raise exc

    monkeypatch.setattr(launch, "run_service", failing)
    save = tmp_path / "out"
    with pytest.raises(type(exc)):
        quant(args(model_dir, save, config_path=str(practice_file), quant_type=None))
    assert not save.exists() and leftovers(tmp_path) == []


def test_layer_wise_runner_on_several_devices_is_refused_before_the_service(tmp_path, model_dir, practice_file,
                                                                            stub_service, monkeypatch):
    practice = tmp_path / "layer_wise.yaml"
    practice.write_text(practice_file.read_text().replace("spec:\n", "spec:\n  runner: layer_wise\n", 1))
    monkeypatch.setattr(launch, "run_service", lambda request: pytest.fail("service must not run"))
    with pytest.raises(UserError, match="layer_wise runs on one device"):
        quant(args(model_dir, tmp_path / "out", config_path=str(practice), quant_type=None, device="cpu:0,1"))
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_service_without_description_is_not_published(tmp_path, model_dir, practice_file, stub_service,
                                                       monkeypatch):
    monkeypatch.setattr(launch, "run_service", lambda request: None)
    with pytest.raises(RuntimeError, match="without writing quant_model_description.json"):
        quant(args(model_dir, tmp_path / "out", config_path=str(practice_file), quant_type=None))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
