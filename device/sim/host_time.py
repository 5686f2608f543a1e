"""Host CPU time spent inside the simulator itself, per thread.

On the simulator every aten op, stream and event call runs the simulator's own Python (dispatch,
sanitizer, timeline, memory model), work a GPU or NPU does not do on the host. A benchmark that
reports the host time of the code driving the device subtracts this: ``seconds()`` is the thread's CPU
time inside simulator frames so far, counted once however deeply they nest. What a call costs before
its frame starts its clock (torch entering a Python mode, the wrapper) is not in it: ``calls()`` counts
the outermost entries, so a caller can subtract a calibrated cost per entry.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

class _Counters(threading.local):
    """Per thread; the class attributes are a thread's starting values (read without a check on every entry)."""

    depth = 0  # counted frames open
    start = 0.0  # thread CPU time when the outermost one began
    total = 0.0  # CPU seconds inside counted frames, closed ones
    calls = 0  # outermost entries
    frames = 0  # of them, those through ``counted`` or ``enter`` rather than the dispatch modes (Note [scaled Python])


_local = _Counters()


def _state() -> Any:
    return _local


def enter() -> None:
    st = _state()
    if st.depth == 0:
        st.start = time.thread_time()
        st.calls += 1
        st.frames += 1
    st.depth += 1


def leave() -> None:
    st = _local
    st.depth -= 1
    if st.depth == 0:
        st.total += time.thread_time() - st.start


def depth() -> int:
    """Simulator frames open on this thread (0: the program's own code is running)."""
    return _local.depth


def seconds() -> float:
    """CPU seconds this thread has spent inside simulator frames (outermost ones only), so far."""
    st = _state()
    running = time.thread_time() - st.start if st.depth else 0.0
    return st.total + running


def calls() -> int:
    """Counted frames this thread entered from outside any other (see ``entry_costs``), so far."""
    return _state().calls


def frames() -> int:
    """Of ``calls()``, those through ``counted`` or ``enter`` (the simulator's streams, events, memory, a simulated
    tensor's ``data_ptr``; see ``frame_entry_us``) rather than through its dispatch modes, so far."""
    return _state().frames


def counted(fn: F) -> F:
    """``fn`` is simulator work: its CPU time goes to ``seconds()``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # enter() and leave(), written out: this wraps every stream, event and memory call the simulator sees.
        st = _local
        if st.depth == 0:
            st.start = time.thread_time()
            st.calls += 1
            st.frames += 1
        st.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            st.depth -= 1
            if st.depth == 0:
                st.total += time.thread_time() - st.start

    return wrapper  # type: ignore[return-value]


def counted_methods(*names: str) -> Callable[[type], type]:
    """Class decorator: the named methods are simulator work (see ``counted``)."""

    def decorate(cls: type) -> type:
        for name in names:
            setattr(cls, name, counted(cls.__dict__[name]))
        return cls

    return decorate


# Note [scaled Python]: under the "measured" host clock (Note [host clock] in device/sim/timeline.py) the program's
# Python between two ops is this machine's CPU time, which is not the device host's. Two corrections make it the
# device host's:
# - entering the simulator costs CPU time before its first counted frame starts, and it is not the same for every
#   entry. An op goes through torch's mode stack (building the call's arguments, wrapping each tensor):
#   ``entry_costs()`` measures that per entry and per tensor argument on a stand-in of the simulator's modes
#   (passthrough ones, counted like the simulator's). A call of one of the simulator's own frames (a stream or event
#   call, whose runtime cost the timeline charges as the preset's ``event_us``; a simulated tensor's ``data_ptr``, a
#   C++ getter of well under a microsecond on a device) costs only the Python call and the frame's wrapper:
#   ``frame_entry_us()``. The clock takes out each entry at its kind's cost (``calls()`` and ``frames()`` tell them
#   apart), since a device host pays its own launch and event costs instead (the preset's figures). Taking an op's
#   cost out for every frame would take out of a replayed step's address checks (a ``data_ptr`` per tensor) some
#   3 us a call more than they cost, and with it the Python around them;
# - what is left is scaled by the device host's speed against this machine's: the preset's ``host_ref_us`` (the
#   device host's CPU time for ``reference_work()``) over ``reference_us()`` (this machine's, timed once per
#   process by the clock; beside each counted step by the layout bench, ``python_scale_now``, since a shared
#   machine's speed drifts within seconds).


def reference_work() -> int:
    """A fixed piece of pure Python of the kind an optimizer's bookkeeping runs (dict look-ups, attribute reads, list
    appends, calls): the yardstick of a host's Python speed. Its CPU time on a device's host is a preset figure
    (``host_ref_us``), measured there by ``reference_us()``."""

    class _Item:
        __slots__ = ("key", "value")

        def __init__(self, key: int, value: int) -> None:
            self.key, self.value = key, value

    counts: dict[int, int] = {}
    items: list[_Item] = []
    for i in range(20_000):
        key = i & 255
        counts[key] = counts.get(key, 0) + 1
        items.append(_Item(key, i))
    return sum(item.value for item in items if counts[item.key] > 0) & 0xFFFF


def reference_us(repeats: int = 15) -> float:
    """This thread's CPU time for ``reference_work()``, in microseconds: the least of `repeats` runs (the others
    carry interruptions and cold caches)."""
    best = math.inf
    for _ in range(repeats):
        start = time.thread_time()
        reference_work()
        best = min(best, time.thread_time() - start)
    return best * 1e6


def python_scale(host_ref_us: float, here_us: Callable[[], float] | None = None) -> float:
    """What one second of this machine's Python is on a host that takes ``host_ref_us`` for ``reference_work()``
    (Note [scaled Python]); 1 where that is not known (0). This machine's time for it is ``here_us()``, by default
    taken once per process."""
    return host_ref_us / (here_us or _reference_once)() if host_ref_us > 0 else 1.0


@functools.cache
def _reference_once() -> float:
    return reference_us()


def python_scale_now(host_ref_us: float, repeats: int = 3) -> float:
    """``python_scale`` with this machine's time for the reference work taken now rather than once per process:
    for a measurement that times its own Python beside it. A shared machine's speed drifts: on a 2-core host the
    least of 5 runs read 8.1-17.9 ms over 12 seconds."""
    return python_scale(host_ref_us, lambda: reference_us(repeats))


@functools.cache
def frame_entry_us() -> float:
    """Microseconds this machine spends per call of a counted frame outside the interval the frame times itself
    (the call, the wrapper, the parts of its two clock reads outside that interval: on some hosts a clock read is a
    system call of several microseconds), measured once per process on a frame that does nothing: the least over 5
    runs."""
    return max(_outside_us(counted(lambda: None), 2000), 0.0)


def _outside_us(body: Callable[[], Any], n: int) -> float:
    """The least, over 5 runs of ``n`` calls of ``body``, of this thread's CPU time per call outside counted frames
    (microseconds)."""
    best = math.inf
    for _ in range(5):
        c0, i0 = time.thread_time(), seconds()
        for _ in range(n):
            body()
        best = min(best, ((time.thread_time() - c0) - (seconds() - i0)) * 1e6 / n)
    return best


@functools.cache
def entry_costs() -> tuple[float, float]:
    """(microseconds per entry, microseconds per tensor argument of an op) this machine spends entering the
    simulator outside its counted frames (Note [scaled Python]), measured once per process on passthrough modes
    counted as the simulator's are, over tensors of a subclass as the simulator's are: an op over 1 tensor, and foreach ops over 8 and 64, less a plain loop's cost."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from device.sim.frames import skip_dynamo

    # Counted as the simulator's modes count themselves, in their own frame (device/sim/modes.py).
    def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        counters = _local
        if counters.depth == 0:
            counters.start = time.thread_time()
            counters.calls += 1
        counters.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            counters.depth -= 1
            if counters.depth == 0:
                counters.total += time.thread_time() - counters.start

    skips = skip_dynamo(dispatch.__code__)

    class _Function(TorchFunctionMode):
        __torch_function__ = dispatch  # the same frame: a function mode is counted as the dispatch mode is

    class _Dispatch(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return not skips  # as the simulator's mode (device/sim/modes.py)

        __torch_dispatch__ = dispatch

    class _Wrapped(torch.Tensor):  # the simulator's tensors are a subclass: torch checks each argument's type
        __torch_function__ = torch._C._disabled_torch_function_impl  # as SimTensor's (device/sim/tensor.py)

    x = torch.zeros(4).as_subclass(_Wrapped)
    lists = {n: [x] * n for n in (8, 64)}

    with _Dispatch(), _Function():
        one = _outside_us(lambda: x.add_(0), 400)
        eight = _outside_us(lambda: torch._foreach_add_(lists[8], 0), 200)
        many = _outside_us(lambda: torch._foreach_add_(lists[64], 0), 100)
    loop = _outside_us(lambda: None, 400)
    per_tensor = max((many - eight) / 56, 0.0)
    per_entry = max(one - loop - per_tensor, 0.0)
    return per_entry, per_tensor
