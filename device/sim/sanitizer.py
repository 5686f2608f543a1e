"""Happens-before race detection between streams and the host, with vector clocks.

Actors are the host (id 0) and each stream. Every op an actor runs gets the next epoch of that
actor. An access (actor a, epoch e) happens before a later op of actor b when b's clock has seen
epoch e of a: program order on one actor, or a chain of event waits / stream waits / synchronizes.
Accesses are tracked per storage at byte-range granularity.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

HOST = 0
# Beyond this many bytes of overlapping span, two strided accesses are assumed to share bytes
# (exact element sets would cost more memory than the check is worth).
EXACT_LIMIT = 1 << 26

Clock = dict[int, int]


class StreamRaceError(RuntimeError):
    """Two accesses to the same bytes, at least one a write, that nothing orders.

    Structured fields (None where not applicable): `access` and `earlier` (the two Access records),
    `stream` and `earlier_stream` (names), `op` and `earlier_op`, `earlier_stack` (where the earlier
    access was made, innermost frame last), `storage` (id) and `nbytes`, and `kind` ("access" for two
    unordered accesses, "free" for a new allocation used while a block freed into it may still be in use by
    another stream: `earlier` is that use, `access` the new allocation's, `storage` the new one's id)."""

    def __init__(
        self,
        message: str,
        *,
        kind: str = "access",
        access: Access | None = None,
        earlier: Access | None = None,
        stream: str | None = None,
        earlier_stream: str | None = None,
        storage: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.access = access
        self.earlier = earlier
        self.stream = stream
        self.earlier_stream = earlier_stream
        self.op = access.op if access is not None else None
        self.earlier_op = earlier.op if earlier is not None else None
        self.earlier_stack = earlier.stack if earlier is not None else None
        self.storage = storage
        self.nbytes = nbytes

    def __str__(self) -> str:
        text = self.message
        if self.earlier_stack:
            text += "\nearlier access made at:\n" + "".join(self.earlier_stack)
        return text


class Access(NamedTuple):
    # A tuple: the simulator makes one for every tensor an op touches, and a tuple is made without a Python frame
    # (tuple.__new__(Access, fields): device/sim/race_checks.py), where a dataclass's __init__ is one.
    start: int  # byte range [start, end) within the storage
    end: int
    write: bool
    actor: int
    epoch: int
    op: str  # "aten.copy_.default"
    label: str | None  # innermost torch.profiler.record_function range
    shape: tuple[int, ...]
    # (sizes, strides, storage offset, itemsize) of a strided view whose elements do not fill
    # [start, end); None for dense accesses
    layout: tuple | None = None
    stack: list[str] | None = None
    # (storage id, bytes) of a freed block this record stands for in a new allocation on the stream the
    # block went back to (Note [free and reuse] in device/sim/device.py); None for an access of its own
    freed: tuple[int, int] | None = None

    def __repr__(self) -> str:  # without the stack, which can be long
        fields = ", ".join(f"{name}={value!r}" for name, value in zip(self._fields, self) if name != "stack")
        return f"Access({fields})"

    def covers(self, other: Access) -> bool:
        """Whether every byte `other` touches is one this access touches."""
        return self.layout is None and self.start <= other.start and other.end <= self.end


def _byte_mask(acc: Access, lo: int, hi: int) -> np.ndarray:
    """Bytes of [lo, hi) that `acc` touches."""
    mask = np.zeros(hi - lo, dtype=bool)
    if acc.layout is None:
        mask[max(acc.start, lo) - lo : min(acc.end, hi) - lo] = True
        return mask
    sizes, strides, offset, itemsize = acc.layout
    # Element start offsets in bytes, relative to lo, as an index grid over all dims.
    starts = np.array([offset * itemsize - lo], dtype=np.int64)
    for size, stride in zip(sizes, strides):
        starts = (starts[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride * itemsize).reshape(-1)
    for b in range(itemsize):
        pos = starts + b
        pos = pos[(pos >= 0) & (pos < hi - lo)]
        mask[pos] = True
    return mask


def overlap(a: Access, b: Access) -> bool:
    """Whether two accesses share a byte: spans first, then exact element sets for strided views."""
    lo, hi = max(a.start, b.start), min(a.end, b.end)
    if lo >= hi:
        return False
    if a.layout is None and b.layout is None:
        return True
    if hi - lo > EXACT_LIMIT or _elements(a) > EXACT_LIMIT or _elements(b) > EXACT_LIMIT:
        return True
    return bool(np.any(_byte_mask(a, lo, hi) & _byte_mask(b, lo, hi)))


def _elements(acc: Access) -> int:
    return 0 if acc.layout is None else math.prod(acc.layout[0])


class Clocks:
    """One vector clock per actor.

    Per-op cost must not grow with every stream ever made: a retired actor (a dropped stream, a finished
    thread) whose last epoch every live actor has seen can never race again, so it is compacted away:
    its entries leave every clock and its records count as ordered."""

    _COMPACT_AT = 32  # retired actors waiting before a compaction pass

    def __init__(self) -> None:
        self._vc: list[Clock] = [{HOST: 0}]
        self._live: list[int] = [HOST]  # actors that can still run ops
        self._retired: list[int] = []
        self._compacted: set[int] = set()

    def new_actor(self) -> int:
        actor = len(self._vc)
        self._vc.append({actor: 0})
        self._live.append(actor)
        return actor

    def retire(self, actor: int) -> None:
        self._live.remove(actor)
        self._retired.append(actor)
        if len(self._retired) >= self._COMPACT_AT:
            self.compact()

    def compact(self) -> None:
        """Drop retired actors that every live actor has caught up with."""
        waiting = []
        for actor in self._retired:
            last = self._vc[actor].get(actor, 0)
            if all(self._vc[b].get(actor, 0) >= last for b in self._live):
                self._compacted.add(actor)
                for b in self._live:
                    self._vc[b].pop(actor, None)
                self._vc[actor] = {}
            else:
                waiting.append(actor)
        self._retired = waiting

    def clock(self, actor: int) -> Clock:
        return self._vc[actor]

    @property
    def compacted(self) -> set[int]:
        """Retired actors every live actor has caught up with (ordered before everything from now on)."""
        return self._compacted

    def actors(self) -> list[int]:
        """Actors that can still run ops (retired ones left nothing a live actor has not seen or will)."""
        return list(self._live) + list(self._retired)

    def tick(self, actor: int) -> int:
        clock = self._vc[actor]
        clock[actor] += 1
        return clock[actor]

    def snapshot(self, actor: int) -> Clock:
        return dict(self._vc[actor])

    def merge(self, actor: int, other: Clock) -> None:
        clock = self._vc[actor]
        compacted = self._compacted
        for a, e in other.items():
            if clock.get(a, 0) < e and a not in compacted:
                clock[a] = e

    def merge_actor(self, actor: int, other_actor: int) -> None:
        self.merge(actor, self._vc[other_actor])

    def ordered(self, acc: Access, actor: int) -> bool:
        """Whether `acc` happens before the next op of `actor`."""
        return acc.actor == actor or self._vc[actor].get(acc.actor, 0) >= acc.epoch or acc.actor in self._compacted

    def has_seen(self, actor: int, clock: Clock) -> bool:
        """Whether `actor` has seen every epoch in `clock`."""
        mine = self._vc[actor]
        return all(mine.get(a, 0) >= e or a in self._compacted for a, e in clock.items())

    def seen_by_all(self, acc: Access) -> bool:
        """Whether every actor is already ordered after `acc`: it can never race again."""
        return acc.actor in self._compacted or all(self._vc[a].get(acc.actor, 0) >= acc.epoch for a in self._live)


class AccessLog:
    """Recent accesses to one storage, kept small: records that a later access supersedes are dropped, and
    records every live actor is ordered after are pruned once the log outgrows ``prune_at``."""

    __slots__ = ("records", "prune_at")

    _PRUNE_AT = 16

    def __init__(self) -> None:
        self.records: list[Access] = []
        # Note [amortized pruning]: a storage that many tensors view (a swap slot, an arena, a flat buffer) holds
        # records of disjoint byte ranges, none of which supersedes another; while a step is in flight none is seen
        # by every actor yet, so pruning at a fixed size would re-scan the whole log on every access (a multi-tensor
        # op over a chunk of 400 params: 2.8 M clock look-ups). The next prune waits until the log has doubled
        # what the last one kept. Pruning later only keeps records longer, which cannot race (a record every live
        # actor has seen stays seen: clocks only grow, and a new stream's first launch merges the host's clock).
        self.prune_at = type(self)._PRUNE_AT

    @property
    def log(self) -> AccessLog:
        return self  # a log is its own holder for check_all / add_all

    def conflict(self, acc: Access, clocks: Clocks) -> Access | None:
        """The first recorded access that races with `acc`, or None."""
        found = check_all([(self, acc)], clocks)
        return None if found is None else found[2]

    def add(self, acc: Access, clocks: Clocks) -> None:
        """Record `acc` (already checked). An access that covers a record and follows it supersedes it when
        it is a write, or when both are reads: whatever would race with the old record races with it."""
        add_all([(self, acc)], clocks)


def check_all(staged: list[tuple[Any, Access]], clocks: Clocks) -> tuple[Any, Access, Access] | None:
    """The first (holder, access, earlier record) among one op's (holder of an AccessLog, access) pairs whose
    access races with a record of the holder's log, or None: written out, one frame per op, not per access."""
    for holder, acc in staged:
        records = holder.log.records
        if not records:  # nothing to race with in an empty log
            continue
        start, end, write, actor = acc.start, acc.end, acc.write, acc.actor
        mine, compacted = clocks._vc[actor], clocks._compacted
        for rec in records:
            if (
                rec.start < end
                and start < rec.end
                and (write or rec.write)
                and not (rec.actor == actor or mine.get(rec.actor, 0) >= rec.epoch or rec.actor in compacted)
                and overlap(rec, acc)
            ):
                return holder, acc, rec
    return None


def add_all(staged: list[tuple[Any, Access]], clocks: Clocks) -> None:
    """Record each (holder of an AccessLog, access) of one op, in order (already checked), written out (one frame
    per op). An access that covers a record and follows it supersedes it when it is a write, or when both are
    reads: whatever would race with the old record races with it."""
    compacted = clocks._compacted
    for holder, acc in staged:
        log = holder.log
        records = log.records
        if not records:
            log.records = [acc]
            continue
        start, end, write, actor = acc.start, acc.end, acc.write, acc.actor
        kept = []
        if acc.layout is None:
            mine = clocks._vc[actor]
            for rec in records:
                if not (
                    start <= rec.start
                    and rec.end <= end
                    and (write or not rec.write)
                    and (rec.actor == actor or mine.get(rec.actor, 0) >= rec.epoch or rec.actor in compacted)
                ):
                    kept.append(rec)
        else:
            kept.extend(records)
        kept.append(acc)
        if len(kept) > log.prune_at:
            kept = [rec for rec in kept if not clocks.seen_by_all(rec)]
            log.prune_at = max(AccessLog._PRUNE_AT, 2 * len(kept))  # Note [amortized pruning]
        log.records = kept


def where(acc: Access, names: list[str]) -> str:
    """"stream#1" or "stream#1 (in 'swap-in')": the actor's name and the record_function range."""
    return f"{names[acc.actor]} (in {acc.label!r})" if acc.label else names[acc.actor]


def race_message(acc: Access, rec: Access, storage_id: int, nbytes: int, names: list[str]) -> str:
    return (
        f"stream race on a tensor of shape {tuple(acc.shape)} (bytes [{acc.start}, {acc.end}) of storage "
        f"#{storage_id}, {nbytes} bytes): {acc.op} on {where(acc, names)} {'writes' if acc.write else 'reads'} "
        f"it while {rec.op} on {where(rec, names)} {'wrote' if rec.write else 'read'} bytes "
        f"[{rec.start}, {rec.end}) (shape {tuple(rec.shape)}) and no event wait, stream wait or synchronize "
        f"orders the two"
    )


def reused_use(rec: Access, uid: int, nbytes: int, new_nbytes: int) -> Access:
    """The record a freed block's unordered use `rec` leaves in a new allocation that may be handed that
    block: the whole new block (where in it the old bytes land is the allocator's choice), the same actor,
    epoch and kind of access."""
    return Access(
        0, new_nbytes, rec.write, rec.actor, rec.epoch, rec.op, rec.label, rec.shape, None, rec.stack, (uid, nbytes)
    )


def free_race_error(acc: Access, rec: Access, storage_id: int, nbytes: int, names: list[str]) -> StreamRaceError:
    """`acc` uses a new allocation that may hold a block freed while `rec` (another stream) still used it."""
    freed_id, freed_bytes = rec.freed
    stream, other = names[acc.actor], names[rec.actor]
    return StreamRaceError(
        f"a device tensor of shape {tuple(rec.shape)} ({freed_bytes} bytes, storage #{freed_id}) was freed while "
        f"{rec.op} on {where(rec, names)} may still use it, and its memory went back to the pool of {stream}, "
        f"which handed out storage #{storage_id} ({nbytes} bytes) since: {acc.op} on {where(acc, names)} "
        f"{'writes' if acc.write else 'reads'} it before anything orders it after that use; call "
        f"device.record_stream(t, stream) (or t.record_stream) before dropping the old tensor, or make {stream} "
        f"wait for {other} first",
        kind="free",
        access=acc,
        earlier=rec,
        stream=stream,
        earlier_stream=other,
        storage=storage_id,
        nbytes=nbytes,
    )


def race_error(acc: Access, rec: Access, storage_id: int, nbytes: int, names: list[str]) -> StreamRaceError:
    """The error for two unordered conflicting accesses, with its structured fields filled in."""
    if rec.freed is not None:
        return free_race_error(acc, rec, storage_id, nbytes, names)
    return StreamRaceError(
        race_message(acc, rec, storage_id, nbytes, names),
        access=acc,
        earlier=rec,
        stream=names[acc.actor],
        earlier_stream=names[rec.actor],
        storage=storage_id,
        nbytes=nbytes,
    )
