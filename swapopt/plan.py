"""Chunk planning: pure functions over sizes, no torch.

A step moves every swapped state through the device in an ordered list of chunks. A chunk is a list
of pieces ``(param index, flat start, flat stop)``; the state bytes of a chunk stay within the chunk
budget. Params of element-wise optimizers may be split across chunks; their cut points are multiples
of ``align`` elements, so vectorized kernels group elements exactly as they do for the whole param
(bitwise parity). Other params are taken whole, so such a chunk holds at least the largest param.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

DEFAULT_ALIGN = 512  # elements; 2 KiB of fp32, a multiple of every CPU/GPU vector width
SLOT_ALIGN = 64  # bytes; every slot region starts on a cache line (and a 16-byte vector boundary)
EXTRA_CHUNKS = 1.5  # with swap_optimizer_times=T, up to 1.5 T chunks to keep params whole
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
# the staging memory, (slots + 1) x chunk. Within that bound the planner has choices that change the step's
# time but not its memory: whether to ramp the first chunks up and the last ones down (Note [ramp]), and
# whether to keep params whole with extra chunks or cut them. Each costs chunks or copies, and each chunk and
# copy costs time that moves no bytes: the link's latency per copy, each direction, and the host's time to issue
# a chunk (its launches and Python). Given the device's costs (``LinkCosts``: from the simulator's preset, a
# calibrated preset file, or the h100/910b figures, swapopt.costs), make_plan builds every plan these choices
# allow and keeps the one whose modeled time (``estimate_us``) is least, fewest chunks on a tie:
#     time = first swap-in alone + last swap-out alone
#            + max(per direction: copies x latency + its bytes at half the duplex rate, chunks x host per chunk)
# So a ramp chunk whose copy is shorter than the latency and host time it adds is left out (on the H100, with
# 15 us a copy and 60 us a chunk, ramp chunks below about 4 MiB), and a whole-param plan that needs more chunks
# than a cut one loses to it where chunks cost more than cut copies. Without costs the rules above apply as
# they are.


@dataclass(frozen=True)
class LinkCosts:
    """What a chunk and a copy cost on the device's link (Note [chunk count from costs]). Rates in GB/s
    (1e9 bytes/s), times in microseconds."""

    copy_latency_us: float
    h2d_gbps: float
    d2h_gbps: float
    duplex_gbps: float
    host_chunk_us: float

    def __post_init__(self) -> None:
        if min(self.h2d_gbps, self.d2h_gbps, self.duplex_gbps) <= 0:
            raise ValueError(f"link rates must be positive, got {self}")
        if self.copy_latency_us < 0 or self.host_chunk_us < 0:
            raise ValueError(f"latency and host time must be >= 0, got {self}")


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


def _copies(chunk: Chunk, sizes: dict[int, ParamSize]) -> int:
    """Copies each way of one chunk, as the host arena lays it out (swapopt.arena): one for the chunk, and
    one more per state of a piece that is only part of its param (its state lies whole elsewhere)."""
    extra = 0
    for pc in chunk.pieces:
        size = sizes.get(pc.index)
        if size is not None and size.state_bytes and (pc.start > 0 or pc.stop < size.numel):
            extra += max(size.regions, 1)
    return 1 + extra


def estimate_us(chunks: Sequence[Chunk], sizes: Sequence[ParamSize], costs: LinkCosts) -> float:
    """Modeled time of a step over ``chunks`` on a link with ``costs`` (Note [chunk count from costs])."""
    if not chunks:
        return 0.0
    by_index = {s.index: s for s in sizes}
    copies = sum(_copies(c, by_index) for c in chunks)
    nbytes = sum(c.nbytes for c in chunks)
    half = costs.duplex_gbps * 1e3 / 2  # bytes per us each direction gets with both busy
    body = max(
        copies * costs.copy_latency_us + nbytes / min(half, costs.h2d_gbps * 1e3, costs.d2h_gbps * 1e3),
        len(chunks) * costs.host_chunk_us,
    )
    fill = chunks[0].nbytes / (costs.h2d_gbps * 1e3) + chunks[-1].nbytes / (costs.d2h_gbps * 1e3)
    return fill + body


def _cheapest(candidates: Sequence[list[Chunk]], sizes: Sequence[ParamSize], costs: LinkCosts) -> list[Chunk]:
    """The candidate with the least modeled time, the fewest chunks on a tie (and the first of equals)."""
    return min(candidates, key=lambda cs: (round(estimate_us(cs, sizes, costs), 3), len(cs)))


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
    while lo < hi:
        mid = (lo + hi) // 2
        if len(chunk_pieces(sizes, mid, align, keep_whole=keep_whole)) > times:
            lo = mid + 1
        else:
            hi = mid
    return lo


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
) -> Plan:
    """Plan one step: resident params first, then chunks of the rest.

    With ``chunk_bytes`` the budget is fixed and params that fit a chunk stay whole. Otherwise the
    budget is about the swapped bytes divided by ``times``: raised to keep params whole when that
    costs at most 25% more per chunk; failing that, the fewest chunks within that same bound that keep
    them whole, if at most ``EXTRA_CHUNKS`` x ``times``; else the smallest budget that keeps alignment
    rounding from adding chunks beyond ``times``. Either way the first chunks ramp up (Note [ramp]),
    unless ``ramp`` is False (the optimizer prefetches its first chunks under the backward: there larger
    first chunks carry more of the first layers in), and the last chunks ramp down unless ``tail`` is False.
    With ``costs`` those choices (ramp, tail, whole params or cut ones) go to the plan of least modeled time
    (Note [chunk count from costs]); the chunk budget stays the one these rules give.
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
        chunks = options[0] if costs is None else _cheapest(options, swapped, costs)
    else:
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
            fewest = len(chunk_pieces(swapped, limit, align, keep_whole=True))
            if fewest <= math.floor(times * EXTRA_CHUNKS):
                budget = _smallest_budget(swapped, base, limit, fewest, align, keep_whole=True)
                keep_whole = True
        choices = [(budget, keep_whole)]
        if not keep_whole:
            choices = [(_smallest_budget(swapped, base, max(total, 1), times, align, keep_whole=False), False)]
        elif costs is not None and budget > base:
            # whole params cost a larger budget or extra chunks; cutting them costs copies: model both
            choices.append((_smallest_budget(swapped, base, max(total, 1), times, align, keep_whole=False), False))
        options = []
        for b, whole in choices:
            ramps = ramp_budgets(b) if ramp and times >= RAMP_MIN_CHUNKS else ()
            tails = tail_budgets(b) if tail and times >= RAMP_MIN_CHUNKS else ()
            for r, t in _ends(ramps, tails, costs):
                options.append((b, chunk_pieces(swapped, b, align, keep_whole=whole, ramp=r, tail=t)))
        if costs is None:
            budget, chunks = options[0]
        else:
            chunks = _cheapest([cs for _, cs in options], swapped, costs)
            budget = next(b for b, cs in options if cs is chunks)
    last = {p.index: k for k, c in enumerate(chunks) for p in c.pieces}
    return Plan(tuple(chunks), resident, budget, last)
