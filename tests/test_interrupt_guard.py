"""The Ctrl-C guard (swapopt/engine/interrupt.py) when SIGINT's handler runs where Python swallows exceptions:
inside a weakref callback (the simulator frees storages in one), a ``weakref.finalize`` or a ``__del__``.
Deterministic: ``signal.raise_signal`` runs the handler before it returns, so inside the callback."""

from __future__ import annotations

import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator

import pytest

from swapopt.engine.interrupt import InterruptGuard


class _Thing:
    pass


class _DelRaises:
    def __init__(self, reached: list[str]) -> None:
        self.reached = reached

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)
        self.reached.append("after the signal")


def _ctrl_c_in_weakref_callback(reached: list[str]) -> None:
    def died(ref: weakref.ref) -> None:
        signal.raise_signal(signal.SIGINT)
        reached.append("after the signal")

    thing = _Thing()
    ref = weakref.ref(thing, died)
    del thing  # the callback runs here
    assert ref() is None


def _ctrl_c_in_finalize(reached: list[str]) -> None:
    def died() -> None:
        signal.raise_signal(signal.SIGINT)
        reached.append("after the signal")

    thing = _Thing()
    weakref.finalize(thing, died)
    del thing


def _ctrl_c_in_del(reached: list[str]) -> None:
    thing = _DelRaises(reached)
    del thing


SWALLOWING = {"weakref_callback": _ctrl_c_in_weakref_callback, "weakref_finalize": _ctrl_c_in_finalize,
              "__del__": _ctrl_c_in_del}


@pytest.fixture
def unraisable(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """What reaches the hook the guard found (Python's default would print "Exception ignored in: ...")."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set on the main thread only")
    seen: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    yield seen


def _guard() -> InterruptGuard:
    return InterruptGuard(grace_s=600)  # the watchdog must not end the test runner


@pytest.mark.parametrize("swallow", list(SWALLOWING.values()), ids=list(SWALLOWING))
def test_ctrl_c_swallowed_in_a_finalizer_is_raised_at_the_next_critical_section(
        unraisable: list[object], swallow: Callable[[list[str]], None]) -> None:
    reached: list[str] = []
    entered = False
    with _guard() as guard:
        swallow(reached)  # returns: Python dropped the KeyboardInterrupt raised inside the finalizer
        assert reached == []  # it was raised there (and cut the finalizer), not somewhere after
        with pytest.raises(KeyboardInterrupt):
            with guard.critical():  # the next safe point: raised before the section starts
                entered = True
        guard.acknowledge()
        with guard.critical():  # taken: nothing owed any more
            pass
    assert not entered and not guard.torn
    assert unraisable == []  # nothing printed or reported


def test_second_ctrl_c_swallowed_inside_a_critical_section_is_raised_at_its_end(unraisable: list[object]) -> None:
    reached: list[str] = []
    finished = False
    with _guard() as guard:
        with pytest.raises(KeyboardInterrupt):
            with guard.critical():
                signal.raise_signal(signal.SIGINT)  # the first: held until the section ends
                _ctrl_c_in_weakref_callback(reached)  # the second, raised at once but swallowed
                finished = True
        guard.acknowledge()
    assert finished and reached == []
    assert not guard.torn  # the section ran whole: its step can be saved
    assert unraisable == []


def test_ctrl_c_swallowed_after_the_last_safe_point_is_raised_by_the_guards_exit(unraisable: list[object]) -> None:
    with pytest.raises(KeyboardInterrupt):
        with _guard():
            _ctrl_c_in_weakref_callback([])
    assert unraisable == []
    # Once the caller took an interrupt it is stopping: a swallowed one after that raises nothing more.
    with _guard() as guard:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        guard.acknowledge()
        _ctrl_c_in_weakref_callback([])
    assert unraisable == []


def test_other_unraisable_exceptions_and_the_hook_are_left_as_they_were(unraisable: list[object]) -> None:
    def died(ref: weakref.ref) -> None:
        raise ValueError("not an interrupt")

    before = sys.unraisablehook
    with _guard():
        thing = _Thing()
        ref = weakref.ref(thing, died)
        del thing
        assert ref() is None
    assert unraisable == [ValueError]
    assert sys.unraisablehook is before
