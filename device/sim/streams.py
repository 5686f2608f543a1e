"""Streams and events of the simulated device (the torch.cuda-like surface); their ordering effects are
applied by the SimDevice that made them."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from device.sim.host_time import counted_methods
from device.sim.sanitizer import Clock

if TYPE_CHECKING:
    from device.sim.device import SimDevice


@counted_methods("__init__", "wait_event", "wait_stream", "record_event", "synchronize", "query", "__enter__", "__exit__")
class SimStream:
    """A stream of the simulated device. Created through `SimDevice.Stream(...)`."""

    _sim: SimDevice

    def __init__(self, device: Any = None, priority: int = 0, *, name: str | None = None) -> None:
        sim = self._sim
        self.actor = sim._clocks.new_actor()
        sim._streams[self.actor] = self
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
        self._sim._raise_pending()

    def query(self) -> bool:
        return self._sim._query(self._sim._clocks.snapshot(self.actor), self.tail_us)

    def __enter__(self) -> SimStream:
        self._prev.append(self._sim._current())
        self._sim.set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._sim.set_stream(self._prev.pop())

    def __repr__(self) -> str:
        return f"<sim Stream {self.name}>"

    # Streams compare as torch's do: by the stream they name, not by Python object (a StreamHandle and
    # its stream are equal and hash alike).
    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimStream) and other._sim is self._sim and other.actor == self.actor

    def __hash__(self) -> int:
        return hash((id(self._sim), self.actor))


def fresh_object(stream: SimStream) -> SimStream:
    """A new Python object for an existing stream, as torch_npu's ``current_stream()`` and
    ``default_stream()`` return on every call (torch_npu/npu/utils.py:260-287 builds a new
    ``torch_npu.npu.Stream`` from the (stream_id, device_index, device_type) triple each time): of the
    stream's class, equal to it and hashing alike, never identical to it. It shares the stream's
    attributes (one __dict__), so work launched through either is the same stream's."""
    other = object.__new__(type(stream))
    other.__dict__ = stream.__dict__
    return other


def canonical(stream: Any) -> Any:
    """The stream object the simulator made for ``stream`` (a fresh_object of it, or itself)."""
    if isinstance(stream, SimStream):
        return stream._sim._streams.get(stream.actor, stream)
    return stream


@counted_methods("__init__", "record", "wait", "query", "synchronize", "elapsed_time")
class SimEvent:
    """An event of the simulated device. Created through `SimDevice.Event(...)`."""

    _sim: SimDevice

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.clock: Clock | None = None  # the recording stream's clock at record time
        self.time_us: float | None = None  # modeled completion time

    def record(self, stream: SimStream | None = None) -> None:
        self._sim._record(self, stream if stream is not None else self._sim._current())

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else self._sim._current()).wait_event(self)

    def query(self) -> bool:
        return self.clock is None or self._sim._query(self.clock, self.time_us)

    def synchronize(self) -> None:
        if self.clock is not None:
            self._sim._host_wait(self.clock, self.time_us)
        self._sim._raise_pending()

    def elapsed_time(self, end_event: SimEvent) -> float:
        """Modeled milliseconds between this event and `end_event`, like torch.cuda.Event.elapsed_time."""
        sim = self._sim
        if sim.flavour == "npu":
            # torch_npu (csrc/core/npu/NPUEvent.cpp:152-176) neither checks enable_timing nor raises for an
            # unfinished event: it drains every task queue and synchronizes on both events, so the host
            # waits for the whole device.
            if self.clock is None or end_event.clock is None:
                raise RuntimeError("Both events must be recorded before calculating elapsed time")
            sim.elapsed_time_drains += 1
            sim.synchronize()
            return (end_event.time_us - self.time_us) / 1e3
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
