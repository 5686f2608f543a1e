"""The stream sanitizer's checks as the simulated device runs them (device/sim/sanitizer.py has the vector
clocks and access logs): RaceChecks, the part of SimDevice that checks each op's reads and writes against the
accesses nothing orders before them, logs new blocks on their allocation stream, and turns a block freed while
another stream may still use it into a hazard of the next allocations of its pool (Note [free and reuse])."""

from __future__ import annotations

import traceback

import torch

from device.sim.accesses import PAGEABLE
from device.sim.accesses import Arg as _Arg
from device.sim.accesses import StorageInfo as _Storage
from device.sim.memory import pool_of
from device.sim.ops import _span
from device.sim.sanitizer import (
    Access,
    Clocks,
    add_all,
    check_all,
    race_error,
    reused_use,
)
from device.sim.streams import SimStream

_WRITES = ("w", "o")  # the roles that write (Arg.writes)
# Access(*fields) with all eleven given, made in C: an Access is made for every tensor an op touches.
_new_tuple = tuple.__new__

# Note [free and reuse]
# A block freed on the host returns to the pool of the stream that allocated it, and the caching allocator
# hands it out again only to a later allocation on that stream, from the same pool (small: blocks of at most
# 1 MiB; large), and nothing else touches it: freeing issues no device work. So a use by another stream that
# is still unordered at the free is harmless unless the block is handed out again and the new owner uses it
# before it is ordered after the old use (an event or stream wait, record_stream, or a synchronize, which
# clears every hazard). Where in the new block the old bytes land is the allocator's choice, so every
# allocation of that pool on that stream until then may hold them: each gets the old use in its log (covering
# it whole), and its first access that nothing orders after the old use raises a "free" StreamRaceError,
# naming both. A block freed so and never handed out again, or handed out and used only after a wait, is
# safe, as on CUDA, and nothing is reported, at a synchronize or at exit either. This is how FSDP2 frees its
# reduce-scatter outputs safely: the reduce-scatter stream waits for the compute stream before it allocates
# again.

class RaceChecks:
    """SimDevice's sanitizer checks. Mixed into SimDevice (device/sim/device.py), whose __init__ makes the state
    used here (_clocks, _hazards, _host_actors, _actor_names, stacks)."""

    # Set by SimDevice.__init__.
    _clocks: Clocks
    _hazards: dict[int, list[tuple[Access, int, int, str]]]
    _host_actors: set[int]
    _actor_names: list[str]
    _labels: list[str]
    stacks: bool

    def _check_and_log(self, name: str, plan: list[tuple[_Arg, int, int]]) -> None:
        """Check every access of one op against the logs before any is recorded, then record them all."""
        labels = self._labels
        label = labels[-1] if labels else None
        stack = traceback.format_stack()[:-3] if self.stacks else None
        staged = []
        clocks = self._clocks
        for a, actor, epoch in plan:
            # byte_range and strided_layout, written out (one contiguity test for both): this runs for every access.
            t = a.tensor
            numel = t.numel()
            if not numel:
                continue
            itemsize = t.element_size()
            offset = t.storage_offset()
            if t.is_contiguous():
                span, layout = numel, None
            else:
                span = _span(t)
                layout = None if numel == 1 or span == numel else (tuple(t.shape), tuple(t.stride()), offset, itemsize)
            if a.info is None:
                a.info = self._register(a.storage, PAGEABLE)
                if self._collectives:  # host memory C++ made: a collective's work may hold it
                    self._hold(t)  # Note [collective tensors at exit]
            info = a.info
            acc = _new_tuple(Access, (
                offset * itemsize, (offset + span) * itemsize, a.role in _WRITES, actor, epoch, name, label, t.shape,
                layout, stack, None,
            ))  # fmt: skip
            staged.append((info, acc))
        found = check_all(staged, clocks)  # every access before any is recorded
        if found is not None:
            info, acc, rec = found
            raise race_error(acc, rec, info.uid, info.nbytes, self._actor_names)
        add_all(staged, clocks)

    def _log_new(self, t: torch.Tensor, info: _Storage, stream: SimStream, epoch: int, name: str) -> None:
        numel = t.numel()
        if numel:
            # byte_range, written out: this runs for every new device tensor.
            itemsize = t.element_size()
            offset = t.storage_offset()
            span = numel if t.is_contiguous() else _span(t)
            stack = traceback.format_stack()[:-3] if self.stacks else None
            labels = self._labels
            acc = _new_tuple(Access, (offset * itemsize, (offset + span) * itemsize, True, stream.actor, epoch, name,
                              labels[-1] if labels else None, t.shape, None, stack, None))
            if info.log.records and not name.endswith("(allocation)"):
                # The op writes a block the allocator may have reused (Note [free and reuse]).
                rec = info.log.conflict(acc, self._clocks)
                if rec is not None:
                    raise race_error(acc, rec, info.uid, info.nbytes, self._actor_names)
            info.log.add(acc, self._clocks)

    def _check_free(self, info: _Storage) -> None:
        """A device block returns to its allocation stream's pool (Note [free and reuse]): other streams'
        uses not yet ordered before that stream, nor covered by record_stream, become a hazard of it."""
        alloc_clock = self._clocks.clock(info.alloc_actor)
        host_clock = self._clocks.clock(self._host())
        for rec in info.log.records:
            if rec.actor in self._host_actors or rec.actor == info.alloc_actor or rec.actor in info.recorded:
                continue
            if alloc_clock.get(rec.actor, 0) >= rec.epoch or host_clock.get(rec.actor, 0) >= rec.epoch:
                continue
            if rec.freed is not None:  # an earlier block's use, inherited: that block's own hazard still stands
                continue
            hazard = (rec, info.uid, info.nbytes, pool_of(info.nbytes))
            self._hazards.setdefault(info.alloc_actor, []).append(hazard)
            return

    def _check_reuse(self, actor: int, info: _Storage) -> None:
        """Stream `actor` allocates `info`: the caching allocator may hand it a block of the same pool freed
        with a hazard (Note [free and reuse]). Each hazard not yet ordered before this stream (nor seen done by
        the host) goes into the new block's log as the old use, so the first access to the new memory that
        nothing orders after that use is the race; hazards ordered by now are dropped."""
        hazards = self._hazards.get(actor)
        if not hazards or not info.nbytes:
            return
        clock = self._clocks.clock(actor)
        host_clock = self._clocks.clock(self._host())
        pool = pool_of(info.nbytes)
        pending = []
        for hazard in hazards:
            rec, uid, nbytes, freed_pool = hazard
            if clock.get(rec.actor, 0) >= rec.epoch or host_clock.get(rec.actor, 0) >= rec.epoch:
                continue
            pending.append(hazard)
            if freed_pool == pool:
                info.log.records.append(reused_use(rec, uid, nbytes, info.nbytes))
        if pending:
            self._hazards[actor] = pending
        else:
            del self._hazards[actor]
