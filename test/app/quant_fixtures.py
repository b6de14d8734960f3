"""Shared fixtures of the app/CLI tests (imported by test/app/conftest.py and test/cli/conftest.py): a fake weight directory, dummy registries and a stub quant service.

The stub stands in for pipeline.launch.run_service (the lead's real service is exercised end to end in
test_quant_end_to_end.py); it records the request and writes a minimal description file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from msmodelslim.app import practice as practice_mod
from msmodelslim.model.base import ModelAdapter
from msmodelslim.model.registry import ModelEntry
from msmodelslim.pipeline import launch

PRACTICE = """\
apiversion: {apiversion}
metadata:
  config_id: stub_w4a8
  score: 10
  verified_model_types: [Kimi-K3, Kimi-Linear]
  label: {{w_bit: 4, a_bit: 8}}
spec:
  process: [{{type: noop}}]
  dataset: {dataset}
  default_text: "Describe this image."
  save: [{{type: noop_saver}}]
"""


@dataclass
class NoopConfig:
    level: int = 0


class NoopEntry:
    config_cls = NoopConfig
    quantizes_linears = True  # the stub practices are labelled w4a8


class DummyAdapter(ModelAdapter):
    units = load_unit = prepare_samples = forward_unit = checkpoint_name = checkpoint_state = None


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["KimiLinearForCausalLM"]}))
    return path


@pytest.fixture
def practice_file(tmp_path: Path) -> Path:
    path = tmp_path / "stub.yaml"
    path.write_text(PRACTICE.format(apiversion="multimodal_vlm_modelslim_v1", dataset="calibImages"))
    return path


@pytest.fixture
def stub_service(monkeypatch):
    """Dummy processor/saver registries, a dummy adapter class and a recording run_service."""
    monkeypatch.setattr(practice_mod, "registries", lambda: ({"noop": NoopEntry}, {"noop_saver": NoopEntry}))
    monkeypatch.setattr(ModelEntry, "load_adapter_class", lambda self: DummyAdapter)
    calls = []

    def run_service(request):
        calls.append(request)
        assert request.work_dir.is_dir() and [p.name for p in request.work_dir.iterdir()] == ["resume"]  # its state
        (request.work_dir / "quant_model_description.json").write_text(json.dumps({"version": "1.0.0",
                                                                                    "x.weight": "W4A8_DYNAMIC"}))
        (request.work_dir / "config.json").write_text("{}")

    monkeypatch.setattr(launch, "run_service", run_service)
    return calls


@pytest.fixture(autouse=True)
def restore_log_level_env(monkeypatch):
    """The CLI exports $MSMODELSLIM_LOG_LEVEL for its workers; keep that inside each test."""
    monkeypatch.delenv("MSMODELSLIM_LOG_LEVEL", raising=False)
