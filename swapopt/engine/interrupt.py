"""Ctrl-C that never tears a step and never waits on a long operation.

SIGINT raises KeyboardInterrupt at once, except inside the part of a step that changes parameters and
optimizer states (``critical()``), where it is held until that part is done, so the model on exit is the one
after a whole number of steps and can be checkpointed. A second Ctrl-C there raises at once (the step is
then marked torn).

Python runs signal handlers only between bytecodes, so one long aten op (a 100-GFLOP matmul on a CPU)
would delay the exit by as long. A watchdog thread learns of the signal through ``signal.set_wakeup_fd``
(written at C level, whatever the main thread does); when the main thread has not caught the interrupt
(``acknowledge()``) within ``grace_s``, it calls ``on_stuck`` and ends the process. That is safe for data: checkpoints are
renamed into place whole, and the metrics file is flushed before every checkpoint (and at the log interval),
so each checkpoint finds the lines of exactly the steps it holds.

A KeyboardInterrupt raised where Python swallows exceptions (a weakref callback, such as the simulator's
storage finalizers, a ``weakref.finalize``, a ``__del__``) is not lost: it is raised again at the next safe point
the guard controls, the start or end of the next ``critical()`` (or the guard's exit), with nothing printed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class InterruptGuard:
    def __init__(self, grace_s: float = 5.0, on_stuck: Callable[[], None] | None = None,
                 exit_code: int = 130) -> None:
        self.grace_s = grace_s
        self.on_stuck = on_stuck
        self.exit_code = exit_code
        self.torn = False  # True when an interrupt cut through a critical section
        self._inside = False
        self._pending = False  # an interrupt for the next safe point: held by critical(), or swallowed (_unraisable)
        self._taken = threading.Event()  # the main thread caught the KeyboardInterrupt (acknowledge)
        self._previous: Any = None
        self._previous_fd: int | None = None
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._previous_hook: Any = None
        self._hook: Any = None
        self._installed = False

    def _raise(self) -> None:
        raise KeyboardInterrupt

    def acknowledge(self) -> None:
        """The caller caught the KeyboardInterrupt: the watchdog stands down. Unacknowledged, it ends the job
        after ``grace_s``: one long operation holds the main thread, or an interrupt swallowed inside a finalizer
        (``_unraisable``) found no safe point in time. Also drops an interrupt still owed: the caller is stopping
        already."""
        self._pending = False
        self._taken.set()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._inside and not self._pending:
            self._pending = True
            return
        if self._inside:
            self.torn = True
        self._raise()

    # A Ctrl-C raised where Python swallows exceptions. The handler still raises at once, and learns of the swallow
    # afterwards, because it cannot know beforehand: its ``frame`` does not tell a weakref callback from an
    # ordinary call (the simulator's Storages._storage_died is a bare weakref callback, whose caller frame is
    # whatever bytecode dropped the last reference), and holding every Ctrl-C for a safe point would lose "stops
    # at once" inside a long forward. Python reports each exception it swallows (weakref callbacks, finalize,
    # __del__, gc callbacks) to ``sys.unraisablehook``: a KeyboardInterrupt reaching it while the guard is
    # installed is the guard's (its handler owns SIGINT); it is owed rather than printed, and raised at the next
    # point the guard controls, where raising is always safe: the start or end of the next ``critical()``, else
    # ``__exit__``. The watchdog's ``grace_s`` still bounds the wait. The cut callback is as any exception in it
    # leaves it.
    def _unraisable(self, unraisable: Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            if self._inside:
                # Only a second Ctrl-C raises inside a critical section; swallowed, it cut nothing of the step,
                # which ends whole and raises the interrupt at its end.
                self.torn = False
            self._pending = True
            return
        (self._previous_hook or sys.__unraisablehook__)(unraisable)

    def _watch(self, reader: socket.socket) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:  # closed by __exit__
                return
            if signal.SIGINT not in data:
                continue
            if not self._taken.wait(self.grace_s):
                if self.on_stuck is not None:
                    self.on_stuck()
                os._exit(self.exit_code)

    def __enter__(self) -> "InterruptGuard":
        # Signal handlers and the wakeup fd can only be set from the main thread; elsewhere Python's default stays.
        if threading.current_thread() is not threading.main_thread():
            return self
        self._previous = signal.signal(signal.SIGINT, self._handler)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._pair = (reader, writer)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(reader,), name="swapopt-interrupt-watchdog", daemon=True).start()
        self._previous_hook, self._hook = sys.unraisablehook, self._unraisable
        sys.unraisablehook = self._hook
        self._installed = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGINT, self._previous)
        signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        if sys.unraisablehook is self._hook:  # else someone replaced it since: theirs stays
            sys.unraisablehook = self._previous_hook
        # Swallowed, and neither a safe point came nor did the caller take another interrupt (then it is stopping).
        owed = self._pending and exc_type is None and not self._taken.is_set()
        self._pending = False
        reader, writer = self._pair
        self._taken.set()  # a signal still being watched is the caller's now
        writer.close()
        try:
            reader.shutdown(socket.SHUT_RDWR)  # wakes the watchdog's recv
        except OSError:
            pass
        reader.close()
        self._installed = False
        if owed:  # the last safe point: the Ctrl-C is the caller's, as if it came just after the guard
            raise KeyboardInterrupt

    @contextmanager
    def critical(self) -> Iterator[None]:
        if self._pending:  # owed (swallowed before): raised before the section starts
            self._pending = False
            self._raise()
        self._inside = True
        try:
            yield
        finally:
            self._inside = False
        if self._pending:
            self._pending = False
            self._raise()
