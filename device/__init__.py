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
import weakref
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
    "npu_pinned_bytes",
    "pinned_bytes",
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


# The NPU probe's answer, per process (a forked worker probes again), kept while what it was asked of stays
# the same: the active simulator (whose torch.npu answers for it while it is active), the torch_npu module
# and torch.npu. Without it every get_device() call, several per param per step, would try the torch_npu
# import and ask torch.npu.is_available(), which asks the driver (torch_npu/npu/__init__.py device_count()).
# The simulator is held weakly: the cache must not keep a finished one alive.
_NPU_PROBE: dict[int, tuple[tuple[Any, ...], bool]] = {}


def _npu_available() -> bool:
    simulated = sim.active()
    asked = (sys.modules.get("torch_npu"), getattr(torch, "npu", None))
    cached = _NPU_PROBE.get(os.getpid())
    if cached is not None:
        ref, *objects = cached[0]
        same_sim = ref is None if simulated is None else ref is not None and ref() is simulated
        if same_sim and all(a is b for a, b in zip(objects, asked)):
            return cached[1]
    answer = _probe_npu()
    # What the probe saw after it ran (the import puts torch_npu in sys.modules and registers torch.npu).
    asked = (sys.modules.get("torch_npu"), getattr(torch, "npu", None))
    _NPU_PROBE.clear()
    _NPU_PROBE[os.getpid()] = ((None if simulated is None else weakref.ref(simulated), *asked), answer)
    return answer


def _probe_npu() -> bool:
    if "torch_npu" not in sys.modules and not _torch_npu_installed():
        return False
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception:  # torch_npu present but CANN missing or broken
        return False
    check_torch_npu_version(torch_npu)
    npu = getattr(torch, "npu", None)
    return npu is not None and bool(npu.is_available())


def _release(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:3])


def check_torch_npu_version(torch_npu: Any) -> None:
    """Warn when torch_npu was built for another torch: torch_npu X.Y.Z (X.Y.Z.postN) is built against torch
    X.Y.Z only, and a mismatch fails in obscure ways (missing ops, ABI errors) well after import."""
    version = str(getattr(torch_npu, "__version__", ""))
    if version and _release(version) != _release(torch.__version__):
        import warnings

        warnings.warn(
            f"torch_npu {version} is built for torch {'.'.join(_release(version))}, but torch {torch.__version__} is "
            "installed: install the torch_npu release matching torch (docs/npu.md)",
            stacklevel=2,
        )


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


def npu_pinned_bytes(nbytes: int, conf: str | None = None) -> int:
    """Host bytes torch_npu's pinned host allocator takes for a request of ``nbytes``. By default it rounds up
    to a power of two (v2.6.0 csrc/core/npu/CachingHostAllocator.cpp:138 ``PowerOf2Ceil``; v2.7.1 keeps
    upstream's CachingHostAllocatorImpl, which rounds the same way), so a pinned buffer just over a power of
    two takes almost twice its size. ``PYTORCH_NPU_ALLOC_CONF=pin_memory_expandable_segments:True``
    (``conf``; the environment when None) selects the expandable host allocator, which rounds
    ``nbytes + 32`` up to 512 bytes instead (v2.7.1 CachingHostAllocator.cpp:947-955)."""
    if nbytes <= 0:
        return 0
    conf = os.environ.get("PYTORCH_NPU_ALLOC_CONF", "") if conf is None else conf
    if "pin_memory_expandable_segments:true" in conf.replace(" ", "").lower():
        return max(512, -(-(nbytes + 32) // 512) * 512)
    return 1 << (nbytes - 1).bit_length()


def pinned_bytes(nbytes: int) -> int:
    """Host memory a pinned allocation of ``nbytes`` takes on this device (npu_pinned_bytes on NPU, the
    simulated npu flavour included; the request itself elsewhere)."""
    return npu_pinned_bytes(nbytes) if get_device() == "npu" else max(int(nbytes), 0)


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
