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
"""

from __future__ import annotations

import os
import signal
import socket
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
        self._pending = False
        self._taken = threading.Event()  # the main thread caught the KeyboardInterrupt (acknowledge)
        self._previous: Any = None
        self._previous_fd: int | None = None
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._installed = False

    def _raise(self) -> None:
        raise KeyboardInterrupt

    def acknowledge(self) -> None:
        """The caller caught the KeyboardInterrupt: the watchdog stands down. Raising is not enough, because a
        KeyboardInterrupt raised inside a finalizer or ``__del__`` (the simulator frees storages through
        weakref callbacks) is printed and dropped by Python, and the job would train on; unacknowledged, the
        watchdog ends it after ``grace_s``."""
        self._taken.set()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._inside and not self._pending:
            self._pending = True
            return
        if self._inside:
            self.torn = True
        self._raise()

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
        self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGINT, self._previous)
        signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        reader, writer = self._pair
        self._taken.set()  # a signal still being watched is the caller's now
        writer.close()
        try:
            reader.shutdown(socket.SHUT_RDWR)  # wakes the watchdog's recv
        except OSError:
            pass
        reader.close()
        self._installed = False

    @contextmanager
    def critical(self) -> Iterator[None]:
        self._inside = True
        try:
            yield
        finally:
            self._inside = False
        if self._pending:
            self._pending = False
            self._raise()
