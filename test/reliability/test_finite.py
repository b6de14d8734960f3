"""pipeline/finite.py: the check behind every calibration pass and the search for the module that made a NaN.
Reference: toy modules with one known overflowing member; exact names and booleans (no tolerance)."""

from __future__ import annotations

import torch
from torch import nn

from msmodelslim.pipeline.finite import all_finite, first_non_finite_module


def test_all_finite_reads_every_floating_tensor_of_a_state():
    state = {"hidden": torch.ones(2, 3), "blocks": [torch.zeros(1), torch.tensor([1.0, float("nan")])],
             "ids": torch.tensor([1, 2])}
    assert not bool(all_finite(state))
    state["blocks"][1] = torch.ones(2)
    assert bool(all_finite(state))
    assert all_finite({"ids": torch.tensor([1])}) is None  # nothing floating to judge


def test_first_non_finite_module_names_the_module_that_made_it_not_its_readers():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(1.0)  # its outputs ~4 each, whatever the random state: the next product overflows
        model[1].weight.fill_(3.0e38)  # finite weights, overflowing product
    x = torch.ones(1, 4)
    assert first_non_finite_module(model, lambda: model(x)) == "1"
    with torch.no_grad():
        model[1].weight.fill_(1.0)
    assert first_non_finite_module(model, lambda: model(x)) is None
    assert not model[0]._forward_hooks  # the hooks are gone afterwards
