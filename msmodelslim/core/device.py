"""`--device` parsing: "npu:0,1" / "cuda:0,1" / "cpu:0,1" -> which devices, how many processes, which backend.

`npu` needs torch_npu, imported only when an npu device is asked for. For `cpu`, indices are process slots
(`cpu:0,1` = two CPU processes over gloo, used to test multi-process runs on any machine).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from msmodelslim.core.torchrun import TorchrunRank
from msmodelslim.errors import UserError

DEVICE_TYPES = ("cpu", "cuda", "npu")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
# torch pins host memory with one cudaHostAlloc per block, which pins its pages on one thread: 2.4 GB/s on the H100
# machine, paid by each new calibration state a unit sends back and by the parked Hessians, so a layer's cost grew
# with its tokens; faulting the pages in on 8 threads and registering them: 8.8 GB/s (bench/pinned_copies.py).
# A user's own `pinned_*` keys in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF win.
PINNED_HOST_ALLOCATOR = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
_ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class DeviceSpec:
    """Devices of one run: one process per index, or, under torchrun, this process's one device of the job."""

    type: str  # "cpu" | "cuda" | "npu"
    indices: tuple[int, ...]
    torchrun: TorchrunRank | None = None  # started by torchrun: `indices` holds this process's device

    @property
    def world_size(self) -> int:
        return self.torchrun.world_size if self.torchrun else len(self.indices)

    @property
    def backend(self) -> str:
        """torch.distributed backend for this device type (gloo / nccl / hccl)."""
        return _BACKENDS[self.type]

    def torch_device(self, rank: int) -> torch.device:
        """The device process `rank` runs on (cpu slots all map to the one CPU device)."""
        if not 0 <= rank < self.world_size or (self.torchrun and rank != self.torchrun.rank):
            raise IndexError(f"rank {rank} out of range for {self} (world size {self.world_size})")
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, self.indices[0 if self.torchrun else rank])

    def __str__(self) -> str:
        where = f"{self.type}:{','.join(str(i) for i in self.indices)}"
        return f"{where}, {self.torchrun.describe()}" if self.torchrun else where


def _visible_count(device_type: str, text: str) -> int:
    """Number of visible accelerators of `device_type`; errors when the runtime is missing."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {text!r}: CUDA is not available in this torch build or on this machine")
        return torch.cuda.device_count()
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as exc:
        raise UserError(
            f"--device {text!r}: npu needs torch_npu, which is not installed ({exc}); "
            "install the Ascend torch_npu wheel or use --device cuda / cpu"
        ) from None
    if importlib.util.find_spec("triton") is None:
        raise UserError(f"--device {text!r}: the checkpoint's fla code imports triton, which is not installed; on an "
                        "NPU host install triton-ascend (pip install 'msmodelslim[npu]')")
    count = torch_npu.npu.device_count()
    if count == 0:
        raise UserError(f"--device {text!r}: torch_npu sees no NPU on this machine")
    return count


def _parse_indices(part: str, text: str) -> tuple[int, ...]:
    items = part.split(",")
    indices: list[int] = []
    for item in items:
        item = item.strip()
        if not item:
            raise UserError(f"--device {text!r}: empty device index")
        try:
            value = int(item)
        except ValueError:
            raise UserError(f"--device {text!r}: device index {item!r} is not an integer") from None
        if value < 0:
            raise UserError(f"--device {text!r}: device index {value} is negative")
        if value in indices:
            raise UserError(f"--device {text!r}: device index {value} given twice")
        indices.append(value)
    return tuple(indices)


def parse_device(text: str, torchrun: TorchrunRank | None = None) -> DeviceSpec:
    """Parse `npu`, `npu:0,1,...`, `cuda`, `cuda:0,1`, `cpu`, `cpu:0,1` (a bare type means index 0).

    Under torchrun (`torchrun` given) the list names the devices of one node, one per local rank, and this
    process takes the one of its LOCAL_RANK; a bare type means device LOCAL_RANK."""
    raw = text.strip()
    device_type, sep, rest = raw.partition(":")
    device_type = device_type.strip().lower()
    if device_type not in DEVICE_TYPES:
        raise UserError(f"--device {text!r}: unknown device type {device_type!r}; expected one of {', '.join(DEVICE_TYPES)}")
    if sep and not rest.strip():
        raise UserError(f"--device {text!r}: no device index after ':'")
    indices = _parse_indices(rest, text) if sep else (0,)
    if torchrun is not None:
        if not sep:
            indices = (torchrun.local_rank,) if device_type != "cpu" else (0,)
        elif len(indices) != torchrun.local_world_size:
            raise UserError(f"--device {text!r} names {len(indices)} device(s), but torchrun starts "
                            f"{torchrun.local_world_size} process(es) per node (--nproc-per-node); name one device "
                            f"per process, or give the bare type ({device_type}) for device LOCAL_RANK")
        else:
            indices = (indices[torchrun.local_rank],)
    if device_type != "cpu":
        count = _visible_count(device_type, text)
        too_high = [i for i in indices if i >= count]
        if too_high:
            raise UserError(
                f"--device {text!r}: {device_type} index {too_high[0]} out of range; "
                f"{count} {device_type} device(s) visible (indices 0..{count - 1})"
            )
    return DeviceSpec(device_type, indices, torchrun)


def bind_device(device: torch.device) -> None:
    """Make `device` the current one of the calling thread (each rank's main and prefetch threads: a thread that
    never sets it would place its work on device 0). On an NPU, operators run as precompiled aclnn kernels rather
    than being compiled on first use, as msModelSlim's quant services set it (`set_compile_mode`). On CUDA, pinned
    host memory is allocated as PINNED_HOST_ALLOCATOR says."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if not any("pinned_" in os.environ.get(env, "") for env in _ALLOC_CONF_ENVS):
            set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) \
                or torch.cuda.memory._set_allocator_settings  # (older torch)
            set_settings(PINNED_HOST_ALLOCATOR)
    elif device.type == "npu":
        import torch_npu  # noqa: F401  (registers the npu device in this process)

        torch.npu.set_device(device)
        torch.npu.set_compile_mode(jit_compile=False)


def peak_device_bytes(device: torch.device) -> int | None:
    """The most memory torch held on `device` so far (None on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device)
    return None


def reset_peak_device_bytes(device: torch.device) -> None:
    """Start `peak_device_bytes` over from what `device` holds now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "npu":
        torch.npu.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (stage timings of an asynchronous device)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def host_values(values: Sequence[int | float], device: torch.device, dtype: torch.dtype = torch.int64
                ) -> torch.Tensor:
    """A small tensor of values the host knows (row counts, table indices), on `device` without waiting for it. On
    CUDA through pinned memory, copied asynchronously: `torch.tensor(values, device=...)` synchronizes the stream,
    so the host would wait for every queued kernel, which undoes the overlap of a pass bound by its launches."""
    values = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def release_cached_memory(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the device (between units, whose shapes differ)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "npu":
        torch.npu.empty_cache()


@contextlib.contextmanager
def tensor_core_fp32_matmuls(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Let fp32 matmuls use TF32 (CUDA) / HF32 (Ascend) tensor cores inside the block. For inputs the reduced format
    holds exactly: it keeps 10 mantissa bits, more than bf16's 7 (KDA's 16-bit inputs, the Hessians' 8-bit
    digits); the products then accumulate in fp32. Or for sums that only rank or report, where ~1e-3 relative is
    enough (the smoothing search's error model, the report's weight error)."""
    if device.type == "cuda":
        flags = torch.backends.cuda.matmul
        name, value = ("fp32_precision", "tf32") if hasattr(flags, "fp32_precision") else ("allow_tf32", True)
    elif device.type == "npu":
        flags, name, value = torch.npu.matmul, "allow_hf32", True
    else:
        enabled = False
    if not enabled:
        yield
        return
    old = getattr(flags, name)
    setattr(flags, name, value)
    try:
        yield
    finally:
        setattr(flags, name, old)


@functools.cache
def cpu_has_bf16_dot_products() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX; Linux's /proc/cpuinfo flags). Elsewhere oneDNN would
    emulate the bf16 products, slower than its float32 ones."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@contextlib.contextmanager
def cpu_bf16_products(enabled: bool = True) -> Iterator[None]:
    """Let float32 matmuls on the CPU multiply in bf16 inside the block: oneDNN's AVX512-BF16 / AMX dot products,
    which accumulate in float32 (about twice float32's speed, BENCHMARKS.md issue 31). Only for inputs that are bf16
    values: the product of two bf16 values is exact in float32, so the result is a float32 sum of exact products
    (values below 2^-126 count as zero). A CPU without bf16 instructions keeps float32 arithmetic."""
    flags = torch.backends.mkldnn.matmul
    if not enabled or not hasattr(flags, "fp32_precision") or not cpu_has_bf16_dot_products():
        yield
        return
    old = flags.fp32_precision
    flags.fp32_precision = "bf16"
    try:
        yield
    finally:
        flags.fp32_precision = old
