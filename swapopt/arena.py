"""Pinned host arenas laid out like a chunk's slot, and the merged copies that move a chunk at once.

The states an element-wise optimizer creates for the params of one chunk are packed, in region order
and without padding (pinned bytes stay equal to state bytes), into one pinned buffer; chunks joined by
a param split across them share one, where that param's states lie whole (swapopt.layout). The slot
packs regions that are adjacent in an arena the same way (``adjacent``), so such regions form one run,
moved by one H2D and one D2H copy of raw bytes instead of one copy per (param, state).

Only storages allocated here are merged, and only regions that touch: a run's copy never writes a byte
that belongs to no state of the chunk. Any other host tensor (a state the user replaced, say) keeps a
copy of its own.

Note [arena memory]: an arena takes its size in host RAM (device.host_empty: allocated by swapopt and
registered, where pin_memory=True would take the next power of two), is allocated unpinned and filled, then
pinned together with the other arenas of the same re-layout or first step (``pin_pending``: one registration
per arena, in parallel). Arenas are at most ``arena_limit`` bytes (1/256 of the states laid out, at least
64 MiB), so that moving states into new arenas never holds more than about one arena twice: a re-plan lets
go of each old arena as soon as no state lies in it (swapopt.layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

import device
from swapopt import hoststate


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


ARENA_MIN = 64 << 20  # arena_limit's floor: smaller jobs keep one arena per group of chunks
ARENA_SHARE = 256  # arena_limit: at most this share of the states laid out


def arena_limit(total: int) -> int:
    """The most bytes one arena packs (Note [arena memory]), for ``total`` bytes of states laid out."""
    return max(ARENA_MIN, -(-int(total) // ARENA_SHARE))


def pack(items: Sequence[tuple[int, int]], limit: int | None = None) -> list[tuple[list[int], list[int], int]]:
    """Byte offsets of ``items`` (nbytes, itemsize), packed in order without padding (pinned bytes stay
    equal to state bytes); an item whose itemsize does not divide the bytes before it starts a new arena, and
    so does one that would take an arena past ``limit`` bytes (Note [arena memory]).
    Per arena: the indices of its items, their offsets and its size."""
    arenas: list[tuple[list[int], list[int], int]] = []
    members: list[int] = []
    offsets: list[int] = []
    end = 0
    for i, (nbytes, size) in enumerate(items):
        if end % size or (limit is not None and end and end + nbytes > limit):
            arenas.append((members, offsets, end))
            members, offsets, end = [], [], 0
        members.append(i)
        offsets.append(end)
        end += nbytes
    if members:
        arenas.append((members, offsets, end))
    return arenas


@dataclass(eq=False)
class Run:
    """Slot bytes ``[offset, offset + nbytes)`` mirror ``host`` (a uint8 view of an arena)."""

    offset: int
    nbytes: int
    host: torch.Tensor
    regions: tuple[int, ...]  # indices of the chunk's regions it covers


class Arenas:
    """The arena storages allocated by one SwapOptimizer, known by storage address while they live."""

    def __init__(self) -> None:
        # Held strongly, so an address here is never reused by another allocation while it is listed;
        # prune() lets go of arenas no state uses any more.
        self._bases: dict[int, torch.Tensor] = {}
        self._pending: list[torch.Tensor] = []  # allocated, not yet pinned (pin_pending)
        self.pin_seconds = 0.0  # host time spent pinning arenas, all told
        self.pinned_total = 0  # bytes pinned, all told

    def allocate(self, nbytes: int) -> torch.Tensor:
        """An arena of ``nbytes`` taking that much host RAM, pageable until pin_pending (Note [arena memory])."""
        base = device.host_empty(nbytes, pin=False, exact=True)
        self._bases[base.untyped_storage().data_ptr()] = base
        self._pending.append(base)
        return base

    def pin_also(self, hosts: Sequence[torch.Tensor]) -> None:
        """Pin whichever of ``hosts`` (host_empty buffers made with pin=False, outside the arenas) is not yet;
        the time counts with the arenas'."""
        start = device.host_clock()
        device.pin_host(list(hosts))
        self.pin_seconds += device.host_clock() - start

    def pin_pending(self) -> float:
        """Pin the arenas allocated since the last call, together; the seconds it took."""
        if not self._pending:
            return 0.0
        pending, self._pending = self._pending, []
        start = device.host_clock()
        device.pin_host(pending)
        took = device.host_clock() - start
        self.pin_seconds += took
        self.pinned_total += sum(b.nbytes for b in pending)
        return took

    def place(self, base: torch.Tensor, offset: int, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A state of ``dtype`` with ``ref``'s (host-local) shape and dense layout at ``offset`` in ``base``."""
        loc = hoststate.local(ref)
        nbytes = loc.numel() * itemsize(dtype)
        flat = base[offset : offset + nbytes].view(dtype)
        return hoststate.wrap_like(ref, flat.as_strided(tuple(loc.shape), hoststate.layout_strides(loc)))

    def nbytes(self) -> int:
        """Bytes the arenas asked the pinned host allocator for."""
        return sum(b.nbytes for b in self._bases.values())

    def pinned_bytes(self) -> int:
        """Host bytes the arenas take (device.host_held_bytes): their size in whole pages; on NPU, where they
        come from torch_npu's pinned allocator, rounded up to a power of two unless
        PYTORCH_NPU_ALLOC_CONF=pin_memory_expandable_segments:True (device.npu_pinned_bytes)."""
        return sum(device.host_held_bytes(b.nbytes, exact=True) for b in self._bases.values())

    def prune(self, hosts: Sequence[torch.Tensor]) -> None:
        """Forget the arenas none of ``hosts`` (the host-local states in use) lies in."""
        live = {t.untyped_storage().data_ptr() for t in hosts}
        for ptr in [p for p in self._bases if p not in live]:
            del self._bases[ptr]
        self._pending = [b for b in self._pending if b.untyped_storage().data_ptr() in self._bases]

    def __len__(self) -> int:
        return len(self._bases)

    def locate(self, host: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """(arena base, byte offset) of a host view into an arena; None for any other tensor."""
        ptr = host.untyped_storage().data_ptr()
        base = self._bases.get(ptr)
        if base is None:
            return None
        return base, host.data_ptr() - ptr

    def adjacent(self, prev: torch.Tensor | None, host: torch.Tensor | None) -> bool:
        """``host`` starts in the same arena right where ``prev`` ends (both host-local, dense)."""
        if prev is None or host is None:
            return False
        a, b = self.locate(prev), self.locate(host)
        if a is None or b is None or a[0] is not b[0]:
            return False
        return a[1] + prev.numel() * prev.element_size() == b[1]

    def runs(self, regions: Sequence[Any]) -> list[Run]:
        """Merge consecutive regions (``offset``, ``nbytes``, ``host``) lying in one arena at the same
        relative positions as in the slot. A run of one region is kept only if it replaces nothing."""
        out: list[Run] = []
        cur: list[Any] = []  # [base, host_start, slot_start, slot_end, region indices]

        def close() -> None:
            if cur and len(cur[4]) > 1:
                base, hstart, sstart, send, idx = cur
                out.append(Run(sstart, send - sstart, base[hstart : hstart + send - sstart], tuple(idx)))

        for i, r in enumerate(regions):
            if r.host is None or r.nbytes == 0:
                continue
            where = self.locate(r.host)
            if where is None:
                close()
                cur = []
                continue
            base, hoff = where
            if cur and cur[0] is base and hoff - cur[1] == r.offset - cur[2] and r.offset == cur[3]:
                cur[3] = r.offset + r.nbytes
                cur[4].append(i)
                continue
            close()
            cur = [base, hoff, r.offset, r.offset + r.nbytes, [i]]
        close()
        return out
