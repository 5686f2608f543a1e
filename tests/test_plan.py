"""Chunk planning: pure functions, checked with hypothesis."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swapopt.plan import (
    EXTRA_CHUNKS, RAMP, RAMP_MIN_BYTES, RAMP_MIN_CHUNKS, Chunk, LinkCosts, ParamSize, Piece, budget_for, chunk_pieces,
    count_chunks,
    estimate_us, make_plan,
    pick_resident, ramp_budgets, tail_budgets,
)

ALIGN = 8


@st.composite
def param_sizes(draw, max_params: int = 12):
    n = draw(st.integers(0, max_params))
    sizes = []
    for i in range(n):
        numel = draw(st.integers(0, 300))
        splittable = draw(st.booleans())
        if splittable:
            elem = draw(st.sampled_from([0, 2, 4, 8, 12, 16]))
            sizes.append(ParamSize(i, numel, numel * elem, True))
        else:
            sizes.append(ParamSize(i, numel, draw(st.integers(0, 2000)), False))
    return sizes


def _check_cover(sizes, chunks):
    flat = [p for c in chunks for p in c.pieces]
    by_param: dict[int, list[Piece]] = {}
    for p in flat:
        by_param.setdefault(p.index, []).append(p)
    assert sorted(by_param) == sorted(s.index for s in sizes)
    # order stable: pieces appear in param order, then flat order
    assert [(p.index, p.start) for p in flat] == sorted((p.index, p.start) for p in flat)
    for s in sizes:
        pieces = by_param[s.index]
        assert pieces[0].start == 0 and pieces[-1].stop == s.numel
        for a, b in zip(pieces, pieces[1:]):
            assert a.stop == b.start  # contiguous: every element exactly once
        if not s.splittable:
            assert len(pieces) == 1
        for p in pieces:
            assert p.stop == s.numel or p.stop % ALIGN == 0, "cut not aligned"
            assert p.numel > 0 or s.numel == 0


@settings(max_examples=300, deadline=None)
@given(param_sizes(), st.integers(1, 3000), st.booleans())
def test_count_chunks_is_the_count_of_chunk_pieces(sizes, budget, whole):
    items = [(s.numel, s.state_bytes, s.splittable, s.pad_bytes) for s in sizes]
    assert count_chunks(items, budget, ALIGN, whole) == len(chunk_pieces(sizes, budget, ALIGN, keep_whole=whole))


@settings(max_examples=300, deadline=None)
@given(param_sizes(), st.integers(1, 3000))
def test_chunk_pieces_cover_budget_order(sizes, budget):
    chunks = chunk_pieces(sizes, budget, ALIGN)
    _check_cover(sizes, chunks)
    by_index = {s.index: s for s in sizes}
    for c in chunks:
        assert c.pieces
        nbytes = sum(
            p.numel * by_index[p.index].elem_bytes if by_index[p.index].splittable else by_index[p.index].state_bytes
            for p in c.pieces
        )
        assert nbytes == c.nbytes
        if c.nbytes > budget:
            # only a lone oversized whole param or a lone aligned block may exceed the budget
            big = [p for p in c.pieces if by_index[p.index].state_bytes > 0]
            assert len(big) == 1
            s = by_index[big[0].index]
            assert (not s.splittable) or big[0].numel <= ALIGN


@settings(max_examples=300, deadline=None)
@given(param_sizes(), st.integers(1, 40))
def test_make_plan_times(sizes, times):
    plan = make_plan(sizes, times=times, align=ALIGN)
    _check_cover(sizes, plan.chunks)
    total = sum(s.state_bytes for s in sizes)
    assert plan.total_bytes == total
    swapped = [s for s in sizes if s.state_bytes > 0]
    if swapped and all(s.splittable for s in swapped):
        ramp = len(ramp_budgets(plan.budget)) if times >= RAMP_MIN_CHUNKS else 0
        ramp += len(tail_budgets(plan.budget)) if times >= RAMP_MIN_CHUNKS else 0
        assert len(plan.chunks) <= int(times * EXTRA_CHUNKS) + ramp
        if len(plan.chunks) > times + ramp:  # extra chunks only to keep params whole, never larger ones
            assert all(len([p for c in plan.chunks for p in c.pieces if p.index == s.index]) == 1
                       for s in swapped if s.state_bytes + s.pad_bytes <= plan.budget)
            assert plan.budget <= budget_for(total + sum(s.pad_bytes for s in sizes), times) * 5 // 4 + 1
    for i, k in plan.last_chunk.items():
        assert any(p.index == i for p in plan.chunks[k].pieces)
        assert all(p.index != i for c in plan.chunks[k + 1:] for p in c.pieces)


@settings(max_examples=300, deadline=None)
@given(param_sizes(), st.integers(1, 3000))
def test_keep_whole_cuts_only_params_larger_than_budget(sizes, budget):
    chunks = chunk_pieces(sizes, budget, ALIGN, keep_whole=True)
    _check_cover(sizes, chunks)
    for s in sizes:
        n_pieces = sum(p.index == s.index for c in chunks for p in c.pieces)
        if s.state_bytes <= budget:
            assert n_pieces == 1, f"param {s.index} fits a chunk but was cut"


def test_llm_shaped_plan_keeps_params_whole():
    # 32 layers of 7 matrices of uneven sizes: 16 chunks fit without cutting any param,
    # within a quarter more bytes per chunk than an even split.
    numels = [4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096, 11008 * 4096, 11008 * 4096, 4096 * 11008] * 32
    sizes = [ParamSize(i, n, 8 * n, True) for i, n in enumerate(numels)]
    plan = make_plan(sizes, times=16)
    ramp, tail = len(ramp_budgets(plan.budget)), len(tail_budgets(plan.budget))
    assert ramp == tail == RAMP and len(plan.chunks) <= 16 + ramp + tail
    # no param cut, but in the smaller first and last chunks (Note [ramp]) and the two before the last ones,
    # which even out what the tail leaves
    middle = [p for c in plan.chunks[ramp + 1 : -(tail + 2)] for p in c.pieces]
    assert all(p.start == 0 and p.stop == sizes[p.index].numel for p in middle)
    assert all(plan.chunks[k].nbytes <= plan.budget >> (RAMP - k) for k in range(ramp))
    assert plan.max_chunk_bytes <= 1.25 * budget_for(plan.total_bytes, 16)
    # a param larger than a chunk is still cut, so the cap holds
    sizes.append(ParamSize(len(sizes), 32000 * 4096 * 8, 8 * 32000 * 4096 * 8, True))
    plan = make_plan(sizes, times=16)
    assert sum(p.index == len(sizes) - 1 for c in plan.chunks for p in c.pieces) > 1
    assert plan.max_chunk_bytes <= 1.25 * budget_for(plan.total_bytes, 16)


def test_times_larger_than_params_and_split():
    sizes = [ParamSize(0, 4096, 4096 * 8, True), ParamSize(1, 10, 80, True)]
    plan = make_plan(sizes, times=64, align=512)
    # the 4096-element param is split at 512-element boundaries
    assert [p for c in plan.chunks for p in c.pieces if p.index == 0] == [
        Piece(0, i, i + 512) for i in range(0, 4096, 512)
    ]
    assert len(plan.chunks) == 9
    whole = [ParamSize(i, 100, 400, False) for i in range(3)]
    assert len(make_plan(whole, times=16).chunks) == 3


def test_times_exact_for_even_sizes():
    sizes = [ParamSize(i, 1 << 16, (1 << 16) * 8, True) for i in range(4)]  # 512 aligned blocks
    for times in (1, 2, 4, 16):
        assert len(make_plan(sizes, times=times, align=512).chunks) == times
    # 3 even chunks would cut two params; 4 whole ones are smaller than those and cut none
    plan = make_plan(sizes, times=3, align=512)
    assert [c.pieces for c in plan.chunks] == [(Piece(i, 0, 1 << 16),) for i in range(4)]
    plan = make_plan(sizes, times=100, align=512)
    # 512 blocks cannot be cut into 100 equal chunks: the largest chunk holds ceil(512/100) blocks
    assert len(plan.chunks) <= 100
    assert plan.max_chunk_bytes == 6 * 512 * 8


def test_whole_params_make_chunk_at_least_largest():
    sizes = [ParamSize(0, 10, 100, False), ParamSize(1, 10, 1000, False), ParamSize(2, 10, 100, False)]
    plan = make_plan(sizes, chunk_bytes=150)
    assert [c.nbytes for c in plan.chunks] == [100, 1000, 100]


def test_zero_state_params_ride_along():
    sizes = [ParamSize(0, 10, 0, True), ParamSize(1, 10, 0, False)]
    plan = make_plan(sizes, times=4)
    assert len(plan.chunks) == 1 and plan.total_bytes == 0


def test_resident_first_fit():
    sizes = [ParamSize(0, 10, 400, True), ParamSize(1, 10, 80, True), ParamSize(2, 10, 80, True)]
    assert pick_resident(sizes, 200) == (1, 2)
    plan = make_plan(sizes, times=2, resident_bytes=200)
    assert plan.resident == (1, 2)
    assert {p.index for c in plan.chunks for p in c.pieces} == {0}


def test_bad_knobs():
    with pytest.raises(ValueError, match="swap_optimizer_times"):
        make_plan([], times=0)
    with pytest.raises(ValueError, match="swap_optimizer_times"):
        budget_for(10, 0)


def test_budget_holds_region_padding():
    # 400 tiny params with two states each: every region is padded to SLOT_ALIGN bytes in the slot, so
    # the budget must hold the padding too (each chunk's padded bytes stay within it).
    from swapopt.plan import SLOT_ALIGN

    sizes = [ParamSize(i, 7, 7 * 8, True, regions=2) for i in range(400)]
    budget = 4096
    chunks = chunk_pieces(sizes, budget, ALIGN)
    _check_cover(sizes, chunks)
    for c in chunks:
        padded = sum(2 * (-(-(p.numel * 4) // SLOT_ALIGN) * SLOT_ALIGN) for p in c.pieces)
        assert padded <= c.nbytes <= budget
    plan = make_plan(sizes, times=8, align=ALIGN)
    assert len(plan.chunks) <= 8 and plan.max_chunk_bytes <= plan.budget


def test_lumpy_layout_takes_more_chunks_of_the_even_size_rather_than_cut():
    # Llama-2-7B's 291 tensors (dims / 11) at 64 chunks: an even cut splits ~90 tensors; keeping them whole
    # in 64 chunks needs chunks ~30% larger. More chunks of the even size cut only the tensors larger than a
    # chunk, with the same staging memory.
    from swapopt.bench.layouts import llama7b, scaled

    numels = [math.prod(shape) for _, shape in scaled(llama7b(), 11).tensors]
    sizes = [ParamSize(i, n, 8 * n, True) for i, n in enumerate(numels)]
    plan = make_plan(sizes, times=64, align=512)
    base = budget_for(sum(s.state_bytes for s in sizes), 64)
    ramp = ramp_budgets(plan.budget)
    tail = tail_budgets(plan.budget)
    assert 64 < len(plan.chunks) <= 96 + len(ramp) + len(tail)
    assert plan.max_chunk_bytes <= base * 5 // 4
    # the fewest chunks that keep params whole within a quarter more bytes than an even split (a chunk costs
    # a copy latency each way), at the smallest budget that gives that many
    fewest = len(chunk_pieces(sizes, base + base // 4, 512, keep_whole=True))
    assert len(chunk_pieces(sizes, plan.budget, 512, keep_whole=True)) == fewest
    assert len(chunk_pieces(sizes, plan.budget - 1, 512, keep_whole=True)) > fewest
    # cut: the params larger than a chunk, and those the smaller first and last chunks hold
    in_ramp = {p.index for c in plan.chunks[: len(ramp) + 1] + plan.chunks[-(len(tail) + 3) :] for p in c.pieces}
    cut = {s.index for s in sizes if sum(p.index == s.index for c in plan.chunks for p in c.pieces) > 1}
    assert cut - in_ramp == {s.index for s in sizes if s.state_bytes > plan.budget} - in_ramp


def test_ramp_makes_the_first_chunks_smaller():
    # 64 MiB of states in 16 chunks of 4 MiB: the first chunks take 1/8, 1/4 and 1/2 of the budget, so the first
    # swap-in (which nothing overlaps) moves 0.5 MiB; each ramp budget is at least RAMP_MIN_BYTES.
    sizes = [ParamSize(i, 1 << 20, 8 << 20, True) for i in range(8)]
    plan = make_plan(sizes, times=16, align=512)
    assert ramp_budgets(plan.budget) == (plan.budget >> 3, plan.budget >> 2, plan.budget >> 1)
    assert [c.nbytes <= b for c, b in zip(plan.chunks, ramp_budgets(plan.budget))] == [True] * RAMP
    assert plan.chunks[0].nbytes <= (4 << 20) // 8 + 64
    # the ramp's and the tail's 7/8 of a chunk each: a chunk more each, or more with cut remainders
    assert 16 < len(plan.chunks) <= 16 + 2 * RAMP
    _check_cover(sizes, plan.chunks)
    # prefetch swaps the first chunks in under the backward: no ramp then, larger first chunks
    flat = make_plan(sizes, times=16, align=512, ramp=False, tail=False)
    assert len(flat.chunks) == 16 and flat.chunks[0].nbytes == flat.budget
    assert make_plan(sizes, times=16, align=512, ramp=False).chunks[-1].nbytes < flat.budget  # the tail stays
    # small states: no ramp chunk below RAMP_MIN_BYTES; few chunks: no ramp; either way K chunks stay K
    small = [ParamSize(i, 1 << 10, 8 << 10, True) for i in range(16)]
    assert ramp_budgets(make_plan(small, times=8).budget) == ()
    assert len(make_plan(small, times=8).chunks) == 8
    assert [len(make_plan(sizes, times=t, align=512).chunks) for t in (1, 2, 4)] == [1, 2, 4]


def test_tail_makes_the_last_chunks_smaller():
    # Note [ramp]: the last swap-out runs alone on the link, so the last chunks fall to 1/2, 1/4 and 1/8 of the
    # budget; the bytes above them are spread evenly over the chunks before them, none above the budget.
    sizes = [ParamSize(i, 1 << 20, 8 << 20, True) for i in range(8)]  # 64 MiB: 16 chunks of 4 MiB
    for ramp in (True, False):
        plan = make_plan(sizes, times=16, align=512, ramp=ramp)
        _check_cover(sizes, plan.chunks)
        b = plan.budget
        assert tail_budgets(b) == (b >> 1, b >> 2, b >> 3)
        last = [c.nbytes for c in plan.chunks[-RAMP - 2 :]]
        assert last == sorted(last, reverse=True), "sizes only fall towards the end"
        assert [abs(n - t) <= 512 * 8 for n, t in zip(last[-RAMP:], tail_budgets(b))] == [True] * RAMP
        assert plan.max_chunk_bytes <= b and plan.total_bytes == 64 << 20
    # a fixed chunk budget ramps down too, and small states (tail chunks below RAMP_MIN_BYTES) or few chunks none
    fixed = make_plan(sizes, chunk_bytes=4 << 20, align=512)
    assert fixed.chunks[-1].nbytes <= (4 << 20) // 8 + 512 * 8 and fixed.max_chunk_bytes <= 4 << 20
    small = [ParamSize(i, 1 << 10, 8 << 10, True) for i in range(16)]
    assert tail_budgets(make_plan(small, times=8).budget) == () and len(make_plan(small, times=8).chunks) == 8
    assert all(t >= RAMP_MIN_BYTES for t in tail_budgets(4 << 20))
    assert [len(make_plan(sizes, times=t, align=512).chunks) for t in (1, 2, 4)] == [1, 2, 4]
    # whole params that fit a chunk stay whole before the tail; unsplittable ones stay whole in it as well
    whole = [ParamSize(i, 1 << 18, 8 << 18, False) for i in range(32)]
    plan = make_plan(whole, times=16, align=512)
    _check_cover(whole, plan.chunks)
    assert all(len([p for c in plan.chunks for p in c.pieces if p.index == s.index]) == 1 for s in whole)


# ----- Note [chunk count from costs] -------------------------------------------------------------------------
H100_LIKE = LinkCosts(copy_latency_us=15.0, h2d_gbps=55.0, d2h_gbps=55.0, duplex_gbps=105.0, host_chunk_us=55.0)
# The h100 preset's link as its first calibration had it (H2D copies paying 28 us of latency, the host's pace at
# 1 MB; D2H ones 2 us), a link where latency weighs: with both
# busy, copies up to 16 MiB keep 55 GB/s in and 50 GB/s out.
H100 = LinkCosts(
    copy_latency_us=15.1, h2d_gbps=55.16, d2h_gbps=55.13, duplex_gbps=105.35, host_chunk_us=54.68,
    h2d_latency_share=0.9354, duplex_table=((16 << 20, 55.16, 50.19), (256 << 20, 34.6, 47.08), (1 << 30, 44.14, 51.61)),
    host_copy_us=6.17, host_tensor_us=0.834,
)


def _fsdp_like(n: int = 291, each: int = 180_000) -> list[ParamSize]:
    """Many small params of two fp32 states, about 200 MiB in all, as one FSDP rank's shards."""
    return [ParamSize(i, each, each * 8, splittable=True, regions=2) for i in range(n)]


def _bound(sizes: list[ParamSize], times: int) -> int:
    """The user's bound on a chunk's bytes: a quarter above an even split (docs/optimizer.md)."""
    base = budget_for(sum(s.state_bytes + s.pad_bytes for s in sizes), times)
    return base + base // 4


@pytest.mark.parametrize("costs", [H100_LIKE, H100], ids=["even", "h100"])
def test_costs_choose_the_plan_of_least_modeled_time(costs):
    sizes = _fsdp_like()
    for times in (16, 64):
        plain = make_plan(sizes, times=times)
        costed = make_plan(sizes, times=times, costs=costs)
        _check_cover(sizes, costed.chunks)
        # the user's bound on chunk bytes holds either way
        assert costed.max_chunk_bytes <= _bound(sizes, times) and costed.budget <= _bound(sizes, times)
        assert estimate_us(costed.chunks, sizes, costs) <= estimate_us(plain.chunks, sizes, costs)
        assert sum(c.nbytes for c in costed.chunks) >= sum(s.state_bytes for s in sizes)
    # at 16 chunks of ~26 MiB the swap-outs trail the swap-ins by one chunk: smaller chunks save more of that lag
    # than their latency and host time cost; at 64 chunks of ~7 MiB, fewer, larger chunks up to the bound win
    for times, more in ((16, True), (64, False)):
        plain, costed = make_plan(sizes, times=times), make_plan(sizes, times=times, costs=costs)
        assert (len(costed.chunks) > len(plain.chunks)) is more
        assert (len(costed.chunks) < len(plain.chunks)) is not more
    # at 64 chunks of ~3 MiB a ramp chunk's copy is shorter than what a chunk costs: no ramp, no tail
    p64 = make_plan(sizes, times=64, costs=H100_LIKE)
    assert len(p64.chunks) < 64 and p64.chunks[0].nbytes > p64.budget // 2


def test_fewer_chunks_only_where_chunks_cost_more_than_they_save():
    sizes = _fsdp_like()
    # a link whose copies and chunks cost nothing but their bytes: the even split and its ramp, as the rules give
    free = LinkCosts(copy_latency_us=0.0, h2d_gbps=55.0, d2h_gbps=55.0, duplex_gbps=110.0, host_chunk_us=0.0)
    for times in (16, 64):
        assert len(make_plan(sizes, times=times, costs=free).chunks) >= times
    # with the H100's latencies the fewest chunks within the bound: none of the budgets tried below the bound
    # models faster, and a larger one would break it
    plan = make_plan(sizes, times=64, costs=H100)
    bound = _bound(sizes, 64)
    best = estimate_us(plan.chunks, sizes, H100)
    for b in range(budget_for(sum(s.state_bytes for s in sizes), 64), bound + 1, bound // 64):
        for whole in (True, False):
            assert best <= estimate_us(chunk_pieces(sizes, b, 512, keep_whole=whole), sizes, H100) + 1e-6
    # more chunks asked for means smaller chunks, never larger ones: the memory bound wins over the time
    sizes_for = {t: make_plan(sizes, times=t, costs=H100).max_chunk_bytes for t in (8, 16, 32, 64)}
    assert list(sizes_for.values()) == sorted(sizes_for.values(), reverse=True)
    assert all(n <= _bound(sizes, t) for t, n in sizes_for.items())


def test_costs_keep_a_ramp_that_pays_for_itself():
    # 8 GiB of states at 16 chunks: 512 MiB chunks, whose first swap-in alone costs ~10 ms; ramp chunks of
    # 64-256 MiB cost far less in latency and host time than they save
    sizes = [ParamSize(i, 1 << 26, 8 << 26, splittable=True, regions=2) for i in range(16)]
    plan = make_plan(sizes, times=16, costs=H100_LIKE)
    assert plan.chunks[0].nbytes < _bound(sizes, 16) // 2
    assert plan.chunks[-1].nbytes < _bound(sizes, 16) // 2
    # On the H100's link an H2D copy of 64-512 MiB keeps only 35-40 GB/s beside a D2H one, against 55 GB/s alone:
    # a ramp moves swap-in bytes from the first copy, alone, to copies beside swap-outs, where H2D is the slower
    # direction, and costs more than it saves. The tail moves swap-out bytes the other way, and pays.
    plan = make_plan(sizes, times=16, costs=H100)
    assert plan.chunks[-1].nbytes < plan.budget // 2
    assert estimate_us(plan.chunks, sizes, H100) < estimate_us(make_plan(sizes, times=16).chunks, sizes, H100)


def test_estimate_counts_latency_host_and_fill():
    costs = LinkCosts(copy_latency_us=10.0, h2d_gbps=1.0, d2h_gbps=1.0, duplex_gbps=2.0, host_chunk_us=0.0)
    sizes = [ParamSize(0, 1000, 8000, splittable=True, regions=2)]
    one = [Chunk((Piece(0, 0, 1000),), 8000)]
    two = [Chunk((Piece(0, 0, 500),), 4000), Chunk((Piece(0, 500, 1000),), 4000)]
    # bytes per us: 1e3 each way alone, 1e3 each with both busy. One chunk: its swap-in and swap-out alone, each
    # a latency and its bytes.
    assert estimate_us(one, sizes, costs) == pytest.approx((10 + 8) + (10 + 8))
    # each piece of the cut param is two copies each way (its states lie whole, one range each): the first
    # swap-in and the last swap-out alone, the second swap-in beside the first swap-out
    assert estimate_us(two, sizes, costs) == pytest.approx((2 * 10 + 4) + (2 * 10 + 4) + (2 * 10 + 4))
    busy_host = LinkCosts(copy_latency_us=0.0, h2d_gbps=1.0, d2h_gbps=1.0, duplex_gbps=2.0, host_chunk_us=100.0,
                          host_copy_us=5.0, host_tensor_us=1.0)
    # the host issues each chunk (100 us), the cut piece's second copy each way and the copy of its step (3 x 5 us)
    # and 7 tensors a piece (param, grad, 2 states, step, the step's add and its snapshot): the swap-ins go under
    # the host's work, the last swap-out after it
    assert estimate_us(two, sizes, busy_host) == pytest.approx(2 * (100 + 15 + 7) + 4)
    # each direction its own latency: an H2D copy waiting 18 us, a D2H one 2 us (share 0.9 of 2 x 10 us)
    skewed = dataclasses.replace(costs, h2d_latency_share=0.9)
    assert estimate_us(one, sizes, skewed) == pytest.approx((18 + 8) + (2 + 8))


def test_estimate_charges_the_swap_outs_lag_behind_the_swap_ins():
    # a link without latency or host time whose directions keep their rates beside each other: a chunk's
    # swap-out waits for its swap-in, so the step is every byte one way and one chunk the other way
    costs = LinkCosts(copy_latency_us=0.0, h2d_gbps=1.0, d2h_gbps=1.0, duplex_gbps=2.0, host_chunk_us=0.0)
    sizes = [ParamSize(0, 8000, 64_000, splittable=True, regions=1)]

    def chunks(*kb: int) -> list[Chunk]:
        starts = list(itertools.accumulate((0, *kb)))
        return [Chunk((Piece(0, a * 125, b * 125),), (b - a) * 1000) for a, b in itertools.pairwise(starts)]

    assert estimate_us(chunks(*[8] * 8), sizes, costs) == pytest.approx(64 + 8)
    assert estimate_us(chunks(*[4] * 16), sizes, costs) == pytest.approx(64 + 4)
    # a ramp up to the same chunks leaves the lag as it is: each larger chunk's swap-in outlasts the swap-out beside it
    assert estimate_us(chunks(2, 4, *[8] * 7, 2), sizes, costs) == pytest.approx(64 + 8)
    # with one slot a swap-in waits for the swap-out before it: nothing overlaps
    assert estimate_us(chunks(*[8] * 8), sizes, costs, slots=1) == pytest.approx(2 * 64)


def test_link_costs_rates_with_both_busy():
    # no table: half the cap each; a table: its rate at the copy's size, interpolated in log size, clamped
    assert H100_LIKE.both_bytes_per_us("h2d", 1 << 20) == pytest.approx(52.5e3)
    assert H100.both_bytes_per_us("h2d", 1 << 20) == pytest.approx(55.16e3)
    assert H100.both_bytes_per_us("d2h", 64 << 20) == pytest.approx((50.19 + (47.08 - 50.19) / 2) * 1e3)
    assert H100.both_bytes_per_us("h2d", 4 << 30) == pytest.approx(44.14e3)
    assert (H100.latency_us("h2d"), H100.latency_us("d2h")) == pytest.approx((28.249, 1.951), abs=1e-3)
    with pytest.raises(ValueError, match="duplex_table"):
        LinkCosts(1.0, 1.0, 1.0, 2.0, 1.0, duplex_table=((2.0, 1.0, 1.0), (1.0, 1.0, 1.0)))


# ----- Note [cut chunks] ------------------------------------------------------------------------------------------
def _cut_chunks(chunks, sizes) -> int:
    whole = {s.index: s.numel for s in sizes}
    return sum(any(pc.start > 0 or pc.stop < whole[pc.index] for pc in c.pieces) for c in chunks)


def test_cut_chunks_cost_the_host_per_chunk():
    sizes = [ParamSize(i, 100_000, 800_000, splittable=True, regions=2) for i in range(8)]
    whole = chunk_pieces(sizes, 1_600_200, keep_whole=True)
    cut = chunk_pieces(sizes, 1_200_000, keep_whole=False)
    assert _cut_chunks(whole, sizes) == 0 and _cut_chunks(cut, sizes) > 0
    base = dataclasses.replace(H100, host_chunk_us=0.0, host_copy_us=0.0, host_tensor_us=0.0, duplex_table=())
    priced = dataclasses.replace(base, host_cut_chunk_us=10_000.0)  # the host sets the step
    assert estimate_us(whole, sizes, priced) == estimate_us(whole, sizes, base)  # no cut: no charge
    # the host's share is the cut chunks' charge, once each; the fill (first swap-in, last swap-out) adds to it
    assert estimate_us(cut, sizes, priced) >= 10_000.0 * _cut_chunks(cut, sizes)
    assert estimate_us(cut, sizes, priced) <= 10_000.0 * _cut_chunks(cut, sizes) + estimate_us(cut, sizes, base)
    with pytest.raises(ValueError, match="host time"):
        dataclasses.replace(base, host_cut_chunk_us=-1.0)
