"""core/rank_server.py: which `--device` makes the command line start the CPU ranks' server before its own imports.
Reference: the device grammar (core/device.parse_device): several CPU indices, in a process that starts its ranks
itself (under torchrun each rank is a process of its own and forks none)."""

from __future__ import annotations

import pytest

from msmodelslim.core import rank_server


@pytest.mark.parametrize("device, wanted", [("cpu:0,1", True), (" CPU:0, 1, 2", True), ("cpu", False),
                                            ("cpu:0", False), ("cuda:0,1", False), ("npu:0,1", False)])
def test_the_server_is_started_early_for_several_cpu_ranks_only(device, wanted, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert rank_server.wanted(device) is wanted


def test_no_server_is_started_early_under_torchrun(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    assert not rank_server.wanted("cpu:0,1")
