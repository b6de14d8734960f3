"""core.device.parse_device: the accepted --device spellings and the one-line errors for everything else.

Device counts are monkeypatched (no accelerator needed); a fake `torch_npu` module stands in for Ascend.
References are the literal expected DeviceSpec values; no tolerances involved.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from msmodelslim.core import device as device_mod
from msmodelslim.core.device import DeviceSpec, parse_device
from msmodelslim.errors import UserError


@pytest.fixture
def cuda4(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


@pytest.fixture
def fake_npu8(monkeypatch):
    mod = types.ModuleType("torch_npu")
    mod.npu = types.SimpleNamespace(device_count=lambda: 8)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return mod


@pytest.fixture
def no_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu", DeviceSpec("cpu", (0,))),
        ("cpu:0,1", DeviceSpec("cpu", (0, 1))),
        ("cuda", DeviceSpec("cuda", (0,))),
        ("cuda:0,1", DeviceSpec("cuda", (0, 1))),
        ("cuda:3", DeviceSpec("cuda", (3,))),
        (" CUDA:2, 0 ", DeviceSpec("cuda", (2, 0))),
    ],
)
def test_valid_cpu_and_cuda_specs_parse(cuda4, text, expected):
    assert parse_device(text) == expected


def test_npu_specs_parse_with_torch_npu_present(fake_npu8):
    assert parse_device("npu") == DeviceSpec("npu", (0,))
    spec = parse_device("npu:0,1,2,3,4,5,6,7")
    assert spec.indices == tuple(range(8))
    assert spec.world_size == 8 and spec.backend == "hccl"


def test_world_size_and_backend_per_type():
    assert DeviceSpec("cpu", (0, 1)).world_size == 2
    assert DeviceSpec("cpu", (0,)).backend == "gloo"
    assert DeviceSpec("cuda", (0, 1, 2)).backend == "nccl"
    assert DeviceSpec("npu", (5,)).backend == "hccl"


def test_torch_device_maps_rank_to_index():
    spec = DeviceSpec("cuda", (2, 0))
    assert spec.torch_device(0) == torch.device("cuda", 2)
    assert spec.torch_device(1) == torch.device("cuda", 0)
    assert DeviceSpec("cpu", (0, 1)).torch_device(1) == torch.device("cpu")
    with pytest.raises(IndexError):
        spec.torch_device(2)


def test_npu_torch_device_with_privateuse1_renamed():
    # torch.device("npu", i) needs the npu backend name registered (torch_npu does that); a subprocess keeps the
    # rename out of this test process.
    code = (
        "import torch; torch.utils.rename_privateuse1_backend('npu');"
        "from msmodelslim.core.device import DeviceSpec;"
        "print(DeviceSpec('npu', (4, 6)).torch_device(1))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "npu:6"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu", "unknown device type 'gpu'"),
        ("tpu:0", "unknown device type 'tpu'"),
        ("cuda:", "no device index after ':'"),
        ("cuda:0,,1", "empty device index"),
        ("cuda:0,0", "device index 0 given twice"),
        ("cuda:-1", "device index -1 is negative"),
        ("cuda:a", "device index 'a' is not an integer"),
        ("cuda:1.5", "device index '1.5' is not an integer"),
        ("cuda:4", "cuda index 4 out of range; 4 cuda device(s) visible"),
        ("cpu:0,0", "device index 0 given twice"),
    ],
)
def test_bad_specs_name_the_value(cuda4, text, message):
    with pytest.raises(UserError) as info:
        parse_device(text)
    assert message in str(info.value)
    assert repr(text) in str(info.value)


def test_cuda_not_available_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="CUDA is not available"):
        parse_device("cuda:0")


def test_npu_without_torch_npu_is_a_user_error(no_npu):
    with pytest.raises(UserError, match="npu needs torch_npu"):
        parse_device("npu:0,1")


def test_npu_index_beyond_visible_count(fake_npu8):
    with pytest.raises(UserError, match="npu index 8 out of range; 8 npu device"):
        parse_device("npu:0,8")


def test_torch_npu_is_imported_only_for_npu(monkeypatch):
    calls = []
    real = device_mod.importlib.import_module
    monkeypatch.setattr(device_mod.importlib, "import_module", lambda name: calls.append(name) or real(name))
    parse_device("cpu:0,1")
    assert calls == []


def test_npu_without_triton_is_a_user_error(fake_npu8, monkeypatch):
    # fla (the checkpoint's KDA code) imports triton at import time; on an NPU host triton-ascend provides it
    real = device_mod.importlib.util.find_spec
    monkeypatch.setattr(device_mod.importlib.util, "find_spec", lambda name: None if name == "triton" else real(name))
    with pytest.raises(UserError, match="imports triton, which is not installed.*triton-ascend"):
        parse_device("npu:0")


def test_an_npu_rank_binds_its_device_turns_jit_compilation_off_and_reads_its_memory(fake_npu8, monkeypatch):
    calls = []
    npu = types.SimpleNamespace(set_device=lambda d: calls.append(("set_device", d)),
                                set_compile_mode=lambda jit_compile: calls.append(("jit_compile", jit_compile)),
                                max_memory_allocated=lambda d: 5 * 2**30, empty_cache=lambda: calls.append("empty"),
                                reset_peak_memory_stats=lambda d: calls.append(("reset_peak", d)))
    monkeypatch.setattr(torch, "npu", npu, raising=False)  # what torch_npu registers on import
    device = types.SimpleNamespace(type="npu", index=3)  # torch.device("npu", 3) needs the real backend
    device_mod.bind_device(device)
    device_mod.release_cached_memory(device)
    device_mod.reset_peak_device_bytes(device)
    assert calls == [("set_device", device), ("jit_compile", False), "empty", ("reset_peak", device)]
    assert device_mod.peak_device_bytes(device) == 5 * 2**30


@pytest.mark.parametrize(("user_conf", "applied"), [
    (None, [device_mod.PINNED_HOST_ALLOCATOR]),
    ("expandable_segments:True", [device_mod.PINNED_HOST_ALLOCATOR]),  # other keys: ours added beside them
    ("pinned_use_cuda_host_register:False", []),  # the user's pinned_* keys win
])
def test_a_cuda_rank_pins_host_memory_on_several_threads_unless_the_user_set_it(monkeypatch, user_conf, applied):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: calls.append(conf),
                        raising=False)
    for env in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(env, raising=False)
    if user_conf is not None:
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", user_conf)
    device = types.SimpleNamespace(type="cuda", index=1)
    device_mod.bind_device(device)
    assert calls == [device, *applied]
