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
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_local = threading.local()


def _state() -> Any:
    st = _local.__dict__
    if "depth" not in st:
        _local.depth, _local.start, _local.total, _local.calls = 0, 0.0, 0.0, 0
    return _local


def enter() -> None:
    st = _state()
    if st.depth == 0:
        st.start = time.thread_time()
        st.calls += 1
    st.depth += 1


def leave() -> None:
    st = _local
    st.depth -= 1
    if st.depth == 0:
        st.total += time.thread_time() - st.start


def seconds() -> float:
    """CPU seconds this thread has spent inside simulator frames (outermost ones only), so far."""
    st = _state()
    running = time.thread_time() - st.start if st.depth else 0.0
    return st.total + running


def calls() -> int:
    """Counted frames this thread entered from outside any other (see ``entries_cost``), so far."""
    return _state().calls


def counted(fn: F) -> F:
    """``fn`` is simulator work: its CPU time goes to ``seconds()``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # enter() and leave(), written out: this wraps every op the simulator sees.
        st = _local if "depth" in _local.__dict__ else _state()
        if st.depth == 0:
            st.start = time.thread_time()
            st.calls += 1
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
