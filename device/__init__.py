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
from device.sim.host_memory import npu_pinned_bytes
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
    "host_available_bytes",
    "host_clock",
    "host_empty",
    "host_held_bytes",
    "pin_host",
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
    """"npu" | "cuda" | "cpu", or for the simulator the device type it presents ("cuda"/"npu", Note [simulated
    device type]). is_simulated() tells it apart."""
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
        return simulated.flavour
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
    if simulated is not None and device == simulated.flavour:
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
    (sim:N / npu:N), cpu for plain CPU."""
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


# Note [host memory at its true size]: torch's CUDA caching host allocator (CachingHostAllocator, behind
# pin_memory=True) asks the driver for the next power of two of each request and keeps freed blocks cached
# until empty_cache; on a 125 GiB H100 host a 24 GiB + 4 KiB buffer took 32 GiB and pinned at 1.5-2 GiB/s on
# one thread (bench/results/cuda-h100-2026-11-26-pinned.txt). Large buffers (swapopt's arenas) are therefore
# allocated here with mmap, at their size in whole pages, and page-locked with cudaHostRegister, which
# torch's pinned checks (is_pinned: cudaPointerGetAttributes) and non_blocking copies (cudaMemcpyAsync) treat
# like cudaHostAlloc memory. Pages are faulted in from several threads first (a single cudaHostRegister would
# fault them on one thread), and buffers are registered in parallel, one cudaHostRegister each, so a copy never
# spans two registrations. torch's binding of cudaHostRegister releases the GIL
# (torch/csrc/cuda/shared/cudart.cpp, py::gil_scoped_release). The registration is dropped (after a device
# synchronize: copies may still read it) when the buffer's last view dies, before its pages are unmapped.
# torch_npu exposes no host-register call to Python (AscendCL's aclrtHostRegister is C only), so on NPU the
# buffers come from torch_npu's pinned allocator; with PYTORCH_NPU_ALLOC_CONF=pin_memory_expandable_segments:True
# it rounds to 512 bytes instead of a power of two (npu_pinned_bytes), which docs/optimizer.md asks for.
REGISTER_MIN = 1 << 20  # smaller buffers: the caching host allocator (its rounding wastes less than this each)
_PAGE = 4096


def _pin_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


def _touch(flat: torch.Tensor, threads: int) -> None:
    """Fault in the pages of ``flat`` from ``threads`` threads, keeping its bytes (one byte per page rewritten
    as itself; torch's kernels release the GIL), so that registration finds them present."""
    from concurrent.futures import ThreadPoolExecutor

    n = flat.numel()
    step = -(-max(-(-n // threads), 64 << 20) // _PAGE) * _PAGE
    parts = [flat[i : i + step : _PAGE] for i in range(0, n, step)]
    if len(parts) == 1:
        parts[0].add_(0)
        return
    with ThreadPoolExecutor(min(threads, len(parts))) as pool:
        list(pool.map(lambda part: part.add_(0), parts))


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.synchronize()  # no copy may still read or write the pages being unlocked
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the process exit releases the pages anyway
        pass


# host_empty buffers by address: [pointer, size, registered]; the entry goes when the buffer dies
_MAPPED: dict[int, list[Any]] = {}


def _release_mapped(ptr: int) -> None:
    entry = _MAPPED.pop(ptr, None)
    if entry is not None and entry[2]:
        _unregister(ptr)


def _cuda_host(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous mmap memory as a uint8 CPU tensor, not yet registered (pin_host does that)."""
    import mmap

    import numpy as np

    size = max(-(-nbytes // _PAGE) * _PAGE, _PAGE)
    region = mmap.mmap(-1, size)  # page-aligned, as cudaHostRegister asks; pages committed when touched
    array = np.frombuffer(region, dtype=np.uint8)
    t = torch.from_numpy(array)  # holds ``array``, whose base is ``region``: the pages live while a view does
    ptr = t.data_ptr()
    _MAPPED[ptr] = [ptr, size, False]
    # numpy clears an array's weak references before it lets go of its base: the registration is dropped
    # before munmap
    weakref.finalize(array, _release_mapped, ptr)
    return t[:nbytes]


def host_empty(nbytes: int, pin: bool = True, exact: bool = False) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes`` for async copies that takes ``nbytes`` of host RAM (whole pages), not
    the power of two the caching host allocators take (Note [host memory at its true size]). ``pin=False``
    leaves it pageable until ``pin_host`` registers it (with others, in parallel); buffers under REGISTER_MIN
    (unless ``exact``: swapopt's arenas, which are few) and NPU buffers come pinned from the caching host
    allocator."""
    nbytes = int(nbytes)
    if not _registers(nbytes, exact):
        return pinned_empty((nbytes,), dtype=torch.uint8)
    simulated = _simulator()
    if simulated is not None:
        return simulated.registered_empty(nbytes, pin=pin)  # pinned by the modeled host's threads
    t = _cuda_host(nbytes)
    if pin:
        pin_host([t])
    return t


def _registers(nbytes: int, exact: bool = False) -> bool:
    """host_empty allocates and registers ``nbytes`` itself (CUDA and the simulator's cuda flavour, from
    REGISTER_MIN on, or any size but 0 when ``exact``), rather than taking them from the caching host
    allocator."""
    if nbytes < (1 if exact else REGISTER_MIN):
        return False
    simulated = _simulator()
    if simulated is not None:
        return simulated.flavour == "cuda"
    return get_device() == "cuda"


def host_clock() -> float:
    """Seconds on the host's clock: the simulator's modeled host time, else the wall clock."""
    import time

    simulated = _simulator()
    return simulated.now_us() / 1e6 if simulated is not None else time.perf_counter()


def pin_host(buffers: list[torch.Tensor], threads: int | None = None) -> None:
    """Page-lock host_empty(..., pin=False) buffers: their pages touched from ``threads`` threads, then one
    cudaHostRegister per buffer, the buffers in parallel (host_clock tells how long it took)."""
    threads = threads or _pin_threads()
    simulated = _simulator()
    if simulated is not None:
        simulated.pin_registered(buffers)  # modeled time: the simulated host's threads, not this machine's
        return
    todo = [b for b in buffers if _MAPPED.get(b.untyped_storage().data_ptr(), (0, 0, True))[2] is False]
    if get_device() != "cuda" or not todo:
        return
    from concurrent.futures import ThreadPoolExecutor

    for b in todo:
        _touch(b, threads)
    cudart = torch.cuda.cudart()

    def register(b: torch.Tensor) -> None:
        entry = _MAPPED.get(b.untyped_storage().data_ptr())
        if entry is None or entry[2]:
            return
        err = cudart.cudaHostRegister(entry[0], entry[1], 0)
        if int(err) != 0:
            raise torch.OutOfMemoryError(
                f"CUDA error: cudaHostRegister of {entry[1] / 2**30:.2f} GiB of host memory failed ({err}): the "
                "host cannot page-lock that much (see swapopt.HostMemoryError's knobs, or ulimit -l)"
            )
        entry[2] = True

    with ThreadPoolExecutor(min(threads, len(todo))) as pool:
        list(pool.map(register, todo))


def host_available_bytes() -> int | None:
    """Host RAM free for pinned memory: the simulated host's capacity less what is pinned there; on hardware
    MemAvailable of /proc/meminfo (None where there is none)."""
    simulated = _simulator()
    if simulated is not None:
        return simulated.host_available()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_held_bytes(nbytes: int, pinned: bool = False, exact: bool = False) -> int:
    """Host RAM a buffer of ``nbytes`` takes: host_empty's (whole pages; on NPU and under REGISTER_MIN unless
    ``exact``, what the caching host allocator takes), or with ``pinned`` pinned_empty's (pinned_bytes)."""
    if nbytes <= 0:
        return 0
    if pinned or not _registers(nbytes, exact):
        return pinned_bytes(nbytes)
    return -(-int(nbytes) // _PAGE) * _PAGE


def pinned_bytes(nbytes: int) -> int:
    """Host memory a pinned allocation of ``nbytes`` (pinned_empty, pin_memory=True) takes on this device:
    npu_pinned_bytes on NPU, the next power of two on CUDA (torch's CachingHostAllocator; the simulator's
    flavours alike), the request itself on CPU."""
    dev = get_device()
    if dev == "npu":
        return npu_pinned_bytes(nbytes)
    if dev == "cuda" and nbytes > 0:
        return 1 << (int(nbytes) - 1).bit_length()
    return max(int(nbytes), 0)


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
        return t.device.type == "cpu"
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


def graph_api(mod: Any) -> tuple[Any, Any] | None:
    """(graph class, capture context manager) of a device module: torch.cuda's CUDAGraph and graph, torch_npu's
    NPUGraph and graph (torch_npu/npu/graphs.py), the simulator's; None where it has none (torch.cpu)."""
    capture = getattr(mod, "graph", None)
    if not callable(capture):
        return None
    for name in ("CUDAGraph", "NPUGraph"):
        cls = getattr(mod, name, None)
        if cls is not None:
            return cls, capture
    return None


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
