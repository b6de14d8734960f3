"""The quant report's loss-aware score (pipeline/impact.py) on a toy unit: a residual block h + b(gelu(a(h))) + c(h)
whose linears a and b form one serving group and c another, quantized min/max W4A8_DYNAMIC.

Reference: separate copies of the unit built float, quantized and with one group float (no module swapped), their
outputs' squared errors summed directly over two samples: a group's impact is
(||y_q - y_f||^2 - ||y_g - y_f||^2) / ||y_f||^2 over the tensor the unit computes, never the one it passes on
(rel 1e-5: float32 sums in another order)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from msmodelslim.core.dist import SINGLE
from msmodelslim.model.base import Unit
from msmodelslim.pipeline.impact import ImpactProbe
from msmodelslim.quant.modules import QuantLinear

UNIT = Unit("layers.0", "decoder", "toy.", 0)
GROUPS = {"toy.ab": ["a", "b"], "toy.c": ["c"]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 48), nn.Linear(48, 16), nn.Linear(16, 16)

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        h = state["h"]
        return {"h": h + self.b(F.gelu(self.a(h))) + self.c(h), "carried": state["carried"]}


class ToyTarget:
    """A serving target that runs toy.a and toy.b as one layer."""

    def fused_groups(self, model: object) -> list[tuple[str, list[str]]]:
        return [("toy.ab", ["toy.a", "toy.b"])]


class ToyAdapter:
    target = ToyTarget()

    def checkpoint_name(self, unit: Unit, live_name: str) -> str:
        return unit.prefix + live_name


def quantized(block: Block, names: list[str]) -> Block:
    out = copy.deepcopy(block)
    for name in names:
        setattr(out, name, QuantLinear.from_linear(getattr(block, name), "W4A8_DYNAMIC", weight_method="minmax"))
    return out


@pytest.fixture(scope="module")
def toy() -> tuple[Block, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    block = Block()
    samples = [{"h": torch.randn(2, 24, 16) * torch.linspace(0.2, 6.0, 16), "carried": torch.randn(2, 24, 8) * 100}
               for _ in range(2)]
    return block, samples


def probed(block: Block, samples: list[dict[str, torch.Tensor]]) -> ImpactProbe:
    """The probe as the runner drives it: the float linears handed over as linear_quant replaces them."""
    probe = ImpactProbe(ToyAdapter(), SINGLE, tokens=None)
    unit = copy.deepcopy(block)
    for name in ("a", "b", "c"):
        linear = getattr(unit, name)
        setattr(unit, name, QuantLinear.from_linear(linear, "W4A8_DYNAMIC", weight_method="minmax"))
        probe.keep(name, linear)
    assert probe.start(UNIT) == 2 + len(GROUPS)  # float, quantized, one per group
    for state in samples:
        probe.measure(unit, lambda state=state: unit(state), state)
    probe.finish()
    assert all(isinstance(getattr(unit, n), QuantLinear) for n in "abc")  # the unit is left as processed
    return probe


def test_a_groups_impact_is_the_drop_of_the_unit_outputs_relative_error_with_the_group_float(toy):
    block, samples = toy
    impacts = probed(block, samples).impacts
    everything = quantized(block, ["a", "b", "c"])
    with torch.no_grad():
        reference = [block(s)["h"] for s in samples]
        signal = sum(float(r.double().square().sum()) for r in reference)

        def error(unit: Block) -> float:
            return sum(float((unit(s)["h"].double() - r.double()).square().sum()) for s, r in zip(samples, reference))

        base = error(everything)
        expected = {group: (base - error(quantized(block, [n for n in "abc" if n not in members]))) / signal
                    for group, members in GROUPS.items()}
    assert impacts.keys() == expected.keys()
    for group, value in expected.items():
        assert value > 0 and impacts[group] == pytest.approx(value, rel=1e-5), (group, impacts, expected)


def test_a_groups_impact_is_shared_by_its_linears_absolute_errors(toy):
    probe = probed(*toy)
    impacts = dict(probe.impacts)
    shares = probe.shares({"toy.a": 1.0, "toy.b": 3.0, "toy.c": 2.0}, replicated={"toy.a", "toy.b", "toy.c"})
    assert shares == pytest.approx({"toy.a": impacts["toy.ab"] / 4, "toy.b": impacts["toy.ab"] * 3 / 4,
                                    "toy.c": impacts["toy.c"]}, rel=1e-12)
    assert probe.impacts == {}  # taken: a unit's impacts are shared once
