"""Helpers of the data-parallel tests: a shrunken practice, output comparison, and a processor that fails on demand.

`FailOnRank` lives in an importable module (not a test file) so spawned ranks can unpickle its config.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from msmodelslim.processor.base import PROCESSORS, Processor, ProcessorConfig, register_processor

REPO = Path(__file__).resolve().parents[2]


def shrunken_practice(source: Path, dest: Path, max_samples: int, max_seq_len: int, extra_process: list | None = None,
                      plain_numerics: bool = False) -> Path:
    """The shipped practice with fewer, shorter calibration samples (same processors), written to `dest`.

    `plain_numerics`: min/max weights and fixed-alpha smoothing instead of GPTQ and the search, for tests of what
    the output looks like (names, schemes, layouts), which the choice of the integers does not change."""
    practice = yaml.safe_load(source.read_text())
    practice["spec"]["max_samples"] = max_samples
    practice["spec"]["max_seq_len"] = max_seq_len
    if plain_numerics:
        for step in practice["spec"]["process"]:
            if step["type"] == "linear_quant":
                step["qconfig"]["weight"]["method"] = "minmax"
            if step["type"] == "iter_smooth":
                step["search"] = False
    practice["spec"]["process"] = (extra_process or []) + practice["spec"]["process"]
    dest.write_text(yaml.safe_dump(practice, sort_keys=False))
    return dest


def read_output(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {}
    for shard in sorted(out.glob("quant_model_weights*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    description = json.loads((out / "quant_model_description.json").read_text())
    return tensors, description


def assert_same_layout(a: Path, b: Path) -> int:
    """Outputs `a` and `b` hold the same tensors (names, shapes, dtypes) and identical descriptions: what a run on
    another number of ranks must keep (its values may differ within the tolerance of test_data_parallel.py)."""
    ta, da = read_output(a)
    tb, db = read_output(b)
    assert da == db, "quant_model_description.json differs"
    assert sorted(ta) == sorted(tb), f"tensor names differ: {sorted(set(ta) ^ set(tb))[:5]}"
    differing = [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape]
    assert not differing, f"{len(differing)} tensors differ in shape or dtype, e.g. {differing[:5]}"
    return len(ta)


def assert_same_bytes(a: Path, b: Path) -> int:
    """Every tensor of output `a` equals output `b` byte for byte; the descriptions are identical."""
    ta, da = read_output(a)
    tb, db = read_output(b)
    assert da == db, "quant_model_description.json differs"
    assert sorted(ta) == sorted(tb), f"tensor names differ: {sorted(set(ta) ^ set(tb))[:5]}"
    differing = [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
                 or not torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8))]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:5]}"
    return len(ta)


@dataclass
class FailOnRankConfig(ProcessorConfig):
    rank: int = 1
    unit: str = "layers.1"
    how: str = "raise"  # raise | kill


class FailOnRank(Processor):
    """Fails rank `rank` when it reaches `unit`: by an exception or by killing its own process."""

    def process_unit(self, ctx) -> None:
        if ctx.dist.rank == self.config.rank and ctx.unit.name == self.config.unit:
            if self.config.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {ctx.dist.rank} at {ctx.unit.name}")


if "fail_on_rank" not in PROCESSORS:
    register_processor("fail_on_rank", FailOnRankConfig)(FailOnRank)
