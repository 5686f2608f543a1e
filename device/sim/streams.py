"""Streams and events of the simulated device: SimStream and SimEvent (the torch.cuda-like objects), and
StreamOrdering, the part of SimDevice that keeps the current stream per thread and applies what streams, events,
synchronize, threads and backward passes order (Note [streams inside a backward pass] in device/sim/modes.py)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from device.sim.host_time import counted_methods
from device.sim.modes import _STREAM_TAG, _SimMode, _StreamTagMode
from device.sim.sanitizer import HOST, Clock

if TYPE_CHECKING:
    from device.sim.device import SimDevice


class ThreadState(threading.local):
    """What the simulator keeps per thread. The class attributes are every thread's defaults: an attribute a
    thread never set is then found, where reading it from a bare threading.local would raise and catch an
    AttributeError (a microsecond or more, on every op)."""

    current: SimStream | None = None  # set_stream / stream()
    set_in: Any = None  # the autograd node that was running when it was set (Note [streams inside a backward pass])
    host: int = HOST  # the thread's host actor
    device: int = 0  # set_device
    backward: dict | None = None  # the backward pass in progress (_node_stream)
    callers: list | None = None  # the callers' streams of nested backward() calls (_backward_call)


@counted_methods(
    "__init__", "wait_event", "wait_stream", "record_event", "synchronize", "query", "__enter__", "__exit__",
    "is_capturing",
)
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
        if self._sim._captures:  # Note [graph capture]: a capturing stream cannot be waited for
            self._sim._capture_sync(self, "Stream.synchronize()")
        self._sim._host_wait(self._sim._clocks.snapshot(self.actor), self.tail_us)
        self._sim._raise_pending()

    def query(self) -> bool:
        if self._sim._captures:
            self._sim._capture_sync(self, "Stream.query()")
        return self._sim._query(self._sim._clocks.snapshot(self.actor), self.tail_us)

    def is_capturing(self) -> bool:
        """Whether a graph capture records this stream's work (torch.Stream.is_capturing)."""
        return self.actor in self._sim._captures

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
        # Last recorded on a capturing stream: (the capture, its number there) until recorded again outside one
        # (Note [graph capture] in device/sim/graphs.py).
        self.captured: tuple[Any, int] | None = None

    def record(self, stream: SimStream | None = None) -> None:
        self._sim._record(self, stream if stream is not None else self._sim._current())

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else self._sim._current()).wait_event(self)

    def query(self) -> bool:
        if self.captured is not None or self._sim._captures:  # Note [graph capture]
            self._sim._captured_event(self, "Event.query()")
        return self.clock is None or self._sim._query(self.clock, self.time_us)

    def synchronize(self) -> None:
        if self.captured is not None or self._sim._captures:
            self._sim._captured_event(self, "Event.synchronize()")
        if self.clock is not None:
            self._sim._host_wait(self.clock, self.time_us)
        self._sim._raise_pending()

    def elapsed_time(self, end_event: SimEvent) -> float:
        """Modeled milliseconds between this event and `end_event`, like torch.cuda.Event.elapsed_time."""
        sim = self._sim
        for event in (self, end_event):
            if event.captured is not None:
                sim._captured_event(event, "Event.elapsed_time()")
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


@counted_methods("current_stream", "default_stream", "set_stream", "synchronize")
class StreamOrdering:
    """SimDevice's streams: the current stream per thread (as in PyTorch), the host actor per thread, and the
    orderings streams, events, synchronize, thread start/join and backward passes make on its vector clocks
    (device.sim.sanitizer.Clocks) and on its timeline. Mixed into SimDevice (device/sim/device.py), whose
    __init__ makes the state it uses: _tls, _default, _comm, _clocks, _timeline, _lock, _hazards,
    _host_actors, _actor_names, _fresh_streams, Stream."""

    # Set by SimDevice.__init__ (see the class docstring).
    _tls: ThreadState
    _default: SimStream
    _comm: SimStream | None
    _captures: dict[int, Any]  # capturing stream's actor -> its capture (device.sim.graphs)

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
        return self._tls.current or self._default

    def _thread_stream(self) -> SimStream:
        """The stream the thread set (set_stream, stream()), whatever node a backward pass runs."""
        return self._tls.current or self._default

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
        previous = tls.current, tls.set_in
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
        saved = tls.current, tls.set_in
        # The caller's stream, which a hook's stream context inside the pass does not change.
        callers = tls.__dict__.setdefault("callers", [])
        callers.append(self._current())  # inside a node (a reentrant checkpoint's backward), the node's
        try:
            yield
        finally:
            callers.pop()
            tls.current, tls.set_in = saved

    def synchronize(self, device: Any = None) -> None:
        if self._captures:  # Note [graph capture]: the device cannot be waited for while a stream captures
            self._capture_sync(None, "synchronize()")
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

    def _name_actor(self, actor: int, name: str | None) -> str:
        """Readable stream names for error messages and traces: "compute", "stream#1", ..."""
        index = len(self._actor_names) - 1  # the host is actor 0
        name = name or (f"stream#{index}" if index else "compute")
        self._actor_names.append(name)
        return name

    def _record(self, event: SimEvent, stream: SimStream, by_host: bool = True) -> None:
        """`event` recorded on `stream`; `by_host`: a call the host makes (not a replayed graph's own join)."""
        if self._captures and stream.actor in self._captures:  # Note [graph capture]: a node of the graph
            self._capture_record(event, stream)
            return
        event.captured = None
        if by_host:
            self._timeline.runtime_call()  # Note [host clock]: the host pays the call before the record is queued
        self._clocks.merge_actor(stream.actor, self._host())  # recording is a launch: it follows the host's past
        event.clock = self._clocks.snapshot(stream.actor)
        event.time_us = max(stream.tail_us, self._timeline.host_us)

    def _stream_wait(self, stream: SimStream, event: SimEvent, by_host: bool = True) -> None:
        """`stream` waits for `event`; `by_host`: as in _record."""
        if event.captured is not None or (self._captures and stream.actor in self._captures):
            self._capture_wait(stream, event)  # Note [graph capture]: joins, forks and captured waits
            return
        if by_host:
            self._timeline.runtime_call()  # Note [host clock]: the call costs the host even where it waits for nothing
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

    def _host(self) -> int:
        """The host actor of the calling thread: the main one, or a thread started while active."""
        return self._tls.host

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
        backward = tls.backward
        if backward is None:
            # The first backward node follows the caller's current stream (where the incoming gradient was
            # made); when the pass ends, the caller's stream waits for every stream it used.
            callers = tls.callers
            caller = callers[-1] if callers else self._thread_stream()
            backward = tls.backward = {"caller": caller, "streams": {caller}, "last": caller, "node": None}
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if backward["node"] is not node:
            # The engine orders a node after the nodes that produced its inputs, before the node and its hooks
            # run; following the previous node over-approximates that, so it never reports a race the engine
            # prevents.
            backward["node"] = node
            if (
                own is self._default and self._captures and backward["last"].actor in self._captures
                and _STREAM_TAG not in node.metadata
            ):  # fmt: skip
                # A node no forward op tagged (one torch made inside a call: the transpose of F.linear) runs on the
                # default stream here, an approximation that must not make the default stream wait on a capture,
                # which CUDA refuses (Note [graph capture]): during a capture it runs where the previous node ran,
                # the capturing stream its forward ran on, as the engine would run it.
                own = node.metadata[_STREAM_TAG] = backward["last"]
            if own is not backward["last"]:
                own.wait_stream(backward["last"])
                backward["last"] = own
            backward["streams"].add(own)
        if tls.set_in is node and tls.current is not own:
            # A hook's own stream: ordered only by what the hook does (a wait it forgets is a race, as on
            # hardware), and not among the streams the engine syncs the caller with at the end.
            return tls.current
        return own

    def _end_backward(self) -> None:
        backward = self._tls.backward
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

    def _host_sync_stream(self) -> None:
        """The host waits for the current stream's queued work (a synchronous copy on it)."""
        stream = self._current()
        if self._captures:
            self._capture_sync(stream, "a synchronous copy")
        self._host_wait(self._clocks.snapshot(stream.actor), stream.tail_us)
