"""A corpus of small stream programs, each labelled by what CUDA would allow.

Labels follow CUDA stream semantics (work on one stream runs in order; other streams and the host are
ordered only by event waits, stream waits, synchronizes and blocking copies), PyTorch's caching-allocator
rules (a freed block goes back to its allocation stream's pool, so other streams' pending uses need
`record_stream` or a wait) and the checks of `torch/cuda/_sanitizer.py`. A program labelled RACE must be
reported (during the program or at the latest when the simulator exits); an OK program must run clean.

A RACE program names the race it shows, and the test asserts exactly that one: an access race by the op that
makes the later access (`op`) and the op it conflicts with (`earlier`), a use-after-free race by the op on
another stream that the free may overtake (`free`) and the op that uses the reused memory before anything
orders it after that one (`op`). Helpers add no race of their own, so that switching one
check of the sanitizer off leaves that check's programs running clean instead of failing on a side race.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RACE, OK = "race", "ok"


@dataclass(frozen=True)
class Program:
    name: str
    group: str
    label: str
    run: Callable  # run(sim) -> None
    kind: str | None = None  # StreamRaceError.kind of a RACE program: "access" or "free"
    op: str | None = None  # the later access's op (access races), or the use of the reused memory (free races)
    earlier: str | None = None  # the earlier access's op: the one racing `op`, or the one a free overtakes


PROGRAMS: list[Program] = []


def program(
    group: str, label: str, *, op: str | None = None, earlier: str | None = None, free: str | None = None
) -> Callable[[Callable], Callable]:
    """Register a program of `group` labelled `label` (RACE or OK); a RACE program names its race: an access
    race by `op` and `earlier`, a use-after-free race by `free` (the op the free may overtake) and `op` (the
    first use of the memory the allocator may hand out again)."""
    if label == RACE:
        assert op is not None and (earlier is not None) != (free is not None), "name the access race or the free race"
    else:
        assert op is None and earlier is None and free is None, "an OK program shows no race"
    kind = None if label == OK else ("free" if free is not None else "access")

    def register(fn: Callable) -> Callable:
        PROGRAMS.append(Program(fn.__name__, group, label, fn, kind, op, free if free is not None else earlier))
        return fn

    return register


from . import (  # noqa: E402  (each module registers its programs on import)
    aliases,
    allocator,
    autograd,
    collectives,
    compiled,
    copies,
    ordering,
    storages,
    threads,
    views,
)

__all__ = ["OK", "PROGRAMS", "RACE", "Program", "program"]
_MODULES = (aliases, allocator, autograd, collectives, compiled, copies, ordering, storages, threads, views)
