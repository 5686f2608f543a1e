"""The simulated accelerator: SimDevice, activate() and the process-wide simulator.

A simulated accelerator on CPU that fails where a real one would. Device tensors are SimTensors (device/sim/
tensor.py) on a device type of their own (Note [simulated device type] in device/sim/backend.py) over real CPU
tensors, and every op runs eagerly, so data are always right. While a simulator is active, a TorchDispatchMode
(device/sim/modes.py) hands it every aten op, on every thread started while it is active, and it
- tells each storage's memory apart (device/sim/accesses.py): *device* (a SimTensor's), *host* (pinned_empty,
  pin_memory=True, Tensor.pin_memory()) and *pageable* (any other CPU tensor);
- runs each op touching device memory on a stream (the thread's current one; in backward, the stream of the
  forward op, or the stream a hook made current: Note [streams inside a backward pass]), every other op on the
  thread's host actor (device/sim/dispatch.py), and checks its reads and writes (from the op schema, on the
  exact elements of strided views) against earlier accesses that no event wait, stream wait, synchronize or
  thread join orders before it (device/sim/race_checks.py, device/sim/sanitizer.py, `StreamRaceError`);
- accounts device memory against a capacity, and pinned memory against the host's (device/sim/storages.py,
  `torch.OutOfMemoryError`);
- places each op on a deterministic timeline (device/sim/timeline.py).
Entry points the dispatcher does not see (host reads through tolist / numpy / DLPack / torch.save,
record_stream with a simulated stream, `.cuda()`, threads, async collectives) are wrapped while a simulator is
active (device/sim/entry_points.py; what SimDevice does for them: device/sim/outside_dispatch.py). Inactive, it
costs nothing: no mode is pushed.

SimDevice is put together here from one part per concept: Storages (memory), StreamOrdering (streams, events,
threads, backward passes), Dispatch (each op), RaceChecks (the sanitizer), OutsideDispatch and Graphs (graph capture
and replay, Note [graph capture] in device/sim/graphs.py); this module adds the torch.cuda-like device surface and
activation.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from loguru import logger

from device.sim import entry_points, signals
from device.sim.accesses import StorageInfo as _Storage
from device.sim.active import _ACTIVE, active
from device.sim.backend import backend_name, register, registered_flavour
from device.sim.dispatch import Dispatch
from device.sim.graphs import Graphs, SimGraph
from device.sim.host_memory import HostMemory, capacity_from_env
from device.sim.memory import DeviceMemory, OutOfMemoryError, fmt_bytes
from device.sim.modes import _SimMode, _StreamTagMode
from device.sim.outside_dispatch import OutsideDispatch
from device.sim.presets import PRESETS, SimPreset, get_preset, resolve_preset
from device.sim.race_checks import RaceChecks
from device.sim.sanitizer import HOST, Access, Clocks, StreamRaceError
from device.sim.storages import Storages
from device.sim.streams import SimEvent, SimStream, StreamOrdering, ThreadState
from device.sim.timeline import Timeline, TimelineOp

__all__ = [
    "PRESETS",
    "OutOfMemoryError",
    "SimDevice",
    "SimEvent",
    "SimGraph",
    "SimPreset",
    "SimStream",
    "StreamRaceError",
    "TimelineOp",
    "activate",
    "active",
    "process_device",
]

# Notes of SimDevice's parts: [collective tensors at exit] and [aliases of host memory] in
# device/sim/outside_dispatch.py, [free and reuse] in device/sim/race_checks.py, [streams inside a backward pass]
# and [backward on the caller's thread] in device/sim/modes.py, [simulated device type] in device/sim/backend.py.

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


class SimDevice(Storages, StreamOrdering, Dispatch, RaceChecks, OutsideDispatch, Graphs):
    """The torch.cuda-like module surface of one simulated accelerator."""

    OutOfMemoryError = OutOfMemoryError

    def __init__(
        self,
        preset: str | SimPreset = "h100",
        capacity_bytes: int | None = None,
        sanitize: bool = True,
        allocator: str = "exact",
        flavour: str | None = None,
    ) -> None:
        self.preset = get_preset(preset)
        # Note [simulated device type]: device tensors are SimTensors on a device type of their own.
        self.flavour = flavour or registered_flavour() or process_flavour() or self.preset.flavour
        register(self.flavour)
        self.backend = backend_name(self.flavour)
        self._device_objects: dict[int, torch.device] = {}  # index -> torch.device(self.backend, index)
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
        self._fresh_streams = self.flavour == "npu"
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
        self._finalizers: dict[int, tuple[weakref.ref, int, int]] = {}  # Storages._register: storages' references
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
        self._tls = ThreadState()
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
        self._init_graphs()  # CUDAGraph / NPUGraph, graph(), the captures underway (device/sim/graphs.py)
        self._default = self.Stream(name="compute")
        self._comm: SimStream | None = None
        self._sigint_gate: signals.SignalGate | None = None  # while active (Note [signals inside simulated ops])

    def __repr__(self) -> str:
        return f"<SimDevice {self.preset.name} capacity={fmt_bytes(self.capacity_bytes)}>"

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def init(self) -> None:
        pass

    def device_count(self) -> int:
        return device_count()

    def current_device(self) -> int:
        """The calling thread's device: 0 until set_device, as on CUDA and torch_npu."""
        return self._tls.device

    def set_device(self, device: int | str | torch.device) -> None:
        index = self._index(device)
        if index is None:
            return
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
        return torch.device(self.backend, self.current_device() if index is None else index)

    def get_device_name(self, device: Any = None) -> str:
        return f"sim:{self.preset.name}"

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(name=self.get_device_name(), total_memory=self.capacity_bytes)

    def manual_seed(self, seed: int) -> None:
        # Device kernels draw from the CPU generator here; torch.manual_seed also calls this one (cuda
        # flavour), so seed the generator itself.
        torch.default_generator.manual_seed(int(seed))

    manual_seed_all = manual_seed

    # The generator's state, as torch.cuda presents a device's (a CPU uint8 tensor): every simulated device of
    # the process draws from the CPU default generator, so saving and restoring it (HF Trainer's checkpoints,
    # torch.utils.checkpoint's recompute) reproduces what the CPU job draws.
    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.default_generator.get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
        torch.default_generator.set_state(new_state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state() for _ in range(self.device_count())]

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        # As torch.cuda's: entry i is device i's state, and a shorter list (an empty one from a caller that saw
        # no device) sets fewer. One generator stands for all devices: the current device's entry holds.
        current = self.current_device()
        if current < len(new_states):
            self.set_rng_state(new_states[current])

    def initial_seed(self) -> int:
        return torch.default_generator.initial_seed()

    def seed(self) -> None:
        torch.default_generator.seed()

    seed_all = seed

    def _is_in_bad_fork(self) -> bool:  # torch.manual_seed asks a PrivateUse1 module before seeding it
        return False

    def get_amp_supported_dtype(self) -> list[torch.dtype]:  # torch.autocast asks a PrivateUse1 module
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return True

    def now_us(self) -> float:
        """Modeled host time in microseconds."""
        return self._timeline.host_us

    def runtime_calls(self) -> int:
        """Event records and stream waits the host has made outside a graph capture so far, each charged the preset's
        ``event_us`` (Note [host clock] in device/sim/timeline.py)."""
        return self._timeline.runtime_calls

    @property
    def timeline(self) -> list[TimelineOp]:
        return self._timeline.ops

    def reset_timeline(self) -> None:
        """Forget recorded timeline ops (clocks keep running)."""
        self._timeline.clear()

    def export_chrome_trace(self, path: str | Path) -> None:
        """Write the timeline as Chrome/Perfetto trace JSON: one track per stream, times in microseconds."""
        self._timeline.export_chrome_trace(path)

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
        self._sigint_gate = signals.gate_sigint()  # Note [signals inside simulated ops]
        logger.debug("simulated device {} active", self.preset.name)

    def _stop(self, _finalizing: Any = sys.is_finalizing) -> None:
        if _finalizing():
            # An activate() block left open (`activate().__enter__()` without `with`), closed as the interpreter
            # tears its modules down: torch's and this package's globals may be gone, and nothing runs after.
            return
        self._release_collectives(everything=True)  # the process goes on: a late worker may take the GIL
        torch._C._set_multithreading_enabled(self._multithreading)
        self._grad_mode.__exit__(None, None, None)
        self._mode.__exit__(None, None, None)
        _ACTIVE.remove(self)
        inner = active()
        entry_points.present_cuda(inner if entry_points.routes_cuda(inner) else None)
        if not _ACTIVE:
            entry_points.uninstall()
        gate, self._sigint_gate = self._sigint_gate, None
        signals.ungate(gate)  # last: a Ctrl-C held until now raises here, with the simulator put away

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
    flavour: str | None = None,
) -> Iterator[SimDevice]:
    """Run the block on a fresh simulated device.

    preset: a SimPreset, a preset name (h100, 910b) or the path of a preset file (device/sim/preset_file.py;
    `python -m swapopt.verify` writes one calibrated on a device).
    allocator: "exact" counts live storages byte for byte; "caching" models PyTorch's CUDA caching
    allocator (512-byte blocks, reserved segments, empty_cache, OOM judged on reserved memory).
    flavour: "cuda" or "npu" (default: the one this process registered, else the preset's)."""
    sim = SimDevice(resolve_preset(preset), capacity_bytes, sanitize, allocator, flavour)
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
