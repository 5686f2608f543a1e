"""Ctrl-C that never tears a step: SIGINT raises KeyboardInterrupt at once, except inside the part of a
step that changes parameters and optimizer states (``critical()``), where it is held until that part is
done, so the model on exit is always the one after a whole number of steps and can be checkpointed.
A second Ctrl-C inside that part raises at once (the user insists); the step is then marked torn.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class InterruptGuard:
    def __init__(self) -> None:
        self._inside = False
        self._pending = False
        self.torn = False  # True when an interrupt cut through a critical section
        self._previous: Any = None
        self._installed = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._inside and not self._pending:
            self._pending = True
            return
        if self._inside:
            self.torn = True
        raise KeyboardInterrupt

    def __enter__(self) -> "InterruptGuard":
        # Signal handlers can only be set from the main thread; elsewhere Python's default stays.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
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
            raise KeyboardInterrupt
