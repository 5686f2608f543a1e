"""A simulated accelerator on CPU that fails where a real one would.

All tensors are real CPU tensors and every op runs eagerly, so data are always right. While a
simulator is active, a TorchDispatchMode (device/modes.py) hands it every aten op, on every thread
started while it is active, and it
- classifies storages (device/dispatch.py): *host* (pinned_empty, pin_memory=True, Tensor.pin_memory()),
  *pageable* (created before activation, `torch.tensor(...)` literals, outputs of ops that read only
  host-side tensors and name no device) and *device* (everything else created while active, and
  copies of device memory made outside the dispatcher: deepcopy, storage clones, torch.load);
- runs each op touching device memory on a stream (the thread's current one; in backward, the stream
  of the forward op, or the stream a hook made current: Note [streams inside a backward pass]), every
  other op on the thread's host actor, and checks its reads and writes (from the op schema, on the
  exact elements of strided views) against earlier accesses that no event wait, stream wait,
  synchronize or thread join orders before it (device/sanitizer.py, `StreamRaceError`);
- accounts device memory against a capacity (device/memory.py, `torch.OutOfMemoryError`);
- places each op on a deterministic timeline (device/timeline.py).
Entry points the dispatcher does not see (host reads through tolist / numpy / DLPack / torch.save,
record_stream with a simulated stream, `.cuda()`, threads, async collectives) are wrapped while a
simulator is active (device/entry_points.py). Inactive, it costs nothing: no mode is pushed.

The accelerator and the host are both "cpu" here, so `.to(device.torch_device())`, `.cpu()` and
`.to("cpu")` without a dtype change return the tensor itself: move data with explicit buffers and
`copy_`. torch's own `Optimizer.load_state_dict`, which casts states to `param.device`, does copy
host states of device params to device memory.
"""

from __future__ import annotations

import atexit
import bisect
import math
import os
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from loguru import logger
from torch._subclasses.fake_tensor import FakeTensor

from device.sim import entry_points, kernels, npu_ops
from device.sim.costs import op_flops
from device.sim.backend import backend_name, register, registered_flavour
from device.sim.dispatch import DEVICE, HOST_MEM, HOST_OUT, PAGEABLE, PINNED_OUT, check_same_device, op_lane
from device.sim.dispatch import Arg as _Arg
from device.sim.dispatch import StorageInfo as _Storage
from device.sim.host_time import counted_methods
from device.sim.host_memory import REGISTER_THREADS, HostMemory, capacity_from_env, power_of_two
from device.sim.memory import Block, DeviceMemory, pool_of
from device.sim.active import _ACTIVE, active
from device.sim.modes import _STREAM_TAG, _SimMode, _StreamTagMode
from device.sim.ops import OpInfo, arg_value, byte_range, factory_bytes, new_outputs, op_info, strided_layout, tensors
from device.sim.presets import PRESETS, SimPreset, get_preset
from device.sim.sanitizer import HOST, Access, Clock, Clocks, StreamRaceError, race_error, reused_use
from device.sim.streams import SimEvent, SimStream, canonical, fresh_object
from device.sim.tensor import _CPU, _MIX_FREE, SimTensor, _check_same_device, _sync_metadata, _unwrap, wrap_outputs
from device.sim.tensor import check_fused_optimizer, is_fused_optimizer
from device.sim.timeline import Timeline, TimelineOp

__all__ = [
    "PRESETS",
    "SimDevice",
    "SimEvent",
    "SimPreset",
    "SimStream",
    "StreamRaceError",
    "TimelineOp",
    "activate",
    "active",
    "process_device",
]

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# Tensor types whose __torch_dispatch__ is this one have no subclass behavior (plain tensors, Parameter).
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # DTensor
    return local if isinstance(local, torch.Tensor) else t


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


_PROCESS: list[SimDevice] = []
_AT_EXIT: list[bool] = []
_SETTLE_S = 0.05  # how long the exit lets a collective's worker thread finish letting go


def _settle_collectives() -> None:
    """At exit, before the interpreter begins finalizing (Note [collective tensors at exit]): let go of the held
    tensors only the simulator still holds, then give up the GIL for a moment, so that a gloo worker still
    letting go of a finished collective (and waiting for the GIL to do so) does it now."""
    sims = [s for s in (*_PROCESS, *_ACTIVE) if s._collectives]
    for sim in sims:
        sim._release_collectives()
    if sims:
        time.sleep(_SETTLE_S)


# Host work of the simulator's own bookkeeping, which a device does not do: device.host_time counts it.
@counted_methods(
    "current_stream", "default_stream", "set_stream", "synchronize", "memory_allocated", "max_memory_allocated",
    "reset_peak_memory_stats", "is_host", "pinned_empty", "record_stream", "free_storage", "alloc_storage",
)
class SimDevice:
    """The torch.cuda-like module surface of one simulated accelerator."""

    OutOfMemoryError = OutOfMemoryError

    def __init__(
        self,
        preset: str | SimPreset = "h100",
        capacity_bytes: int | None = None,
        sanitize: bool = True,
        allocator: str = "exact",
        typed: bool | None = None,
        flavour: str | None = None,
    ) -> None:
        self.preset = get_preset(preset)
        # Note [simulated device type]: typed, device tensors are SimTensors on a device of their own; untyped
        # (the earlier model), they are cpu-typed and told from host memory by where they were made.
        self.typed = typed_default() if typed is None else typed
        self.flavour = flavour or registered_flavour() or process_flavour() or self.preset.flavour
        if self.typed:
            register(self.flavour)
        self.backend = backend_name(self.flavour) if self.typed else "cpu"
        self.capacity_bytes = int(capacity_bytes if capacity_bytes is not None else self.preset.capacity_bytes)
        if allocator not in ("exact", "caching"):
            raise ValueError(f"allocator must be 'exact' or 'caching', got {allocator!r}")
        self._caching = allocator == "caching"
        self._mems: dict[int, DeviceMemory] = {}  # per device index, made on first use
        self._streams: weakref.WeakValueDictionary[int, SimStream] = weakref.WeakValueDictionary()
        self.sanitize = sanitize
        # Per-instance classes so that `isinstance(s, dev.Stream)` works and streams know their device.
        self.Stream = type("Stream", (SimStream,), {"_sim": self})
        self.Event = type("Event", (SimEvent,), {"_sim": self})
        # The npu flavour hands out a new object for the current/default stream on every call, as
        # torch_npu does (device.sim.streams.fresh_object); code that compares streams with `is` breaks.
        self._fresh_streams = self.typed and self.flavour == "npu"
        # Fused optimizer kernels run through torch_npu's CPU fallback (device.sim.kernels), by kernel name.
        self.cpu_fallbacks: dict[str, int] = {}
        # npu flavour: record_stream calls that named the block's own allocation stream, a no-op on CUDA but
        # on NPU a hold on the block until that stream's queued work is done (see record_stream).
        self.self_stream_records = 0
        # npu flavour: non_blocking host<->device copies that blocked because a side was not contiguous.
        self.strided_copies = 0
        # npu flavour: Event.elapsed_time calls, each of which drained the whole device.
        self.elapsed_time_drains = 0
        self._clocks = Clocks()
        self._timeline = Timeline(self.preset)
        self._storages: dict[int, _Storage] = {}  # StorageImpl address -> info; entries die with the storage
        self._uid = 0
        self._first_uid: dict[int, int] = {}  # storages free_storage emptied (alive, maybe given memory again): their id
        self._live_host = 0
        self._peak_host = 0
        self._host_costs: dict[int, int] = {}  # live pinned storage id -> host bytes it takes (_host_cost)
        # The host's RAM as the pinned host allocators see it (device/sim/host_memory.py): SWAPOPT_SIM_HOST_MB or
        # the preset's host_capacity_bytes; storages of registered_empty (by id) count at their true size.
        self.host_mem = HostMemory(
            capacity_from_env(self.preset.host_capacity_bytes), self._pinned_rounding, self.flavour,
            self.preset.pin_gbps,
        )
        self._registered: set[int] = set()
        self._registering = 0  # while registered_empty allocates: its threads (-1: pinned later), else 0
        self._unpinned: dict[int, int] = {}  # registered_empty(pin=False) storages not yet pinned -> bytes
        self._actor_names = ["host"]
        self._host_alloc = 0
        self._labels: list[str] = []
        self.range_labels = True  # timeline ops carry the profiler range open around them (off in untagged())
        self._pending: StreamRaceError | None = None
        self._mode = _SimMode(self)
        self._grad_mode = _StreamTagMode(self)
        # Per thread: current stream (thread-local, as in PyTorch), host actor, backward bookkeeping.
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._late_frees: list[tuple[int, int]] = []
        # Note [collective tensors at exit]: tensors a collective took, by id, until no C++ holder is left.
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}  # id -> (tensor, CPU tensor, storage)
        self._collectives = False  # whether a collective ran here
        self._held_lock = threading.Lock()
        # Note [aliases of host memory]: live pinned storages by the address their memory starts at.
        self._host_starts: list[int] = []  # sorted
        self._host_spans: dict[int, tuple[int, weakref.ref, int]] = {}  # start -> (end, storage, key)
        self._host_at: dict[int, int] = {}  # key -> start
        # Note [free and reuse]: per allocation stream, blocks freed while another stream may still use them.
        self._hazards: dict[int, list[tuple[Access, int, int, str]]] = {}  # (use, freed id, bytes, pool)
        self._host_actors = {HOST}
        # Stacks of accesses, for StreamRaceError.earlier_stack; off by default (it costs per op).
        self.stacks = os.environ.get("SWAPOPT_SIM_STACKS", "0") not in ("", "0")
        self._default = self.Stream(name="compute")
        self._comm: SimStream | None = None

    def __repr__(self) -> str:
        return f"<SimDevice {self.preset.name} capacity={_fmt_bytes(self.capacity_bytes)}>"

    # ----- torch.cuda-like surface -------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def init(self) -> None:
        pass

    def device_count(self) -> int:
        return device_count() if self.typed else 1

    def current_device(self) -> int:
        """The calling thread's device: 0 until set_device, as on CUDA and torch_npu."""
        return getattr(self._tls, "device", 0)

    def set_device(self, device: int | str | torch.device) -> None:
        index = self._index(device)
        if index is None:
            return
        if not self.typed and index != 0:
            raise ValueError(f"the untyped simulator has one device (0), got {device!r}")
        self._tls.device = index

    def _index(self, device: Any) -> int | None:
        """The device index `device` names (None: the current one), refusing indices past device_count()."""
        if device is None:
            return None
        if isinstance(device, str):
            device = torch.device(device) if ":" in device or device in ("cpu", "cuda", "npu", self.backend) else device
        if isinstance(device, torch.device):
            if device.type == "cpu":
                raise ValueError(f"{device} is the host, not a simulated device")
            index = device.index
        else:
            index = int(device)
        if index is not None and not 0 <= index < self.device_count():
            raise RuntimeError(
                f"invalid device ordinal {index}: the simulator has {self.device_count()} devices "
                f"(SWAPOPT_SIM_DEVICES)"
            )
        return index

    def torch_device(self, index: int | None = None) -> torch.device:
        """Where this simulator's device tensors live (the current device by default)."""
        if not self.typed:
            return torch.device("cpu")
        return torch.device(self.backend, self.current_device() if index is None else index)

    def get_device_name(self, device: Any = None) -> str:
        return f"sim:{self.preset.name}"

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(name=self.get_device_name(), total_memory=self.capacity_bytes)

    def manual_seed(self, seed: int) -> None:
        # Device kernels draw from the CPU generator here; torch.manual_seed also calls this one (typed cuda
        # flavour), so seed the generator itself.
        torch.default_generator.manual_seed(int(seed))

    manual_seed_all = manual_seed

    def _is_in_bad_fork(self) -> bool:  # torch.manual_seed asks a PrivateUse1 module before seeding it
        return False

    def get_amp_supported_dtype(self) -> list[torch.dtype]:  # torch.autocast asks a PrivateUse1 module
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return True

    def current_stream(self, device: Any = None) -> SimStream:
        return self._present(self._current())

    def default_stream(self, device: Any = None) -> SimStream:
        return self._present(self._default)

    def _current(self) -> SimStream:
        """The current stream object itself (the simulator's own bookkeeping compares streams by identity).
        Inside a backward pass that is the running node's stream (Note [streams inside a backward pass])."""
        node = torch._C._current_autograd_node()
        if node is not None:
            return self._node_stream(node)
        return getattr(self._tls, "current", None) or self._default

    def _thread_stream(self) -> SimStream:
        """The stream the thread set (set_stream, stream()), whatever node a backward pass runs."""
        return getattr(self._tls, "current", None) or self._default

    def _present(self, stream: SimStream) -> SimStream:
        return fresh_object(stream) if self._fresh_streams else stream

    def set_stream(self, stream: SimStream) -> None:
        self._tls.current = canonical(stream)
        # Set by a hook inside a backward pass: current for the rest of that node only, as the engine's
        # stream guard restores the node's stream when the node returns.
        self._tls.set_in = torch._C._current_autograd_node()

    @contextmanager
    def stream(self, stream: SimStream | None) -> Iterator[SimStream | None]:
        """Make `stream` current inside the block (None: leave the current stream alone)."""
        if stream is None:
            yield None
            return
        tls = self._tls
        previous = getattr(tls, "current", None), getattr(tls, "set_in", None)
        tls.current = canonical(stream)
        tls.set_in = torch._C._current_autograd_node()
        try:
            yield stream
        finally:
            tls.current, tls.set_in = previous

    @contextmanager
    def _backward_call(self) -> Iterator[None]:
        """Around backward() / autograd.grad: streams a hook set without restoring them end with the pass, as
        on hardware, where the pass runs under the engine's stream guards and leaves the caller's stream be."""
        tls = self._tls
        saved = getattr(tls, "current", None), getattr(tls, "set_in", None)
        # The caller's stream, which a hook's stream context inside the pass does not change.
        callers = tls.__dict__.setdefault("callers", [])
        callers.append(self._current())  # inside a node (a reentrant checkpoint's backward), the node's
        try:
            yield
        finally:
            callers.pop()
            tls.current, tls.set_in = saved

    def synchronize(self, device: Any = None) -> None:
        host = self._host()
        for actor in self._clocks.actors():
            if actor not in self._host_actors:
                self._clocks.merge_actor(host, actor)
        self._timeline.wait_host(self._timeline.device_tail_us())
        with self._lock:
            self._drain_frees()
            self._hazards.clear()  # every use is done: a freed block is safe to hand out again
        self._clocks.compact()  # dropped streams the host has now seen stop costing anything
        self._raise_pending()

    def _mem_of(self, index: int) -> DeviceMemory:
        mem = self._mems.get(index)
        if mem is None:
            mem = self._mems[index] = DeviceMemory(self.capacity_bytes, caching=self._caching)
        return mem

    @property
    def _mem(self) -> DeviceMemory:
        return self._mem_of(self.current_device())

    def _memory(self, device: Any = None) -> DeviceMemory:
        if self._held:
            self._release_collectives()  # what only the simulator holds is no longer allocated
        if self._late_frees:
            with self._lock:
                self._drain_frees()
        index = self._index(device)
        mem = self._mem_of(self.current_device() if index is None else index)
        mem.process_deferred(self._timeline.host_us)
        return mem

    def memory_allocated(self, device: Any = None) -> int:
        return self._memory(device).allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._memory(device).peak_allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._memory(device).reset_peaks()
        self._peak_host = self._live_host

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_reserved(self, device: Any = None) -> int:
        """Bytes held in segments (allocator="caching"); equal to memory_allocated with exact accounting."""
        return self._memory(device).reserved

    def max_memory_reserved(self, device: Any = None) -> int:
        return self._memory(device).peak_reserved

    def empty_cache(self) -> None:
        for index in list(self._mems):
            self._memory(index).empty_cache()
        self.host_mem.empty_cache()  # torch.cuda.empty_cache also frees the caching host allocator's free blocks

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return max(self.capacity_bytes - self._memory(device).reserved, 0), self.capacity_bytes

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        mem = self._memory(device)
        return {
            "allocated_bytes.all.current": mem.allocated,
            "allocated_bytes.all.peak": mem.peak_allocated,
            "reserved_bytes.all.current": mem.reserved,
            "reserved_bytes.all.peak": mem.peak_reserved,
        }

    # ----- simulator extras --------------------------------------------------------------------
    def now_us(self) -> float:
        """Modeled host time in microseconds."""
        return self._timeline.host_us

    @property
    def timeline(self) -> list[TimelineOp]:
        return self._timeline.ops

    def reset_timeline(self) -> None:
        """Forget recorded timeline ops (clocks keep running)."""
        self._timeline.clear()

    def export_chrome_trace(self, path: str | Path) -> None:
        """Write the timeline as Chrome/Perfetto trace JSON: one track per stream, times in microseconds."""
        self._timeline.export_chrome_trace(path)

    def is_host(self, t: torch.Tensor) -> bool:
        """Host memory: pinned_empty allocations and pageable (untracked) tensors; typed, every cpu tensor."""
        if self.typed:
            return _local(t).device.type == "cpu"
        info = self._lookup(_local(t).untyped_storage())
        return info is None or info.kind != DEVICE

    def pinned_empty(self, size: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A CPU tensor registered as pinned host memory (not counted as device memory), taken from the host
        as the caching host allocator takes it (rounded, _host_cost)."""
        self._host_alloc += 1
        try:
            t = torch.empty(size, dtype=dtype, device="cpu")
        finally:
            self._host_alloc -= 1
        storage = t.untyped_storage()
        if self._lookup(storage) is None:  # allocated where the mode does not see it (another thread)
            self._register(storage, HOST_MEM)
        return t

    def registered_empty(self, nbytes: int, threads: int = REGISTER_THREADS, pin: bool = True) -> torch.Tensor:
        """``nbytes`` of host memory the program allocates itself and registers (cudaHostRegister; what
        device.host_empty does on hardware): pinned like pinned_empty's and counted at its true size in whole
        pages from the start (its pages are written before it is pinned); pinning it costs modeled host time
        at ``threads`` times the preset's rate, now or, with ``pin=False``, at pin_registered."""
        with self._lock:
            self._registering = max(int(threads), 1) if pin else -1
            try:
                t = self.pinned_empty((int(nbytes),), torch.uint8)
            finally:
                self._registering = 0
        if not pin:
            self._unpinned[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    def pin_registered(self, buffers: list[torch.Tensor], threads: int = REGISTER_THREADS) -> None:
        """Register registered_empty(..., pin=False) buffers: the modeled time of pinning their bytes."""
        nbytes = sum(self._unpinned.pop(b.untyped_storage()._cdata, 0) for b in buffers)
        if nbytes:
            self._timeline.host_us += self.host_mem.pin_us(nbytes, threads)

    def _pinned_rounding(self, nbytes: int) -> int:
        """Host bytes a pinned allocation of ``nbytes`` takes: the cuda flavour rounds up to a power of two as
        torch's CachingHostAllocator does, the npu flavour as torch_npu's (device.npu_pinned_bytes, under
        PYTORCH_NPU_ALLOC_CONF as it is at allocation)."""
        if self.flavour != "npu":
            return power_of_two(nbytes)
        from device import npu_pinned_bytes  # the package above the simulator; imported by then

        return npu_pinned_bytes(nbytes)

    def _host_cost(self, info: _Storage) -> int:
        """Host bytes a pinned allocation takes (``host_mem``: rounded and cached as the caching host
        allocator does, or at its true size while registered_empty allocates); kept until the free. Past the
        host's capacity it fails as the driver does, and the storage is then not counted as pinned. Pinning
        new bytes costs host time at the preset's pin_gbps per thread."""
        try:
            if self._registering:
                cost, fresh = self.host_mem.register(info.nbytes), True
                self._registered.add(info.uid)
            else:
                cost, fresh = self.host_mem.pin(info.nbytes)
        except RuntimeError:
            info.kind = PAGEABLE  # nothing was pinned: its free gives nothing back
            raise
        self._host_costs[info.uid] = cost
        if fresh and cost and self._registering >= 0:
            self._timeline.host_us += self.host_mem.pin_us(cost, self._registering or 1)
        return cost

    def _host_release(self, info: _Storage) -> int:
        """A pinned storage died: the bytes it took leave the host's count (registered memory) or go to the
        caching allocator's free blocks (pinned memory, until empty_cache)."""
        cost = self._host_costs.pop(info.uid, 0)
        if info.uid in self._registered:
            self._registered.discard(info.uid)
            self.host_mem.unregister(cost)
        else:
            self.host_mem.unpin(cost)
        return cost

    def host_memory_allocated(self) -> int:
        """Live bytes of pinned host memory (pinned_empty, pin_memory=True, Tensor.pin_memory(), registered_empty),
        as the host allocator takes them (rounded, _host_cost; registered memory at its true size)."""
        return self._live_host

    def max_host_memory_allocated(self) -> int:
        return self._peak_host

    def host_memory_reserved(self) -> int:
        """Host RAM held for pinned memory: live allocations plus the free blocks the caching allocator keeps."""
        return self.host_mem.held

    def max_host_memory_reserved(self) -> int:
        return self.host_mem.peak

    def host_available(self) -> int:
        """Host RAM not held for pinned memory (the simulated host's capacity less host_memory_reserved)."""
        return self.host_mem.available()

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        """Like Tensor.record_stream: freeing t's storage is safe with respect to work queued on `stream`."""
        info = self._lookup(_local(t).untyped_storage())
        if info is None:
            return
        if stream.actor == info.alloc_actor and self.flavour == "npu":
            # CUDA's allocator skips the allocating stream; NPU's records it like any other
            # (torch_npu NPUCachingAllocator.cpp DeviceCachingAllocator::recordStream just inserts into
            # stream_uses), so the block waits for that stream's queued work before reuse. Counted, so
            # that tests can tell a library that records it.
            self.self_stream_records += 1
        info.recorded.add(stream.actor)

    def free_storage(self, t: torch.Tensor) -> None:
        """Like ``untyped_storage().resize_(0)`` on a device tensor: its block is freed as if the tensor
        died (record_stream and the free check apply), while the tensor and its views stay, pointing at
        no memory until alloc_storage."""
        storage = _local(t).untyped_storage()
        with self._lock:
            info = self._lookup(storage)
            if info is not None:
                self._first_uid[storage._cdata] = info.uid
                self._free(storage._cdata, info.uid, dead=False)
                self._drain_frees()
            with torch.utils._python_dispatch._disable_current_modes():
                storage.resize_(0)
        self._raise_pending()

    def alloc_storage(self, t: torch.Tensor, nbytes: int) -> None:
        """Like ``untyped_storage().resize_(nbytes)`` on a tensor freed by free_storage: a new device block,
        allocated on the current stream, under the storage's first id (its finalizer frees the block when
        the storage dies)."""
        storage = _local(t).untyped_storage()
        with self._lock:
            if self._lookup(storage) is not None:
                raise RuntimeError("alloc_storage: the tensor still has its memory; free_storage it first")
            first = self._first_uid.get(storage._cdata)
            stream = self._current()
            with torch.utils._python_dispatch._disable_current_modes():
                storage.resize_(nbytes)
            try:
                info = self._register(storage, DEVICE, stream.actor, uid=first)
            except OutOfMemoryError:
                with torch.utils._python_dispatch._disable_current_modes():
                    storage.resize_(0)
                raise
            self._allocated(info, stream)

    # ----- clocks and time ---------------------------------------------------------------------
    def _name_actor(self, actor: int, name: str | None) -> str:
        """Readable stream names for error messages and traces: "compute", "stream#1", ..."""
        index = len(self._actor_names) - 1  # the host is actor 0
        name = name or (f"stream#{index}" if index else "compute")
        self._actor_names.append(name)
        return name

    def _record(self, event: SimEvent, stream: SimStream) -> None:
        self._clocks.merge_actor(stream.actor, self._host())  # recording is a launch: it follows the host's past
        event.clock = self._clocks.snapshot(stream.actor)
        event.time_us = max(stream.tail_us, self._timeline.host_us)

    def _stream_wait(self, stream: SimStream, event: SimEvent) -> None:
        if event.clock is None:  # waiting on a never-recorded event is a no-op, as in CUDA
            return
        self._clocks.merge_actor(stream.actor, self._host())
        self._clocks.merge(stream.actor, event.clock)
        stream.tail_us = max(stream.tail_us, event.time_us)

    def _host_wait(self, clock: Clock, time_us: float) -> None:
        self._clocks.merge(self._host(), clock)
        self._timeline.wait_host(time_us)

    def _host_has_seen(self, clock: Clock) -> bool:
        return self._clocks.has_seen(self._host(), clock)

    def _query(self, clock: Clock, time_us: float) -> bool:
        if self._timeline.host_us >= time_us:
            self._host_wait(clock, time_us)  # observing completion orders the host after the work
            return True
        # Polling costs host time, so a polling loop reaches the completion time.
        self._timeline.host_us += max(self.preset.launch_us, 1.0)
        return False

    # ----- threads and autograd --------------------------------------------------------------
    def _host(self) -> int:
        """The host actor of the calling thread: the main one, or a thread started while active."""
        return getattr(self._tls, "host", HOST)

    def _fork(self) -> int:
        """A new host actor for a thread being started: it follows everything its parent did so far."""
        parent = self._host()
        child = self._clocks.new_actor()
        self._host_actors.add(child)
        self._actor_names.append(f"host thread #{child}")
        self._clocks.merge_actor(child, parent)
        self._clocks.tick(parent)
        return child

    @contextmanager
    def _thread(self, actor: int) -> Iterator[None]:
        """Run a started thread's body under this simulator, as `actor`."""
        self._tls.host = actor
        modes = (_SimMode(self), _StreamTagMode(self))
        for mode in modes:
            mode.__enter__()
        torch._C._set_multithreading_enabled(False)  # per thread: Note [backward on the caller's thread]
        try:
            yield
        finally:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
            self._clocks.retire(actor)

    def _joined(self, actor: int) -> None:
        """Thread.join returned: the joining thread follows everything the joined one did."""
        self._clocks.merge_actor(self._host(), actor)

    def _op_stream(self) -> SimStream:
        """The stream an op runs on: the thread's current one when it is issued (Note [streams inside a
        backward pass])."""
        node = torch._C._current_autograd_node()
        if node is None:
            return self._thread_stream()
        return self._node_stream(node)

    def _node_stream(self, node: Any) -> SimStream:
        """The current stream while autograd runs `node`: the node's own, or one a hook of it made current. The
        first time the pass is seen in a node, the node's own stream is ordered as the engine orders it."""
        own = node.metadata.get(_STREAM_TAG) or self._default
        tls = self._tls
        backward = getattr(tls, "backward", None)
        if backward is None:
            # The first backward node follows the caller's current stream (where the incoming gradient was
            # made); when the pass ends, the caller's stream waits for every stream it used.
            callers = getattr(tls, "callers", None)
            caller = callers[-1] if callers else self._thread_stream()
            backward = tls.backward = {"caller": caller, "streams": {caller}, "last": caller, "node": None}
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if backward["node"] is not node:
            # The engine orders a node after the nodes that produced its inputs, before the node and its hooks
            # run; following the previous node over-approximates that, so it never reports a race the engine
            # prevents.
            backward["node"] = node
            if own is not backward["last"]:
                own.wait_stream(backward["last"])
                backward["last"] = own
            backward["streams"].add(own)
        if getattr(tls, "set_in", None) is node and tls.current is not own:
            # A hook's own stream: ordered only by what the hook does (a wait it forgets is a race, as on
            # hardware), and not among the streams the engine syncs the caller with at the end.
            return tls.current
        return own

    def _end_backward(self) -> None:
        backward = getattr(self._tls, "backward", None)
        self._tls.backward = None
        if backward is not None:
            for stream in backward["streams"]:
                if stream is not backward["caller"]:
                    backward["caller"].wait_stream(stream)

    def _comm_stream(self) -> SimStream:
        """The stream async collectives run on (like NCCL's internal stream)."""
        if self._comm is None:
            self._comm = self.Stream(name="collectives")
        return self._comm

    # ----- host reads outside the dispatcher ----------------------------------------------------
    def _host_read(self, t: torch.Tensor, what: str) -> None:
        """tolist(), numpy(), DLPack, torch.save: the host reads t's bytes without an aten op.
        A device tensor is read by a blocking copy on the current stream, as CUDA does."""
        with self._lock:
            self._host_read_locked(t, what)

    def _host_read_locked(self, t: torch.Tensor, what: str) -> None:
        if not self.sanitize or t.device.type != "cpu" or t.layout is not torch.strided:
            return
        storage = t.untyped_storage()
        info = self._lookup(storage)
        if info is None:
            t, storage, info = self._alias(t, storage)  # Note [aliases of host memory]
        if info is None:
            return
        arg = _Arg(t, storage, info, "r")
        if info.kind == DEVICE:
            stream = self._current()
            host = self._host()
            self._clocks.merge_actor(stream.actor, host)
            self._check_and_log(what, [(arg, stream.actor, self._clocks.tick(stream.actor))])
            self._clocks.merge_actor(host, stream.actor)
            self._timeline.wait_host(stream.tail_us)
        else:
            host = self._host()
            self._check_and_log(what, [(arg, host, self._clocks.tick(host))])

    def _is_pinned(self, t: torch.Tensor) -> bool:
        """Tensor.is_pinned(): pinned memory, through an alias too (CUDA asks the host allocator by address)."""
        storage = t.untyped_storage()
        info = self._lookup(storage)
        if info is None:
            info = self._alias(t, storage)[2]
        return info is not None and info.kind == HOST_MEM

    def _index_host(self, storage: Any, key: int) -> None:
        """Note [aliases of host memory]: a live pinned storage, found by address from now on."""
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or start in self._host_spans:
            return
        bisect.insort(self._host_starts, start)
        self._host_spans[start] = (start + nbytes, weakref.ref(storage), key)
        self._host_at[key] = start

    def _unindex_host(self, key: int) -> None:
        start = self._host_at.pop(key, None)
        if start is None or self._host_spans.get(start, (0, None, None))[2] != key:
            return
        del self._host_spans[start]
        del self._host_starts[bisect.bisect_left(self._host_starts, start)]

    def _alias(self, t: torch.Tensor, storage: Any) -> tuple[torch.Tensor, Any, _Storage | None]:
        """Note [aliases of host memory]: (t, storage, None) for memory of no tracked storage; for a tensor
        whose storage is not tracked but whose bytes lie in a live pinned storage, that storage and t as a view
        of it (the same elements), so that its accesses are judged on the memory they touch."""
        starts = self._host_starts
        if not starts or t.layout is not torch.strided or t.device.type != "cpu":
            return t, storage, None
        try:
            ptr = storage.data_ptr()
        except RuntimeError:  # a wrapper subclass's storage holds no memory of its own
            return t, storage, None
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return t, storage, None
        start = starts[i]
        end, ref, key = self._host_spans[start]
        rng = byte_range(t)
        if ptr >= end or rng is None:
            return t, storage, None
        base = ref()
        info = self._storages.get(key)
        delta = ptr - start
        if (
            base is None or info is None or ptr + rng[1] > end
            or base.data_ptr() != start or start + base.nbytes() != end  # moved (share_memory_) or resized
        ):
            return t, storage, None
        itemsize = t.element_size()
        with torch.utils._python_dispatch._disable_current_modes():
            if delta % itemsize == 0:
                view = torch.empty(0, dtype=t.dtype, device="cpu").set_(
                    base, t.storage_offset() + delta // itemsize, t.shape, t.stride()
                )
            else:  # bytes not aligned to its dtype in the pinned storage: the same bytes, element by element
                view = torch.empty(0, dtype=torch.uint8, device="cpu").set_(
                    base, t.storage_offset() * itemsize + delta, (*t.shape, itemsize),
                    (*(s * itemsize for s in t.stride()), 1),
                )
        return view, base, info

    def _hold_collective(self, args: tuple, kwargs: dict, out: Any) -> None:
        """Note [collective tensors at exit]: keep the tensors a collective took or returned (for a SimTensor,
        the wrapper, which keeps the CPU tensor the backend got) until no C++ holder of theirs is left."""
        self._collectives = True
        found: list[torch.Tensor] = []
        for value in (*args, *kwargs.values(), out):
            _collect_tensors(value, found)
        for t in found:
            self._hold(t)

    def _hold(self, t: torch.Tensor) -> None:
        inner = t._elem if type(t) is SimTensor else t
        if inner.layout is not torch.strided:
            return
        storage = inner.untyped_storage()  # its Python object: C++'s last release of it would take the GIL
        with self._held_lock:
            self._held[id(inner)] = (t, inner, storage)

    def _release_collectives(self, everything: bool = False) -> None:
        """Let go of the held tensors nothing but this simulator still holds (``everything``: all of them);
        each is freed, if nothing else holds it, here on this thread."""
        use_count = torch._C._storage_Use_Count
        with self._held_lock:
            # Nothing else holds the tensor, and its storage only it and the storage's own Python object (a
            # view a collective's work made of it would be one more).
            done = [
                key for key, (_, inner, storage) in self._held.items()
                if everything or (inner._use_count() <= 1 and use_count(storage._cdata) <= 2)
            ]
            dropped = [self._held.pop(key) for key in done]
        del dropped  # outside the lock: a free runs the storage's finalizer

    def _adopt(self, storage: Any, like: _Storage | None) -> None:
        """A storage made outside the dispatcher as a copy of one whose kind is `like` (deepcopy, clone)."""
        if like is None or self._lookup(storage) is not None:
            return
        stream = self._current()
        info = self._register(storage, like.kind, stream.actor if like.kind == DEVICE else HOST)
        if info.kind == DEVICE:
            self._allocated(info, stream)

    def _allocated(self, info: _Storage, stream: SimStream) -> None:
        """A device block registered outside an op (already accounted): its allocation-stream record."""
        if self.sanitize and info.nbytes:
            host = self._host()
            self._clocks.merge_actor(stream.actor, host)
            epoch = self._clocks.tick(stream.actor)
            acc = Access(0, info.nbytes, True, stream.actor, epoch, "(allocation)", self._label(), (info.nbytes,))
            info.log.add(acc, self._clocks)

    def _loaded(self, storage: Any) -> None:
        """A storage torch.load restored from a checkpoint saved from device memory: device memory again."""
        if self._lookup(storage) is None:
            stream = self._current()
            self._allocated(self._register(storage, DEVICE, stream.actor), stream)

    def _saved(self, storage: Any) -> bool:
        """torch.save reads a whole storage on the host; whether it is device memory (saved as such)."""
        info = self._lookup(storage)
        if info is None and not self._host_starts:
            return False
        with torch.utils._python_dispatch._disable_current_modes():
            t = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)
        self._host_read(t, "torch.save")  # of a storage aliasing pinned memory too (Note [aliases of host memory])
        return info is not None and info.kind == DEVICE

    def _to_param_device(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """torch's Optimizer.load_state_dict casts states to param.device: a host state of a device param is
        copied to device memory, as on CUDA (both are typed cpu here, so `.to` alone would not copy)."""
        if self.is_host(value) and not self.is_host(param) and value.layout is torch.strided:
            return self._device_copy(value)
        return value

    def _device_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A device tensor with t's layout and data (a dispatched copy: checked and timed like any other)."""
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.torch_device())
        out.copy_(t)
        return out

    # ----- storages and memory -----------------------------------------------------------------
    def _lookup(self, storage: Any) -> _Storage | None:
        return self._storages.get(storage._cdata)

    def _register(
        self, storage: Any, kind: str, actor: int = HOST, uid: int | None = None, index: int | None = None
    ) -> _Storage:
        """Track a storage from now on; ``uid``: a storage alloc_storage gives memory again, which keeps its
        first id and finalizer; ``index``: the device of device memory (the current one by default)."""
        key = storage._cdata
        if uid is None:
            self._uid += 1
        info = _Storage(uid or self._uid, kind, storage.nbytes(), actor)
        self._storages[key] = info
        if kind == DEVICE:
            info.index = self.current_device() if index is None else index
            block = self._memory(info.index).allocate(info.nbytes)
            if block is None:
                del self._storages[key]
                raise self._oom(info.nbytes, info.index)
            info.block = block
            if self._hazards and self.sanitize:
                self._check_reuse(actor, info)
        if uid is not None:
            return info
        finalizer = weakref.finalize(storage, self._on_free, key, info.uid)
        finalizer.atexit = False
        if kind == HOST_MEM:
            self._live_host += self._host_cost(info)
            self._peak_host = max(self._peak_host, self._live_host)
            self._index_host(storage, key)
        return info

    def _forget(self, storage: Any) -> None:
        info = self._storages.pop(storage._cdata, None)
        if info is not None and info.kind == DEVICE:
            self._mem_of(info.index).free(info.block)

    def _on_free(self, key: int, uid: int) -> None:
        # Finalizers run on whatever thread drops the last reference, gloo's worker threads included,
        # possibly while another thread holds the lock and waits for that very worker: never block here.
        if self._lock.acquire(blocking=False):
            try:
                self._free(key, uid)
                self._drain_frees()
            finally:
                self._lock.release()
        else:
            self._late_frees.append((key, uid))

    def _drain_frees(self) -> None:
        """Frees that arrived while another thread held the lock (call with the lock held)."""
        while self._late_frees:
            self._free(*self._late_frees.pop(0))

    def _free(self, key: int, uid: int, dead: bool = True) -> None:
        """The block of storage ``key`` (id ``uid``) is freed: the storage died (its finalizer) or, ``dead``
        False, free_storage gave its memory back."""
        if dead and self._first_uid.get(key) == uid:
            del self._first_uid[key]
        info = self._storages.get(key)
        if info is None or info.uid != uid:
            return
        del self._storages[key]
        if info.kind == HOST_MEM:
            self._live_host -= self._host_release(info)
            self._unindex_host(key)
        if info.kind != DEVICE:
            return
        # The caching allocator reuses a block freed after record_stream only once the recorded streams'
        # queued work is done; until then it still counts as allocated. (Exact accounting: live storages.)
        ready = 0.0
        mem = self._mem_of(info.index)
        if mem.caching:
            ready = max((s.tail_us for a in info.recorded if (s := self._streams.get(a)) is not None), default=0.0)
        if ready > self._timeline.host_us:
            mem.free_after(info.block, ready)
        else:
            mem.free(info.block)
        if self.sanitize:
            self._check_free(info)

    def _check_free(self, info: _Storage) -> None:
        """A device block returns to its allocation stream's pool (Note [free and reuse]): other streams'
        uses not yet ordered before that stream, nor covered by record_stream, become a hazard of it."""
        alloc_clock = self._clocks.clock(info.alloc_actor)
        host_clock = self._clocks.clock(self._host())
        for rec in info.log.records:
            if rec.actor in self._host_actors or rec.actor == info.alloc_actor or rec.actor in info.recorded:
                continue
            if alloc_clock.get(rec.actor, 0) >= rec.epoch or host_clock.get(rec.actor, 0) >= rec.epoch:
                continue
            if rec.freed is not None:  # an earlier block's use, inherited: that block's own hazard still stands
                continue
            hazard = (rec, info.uid, info.nbytes, pool_of(info.nbytes))
            self._hazards.setdefault(info.alloc_actor, []).append(hazard)
            return

    def _check_reuse(self, actor: int, info: _Storage) -> None:
        """Stream `actor` allocates `info`: the caching allocator may hand it a block of the same pool freed
        with a hazard (Note [free and reuse]). Each hazard not yet ordered before this stream (nor seen done by
        the host) goes into the new block's log as the old use, so the first access to the new memory that
        nothing orders after that use is the race; hazards ordered by now are dropped."""
        hazards = self._hazards.get(actor)
        if not hazards or not info.nbytes:
            return
        clock = self._clocks.clock(actor)
        host_clock = self._clocks.clock(self._host())
        pool = pool_of(info.nbytes)
        pending = []
        for hazard in hazards:
            rec, uid, nbytes, freed_pool = hazard
            if clock.get(rec.actor, 0) >= rec.epoch or host_clock.get(rec.actor, 0) >= rec.epoch:
                continue
            pending.append(hazard)
            if freed_pool == pool:
                info.log.records.append(reused_use(rec, uid, nbytes, info.nbytes))
        if pending:
            self._hazards[actor] = pending
        else:
            del self._hazards[actor]

    def _oom(self, need: int, index: int | None = None) -> OutOfMemoryError:
        index = self.current_device() if index is None else index
        mem = self._mem_of(index)
        free = max(self.capacity_bytes - mem.reserved, 0)
        return OutOfMemoryError(
            f"Simulated {self.preset.name} out of memory. Tried to allocate {_fmt_bytes(need)}. Device {index} has a "
            f"total capacity of {_fmt_bytes(self.capacity_bytes)} of which {_fmt_bytes(free)} is free. "
            f"{_fmt_bytes(mem.allocated)} is allocated by live tensors and {_fmt_bytes(mem.reserved - mem.allocated)} "
            f"is reserved but unallocated."
        )

    def _keep(self, err: BaseException) -> None:
        """An error inside backward, raised when backward() returns (Note [backward on the caller's thread]);
        the first one wins, as the first is what a pass on hardware would have stopped at."""
        if self._pending is None:
            self._pending = err

    def _deferred(self, err: BaseException, func: Any, args: tuple, kwargs: dict) -> Any:
        """An error of the op `func` inside backward (Note [backward on the caller's thread]): kept to be
        raised when backward() returns, and the op run plainly so that the pass can finish."""
        self._keep(err)
        found: list[SimTensor] = []
        hosts: list[torch.Tensor] = []
        args = tuple([_unwrap(a, found, hosts) for a in args])
        kwargs = {k: _unwrap(v, found, hosts) for k, v in kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = _CPU
        with torch.utils._python_dispatch._disable_current_modes():
            out = func(*args, **kwargs)
        place = found[0].device.index if found else HOST_OUT
        return self._wrap(out, found, hosts, place, func.overloadpacket)

    def _raise_pending(self) -> None:
        if self._pending is not None:
            err, self._pending = self._pending, None
            raise err

    # ----- the dispatch mode -------------------------------------------------------------------
    def _start(self) -> None:
        if not _AT_EXIT:  # Note [collective tensors at exit]
            atexit.register(_settle_collectives)
            _AT_EXIT.append(True)
        _ACTIVE.append(self)
        entry_points.install()
        entry_points.present_cuda(self if entry_points.routes_cuda(self) else None)
        self._mode.__enter__()
        self._grad_mode.__enter__()
        self._multithreading = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)  # Note [backward on the caller's thread]
        logger.debug("simulated device {} active", self.preset.name)

    def _stop(self) -> None:
        self._release_collectives(everything=True)  # the process goes on: a late worker may take the GIL
        torch._C._set_multithreading_enabled(self._multithreading)
        self._grad_mode.__exit__(None, None, None)
        self._mode.__exit__(None, None, None)
        _ACTIVE.remove(self)
        inner = active()
        entry_points.present_cuda(inner if entry_points.routes_cuda(inner) else None)
        if not _ACTIVE:
            entry_points.uninstall()

    @contextmanager
    def untagged(self) -> Iterator[None]:
        """Leave autograd nodes made in the block untagged with their stream (see _StreamTagMode): for
        code that records no backward graph, so that the tagging mode's per-call host cost, which a device
        does not have, stays out of host-time measurements. Backward ops of nodes made inside would run on
        the default stream. Code that opens profiler ranges only for a profiler or this timeline
        (device.labels_ranges) opens none in the block either: its ops go unlabelled."""
        self._grad_mode.__exit__(None, None, None)
        labels, self.range_labels = self.range_labels, False
        try:
            yield
        finally:
            self.range_labels = labels
            self._grad_mode.__enter__()

    def _label(self) -> str | None:
        return self._labels[-1] if self._labels else None

    def _profiler_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        name = str(func)
        if "enter" in name and args and isinstance(args[0], str):
            self._labels.append(args[0])
        elif "exit" in name and self._labels:
            # record_function ranges nest like context managers (the exit handle is a fresh
            # ScriptObject each time, so match by position, not identity).
            self._labels.pop()
        return out

    def _dispatch(self, func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
        if self._late_frees:
            self._drain_frees()
        if self._held:
            self._release_collectives()
        if func.namespace == "profiler":
            return self._profiler_op(func, args, kwargs)
        for t in types:
            if t is SimTensor:
                continue
            if issubclass(t, FakeTensor):
                return func(*args, **kwargs)
            if t.__torch_dispatch__ is not _PLAIN_DISPATCH:
                return NotImplemented  # let the subclass (DTensor) run; its local ops come back here
        if self.typed:
            return self._typed_dispatch(func, args, kwargs)
        packet = func.overloadpacket
        if packet is torch.ops.aten.is_pinned:
            return self._is_pinned(args[0])
        if packet is torch.ops.aten._pin_memory or kwargs.get("pin_memory"):
            return self._pinned_alloc(func, args, kwargs)
        return self._run(func, args, kwargs)

    # ----- typed device tensors (Note [simulated device type]) ---------------------------------
    def _route(self, device: Any) -> int:
        """The placement a `device=` argument names: a device index, or HOST_OUT for the host. The cuda
        flavour takes "cuda" for its own device type, as code written for CUDA names it, and so does the npu
        flavour after torch_npu.contrib.transfer_to_npu is imported, as torch_npu's does."""
        d = device if isinstance(device, torch.device) else torch.device(device)
        if d.type == "cpu":
            return HOST_OUT
        if d.type == self.backend or (d.type == "cuda" and (self.flavour == "cuda" or npu_ops.cuda_to_npu())):
            index = self._index(d)
            return self.current_device() if index is None else index
        raise RuntimeError(
            f"device {d} is not available here: the simulated {self.flavour} device is {self.backend!r} "
            f"(and the host is cpu)"
        )

    def _typed_dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        fused = is_fused_optimizer(func)
        if fused and not (self.flavour == "npu" and kernels.npu_kind(func) == kernels.CPU_FALLBACK):
            # CUDA's rule for these kernels (device.sim.tensor._FUSED_OPTIMIZERS). torch_npu's CPU fallback copies
            # every argument to the host first, so there host tensors of any shape are fine.
            check_fused_optimizer(func, args, kwargs)
        found: list[SimTensor] = []
        hosts: list[torch.Tensor] = []
        args = tuple([_unwrap(a, found, hosts) for a in args])
        if kwargs:
            kwargs = {k: _unwrap(v, found, hosts) for k, v in kwargs.items()}
        packet = func.overloadpacket
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta":
            return func(*args, **kwargs)  # meta tensors hold no memory and run no kernel, as on CUDA
        if device is not None:
            place = self._route(device)
            kwargs["device"] = _CPU
        elif found:
            place = found[0].device.index
        else:
            place = HOST_OUT
        if found and not (fused or packet in _MIX_FREE or op_info(func).copy):
            _check_same_device(func, found, hosts)
        if packet is torch.ops.aten.is_pinned:
            if found:
                return False
            return self._is_pinned(args[0])
        if packet is torch.ops.aten._pin_memory or kwargs.get("pin_memory"):
            # Only host memory can be pinned: pinning a device tensor, or a pinned result on the device, is
            # refused as CUDA refuses it; a pinned host result shaped like a device tensor
            # (`empty_like(t, device="cpu", pin_memory=True)`) is fine, as on CUDA.
            if place >= 0 or (packet is torch.ops.aten._pin_memory and found):
                kind = found[0].device.type if found else self.backend
                raise RuntimeError(f"cannot pin '{kind}' memory: only dense CPU tensors can be pinned")
            if found and op_info(func).copy:
                # A copy of device data into a new pinned host tensor (`_to_copy(t, device="cpu",
                # pin_memory=True)`): a device-to-host copy on the stream, its output pinned.
                kwargs["pin_memory"] = False
                return self._wrap(self._run(func, args, kwargs, PINNED_OUT), found, hosts, HOST_OUT, packet)
            return self._pinned_alloc(func, args, kwargs)
        if place == HOST_OUT and packet is torch.ops.aten._to_copy and found and kwargs.get("non_blocking"):
            place = PINNED_OUT
        fallback = False
        if self.flavour == "npu" and found:  # fused optimizer kernels as op-plugin has them (device.sim.kernels)
            kind = kernels.npu_kind(func)
            if kind == kernels.NATIVE:
                kernels.check_npu_args(func, kwargs)
            if kind == kernels.IGNORES_SCALING:
                kwargs = kernels.without_scaling(kwargs)
            fallback = kind == kernels.CPU_FALLBACK
            if fallback:
                name = func.overloadpacket.__name__
                self.cpu_fallbacks[name] = self.cpu_fallbacks.get(name, 0) + 1
                self._host_sync_stream()  # the fallback's copies to the host wait for the stream's queued work
        out = self._run(func, args, kwargs, place)
        if fallback:
            self._host_sync_stream()  # ... and its copies back are synchronous too
        if place < 0 and not found:
            return out
        wrapped = self._wrap(out, found, hosts, place, packet)
        if found and any(role == "o" for _, _, role in op_info(func).roles):
            # An out= argument the kernel resized (an empty `out`, as torch allows): its wrapper takes the
            # sizes its CPU tensor now has, as a device tensor's own sizes would change.
            for w in found:
                _sync_metadata(w)
        return wrapped

    def _host_sync_stream(self) -> None:
        """The host waits for the current stream's queued work (a synchronous copy on it)."""
        stream = self._current()
        self._host_wait(self._clocks.snapshot(stream.actor), stream.tail_us)

    def _wrap(self, out: Any, found: list[SimTensor], hosts: list[torch.Tensor], place: int, packet: Any) -> Any:
        return wrap_outputs(out, found, hosts, torch.device(self.backend, place) if place >= 0 else None, packet)

    def _pinned_alloc(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """pin_memory=True factories and Tensor.pin_memory() give host memory, like pinned_empty."""
        if func.overloadpacket is torch.ops.aten._pin_memory:
            # Pinning what the simulator counts as device memory (a factory tensor made while active, which
            # CUDA code would have made on the host) gives a pinned host copy, as pinning a CPU tensor does.
            # Such a tensor was written synchronously in that code, so the copy follows the current stream.
            if not self.is_host(args[0]):
                stream = self._current()
                self._host_wait(self._clocks.snapshot(stream.actor), stream.tail_us)
            func, args, kwargs = torch.ops.aten.clone.default, args[:1], {}
        else:
            kwargs = {**kwargs, "pin_memory": False}  # a CPU-only torch cannot pin
        self._host_alloc += 1
        try:
            return self._run(func, args, kwargs)
        finally:
            self._host_alloc -= 1

    def _run(self, func: Any, args: tuple, kwargs: dict, place: int | None = None) -> Any:
        """Run one op on unwrapped tensors. ``place``: where new outputs go (typed: a device index, HOST_OUT or
        PINNED_OUT); None: the untyped rule (device memory unless made from host memory alone)."""
        op = op_info(func)
        tensor_args: list[_Arg] = []
        has_input = has_device = False
        for position, name, role in op.roles:
            value = args[position] if position < len(args) else kwargs.get(name)
            for t in tensors(value):
                if t.device.type != "cpu" or t.layout is not torch.strided:
                    continue
                storage = t.untyped_storage()
                info = self._lookup(storage)
                if info is None and self._host_starts and role != "v":
                    t, storage, info = self._alias(t, storage)  # Note [aliases of host memory]
                if info is None and role != "v" and t.numel() and storage._cdata in self._first_uid:
                    raise RuntimeError(
                        f"{func} used a device tensor of shape {tuple(t.shape)} whose memory free_storage gave "
                        "back (a GPU would fault, or read memory now someone else's)"
                    )
                has_input = True
                has_device = has_device or (info is not None and info.kind == DEVICE)
                tensor_args.append(_Arg(t, storage, info, role))
        accesses = [a for a in tensor_args if a.role != "v"]
        if op.resize and has_device:
            self._check_resize(func, args, kwargs, tensor_args)
        if not accesses and not op.new_outputs:
            out = func(*args, **kwargs)  # views and metadata
            if has_device:
                self._refresh_sizes(tensor_args)
            return out
        if place is None:
            creates_device = op.new_outputs and not op.lift_copy and (
                has_device or not has_input or kwargs.get("device") is not None
            )
        else:
            creates_device = op.new_outputs and place >= 0
        if self._host_alloc or not (has_device or creates_device):
            return self._host_op(func, op, args, kwargs, accesses)
        kernel = kernels.device_kernel(func) if has_device else None
        return self._stream_op(func, op, args, kwargs, tensor_args, accesses, has_device, has_input, place, kernel)

    def _host_op(self, func: Any, op: OpInfo, args: tuple, kwargs: dict, accesses: list[_Arg]) -> Any:
        tracked = [a for a in accesses if a.info is not None]
        if self.sanitize and tracked:
            host = self._host()
            epoch = self._clocks.tick(host)
            self._check_and_log(op.name, [(a, host, epoch) for a in tracked])
        out = func(*args, **kwargs)
        if self._host_alloc:
            for t in new_outputs(func, out):
                storage = t.untyped_storage()
                if self._lookup(storage) is None:
                    self._register(storage, HOST_MEM)
        elif not op.alloc_only:
            self._timeline.host_op(sum(a.tensor.nbytes for a in accesses), op.name, self._label())
        return out

    def _stream_op(
        self,
        func: Any,
        op: OpInfo,
        args: tuple,
        kwargs: dict,
        tensor_args: list[_Arg],
        accesses: list[_Arg],
        has_device: bool,
        has_input: bool,
        place: int | None = None,
        kernel: Any = None,
    ) -> Any:
        """Run a device op on its stream. kernel: what computes it where torch's CPU kernel cannot
        (device.sim.kernels.device_kernel); None: the op itself."""
        stream = self._op_stream()
        if place is None and has_device and not (op.copy or op.mixed_ok) and any(a.writes for a in accesses):
            check_same_device(op, accesses)
        index = place if place is not None and place >= 0 else None
        if not has_input:  # a factory: refuse before allocating
            need = factory_bytes(func, args, kwargs)
            if not self._memory(index).fits(need):
                raise self._oom(need, index)
        new_on_device = place is None or place >= 0
        lane, blocking, staged_src = op_lane(func, op, args, kwargs, accesses, new_on_device)
        if self.flavour == "npu" and op.copy and lane in ("h2d", "d2h") and not blocking and not all(
            a.tensor.is_contiguous() for a in accesses
        ):
            # torch_npu copies a non-contiguous host<->device pair through contiguous temporaries and waits for
            # the copy stream: the host blocks, however non_blocking was asked.
            blocking = True
            self.strided_copies += 1

        host = self._host()
        self._clocks.merge_actor(stream.actor, host)  # a launch follows everything the host did before it
        epoch = self._clocks.tick(stream.actor)
        if self.sanitize and accesses:
            # Copies access host memory from the stream; other kernels only take host scalars, read at launch.
            host_epoch = 0
            plan = []
            for a in accesses:
                if a.host_side and (not op.copy or (staged_src and not a.writes)):
                    host_epoch = host_epoch or self._clocks.tick(host)
                    plan.append((a, host, host_epoch))
                else:
                    plan.append((a, stream.actor, epoch))
            self._check_and_log(op.name, plan)

        out = (kernel or func)(*args, **kwargs)

        new = new_outputs(func, out)
        created = []
        pinned = []
        try:
            for t in new:
                storage = t.untyped_storage()
                if self._lookup(storage) is not None:
                    continue
                if new_on_device:
                    created.append((t, storage, self._register(storage, DEVICE, stream.actor, index=index)))
                elif place == PINNED_OUT:  # .to("cpu", non_blocking=True) copies into pinned memory, as torch does
                    pinned.append((t, self._register(storage, HOST_MEM)))
        except OutOfMemoryError:  # the op's outputs are dropped, as if the allocation had failed
            for _, storage, _ in created:
                self._forget(storage)
            raise
        self._refresh_sizes(tensor_args)
        if self.sanitize:
            # A fresh block is safe to use on its allocation stream only: the caching allocator may hand out
            # memory whose last user on that stream is still queued, so other streams must wait for it first.
            name = f"{op.name} (allocation)" if op.alloc_only else op.name
            for t, _, info in created:
                self._log_new(t, info, stream, epoch, name)
            # The stream writes a pinned output until the copy is done: the host may read it only after.
            for t, info in pinned:
                self._log_new(t, info, stream, epoch, name)
        if op.alloc_only:
            return out

        if lane == "compute":
            nbytes = sum(a.traffic for a in accesses) + sum(t.nbytes for t in new)
        elif op.local_scalar:
            nbytes = sum(a.tensor.element_size() for a in accesses)
        else:
            nbytes = sum(a.tensor.nbytes for a in accesses if a.writes) + sum(t.nbytes for t in new)
        flops = op_flops(func, args, kwargs) if lane == "compute" else None
        # The tensors it takes set the host's cost of issuing it (Note [host clock] in device/sim/timeline.py).
        timed = self._timeline.launch(stream.name, stream.tail_us, lane, nbytes, op.name, self._label(), flops,
                                      tensors=len(tensor_args))
        stream.tail_us = timed.end_us
        if blocking:
            self._clocks.merge_actor(host, stream.actor)
            self._timeline.wait_host(timed.end_us)
        return out

    def _refresh_sizes(self, tensor_args: list[_Arg]) -> None:
        """Pick up storages resized by an op (resize_) or behind the dispatcher (storage.resize_)."""
        for a in tensor_args:
            info = a.info
            if info is not None and info.kind == DEVICE:
                nbytes = a.storage.nbytes()
                if nbytes != info.nbytes:
                    # A resize takes a new block, copies and frees the old one: the peak holds both.
                    mem = self._mem_of(info.index)
                    block = mem.allocate(nbytes)
                    mem.free(info.block)
                    if block is None:  # resized behind the dispatcher: past capacity, report it now
                        info.block, info.nbytes = Block(0), 0
                        raise self._oom(nbytes, info.index)
                    grew, info.block, info.nbytes = nbytes > info.nbytes, block, nbytes
                    if grew and self.sanitize:  # a fresh block: safe on the stream that resized it only
                        self._allocated(info, self._current())

    def _check_resize(self, func: Any, args: tuple, kwargs: dict, tensor_args: list[_Arg]) -> None:
        """resize_ of a device tensor beyond what fits raises before resizing, like the allocator."""
        size = arg_value(func, args, kwargs, "size")
        if not tensor_args or not isinstance(size, (list, tuple)):
            return
        a = tensor_args[0]
        if a.info is None or a.info.kind != DEVICE:
            return
        need = (a.tensor.storage_offset() + math.prod(size)) * a.tensor.element_size()
        if need > a.info.nbytes and not self._memory().fits(need):
            raise self._oom(need)

    def _check_and_log(self, name: str, plan: list[tuple[_Arg, int, int]]) -> None:
        """Check every access of one op against the logs before any is recorded, then record them all."""
        label = self._label()
        stack = traceback.format_stack()[:-3] if self.stacks else None
        staged = []
        for a, actor, epoch in plan:
            rng = byte_range(a.tensor)
            if rng is None:
                continue
            if a.info is None:
                a.info = self._register(a.storage, PAGEABLE)
                if self._collectives:  # host memory C++ made: a collective's work may hold it
                    self._hold(a.tensor)  # Note [collective tensors at exit]
            info = a.info
            acc = Access(
                rng[0], rng[1], a.writes, actor, epoch, name, label, a.tensor.shape, strided_layout(a.tensor), stack
            )
            staged.append((info, acc))
        for info, acc in staged:
            rec = info.log.conflict(acc, self._clocks)
            if rec is not None:
                raise race_error(acc, rec, info.uid, info.nbytes, self._actor_names)
        for info, acc in staged:
            info.log.add(acc, self._clocks)

    def _log_new(self, t: torch.Tensor, info: _Storage, stream: SimStream, epoch: int, name: str) -> None:
        rng = byte_range(t)
        if rng is not None:
            stack = traceback.format_stack()[:-3] if self.stacks else None
            acc = Access(rng[0], rng[1], True, stream.actor, epoch, name, self._label(), t.shape, None, stack)
            if info.log.records and not name.endswith("(allocation)"):
                # The op writes a block the allocator may have reused (Note [free and reuse]).
                rec = info.log.conflict(acc, self._clocks)
                if rec is not None:
                    raise race_error(acc, rec, info.uid, info.nbytes, self._actor_names)
            info.log.add(acc, self._clocks)



# Note [collective tensors at exit]
# A gloo worker thread drops its references to a collective's tensors only after the caller's wait() has
# returned. If the program has dropped them by then, the worker's is the last reference, and releasing a
# tensor whose Python object C++ now owns (torch keeps it, and the simulator's finalizers on its storages)
# takes the GIL on that worker. A thread that takes the GIL after the interpreter began finalizing is
# stopped with pthread_exit, whose forced unwind crosses a noexcept frame (TensorImpl::decref_pyobject):
# std::terminate, "terminate called without an active exception", after a correct program's last line.
# So the simulator holds every tensor a collective took or returned (c10d ops through its dispatch mode)
# until the use counts of the tensor and of its storage say no C++ holder is left (a work may hold a view
# of it): the worker's release is then never the last reference (it takes no GIL), and the last one is
# dropped on a thread that runs Python (the next op's dispatch, or a memory query). Host memory the
# simulator first sees while collectives run (temporaries gloo made and ops in its wait() touch, which the
# simulator then registers) is held the same way. Tensors a C++ object still holds at exit (a view's base,
# an autograd node) stay held until the interpreter itself frees them on the main thread; leaving an
# activate() block lets go of all of them. Last, at exit (an atexit hook, which runs before the interpreter
# begins finalizing), a process that ran collectives gives up the GIL for a moment (_settle_collectives), so
# that a worker still letting go of something the simulator does not hold does it then.

# Note [aliases of host memory]
# A tensor can reach a pinned storage's memory through a storage of its own: numpy() and torch.from_numpy,
# torch.frombuffer, DLPack, UntypedStorage over the same address. CUDA judges memory, not storage objects:
# a D2H copy into pinned memory races any host read of those bytes, whatever tensor makes it. So live pinned
# storages are indexed by address (_index_host), and a tensor of an untracked storage whose bytes lie inside
# one (_alias) is checked as the view of that storage it is: dispatched ops (_run), tolist / numpy / DLPack
# (_host_read) and torch.save (_saved). Reads through a numpy array itself (numpy code, not torch) are not
# seen: numpy() is checked as a read of the whole tensor when it is called.

# Note [free and reuse]
# A block freed on the host returns to the pool of the stream that allocated it, and the caching allocator
# hands it out again only to a later allocation on that stream, from the same pool (small: blocks of at most
# 1 MiB; large), and nothing else touches it: freeing issues no device work. So a use by another stream that
# is still unordered at the free is harmless unless the block is handed out again and the new owner uses it
# before it is ordered after the old use (an event or stream wait, record_stream, or a synchronize, which
# clears every hazard). Where in the new block the old bytes land is the allocator's choice, so every
# allocation of that pool on that stream until then may hold them: each gets the old use in its log (covering
# it whole), and its first access that nothing orders after the old use raises a "free" StreamRaceError,
# naming both. A block freed so and never handed out again, or handed out and used only after a wait, is
# safe, as on CUDA, and nothing is reported, at a synchronize or at exit either. This is how FSDP2 frees its
# reduce-scatter outputs safely: the reduce-scatter stream waits for the compute stream before it allocates
# again.


def _collect_tensors(value: Any, found: list[torch.Tensor]) -> None:
    """Tensors in ``value`` (nested lists, tuples and dicts; c10d ops take Tensor[][])."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_tensors(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_tensors(v, found)


def typed_default() -> bool:
    """Whether simulators are typed unless told (SWAPOPT_SIM_TYPED, Note [simulated device type])."""
    return os.environ.get("SWAPOPT_SIM_TYPED", "1").strip() not in ("", "0")


def device_count() -> int:
    """Simulated devices per process: SWAPOPT_SIM_DEVICES, default 8."""
    value = os.environ.get("SWAPOPT_SIM_DEVICES", "8").strip() or "8"
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"SWAPOPT_SIM_DEVICES={value!r}: give a device count of at least 1")
    return count


def process_flavour() -> str | None:
    """The flavour SWAPOPT_SIM_PRESET gives the process (None when unset): every simulator of a process
    presents one flavour (Note [simulated device type]), whatever preset times it."""
    if not os.environ.get("SWAPOPT_SIM_PRESET", "").strip():
        return None
    return get_preset(preset_from_env()).flavour


def preset_from_env() -> str:
    """SWAPOPT_SIM_PRESET: the preset of the process-wide simulator (h100 by default, 910b for the npu flavour)."""
    name = os.environ.get("SWAPOPT_SIM_PRESET", "h100").strip() or "h100"
    get_preset(name)  # a clear error naming the presets
    return name


@contextmanager
def activate(
    preset: str | os.PathLike[str] | SimPreset = "h100",
    capacity_bytes: int | None = None,
    sanitize: bool = True,
    allocator: str = "exact",
    typed: bool | None = None,
    flavour: str | None = None,
) -> Iterator[SimDevice]:
    """Run the block on a fresh simulated device.

    preset: a SimPreset, a preset name (h100, 910b) or the path of a preset file (device/sim/preset_file.py;
    `python -m swapopt.verify` writes one calibrated on a device).
    allocator: "exact" counts live storages byte for byte; "caching" models PyTorch's CUDA caching
    allocator (512-byte blocks, reserved segments, empty_cache, OOM judged on reserved memory).
    typed: device tensors are SimTensors on a device type of their own (default: SWAPOPT_SIM_TYPED).
    flavour: "cuda" or "npu" (default: the one this process registered, else the preset's)."""
    from device.sim.preset_file import resolve_preset  # imported here: preset_file needs only presets

    sim = SimDevice(resolve_preset(preset), capacity_bytes, sanitize, allocator, typed, flavour)
    sim._start()
    try:
        yield sim
    finally:
        sim._stop()
    sim._raise_pending()  # an error kept inside a backward pass and not raised since


def process_device() -> SimDevice:
    """The process-wide simulator used when SWAPOPT_DEVICE=sim: activated on first use, never exited."""
    if not _PROCESS:
        sim = SimDevice(preset_from_env())
        sim._start()
        _PROCESS.append(sim)
    return _PROCESS[0]
