"""Ctrl-C while the simulator's own Python runs: held until the op returns, where a device's C++ op would let
Python see it.

Note [signals inside simulated ops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a device an op is C++: Python runs a signal handler only between the program's own bytecodes, so a Ctrl-C
raises KeyboardInterrupt before or after an op, never inside one. On the simulator an op runs Python (the dispatch
and torch-function modes, and the Python torch calls inside an op, such as activation checkpointing's saved-tensor
hooks), so the handler would run inside it and raise through torch's C++ where an exception may not pass: the
process ends in std::terminate ("terminate called without an active exception"; once in some 60 Ctrl-Cs to the
main job, in a forward pass under activation checkpointing). A backward pass is the same case (Note [backward on
the caller's thread] in device/sim/modes.py).

So while a simulator is active on the main thread, the SIGINT handler found at activation is wrapped in a
``SignalGate``: called while the main thread is inside a simulator frame (``host_time``'s depth above 0), it only
notes the signal; the outermost op or torch function hands it to the handler as it returns (``deliver_owed``),
where a device would have raised it. A backward pass gates whatever handler is installed when it begins, since a
program may install its own after activation. Handlers that are not Python (SIG_DFL ends the process at once, as on
a device; SIG_IGN) are left as they are.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from device.sim import host_time

Handler = Callable[[int, FrameType | None], Any]

# Signals noted inside a simulator frame, each with the handler that is to get it: read on every op's return, so
# a list (empty: false) rather than a call.
OWED: list[tuple[Handler, int, FrameType | None]] = []


class SignalGate:
    """A SIGINT handler that holds ``handler``'s signal while the main thread is inside a simulator frame."""

    __slots__ = ("handler",)

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        if inside_simulator():  # handlers run on the main thread: its depth
            if not OWED:  # a second Ctrl-C before the op returns is the same interrupt
                OWED.append((self.handler, signum, frame))
            return None
        return self.handler(signum, frame)


def inside_simulator() -> bool:
    """Whether the calling thread is inside a simulator frame, where a handler must not raise (Note [signals
    inside simulated ops])."""
    return host_time.depth() > 0


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def gate_sigint() -> SignalGate | None:
    """Wrap the SIGINT handler now installed in a SignalGate; the gate (to give to ``ungate``), or None where
    there is nothing to wrap: not the main thread, already a gate, or not a Python handler."""
    if not _main_thread():
        return None
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, SignalGate) or not callable(current):
        return None
    gate = SignalGate(current)
    signal.signal(signal.SIGINT, gate)
    return gate


def ungate(gate: SignalGate | None) -> None:
    """Put back the handler ``gate`` wraps, unless another has been installed since, then hand it a signal still
    owed (the caller is back in the program's Python)."""
    if gate is None:
        return
    if signal.getsignal(signal.SIGINT) is gate:
        signal.signal(signal.SIGINT, gate.handler)
    deliver_owed()


@contextmanager
def gated() -> Iterator[None]:
    """SIGINT gated for the body (a backward pass), whatever handler is installed when it begins."""
    gate = gate_sigint()
    try:
        yield
    finally:
        ungate(gate)  # still inside the op's frame: an owed signal goes at its return, as any other


def deliver_owed() -> None:
    """Hand a signal noted inside a simulator frame to its handler (which may raise KeyboardInterrupt): called by
    the outermost op or torch function as it returns, and when a gate comes off. Only on the main thread, where
    Python runs signal handlers: another thread's op returning leaves it for the main thread's next one."""
    if OWED and host_time.depth() == 0 and _main_thread():
        handler, signum, frame = OWED.pop()
        handler(signum, frame)
