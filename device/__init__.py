"""Accelerator abstraction: which device, its torch module, pinned host memory, stream-safe release.

Knows nothing about optimizers. Detection order: SWAPOPT_DEVICE (auto|cuda|npu|cpu|sim), then an
active simulator, then Ascend NPU (torch_npu), then CUDA, then CPU. NPU comes before CUDA because
`torch_npu.contrib.transfer_to_npu` makes `torch.cuda` answer for the NPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Any

import torch
from loguru import logger

from device import sim
from device.sim.tensor import SimTensor

# A library stays quiet unless the application asks (the swapopt CLIs call logger.enable).
logger.disable("device")

# Under SWAPOPT_DEVICE=sim the simulator is active from import on, so that a model built before any other
# device query already lives in simulated device memory.
if os.environ.get("SWAPOPT_DEVICE", "").strip().lower() == "sim":
    sim.process_device()

__all__ = [
    "CHOICES",
    "alloc_storage",
    "free_storage",
    "get_device",
    "get_torch_device_module",
    "is_host_tensor",
    "is_simulated",
    "labels_ranges",
    "pinned_empty",
    "record_stream",
    "sim",
    "torch_device",
]

CHOICES = ("auto", "cuda", "npu", "cpu", "sim")
ENV = "SWAPOPT_DEVICE"


@functools.cache
def _torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def _npu_available() -> bool:
    if "torch_npu" not in sys.modules and not _torch_npu_installed():
        return False
    try:
        importlib.import_module("torch_npu")
    except Exception:  # torch_npu present but CANN missing or broken
        return False
    npu = getattr(torch, "npu", None)
    return npu is not None and bool(npu.is_available())


def _requested() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a device choice; choose one of: {', '.join(CHOICES)}")
    return value


def is_simulated() -> bool:
    """Whether the device is the simulator (SWAPOPT_DEVICE=sim or an active device.sim.activate())."""
    return _simulator() is not None


def get_device() -> str:
    """"npu" | "cuda" | "cpu", or for the simulator the device type it presents ("cuda"/"npu" when typed,
    Note [simulated device type]; "sim" for the untyped simulator). is_simulated() tells it apart."""
    requested = _requested()
    if requested == "npu":
        if not _npu_available():
            raise RuntimeError(
                f"{ENV}=npu but no Ascend NPU is usable: torch_npu must import and torch.npu.is_available() "
                "must be true (install torch_npu and the CANN toolkit, and source CANN's set_env.sh)"
            )
        return "npu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{ENV}=cuda but torch.cuda.is_available() is false (no CUDA GPU or a CPU-only torch)")
        return "cuda"
    if requested == "cpu":
        return "cpu"
    simulated = _simulator()
    if simulated is not None:
        return simulated.flavour if simulated.typed else "sim"
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def get_torch_device_module(device: str | None = None) -> Any:
    """torch.cuda, torch.npu, the active SimDevice (the process-wide one under SWAPOPT_DEVICE=sim) or torch.cpu."""
    if device is None or device == "sim":
        simulated = _simulator()
        if simulated is not None:
            return simulated
    device = device or get_device()
    if device == "sim":
        return sim.process_device()
    simulated = sim.active()
    if simulated is not None and simulated.typed and device == simulated.flavour:
        return simulated
    if device == "npu":
        return torch.npu
    if device == "cuda":
        return torch.cuda
    if device == "cpu":
        return torch.cpu
    raise ValueError(f"unknown device {device!r}; choose one of: npu, cuda, sim, cpu")


def torch_device(device: str | None = None) -> torch.device:
    """Where accelerator tensors live, on the current device: cuda:N / npu:N, the simulator's device
    (sim:N / npu:N typed, cpu untyped), cpu for plain CPU."""
    simulated = _simulator() if device in (None, "sim") else None
    if simulated is not None:
        return simulated.torch_device()
    device = device or get_device()
    if device in ("cuda", "npu"):
        return torch.device(device, get_torch_device_module(device).current_device())
    return torch.device("cpu")


def _simulator() -> sim.SimDevice | None:
    """The simulator in use: the process-wide one under SWAPOPT_DEVICE=sim, else an active one unless
    SWAPOPT_DEVICE names a real device (which then wins)."""
    requested = _requested()
    if requested == "sim":
        return sim.active() or sim.process_device()
    return sim.active() if requested == "auto" else None


def pinned_empty(size: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialized host memory for async copies: pinned on cuda/npu, registered host memory on the simulator."""
    simulated = _simulator()
    if simulated is not None:
        return simulated.pinned_empty(size, dtype)
    return torch.empty(size, dtype=dtype, device="cpu", pin_memory=get_device() in ("cuda", "npu"))


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # DTensor: look at this rank's shard
    return local if isinstance(local, torch.Tensor) else t


def _memory_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds t's memory: a DTensor's shard, a simulated tensor's CPU tensor."""
    t = _local(t)
    return t._elem if type(t) is SimTensor else t


def is_host_tensor(t: torch.Tensor) -> bool:
    """Whether t (or a DTensor's local shard) is host memory on the current device."""
    t = _local(t)
    simulated = _simulator()
    if simulated is not None:
        return t.device.type == "cpu" if simulated.typed else simulated.is_host(t)
    return t.device.type == "cpu" or get_device() == "cpu"


def free_storage(t: torch.Tensor) -> None:
    """Give t's memory back to the allocator but keep the tensor object, and every view made of it, for
    ``alloc_storage`` to give memory again (FSDP frees its unsharded params this way). Call
    record_stream first for streams other than the allocating one that used the memory."""
    simulated = _simulator()
    if simulated is not None:
        simulated.free_storage(t)
    else:
        _memory_of(t).untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor, nbytes: int) -> None:
    """Memory again for a tensor freed by ``free_storage``, from the allocator of the current stream;
    the views made of t before it was freed see the new memory (its contents are undefined)."""
    simulated = _simulator()
    if simulated is not None:
        simulated.alloc_storage(t, nbytes)
    else:
        _memory_of(t).untyped_storage().resize_(nbytes)


def labels_ranges() -> bool:
    """Whether the device labels its work with the profiler ranges open around it (the simulator's
    timeline does, outside ``untagged()``), so that a range must be opened even with no profiler running."""
    simulated = sim.active()
    return simulated is not None and simulated.range_labels


def record_stream(t: torch.Tensor, stream: Any) -> None:
    """Mark t as used by `stream`, so freeing it waits for that stream's queued work."""
    simulated = _simulator()
    if simulated is not None:
        simulated.record_stream(t, stream)
    elif get_device() != "cpu":
        _local(t).record_stream(stream)
