"""A corpus of small stream programs, each labelled by what CUDA would allow.

Labels follow CUDA stream semantics (work on one stream runs in order; other streams and the host are
ordered only by event waits, stream waits, synchronizes and blocking copies), PyTorch's caching-allocator
rules (a freed block goes back to its allocation stream's pool, so other streams' pending uses need
`record_stream` or a wait) and the checks of `torch/cuda/_sanitizer.py`. A program labelled RACE must be
reported (during the program or at the latest when the simulator exits); an OK program must run clean.
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


PROGRAMS: list[Program] = []


def program(group: str, label: str) -> Callable[[Callable], Callable]:
    """Register a program of `group` labelled `label` (RACE or OK)."""

    def register(fn: Callable) -> Callable:
        PROGRAMS.append(Program(fn.__name__, group, label, fn))
        return fn

    return register


from . import (  # noqa: E402  (each module registers its programs on import)
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
_MODULES = (allocator, autograd, collectives, compiled, copies, ordering, storages, threads, views)
