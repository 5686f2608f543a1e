"""A simulated accelerator on CPU that fails where a real one would.

All tensors are real CPU tensors and every op runs eagerly, so data are always right. While a
simulator is active, a TorchDispatchMode sees every aten op and
- classifies storages: *host* (pinned_empty, pin_memory=True, Tensor.pin_memory()), *pageable*
  (created before activation, `torch.tensor(...)` literals, outputs of ops that read only host-side
  tensors and name no device) and *device* (everything else created while active);
- runs each op touching device memory on the current stream, every other op on the host, and checks
  its reads and writes (from the op schema, per byte range) against earlier accesses that no event
  wait, stream wait or synchronize orders before it (`StreamRaceError`);
- accounts live device bytes against a capacity (`torch.OutOfMemoryError`);
- places each op on a deterministic timeline (device/timeline.py).
Inactive, it costs nothing: no mode is pushed.

The accelerator and the host are both "cpu" here, so `.to(device.torch_device())`, `.cpu()` and
`.to("cpu")` without a dtype change return the tensor itself: move data with explicit buffers and
`copy_`. `Tensor.tolist()` and `.numpy()` read data without an aten op and are not checked.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from loguru import logger
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from device.costs import op_flops
from device.ops import OpInfo, arg_value, byte_range, factory_bytes, new_outputs, op_info, tensors
from device.presets import PRESETS, SimPreset, get_preset
from device.sanitizer import HOST, Access, AccessLog, Clock, Clocks, StreamRaceError, race_message, where
from device.timeline import Timeline, TimelineOp

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

DEVICE, HOST_MEM, PAGEABLE = "device", "host", "pageable"

# Tensor types whose __torch_dispatch__ is this one have no subclass behavior (plain tensors, Parameter).
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # DTensor
    return local if isinstance(local, torch.Tensor) else t


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


@dataclass(eq=False)
class _Storage:
    uid: int
    kind: str
    nbytes: int
    alloc_actor: int  # the stream whose pool the block returns to when freed
    log: AccessLog = field(default_factory=AccessLog)
    recorded: set[int] = field(default_factory=set)  # streams named by record_stream


@dataclass(slots=True)
class _Arg:
    tensor: torch.Tensor
    storage: Any
    info: _Storage | None
    role: str

    @property
    def host_side(self) -> bool:
        return self.info is None or self.info.kind != DEVICE

    @property
    def pageable(self) -> bool:
        return self.info is None or self.info.kind == PAGEABLE

    @property
    def writes(self) -> bool:
        return self.role in ("w", "o")

    @property
    def traffic(self) -> int:
        """Bytes a kernel moves for this argument: in-place arguments are read and written."""
        return self.tensor.nbytes * (2 if self.role == "w" else 1)


class SimStream:
    """A stream of the simulated device. Created through `SimDevice.Stream(...)`."""

    _sim: SimDevice

    def __init__(self, device: Any = None, priority: int = 0, *, name: str | None = None) -> None:
        sim = self._sim
        self.actor = sim._clocks.new_actor()
        self.name = sim._name_actor(self.actor, name)
        # A dropped stream launches nothing more: its clock no longer keeps old accesses alive.
        weakref.finalize(self, sim._clocks.retire, self.actor).atexit = False
        self.priority = priority
        self.device = torch.device("cpu")
        self.tail_us = 0.0  # modeled time at which its last launched op (or waited event) completes
        self._prev: list[SimStream] = []

    def wait_event(self, event: SimEvent) -> None:
        self._sim._stream_wait(self, event)

    def wait_stream(self, stream: SimStream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else self._sim.Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._sim._host_wait(self._sim._clocks.snapshot(self.actor), self.tail_us)

    def query(self) -> bool:
        return self._sim._query(self._sim._clocks.snapshot(self.actor), self.tail_us)

    def __enter__(self) -> SimStream:
        self._prev.append(self._sim.current_stream())
        self._sim.set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._sim.set_stream(self._prev.pop())

    def __repr__(self) -> str:
        return f"<sim Stream {self.name}>"


class SimEvent:
    """An event of the simulated device. Created through `SimDevice.Event(...)`."""

    _sim: SimDevice

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.clock: Clock | None = None  # the recording stream's clock at record time
        self.time_us: float | None = None  # modeled completion time

    def record(self, stream: SimStream | None = None) -> None:
        self._sim._record(self, stream if stream is not None else self._sim.current_stream())

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else self._sim.current_stream()).wait_event(self)

    def query(self) -> bool:
        return self.clock is None or self._sim._query(self.clock, self.time_us)

    def synchronize(self) -> None:
        if self.clock is not None:
            self._sim._host_wait(self.clock, self.time_us)

    def elapsed_time(self, end_event: SimEvent) -> float:
        """Modeled milliseconds between this event and `end_event`, like torch.cuda.Event.elapsed_time."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self.clock is None or end_event.clock is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        if not (self._sim._host_has_seen(self.clock) and self._sim._host_has_seen(end_event.clock)):
            raise RuntimeError("device not ready: synchronize on the end event before elapsed_time")
        return (end_event.time_us - self.time_us) / 1e3

    def __repr__(self) -> str:
        state = "unrecorded" if self.time_us is None else f"at {self.time_us:.3f} us"
        return f"<sim Event {state}>"


class _SimMode(TorchDispatchMode):
    def __init__(self, sim: SimDevice) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if active() is not self.sim:  # an outer simulator while an inner one is active
            return func(*args, **kwargs)
        return self.sim._dispatch(func, types, args, kwargs)


_ACTIVE: list[SimDevice] = []
_PROCESS: list[SimDevice] = []


class SimDevice:
    """The torch.cuda-like module surface of one simulated accelerator."""

    OutOfMemoryError = OutOfMemoryError

    def __init__(
        self, preset: str | SimPreset = "h100", capacity_bytes: int | None = None, sanitize: bool = True
    ) -> None:
        self.preset = get_preset(preset)
        self.capacity_bytes = int(capacity_bytes if capacity_bytes is not None else self.preset.capacity_bytes)
        self.sanitize = sanitize
        # Per-instance classes so that `isinstance(s, dev.Stream)` works and streams know their device.
        self.Stream = type("Stream", (SimStream,), {"_sim": self})
        self.Event = type("Event", (SimEvent,), {"_sim": self})
        self._clocks = Clocks()
        self._timeline = Timeline(self.preset)
        self._storages: dict[int, _Storage] = {}  # StorageImpl address -> info; entries die with the storage
        self._uid = 0
        self._live = 0
        self._peak = 0
        self._live_host = 0
        self._peak_host = 0
        self._actor_names = ["host"]
        self._host_alloc = 0
        self._labels: list[str] = []
        self._pending: StreamRaceError | None = None
        self._mode = _SimMode(self)
        self._default = self.Stream(name="compute")
        self._current = self._default

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
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device: int | str | torch.device) -> None:
        index = device.index if isinstance(device, torch.device) else device
        if index not in (0, None, "cpu", "sim"):
            raise ValueError(f"the simulator has one device (0), got {device!r}")

    def get_device_name(self, device: Any = None) -> str:
        return f"sim:{self.preset.name}"

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(name=self.get_device_name(), total_memory=self.capacity_bytes)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return True

    def current_stream(self, device: Any = None) -> SimStream:
        return self._current

    def default_stream(self, device: Any = None) -> SimStream:
        return self._default

    def set_stream(self, stream: SimStream) -> None:
        self._current = stream

    @contextmanager
    def stream(self, stream: SimStream | None) -> Iterator[SimStream | None]:
        """Make `stream` current inside the block (None: leave the current stream alone)."""
        if stream is None:
            yield None
            return
        previous = self._current
        self._current = stream
        try:
            yield stream
        finally:
            self._current = previous

    def synchronize(self, device: Any = None) -> None:
        for actor in self._clocks.actors():
            self._clocks.merge_actor(HOST, actor)
        self._timeline.wait_host(self._timeline.device_tail_us())

    def memory_allocated(self, device: Any = None) -> int:
        return self._live

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._peak

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._peak = self._live
        self._peak_host = self._live_host

    reset_max_memory_allocated = reset_peak_memory_stats

    # No caching allocator: reserved memory is what live tensors hold.
    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return max(self.capacity_bytes - self._live, 0), self.capacity_bytes

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self._live,
            "allocated_bytes.all.peak": self._peak,
            "reserved_bytes.all.current": self._live,
            "reserved_bytes.all.peak": self._peak,
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
        """Host memory: pinned_empty allocations and pageable (untracked) tensors."""
        info = self._lookup(_local(t).untyped_storage())
        return info is None or info.kind != DEVICE

    def pinned_empty(self, size: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A CPU tensor registered as pinned host memory (not counted as device memory)."""
        self._host_alloc += 1
        try:
            t = torch.empty(size, dtype=dtype)
        finally:
            self._host_alloc -= 1
        storage = t.untyped_storage()
        if self._lookup(storage) is None:  # allocated where the mode does not see it (another thread)
            self._register(storage, HOST_MEM)
        return t

    def host_memory_allocated(self) -> int:
        """Live bytes of pinned host memory (pinned_empty, pin_memory=True, Tensor.pin_memory())."""
        return self._live_host

    def max_host_memory_allocated(self) -> int:
        return self._peak_host

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        """Like Tensor.record_stream: freeing t's storage is safe with respect to work queued on `stream`."""
        info = self._lookup(_local(t).untyped_storage())
        if info is not None:
            info.recorded.add(stream.actor)

    # ----- clocks and time ---------------------------------------------------------------------
    def _name_actor(self, actor: int, name: str | None) -> str:
        """Readable stream names for error messages and traces: "compute", "stream#1", ..."""
        index = len(self._actor_names) - 1  # the host is actor 0
        name = name or (f"stream#{index}" if index else "compute")
        self._actor_names.append(name)
        return name

    def _record(self, event: SimEvent, stream: SimStream) -> None:
        self._clocks.merge_actor(stream.actor, HOST)  # recording is a launch: it follows the host's past
        event.clock = self._clocks.snapshot(stream.actor)
        event.time_us = max(stream.tail_us, self._timeline.host_us)

    def _stream_wait(self, stream: SimStream, event: SimEvent) -> None:
        if event.clock is None:  # waiting on a never-recorded event is a no-op, as in CUDA
            return
        self._clocks.merge_actor(stream.actor, HOST)
        self._clocks.merge(stream.actor, event.clock)
        stream.tail_us = max(stream.tail_us, event.time_us)

    def _host_wait(self, clock: Clock, time_us: float) -> None:
        self._clocks.merge(HOST, clock)
        self._timeline.wait_host(time_us)

    def _host_has_seen(self, clock: Clock) -> bool:
        host = self._clocks.clock(HOST)
        return all(host.get(actor, 0) >= epoch for actor, epoch in clock.items())

    def _query(self, clock: Clock, time_us: float) -> bool:
        if self._timeline.host_us >= time_us:
            self._host_wait(clock, time_us)  # observing completion orders the host after the work
            return True
        # Polling costs host time, so a polling loop reaches the completion time.
        self._timeline.host_us += max(self.preset.launch_us, 1.0)
        return False

    # ----- storages and memory -----------------------------------------------------------------
    def _lookup(self, storage: Any) -> _Storage | None:
        return self._storages.get(storage._cdata)

    def _register(self, storage: Any, kind: str, actor: int = HOST) -> _Storage:
        self._uid += 1
        key = storage._cdata
        info = _Storage(self._uid, kind, storage.nbytes(), actor)
        self._storages[key] = info
        finalizer = weakref.finalize(storage, self._on_free, key, self._uid)
        finalizer.atexit = False
        if kind == DEVICE:
            self._live += info.nbytes
        elif kind == HOST_MEM:
            self._live_host += info.nbytes
            self._peak_host = max(self._peak_host, self._live_host)
        return info

    def _forget(self, storage: Any) -> None:
        info = self._storages.pop(storage._cdata, None)
        if info is not None and info.kind == DEVICE:
            self._live -= info.nbytes

    def _on_free(self, key: int, uid: int) -> None:
        info = self._storages.get(key)
        if info is None or info.uid != uid:
            return
        del self._storages[key]
        if info.kind == HOST_MEM:
            self._live_host -= info.nbytes
        if info.kind != DEVICE:
            return
        self._live -= info.nbytes
        if self.sanitize and self._pending is None:
            self._check_free(info)

    def _check_free(self, info: _Storage) -> None:
        """A device block returns to its allocation stream's pool: other streams' unordered uses must be
        covered by record_stream, or the allocator may hand the memory out while they still run."""
        alloc_clock = self._clocks.clock(info.alloc_actor)
        host_clock = self._clocks.clock(HOST)
        for rec in info.log.records:
            if rec.actor in (HOST, info.alloc_actor) or rec.actor in info.recorded:
                continue
            if alloc_clock.get(rec.actor, 0) >= rec.epoch or host_clock.get(rec.actor, 0) >= rec.epoch:
                continue
            self._pending = StreamRaceError(
                f"a device tensor of shape {tuple(rec.shape)} ({info.nbytes} bytes, storage #{info.uid}) "
                f"allocated on {self._actor_names[info.alloc_actor]} was freed while {rec.op} on {where(rec, self._actor_names)} "
                f"may still use it; call device.record_stream(t, stream) before dropping it or make "
                f"{self._actor_names[info.alloc_actor]} wait for that stream"
            )
            return

    def _oom(self, need: int) -> OutOfMemoryError:
        free = max(self.capacity_bytes - self._live, 0)
        return OutOfMemoryError(
            f"Simulated {self.preset.name} out of memory. Tried to allocate {_fmt_bytes(need)}. Device 0 has a "
            f"total capacity of {_fmt_bytes(self.capacity_bytes)} of which {_fmt_bytes(free)} is free. "
            f"{_fmt_bytes(self._live)} is allocated by live tensors."
        )

    def _raise_pending(self) -> None:
        if self._pending is not None:
            err, self._pending = self._pending, None
            raise err

    # ----- the dispatch mode -------------------------------------------------------------------
    def _start(self) -> None:
        _ACTIVE.append(self)
        self._mode.__enter__()
        logger.debug("simulated device {} active", self.preset.name)

    def _stop(self) -> None:
        self._mode.__exit__(None, None, None)
        _ACTIVE.remove(self)

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
        if self._pending is not None:
            self._raise_pending()
        if func.namespace == "profiler":
            return self._profiler_op(func, args, kwargs)
        for t in types:
            if issubclass(t, FakeTensor):
                return func(*args, **kwargs)
            if t.__torch_dispatch__ is not _PLAIN_DISPATCH:
                return NotImplemented  # let the subclass (DTensor) run; its local ops come back here
        packet = func.overloadpacket
        if packet is torch.ops.aten.is_pinned:
            info = self._lookup(args[0].untyped_storage())
            return info is not None and info.kind == HOST_MEM
        if packet is torch.ops.aten._pin_memory or kwargs.get("pin_memory"):
            return self._pinned_alloc(func, args, kwargs)
        return self._run(func, args, kwargs)

    def _pinned_alloc(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """pin_memory=True factories and Tensor.pin_memory() give host memory, like pinned_empty."""
        if func.overloadpacket is torch.ops.aten._pin_memory:
            if not self.is_host(args[0]):
                raise RuntimeError("cannot pin device memory: only dense host (CPU) tensors can be pinned")
            func, args, kwargs = torch.ops.aten.clone.default, args[:1], {}
        else:
            kwargs = {**kwargs, "pin_memory": False}  # a CPU-only torch cannot pin
        self._host_alloc += 1
        try:
            return self._run(func, args, kwargs)
        finally:
            self._host_alloc -= 1

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
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
                has_input = True
                has_device = has_device or (info is not None and info.kind == DEVICE)
                tensor_args.append(_Arg(t, storage, info, role))
        accesses = [a for a in tensor_args if a.role != "v"]
        if not accesses and not op.new_outputs:
            out = func(*args, **kwargs)  # views and metadata
            if has_device:
                self._refresh_sizes(tensor_args)
            return out
        creates_device = op.new_outputs and not op.lift_copy and (
            has_device or not has_input or kwargs.get("device") is not None
        )
        if self._host_alloc or not (has_device or creates_device):
            return self._host_op(func, op, args, kwargs, accesses)
        return self._stream_op(func, op, args, kwargs, tensor_args, accesses, has_device, has_input)

    def _host_op(self, func: Any, op: OpInfo, args: tuple, kwargs: dict, accesses: list[_Arg]) -> Any:
        tracked = [a for a in accesses if a.info is not None]
        if self.sanitize and tracked:
            epoch = self._clocks.tick(HOST)
            self._check_and_log(op.name, [(a, HOST, epoch) for a in tracked])
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
    ) -> Any:
        stream = self._current
        if has_device and not (op.copy or op.mixed_ok) and any(a.writes for a in accesses):
            self._check_same_device(op, accesses)
        if not has_input:  # a factory: refuse before allocating
            need = factory_bytes(func, args, kwargs)
            if self._live + need > self.capacity_bytes:
                raise self._oom(need)
        lane, blocking, staged_src = self._lane(func, op, args, kwargs, accesses)

        self._clocks.merge_actor(stream.actor, HOST)  # a launch follows everything the host did before it
        epoch = self._clocks.tick(stream.actor)
        if self.sanitize and accesses:
            # Copies access host memory from the stream; other kernels only take host scalars, read at launch.
            host_epoch = 0
            plan = []
            for a in accesses:
                if a.host_side and (not op.copy or (staged_src and not a.writes)):
                    host_epoch = host_epoch or self._clocks.tick(HOST)
                    plan.append((a, HOST, host_epoch))
                else:
                    plan.append((a, stream.actor, epoch))
            self._check_and_log(op.name, plan)

        out = func(*args, **kwargs)

        new = new_outputs(func, out)
        created = []
        for t in new:
            storage = t.untyped_storage()
            if self._lookup(storage) is None:
                created.append((t, storage, self._register(storage, DEVICE, stream.actor)))
        self._refresh_sizes(tensor_args)
        if self._live > self.capacity_bytes:
            for _, storage, _ in created:
                self._forget(storage)
            raise self._oom(sum(info.nbytes for _, _, info in created))
        self._peak = max(self._peak, self._live)
        if self.sanitize:
            # A fresh block is safe to use on its allocation stream only: the caching allocator may hand out
            # memory whose last user on that stream is still queued, so other streams must wait for it first.
            name = f"{op.name} (allocation)" if op.alloc_only else op.name
            for t, _, info in created:
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
        timed = self._timeline.launch(stream.name, stream.tail_us, lane, nbytes, op.name, self._label(), flops)
        stream.tail_us = timed.end_us
        if blocking:
            self._clocks.merge_actor(HOST, stream.actor)
            self._timeline.wait_host(timed.end_us)
        return out

    def _lane(self, func: Any, op: OpInfo, args: tuple, kwargs: dict, accesses: list[_Arg]) -> tuple[str, bool, bool]:
        """(lane, whether the host waits for the op, whether the host stages a pageable source itself)."""
        blocking = op.sync or op.value_return
        if op.local_scalar:
            return "d2h", True, False
        if not op.copy:
            return "compute", blocking, False
        non_blocking = bool(arg_value(func, args, kwargs, "non_blocking", False))
        written, read = [a for a in accesses if a.writes], [a for a in accesses if not a.writes]
        if op.new_outputs or any(not a.host_side for a in written):
            sources = [a for a in read if a.host_side]
            if sources:  # H2D; from pageable memory the host stages the source before the call returns
                return "h2d", blocking or not non_blocking, any(a.pageable for a in sources)
        elif any(not a.host_side for a in read):
            # D2H; into pageable memory the call returns only when the copy is done, as CUDA does
            return "d2h", blocking or not non_blocking or any(a.pageable for a in written), False
        return "compute", blocking, False

    @staticmethod
    def _check_same_device(op: OpInfo, accesses: list[_Arg]) -> None:
        """An in-place kernel cannot mix device memory with host arrays (0-dim CPU scalars are fine), as on CUDA.
        Out-of-place ops are let through so that tests can compare host and device tensors directly."""
        big = [a for a in accesses if a.host_side and a.tensor.dim() > 0]
        if big and len(big) < len(accesses):
            raise RuntimeError(
                f"Expected all tensors to be on the same device: {op.name} mixes device tensors with a host "
                f"tensor of shape {tuple(big[0].tensor.shape)}. (Simulated device: host tensors are pinned_empty "
                f"allocations, torch.tensor literals and tensors created before activation; "
                f".to(device.torch_device()) does not copy here: allocate on the device and copy_ instead.)"
            )

    def _refresh_sizes(self, tensor_args: list[_Arg]) -> None:
        """Pick up storages resized by an op (resize_) or behind the dispatcher (storage.resize_)."""
        for a in tensor_args:
            info = a.info
            if info is not None and info.kind == DEVICE:
                nbytes = a.storage.nbytes()
                if nbytes != info.nbytes:
                    self._live += nbytes - info.nbytes
                    info.nbytes = nbytes

    def _check_and_log(self, name: str, plan: list[tuple[_Arg, int, int]]) -> None:
        """Check every access of one op against the logs before any is recorded, then record them all."""
        label = self._label()
        staged = []
        for a, actor, epoch in plan:
            rng = byte_range(a.tensor)
            if rng is None:
                continue
            info = a.info if a.info is not None else self._register(a.storage, PAGEABLE)
            a.info = info
            acc = Access(rng[0], rng[1], a.writes, actor, epoch, name, label, a.tensor.shape)
            staged.append((info, acc))
        for info, acc in staged:
            rec = info.log.conflict(acc, self._clocks)
            if rec is not None:
                raise StreamRaceError(race_message(acc, rec, info.uid, info.nbytes, self._actor_names))
        for info, acc in staged:
            info.log.add(acc, self._clocks)

    def _log_new(self, t: torch.Tensor, info: _Storage, stream: SimStream, epoch: int, name: str) -> None:
        rng = byte_range(t)
        if rng is not None:
            acc = Access(rng[0], rng[1], True, stream.actor, epoch, name, self._label(), t.shape)
            info.log.add(acc, self._clocks)


def active() -> SimDevice | None:
    """The innermost active simulator, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def activate(
    preset: str | SimPreset = "h100", capacity_bytes: int | None = None, sanitize: bool = True
) -> Iterator[SimDevice]:
    """Run the block on a fresh simulated device; `device.get_device()` is "sim" inside."""
    sim = SimDevice(preset, capacity_bytes, sanitize)
    sim._start()
    try:
        yield sim
    finally:
        sim._stop()
        if sim._pending is not None:  # no later op to report it at
            logger.warning("{}", sim._pending)


def process_device() -> SimDevice:
    """The process-wide simulator used when SWAPOPT_DEVICE=sim: activated on first use, never exited."""
    if not _PROCESS:
        sim = SimDevice()
        sim._start()
        _PROCESS.append(sim)
    return _PROCESS[0]
