"""Chunk planning: pure functions over sizes, no torch.

A step moves every swapped state through the device in an ordered list of chunks. A chunk is a list
of pieces ``(param index, flat start, flat stop)``; the state bytes of a chunk stay within the chunk
budget. Params of element-wise optimizers may be split across chunks; their cut points are multiples
of ``align`` elements, so vectorized kernels group elements exactly as they do for the whole param
(bitwise parity). Other params are taken whole, so such a chunk holds at least the largest param.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from device.link_table import duplex_rate

DEFAULT_ALIGN = 512  # elements; 2 KiB of fp32, a multiple of every CPU/GPU vector width
SLOT_ALIGN = 64  # bytes; every slot region starts on a cache line (and a 16-byte vector boundary)
EXTRA_CHUNKS = 1.5  # with swap_optimizer_times=T, up to 1.5 T chunks to keep params whole
# With costs, the planner also models the plans the rules give for 2, 4, ... times the chunks asked for, up to
# MORE_CHUNKS times as many (Note [chunk count from costs]).
MORE_CHUNKS = 8
DEFAULT_SLOTS = 3  # staging slots the pipeline cycles through (swapopt.config's default)
# Bytes an update moves in device memory per state byte it swapped: fused AdamW reads and writes the param and its two
# states and reads the grad, 28 bytes an fp32 element against 8 bytes of states (Note [chunk count from costs]).
UPDATE_TRAFFIC = 3.5
# Note [ramp]: the step's first swap-in is the one copy nothing overlaps (the swap-out lane idles until the
# first update is done), and with overlap_forward the next forward waits for it. So the first chunks are
# cut smaller, 1/2**RAMP, ..., 1/4, 1/2 of the budget, each swap-out then covering the next, larger
# swap-in. Ramp chunks below RAMP_MIN_BYTES are left out: below it a chunk's launches cost more host time
# than its copy takes on the link, and a tiny state has no fill worth hiding. Plans of fewer than
# RAMP_MIN_CHUNKS chunks have none: the fill is a large share of any short pipeline, but a user asking for
# a few chunks asks for that many. With prefetch (the first chunks swapped in under the backward) there is
# no ramp either: larger prefetched chunks carry more of the first layers' states in ahead of the step.
#
# The step's last swap-out is the mirror image: nothing is left to swap in beside it, so it runs alone on the
# link, at one direction's rate where both together would carry the cap (Note [link sharing] in
# device/sim/presets.py). So plans of RAMP_MIN_CHUNKS or more chunks also end smaller, 1/2, 1/4, ...,
# 1/2**RAMP of the budget (the same floor on their size), with or without prefetch: the chunk before them
# takes what is left over, so every chunk stays within the budget. Both ends keep the memory cap of
# (slots + 1) x budget; each costs up to RAMP more chunks.
RAMP = 3
RAMP_MIN_BYTES = 512 << 10
RAMP_MIN_CHUNKS = 8

# Note [chunk count from costs]: ``swap_optimizer_times`` (or ``chunk_mb``) bounds the bytes of a chunk, and so
# the staging memory, (slots + 1) x chunk: with ``swap_optimizer_times`` a chunk holds at most a quarter more
# than an even split (docs/optimizer.md). Within that bound the planner has choices that change the step's time
# but not the bound: how many chunks (fewer, larger ones up to the bound, or more, smaller ones), whether to ramp
# the first chunks up and the last ones down (Note [ramp]), and whether to keep params whole with extra chunks or
# cut them. Each costs chunks or copies, and each chunk and copy costs time that moves no bytes: its direction's
# latency per copy (on the H100 2.7 us H2D, 1.7 us D2H once queued: SimPreset.latency_us) and the host's time to
# issue a chunk (its launches, its event records and stream waits, and Python; a replayed one's, its graph nodes:
# Note [replayed costs] in swapopt.costs). Given the device's costs (``LinkCosts``: from the simulator's preset,
# a calibrated preset file, or the h100/910b figures, swapopt.costs), make_plan builds the plans these choices
# allow, at a few budgets from the even split up to the bound, and the plans the rules give for 2, 4 and 8 times
# the chunks asked for, and keeps the one whose modeled time (``estimate_us``) is least, fewest chunks on a tie.
# ``estimate_us`` schedules the pipeline chunk by chunk: a swap-in once the host has issued it, its lane is free and
# its slot's last swap-out done; an update once its swap-in is done and the host has issued it; a swap-out once its
# update is done and its lane free; a copy takes its direction's latency and then its bytes at the rate that
# direction keeps with the other busy (the preset's duplex table at that copy size, Note [link sharing] in
# device/sim/preset_spec.py), at its rate alone once the other has nothing scheduled.
#
# What that schedule shows: a chunk's swap-out cannot start before its swap-in is done, so where the two
# directions move at about the same rate (the H100's 51.8 and 50.2 GB/s with both busy) the swap-out lane trails
# the swap-in lane by one chunk, whatever came before: a step takes every byte one way plus about one chunk's copy
# the other way. A ramp does not shorten that (each larger chunk's swap-in outlasts the smaller swap-out beside
# it); smaller chunks do, until their latencies and host time cost more than the lag they save. On the simulated
# H100 one FSDP2 rank at 16 requested chunks was 1.09 of the bound with 18 chunks (a ramp, 12 MiB chunks) and is
# 1.04 with 28 even ones; Llama-2-7B's 100 M-param layout 1.09 -> 1.01. So more chunks than asked for are taken
# where they model faster, never fewer than the memory bound allows; and where a chunk's copy is short against its
# latency and host time (many small chunks: one FSDP rank's shards at 64 chunks), fewer, larger chunks up to the
# bound win; a ramp chunk whose copy is shorter than the latency and host time it adds is left out; and a
# whole-param plan that needs more chunks than a cut one loses to it where chunks cost more than cut copies. More
# chunks asked for never means chunks above the bound they set: where the costs would want larger ones, the
# memory bound wins. The plans for 2T chunks are among those tried for T, so asking for fewer chunks never models
# slower. Without costs the rules above apply as they are.
#
# Note [cut chunks]: a chunk that holds pieces of cut params costs the host more than their copies. A cut piece's
# state dict is made each step (slot views of its range and a clone of its step count) and the cut pieces take a
# call of their own, while the chunk's whole params keep their dicts and take the direct step (Note [mixed chunks]
# in swapopt.pipeline). Before chunks were mixed, one cut piece sent every param of its chunk through the inner step:
# on the H100 (2026-11-27, bench/results/cuda-h100-2026-11-27-host.md) the moe layout at 100 M params and 16
# requested chunks cut a param in 18 of its 19 chunks and took 42 ms of host CPU a step, at 64 chunks (none cut)
# 26 ms. estimate_us charges such a chunk ``host_cut_chunk_us``.
#
# A piece of a param split across chunks costs a copy per state beyond the first, each way (``_chunk_work``): each
# state of a param lies dense and whole in host memory (the state dict hands them out as they are), so the
# same elements of two states are two ranges there, never one. The planner counts them; it cannot merge them.


@dataclass(frozen=True)
class LinkCosts:
    """What a chunk and a copy cost on the device's link (Note [chunk count from costs]). Rates in GB/s
    (1e9 bytes/s), times in microseconds."""

    copy_latency_us: float  # mean of the two directions' latencies
    h2d_gbps: float  # one direction alone
    d2h_gbps: float
    duplex_gbps: float  # the most both carry together
    host_chunk_us: float  # host time to issue one chunk: its launches, event calls and the pipeline's Python
    # The share of the two latencies an H2D copy pays (SimPreset.h2d_latency_share): 0.5, both the mean.
    h2d_latency_share: float = 0.5
    # (copy bytes, H2D GB/s, D2H GB/s) with both directions busy (SimPreset.duplex_table, link_sharing "sized");
    # none: each direction gets at most half of duplex_gbps while the other is busy.
    duplex_table: tuple[tuple[float, float, float], ...] = ()
    host_copy_us: float = 0.0  # host time of one more copy (its launch): what a split piece's copies add
    host_tensor_us: float = 0.0  # host time per tensor an update's lists take (param, grad, step, states)
    # Host time a chunk that holds cut pieces pays for them beyond their copies: a call of their own and their
    # state dicts, made each step (Note [cut chunks]).
    host_cut_chunk_us: float = 0.0
    # Device memory bandwidth, for an update's time (UPDATE_TRAFFIC bytes a swapped state byte); 0: updates are free.
    hbm_gbps: float = 0.0

    def __post_init__(self) -> None:
        if min(self.h2d_gbps, self.d2h_gbps, self.duplex_gbps) <= 0:
            raise ValueError(f"link rates must be positive, got {self}")
        if min(self.copy_latency_us, self.host_chunk_us, self.host_copy_us, self.host_tensor_us,
               self.host_cut_chunk_us, self.hbm_gbps) < 0:
            raise ValueError(f"latency and host time must be >= 0, got {self}")
        if not 0.0 <= self.h2d_latency_share <= 1.0:
            raise ValueError(f"h2d_latency_share must lie in [0, 1], got {self.h2d_latency_share}")
        table = tuple((float(n), float(h), float(d)) for n, h, d in self.duplex_table)
        if any(min(row) <= 0 for row in table) or any(a[0] >= b[0] for a, b in itertools.pairwise(table)):
            raise ValueError(f"duplex_table rows must be (bytes, GB/s, GB/s), all positive, bytes ascending: {table}")
        object.__setattr__(self, "duplex_table", table)

    def latency_us(self, direction: str) -> float:
        """The fixed cost of one copy of ``direction`` ("h2d" or "d2h") before its bytes flow."""
        share = self.h2d_latency_share if direction == "h2d" else 1.0 - self.h2d_latency_share
        return 2.0 * share * self.copy_latency_us

    def both_bytes_per_us(self, direction: str, nbytes: float) -> float:
        """Bytes per us a copy of ``direction`` and ``nbytes`` moves while the other direction is busy: the duplex
        table's rate at that size (interpolated in log size, clamped at its ends), never above the direction's
        rate alone (as SimPreset.both_gbps)."""
        alone = self.h2d_gbps if direction == "h2d" else self.d2h_gbps
        table = self.duplex_table
        if not table:
            return min(alone, self.duplex_gbps / 2) * 1e3
        rate = duplex_rate(table, direction, nbytes)
        return min(rate, alone) * 1e3


@dataclass(frozen=True)
class ParamSize:
    """What the planner needs to know about one param.

    ``state_bytes``: bytes of its swapped states (0 for params without swapped state);
    ``splittable``: its states are element-wise (same shape as the param), so a flat range of the
    param carries ``state_bytes // numel`` bytes per element; ``regions``: slot regions one piece of it
    occupies (one per state), each padded to ``SLOT_ALIGN`` bytes, which the budget must hold too.
    """

    index: int
    numel: int
    state_bytes: int
    splittable: bool = False
    regions: int = 0

    @property
    def elem_bytes(self) -> int:
        return self.state_bytes // self.numel if self.numel else 0

    @property
    def pad_bytes(self) -> int:
        """Most bytes the alignment of one piece's regions can add (none for empty states)."""
        return self.regions * (SLOT_ALIGN - 1) if self.state_bytes else 0


@dataclass(frozen=True)
class Piece:
    """Flat elements ``[start, stop)`` of param ``index``."""

    index: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Chunk:
    pieces: tuple[Piece, ...]
    nbytes: int  # slot bytes of this chunk: state bytes (and gathered grads), alignment padding included


@dataclass(frozen=True)
class Plan:
    chunks: tuple[Chunk, ...]
    resident: tuple[int, ...] = ()  # param indices whose states stay on the device
    budget: int = 0  # the chunk budget the chunks were cut to (bytes)
    last_chunk: dict[int, int] = field(default_factory=dict)  # param index -> chunk of its last piece

    @property
    def max_chunk_bytes(self) -> int:
        return max((c.nbytes for c in self.chunks), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


def ramp_budgets(budget: int) -> tuple[int, ...]:
    """Budgets of the first, smaller chunks of a plan with chunks of ``budget`` bytes (Note [ramp])."""
    return tuple(b for b in (budget >> j for j in range(RAMP, 0, -1)) if b >= RAMP_MIN_BYTES)


def tail_budgets(budget: int) -> tuple[int, ...]:
    """Budgets of the last, smaller chunks of a plan with chunks of ``budget`` bytes (Note [ramp])."""
    return tuple(reversed(ramp_budgets(budget)))


def _tail_sequence(left: int, full: int, tail: Sequence[int]) -> list[int]:
    """Budgets of the chunks that hold the last ``left`` bytes (at most two full chunks and the tail): the
    bytes above the tail in as few even chunks as fit the budget, then the tail; bytes above it smaller than
    its first chunk join that chunk, so the sizes only fall."""
    over = left - sum(tail)
    if over <= 0:
        return list(tail)
    if over < tail[0]:
        return [min(over + tail[0], full), *tail[1:]]
    n = -(-over // full)
    return [-(-over // n)] * n + list(tail)


def chunk_pieces(
    sizes: Sequence[ParamSize],
    budget: int,
    align: int = DEFAULT_ALIGN,
    *,
    keep_whole: bool = False,
    ramp: Sequence[int] = (),
    tail: Sequence[int] = (),
) -> list[Chunk]:
    """Greedy, order-preserving cut of ``sizes`` into chunks of at most ``budget`` state bytes.

    A chunk exceeds the budget only when it holds a single whole (unsplittable) param larger than
    the budget, or a single ``align``-element block of a splittable param. With ``keep_whole`` a
    splittable param that fits an empty chunk starts a new chunk instead of being cut: only params
    larger than the budget are split (a split param costs extra work on the failure path).
    ``ramp``: smaller budgets of the first chunks, ``tail`` of the last ones, largest first (Note [ramp]);
    both cut splittable params even with ``keep_whole``. The last chunk takes what is left, up to the full
    budget: cutting at aligned blocks leaves the tail's sizes a little off.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    sizes = list(sizes)
    full = max(int(budget), 1)
    ramp = [min(max(int(b), 1), full) for b in ramp]
    tail = [min(max(int(b), 1), full) for b in tail]
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    used = 0
    budget = ramp[0] if ramp else full  # of the chunk being filled
    left = sum(s.state_bytes + s.pad_bytes for s in sizes)  # bytes not yet placed in a chunk
    ending: list[int] = []  # once the tail is reached: budgets of the chunks after the one being filled
    tail_from: int | None = None  # the chunk the tail (with the chunk before it) starts at

    def close() -> None:
        nonlocal pieces, used, budget, ending, tail_from
        if pieces:
            chunks.append(Chunk(tuple(pieces), used))
            if len(chunks) < len(ramp):
                budget = ramp[len(chunks)]
            else:
                if tail and tail_from is None and left <= 2 * full + sum(tail):
                    ending, tail_from = _tail_sequence(left, full, tail), len(chunks)
                budget = ending.pop(0) if ending else full
                if tail_from is not None and not ending:
                    budget = full  # the last chunk takes whatever is left
        pieces, used = [], 0

    def in_ends() -> bool:
        """The chunk being filled is a ramp chunk or one before the last of the tail: they cut params to
        their budget."""
        return len(chunks) < len(ramp) or bool(ending)

    for size in sizes:
        if size.numel < 0 or size.state_bytes < 0:
            raise ValueError(f"negative size in {size}")
        pad = size.pad_bytes
        # ramp and tail chunks cut params to their budget: one whole param there would undo the ramp
        fits_whole = keep_whole and size.state_bytes + pad <= full and not in_ends()
        if not size.splittable or fits_whole or size.numel == 0 or size.state_bytes == 0:
            if pieces and size.state_bytes and used + size.state_bytes + pad > budget:
                close()  # a full chunk is closed by the next piece that carries bytes
            pieces.append(Piece(size.index, 0, size.numel))
            used += size.state_bytes + pad
            left -= size.state_bytes + pad
            continue
        if size.state_bytes % size.numel:
            raise ValueError(f"splittable param {size.index}: state bytes not a multiple of numel")
        start, eb = 0, size.elem_bytes
        while start < size.numel:
            fit = start + max(budget - used - pad, 0) // eb
            if fit >= size.numel:
                stop = size.numel
            else:
                stop = (fit // align) * align
                if stop <= start:
                    if pieces:  # no room for one aligned block here: next chunk
                        close()
                        continue
                    stop = min(size.numel, start + align)  # budget below one block: one block
            pieces.append(Piece(size.index, start, stop))
            used += (stop - start) * eb + pad
            left -= (stop - start) * eb + (pad if stop == size.numel else 0)
            start = stop
    close()
    return chunks


def _chunk_work(chunk: Chunk, sizes: dict[int, ParamSize]) -> tuple[int, int, int]:
    """(copies each way, cut pieces, tensors the host walks) of one chunk. Copies as the host arena lays it out
    (swapopt.arena): one copy for the chunk, and one more per state beyond the first of a piece that is only part
    of its param (its states lie whole and dense elsewhere, so that piece's range of each state is a range of its
    own: one state's joins the run beside it, the others' are copies of their own; Note [chunk count from costs]).
    Tensors per piece: the update's lists (param, grad, states, step count), the step count's add and its
    snapshot (Note [snapshot batches] in swapopt.pipeline), which a chunk stepped by the direct fused calls alone
    does not take (Note [undone step counts] in swapopt.internals), so there the count is one a piece high."""
    extra = cut = tensors = 0
    for pc in chunk.pieces:
        size = sizes.get(pc.index)
        if size is None:
            continue
        tensors += max(size.regions, 1) + 5
        if size.state_bytes and (pc.start > 0 or pc.stop < size.numel):
            extra += max(size.regions, 1) - 1
            cut += 1
    return 1 + extra, cut, tensors


def _moved_until(start: float, nbytes: float, both: float, alone: float, other_until: float) -> float:
    """When a copy's ``nbytes`` have moved, from ``start``: at ``both`` bytes per us while the other direction is
    busy (until ``other_until``), at ``alone`` after."""
    if start >= other_until:
        return start + nbytes / alone
    beside = (other_until - start) * both
    return start + nbytes / both if beside >= nbytes else other_until + (nbytes - beside) / alone


def estimate_us(
    chunks: Sequence[Chunk], sizes: Sequence[ParamSize], costs: LinkCosts, slots: int = DEFAULT_SLOTS
) -> float:
    """Modeled time of a step over ``chunks`` with ``slots`` staging slots on a link with ``costs`` (Note [chunk
    count from costs]): the pipeline's schedule, chunk by chunk. The host issues each chunk's update and swap-out
    in turn (its share of launches, Python and the tensors of its lists), and each swap-in with the swap-out of
    the chunk ``slots - 1`` before it (the first ``slots - 1`` at once). A swap-in starts once issued, its lane
    free and its slot's last swap-out done; an update once its swap-in is done and it is issued; a swap-out once
    its update is done and its lane free. Each copy waits its direction's latency, then moves its bytes at the
    rate that direction keeps while the other is busy, at its rate alone once the other has nothing left."""
    if not chunks:
        return 0.0
    slots = max(int(slots), 1)
    by_index = {s.index: s for s in sizes}
    lat = {way: costs.latency_us(way) for way in ("h2d", "d2h")}
    alone = {"h2d": costs.h2d_gbps * 1e3, "d2h": costs.d2h_gbps * 1e3}  # bytes per us
    hbm = costs.hbm_gbps * 1e3
    n = len(chunks)
    copies, host = [0] * n, [0.0] * n
    for k, chunk in enumerate(chunks):
        c, cut, tensors = _chunk_work(chunk, by_index)
        copies[k] = c
        # a cut piece's extra copies each way, and the copy of its scalar states (step) it is stepped with
        h = costs.host_chunk_us + (2 * (c - 1) + cut) * costs.host_copy_us + costs.host_tensor_us * tensors
        host[k] = h + (costs.host_cut_chunk_us if cut else 0.0)
    issued = list(itertools.accumulate(host))  # host clock once chunk k's update and swap-out are issued
    in_end, out_end = [0.0] * n, [0.0] * n

    def swap_in(j: int) -> None:
        ready = max(issued[j - slots + 1] if j >= slots - 1 else 0.0, in_end[j - 1] if j else 0.0,
                    out_end[j - slots] if j >= slots else 0.0)
        nbytes = chunks[j].nbytes
        both = costs.both_bytes_per_us("h2d", nbytes / copies[j])
        # the swap-outs already scheduled are what runs beside it
        in_end[j] = _moved_until(ready + copies[j] * lat["h2d"], nbytes, both, alone["h2d"], out_end[j - 1] if j else 0.0)

    done_in = -1
    update_end = 0.0
    for k in range(n):
        while done_in < min(k + slots - 1, n - 1):  # the swap-ins issued by now: each needs an older swap-out
            done_in += 1
            swap_in(done_in)
        nbytes = chunks[k].nbytes
        update_end = max(in_end[k], issued[k], update_end) + (UPDATE_TRAFFIC * nbytes / hbm if hbm else 0.0)
        start = max(update_end, out_end[k - 1] if k else 0.0)
        both = costs.both_bytes_per_us("d2h", nbytes / copies[k])
        out_end[k] = _moved_until(start + copies[k] * lat["d2h"], nbytes, both, alone["d2h"], in_end[done_in])
    return out_end[-1]


def _cheapest(
    candidates: Sequence[list[Chunk]], sizes: Sequence[ParamSize], costs: LinkCosts, slots: int = DEFAULT_SLOTS
) -> list[Chunk]:
    """The candidate with the least modeled time, the fewest chunks on a tie (and the first of equals)."""
    return min(candidates, key=lambda cs: _rank(cs, sizes, costs, slots))


def _rank(chunks: Sequence[Chunk], sizes: Sequence[ParamSize], costs: LinkCosts, slots: int) -> tuple[float, int]:
    """What plans are compared by: modeled time (to the ns), then chunks."""
    return round(estimate_us(chunks, sizes, costs, slots), 3), len(chunks)


def _ends(ramps: Sequence[int], tails: Sequence[int], costs: LinkCosts | None) -> list[tuple[tuple, tuple]]:
    """The (ramp, tail) budgets to try: as given without costs; with costs, each end on and off."""
    if costs is None:
        return [(tuple(ramps), tuple(tails))]
    return list(dict.fromkeys((r, t) for r in {tuple(ramps), ()} for t in {tuple(tails), ()}))


def budget_for(total_bytes: int, times: int) -> int:
    """Bytes per chunk that split ``total_bytes`` into ``times`` chunks."""
    if times < 1:
        raise ValueError(f"swap_optimizer_times must be >= 1, got {times}")
    return max(1, math.ceil(total_bytes / times))


def pick_resident(sizes: Sequence[ParamSize], resident_bytes: int) -> tuple[int, ...]:
    """Whole params, in order, whose states fit ``resident_bytes`` together (first fit)."""
    chosen: list[int] = []
    left = resident_bytes
    for size in sizes:
        if 0 < size.state_bytes <= left:
            chosen.append(size.index)
            left -= size.state_bytes
    return tuple(chosen)


def _smallest_budget(
    sizes: Sequence[ParamSize], lo: int, hi: int, times: int, align: int, *, keep_whole: bool
) -> int:
    """Smallest budget in [lo, hi] that cuts ``sizes`` into at most ``times`` chunks (binary search;
    greedy cutting in a fixed order never needs more chunks for a larger budget)."""
    items = [(s.numel, s.state_bytes, s.splittable, s.pad_bytes) for s in sizes]
    while lo < hi:
        mid = (lo + hi) // 2
        if count_chunks(items, mid, align, keep_whole) > times:
            lo = mid + 1
        else:
            hi = mid
    return lo


def count_chunks(items: Sequence[tuple[int, int, bool, int]], budget: int, align: int, keep_whole: bool) -> int:
    """``len(chunk_pieces(sizes, budget, align, keep_whole=keep_whole))`` without ramp or tail, from each size's
    (numel, state bytes, splittable, pad bytes), without building the chunks: the binary searches above call it
    some twenty times a plan, on up to tens of thousands of params."""
    budget = max(int(budget), 1)
    n, used, has = 0, 0, False
    for numel, nbytes, split, pad in items:
        if numel < 0 or nbytes < 0:
            raise ValueError(f"negative size ({numel} elements, {nbytes} bytes)")
        if not split or (keep_whole and nbytes + pad <= budget) or numel == 0 or nbytes == 0:
            if has and nbytes and used + nbytes + pad > budget:
                n, used = n + 1, 0
            used += nbytes + pad
            has = True
            continue
        if nbytes % numel:
            raise ValueError(f"splittable param of {numel} elements: state bytes {nbytes} not a multiple of numel")
        eb, start = nbytes // numel, 0
        while start < numel:
            fit = start + max(budget - used - pad, 0) // eb
            if fit >= numel:
                stop = numel
            else:
                stop = (fit // align) * align
                if stop <= start:
                    if has:
                        n, used, has = n + 1, 0, False
                        continue
                    stop = min(numel, start + align)
            used += (stop - start) * eb + pad
            has = True
            start = stop
    return n + has


def _least_time(
    sizes: Sequence[ParamSize], choices: Sequence[tuple[int, bool, int]], align: int, ramp: bool, tail: bool,
    costs: LinkCosts, slots: int = DEFAULT_SLOTS,
) -> tuple[int, list[Chunk]]:
    """(budget, chunks) of least modeled time (Note [chunk count from costs]): each of the rules' ``choices``
    (budget, keep params whole, the bound it was chosen under), each also at budgets up to that bound (fewer,
    larger chunks, never above the user's bound), each with the ends the rules give (Note [ramp]) and with none;
    then the best of those with each end alone."""

    def plan(b: int, whole: bool, r: Sequence[int], t: Sequence[int]) -> list[Chunk]:
        return chunk_pieces(sizes, b, align, keep_whole=whole, ramp=r, tail=t)

    def ends(b: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (ramp_budgets(b) if ramp else ()), (tail_budgets(b) if tail else ())

    tried: list[tuple[int, bool]] = []
    for b, whole, limit in choices:
        # larger budgets keep whole params whole within the count the rules allowed (a larger budget never
        # needs more chunks), and cut ones within `times`
        for c in (b, b + (limit - b) // 2, limit) if b < limit else (b,):
            if (c, whole) not in tried:
                tried.append((c, whole))
    options: list[tuple[int, bool, tuple, tuple, list[Chunk]]] = []
    ranks: list[tuple[float, int]] = []  # per option, as _cheapest ranks it: each plan modeled once

    def best() -> tuple[int, bool, tuple, tuple, list[Chunk]]:
        ranks.extend(_rank(o[4], sizes, costs, slots) for o in options[len(ranks):])
        return options[min(range(len(options)), key=ranks.__getitem__)]

    for b, whole in tried:
        r, t = ends(b)
        for rt in dict.fromkeys([(r, t), ((), ())]):
            options.append((b, whole, *rt, plan(b, whole, *rt)))
    b, whole, r, t, _ = best()
    full_r, full_t = ends(b)
    for rt in {(full_r, ()), ((), full_t)} - {(r, t), (full_r, full_t), ((), ())}:
        options.append((b, whole, *rt, plan(b, whole, *rt)))
    chosen = best()
    return chosen[0], chosen[4]


def _rule_choices(
    swapped: Sequence[ParamSize], total: int, times: int, align: int, costed: bool
) -> tuple[list[tuple[int, bool]], int]:
    """The rules' (budget, keep params whole) for ``times`` chunks, first the one they pick, and the bound on a
    chunk's bytes they were chosen under (make_plan)."""
    # Prefer whole params (no cuts at chunk boundaries): a cut costs a copy per state and direction in
    # each chunk it spans and extra work on the failure path. Keep them whole when that costs at most a
    # quarter more bytes per chunk than an even split, with `times` chunks or else up to EXTRA_CHUNKS
    # times as many; otherwise cut params to hold `times` even chunks.
    base = budget_for(total, times)
    limit = base + base // 4
    budget = _smallest_budget(swapped, base, max(total, 1), times, align, keep_whole=True)
    keep_whole = budget <= limit
    if not keep_whole:
        # Every chunk costs a copy latency each way and a share of the launches: take the fewest chunks
        # that keep params whole within the bound, and the smallest budget that gives that many.
        fewest = count_chunks([(s.numel, s.state_bytes, s.splittable, s.pad_bytes) for s in swapped], limit, align, True)
        if fewest <= math.floor(times * EXTRA_CHUNKS):
            budget = _smallest_budget(swapped, base, limit, fewest, align, keep_whole=True)
            keep_whole = True
    cut = (_smallest_budget(swapped, base, max(total, 1), times, align, keep_whole=False), False)
    if not keep_whole:
        return [cut], limit
    # with costs, whole params cost a larger budget or extra chunks; cutting them costs copies: model both
    return ([(budget, True), cut] if costed else [(budget, True)]), limit


def make_plan(
    sizes: Iterable[ParamSize],
    *,
    times: int = 16,
    chunk_bytes: int | None = None,
    resident_bytes: int = 0,
    align: int = DEFAULT_ALIGN,
    ramp: bool = True,
    tail: bool = True,
    costs: LinkCosts | None = None,
    slots: int = DEFAULT_SLOTS,
) -> Plan:
    """Plan one step: resident params first, then chunks of the rest.

    With ``chunk_bytes`` the budget is fixed and params that fit a chunk stay whole. Otherwise the
    budget is about the swapped bytes divided by ``times``: raised to keep params whole when that
    costs at most 25% more per chunk; failing that, the fewest chunks within that same bound that keep
    them whole, if at most ``EXTRA_CHUNKS`` x ``times``; else the smallest budget that keeps alignment
    rounding from adding chunks beyond ``times``. Either way the first chunks ramp up (Note [ramp]),
    unless ``ramp`` is False (the optimizer prefetches its first chunks under the backward: there larger
    first chunks carry more of the first layers in), and the last chunks ramp down unless ``tail`` is False.
    With ``costs`` those choices (ramp, tail, whole params or cut ones) and the chunk count, down to the fewest
    chunks within that same bound of 25% more bytes per chunk, go to the plan of least modeled time (Note [chunk
    count from costs]); with ``chunk_bytes`` the budget stays as given.
    """
    if times < 1:
        raise ValueError(f"swap_optimizer_times must be >= 1, got {times}")
    sizes = list(sizes)
    resident = pick_resident(sizes, resident_bytes) if resident_bytes > 0 else ()
    rset = set(resident)
    swapped = [s for s in sizes if s.index not in rset]
    total = sum(s.state_bytes + s.pad_bytes for s in swapped)
    if chunk_bytes is not None:
        budget = max(1, int(chunk_bytes))
        ends = total >= RAMP_MIN_CHUNKS * budget
        ramps = ramp_budgets(budget) if ramp and ends else ()
        tails = tail_budgets(budget) if tail and ends else ()
        options = [
            chunk_pieces(swapped, budget, align, keep_whole=True, ramp=r, tail=t) for r, t in _ends(ramps, tails, costs)
        ]
        chunks = options[0] if costs is None else _cheapest(options, swapped, costs, slots)
    else:
        choices, limit = _rule_choices(swapped, total, times, align, costs is not None)
        budget, keep_whole = choices[0]
        ends = ramp and times >= RAMP_MIN_CHUNKS, tail and times >= RAMP_MIN_CHUNKS
        if costs is None:
            ramps = ramp_budgets(budget) if ends[0] else ()
            tails = tail_budgets(budget) if ends[1] else ()
            chunks = chunk_pieces(swapped, budget, align, keep_whole=keep_whole, ramp=ramps, tail=tails)
        else:
            # and the rules' plans for 2, 4, ... times the chunks: smaller chunks, where the costs favour them
            # (Note [chunk count from costs]); so a plan for T chunks is modeled as fast as one for 2T at least
            more = [(b, whole, limit) for b, whole in choices]
            more_times = 2 * times
            while more_times <= MORE_CHUNKS * times and budget_for(total, more_times) >= RAMP_MIN_BYTES:
                options, bound = _rule_choices(swapped, total, more_times, align, True)
                more += [(b, whole, bound) for b, whole in options]
                more_times *= 2
            budget, chunks = _least_time(swapped, list(dict.fromkeys(more)), align, *ends, costs, slots)
    last = {p.index: k for k, c in enumerate(chunks) for p in c.pieces}
    return Plan(tuple(chunks), resident, budget, last)
