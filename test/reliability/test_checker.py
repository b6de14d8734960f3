"""The checkpoint checker (model/common/hf_checkpoint.py) finds every fault that headers show, before any tensor
is read: opening the weight directory (index, shards, quantization_config), then one walk of every unit's tensor
slots against the stored names, shapes and dtypes, and the strays. Reference: the fault's regex of faults.py (the
same one the command line's error line must match) on the CheckpointError's message."""

from __future__ import annotations

import pytest
import torch

from msmodelslim.model.common.hf_checkpoint import HFCheckpoint
from msmodelslim.model.kimi_k3.layout import KimiLayout
from msmodelslim.source.checkpoint import CheckpointError

from .faults import CHECKER_FAULTS, FAULTS


@pytest.mark.parametrize("case", CHECKER_FAULTS)
def test_the_checker_finds_a_header_fault_before_any_tensor_is_read(case, broken_copy, monkeypatch):
    model, workspace = broken_copy
    fault, expected = FAULTS[case]
    fault(model, workspace)
    monkeypatch.setattr(HFCheckpoint, "_read_tensor", lambda *a: pytest.fail("the checker read a tensor"))
    with pytest.raises(CheckpointError, match=expected):
        checkpoint = HFCheckpoint(model, trust_remote_code=True, dtype=torch.bfloat16)
        checkpoint.check(KimiLayout(checkpoint.model))


def test_the_checker_passes_the_good_checkpoint(tiny_k3_checkpoint):
    checkpoint = HFCheckpoint(tiny_k3_checkpoint, trust_remote_code=True, dtype=torch.bfloat16)
    checkpoint.check(KimiLayout(checkpoint.model))
    assert all(p.is_meta for p in checkpoint.model.parameters())  # nothing was loaded
