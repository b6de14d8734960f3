"""pipeline/launch.host_threads: a rank's threads for host work are the cores this process may run on, shared by the
ranks of its host. Reference: the affinity set's size (os.sched_getaffinity: what taskset, a scheduler's CPU binding
or a container's cpuset leaves) divided by the ranks, at least one; os.cpu_count() counts the host's cores, which
made two torchrun nodes bound to one core each run two threads apiece on it."""

from __future__ import annotations

import os

import pytest

from msmodelslim.pipeline.launch import host_threads


@pytest.mark.parametrize("cores, ranks, threads", [(64, 8, 8), (64, 1, 64), (6, 4, 1), (1, 2, 1)])
def test_the_cores_a_process_may_run_on_are_shared_by_the_ranks_of_its_host(cores, ranks, threads, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "cpu_count", lambda: 256)  # the host's: not what the process may use
    assert host_threads(ranks) == threads


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a process allowed on two cores or more")
def test_a_process_bound_to_one_core_runs_one_thread():
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread only, restored below
    try:
        assert host_threads(1) == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert host_threads(1) == len(allowed)
