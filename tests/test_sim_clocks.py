"""The pruned access log finds a race exactly when a full history would (random programs, vector clocks)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device.sim.sanitizer import HOST, Access, AccessLog, Clocks

STREAMS = 3

access = st.tuples(
    st.just("access"), st.integers(0, STREAMS), st.integers(0, 40), st.integers(1, 8), st.sampled_from([0, 0, 1])
)
record = st.tuples(st.just("record"), st.integers(1, STREAMS))
wait = st.tuples(st.just("wait"), st.integers(1, STREAMS), st.integers(0, 3))
sync = st.tuples(st.just("sync"), st.integers(1, STREAMS))
barrier = st.tuples(st.just("barrier"))
programs = st.lists(st.one_of(access, access, access, record, wait, wait, sync, barrier), min_size=30, max_size=80)


def _full_history_race(history: list[Access], acc: Access, clocks: Clocks) -> bool:
    return any(
        rec.start < acc.end and acc.start < rec.end and (rec.write or acc.write) and not clocks.ordered(rec, acc.actor)
        for rec in history
    )


@pytest.mark.parametrize("prune_at", [2, AccessLog._PRUNE_AT])
@settings(max_examples=100, deadline=None)
@given(program=programs)
def test_pruned_log_agrees_with_full_history(prune_at, program):
    AccessLog._PRUNE_AT, saved = prune_at, AccessLog._PRUNE_AT
    try:
        clocks = Clocks()
        for _ in range(STREAMS):
            clocks.new_actor()
        log, history, events = AccessLog(), [], []
        for step in program:
            kind = step[0]
            if kind == "access":
                _, actor, start, length, write = step
                if actor != HOST:
                    clocks.merge_actor(actor, HOST)  # a launch follows the host's past
                acc = Access(start, start + length, bool(write), actor, clocks.tick(actor), "op", None, (length,))
                expected = _full_history_race(history, acc, clocks)
                assert (log.conflict(acc, clocks) is not None) == expected
                if expected:
                    continue  # the simulator raises here: the access never happens
                log.add(acc, clocks)
                history.append(acc)
            elif kind == "record":
                clocks.merge_actor(step[1], HOST)
                events.append(clocks.snapshot(step[1]))
            elif kind == "wait" and events:
                clocks.merge_actor(step[1], HOST)
                clocks.merge(step[1], events[-1 - step[2] % len(events)])  # mostly recent events
            elif kind == "sync":
                clocks.merge_actor(HOST, step[1])
            elif kind == "barrier":  # everyone waits for everyone
                for actor in clocks.actors():
                    clocks.merge_actor(HOST, actor)
                for actor in clocks.actors():
                    clocks.merge_actor(actor, HOST)
            assert len(log.records) <= len(history)
    finally:
        AccessLog._PRUNE_AT = saved


def test_log_stays_small_in_a_loop():
    clocks = Clocks()
    side = clocks.new_actor()
    compute = clocks.new_actor()
    log = AccessLog()
    for _ in range(1000):
        for actor, write in ((side, True), (compute, False)):
            acc = Access(0, 64, write, actor, clocks.tick(actor), "op", None, (16,))
            assert log.conflict(acc, clocks) is None
            log.add(acc, clocks)
            if actor == side:
                clocks.merge(compute, clocks.snapshot(side))
            else:
                clocks.merge(side, clocks.snapshot(compute))
    assert len(log.records) <= 2


def test_retired_streams_do_not_pin_records():
    clocks = Clocks()
    a, b = clocks.new_actor(), clocks.new_actor()
    acc = Access(0, 4, True, a, clocks.tick(a), "op", None, (1,))
    clocks.merge_actor(HOST, a)
    assert not clocks.seen_by_all(acc)  # b never waited for a
    clocks.retire(b)
    assert clocks.seen_by_all(acc)


def _access(clocks, actor, write, start=0, end=64):
    if actor != HOST:
        clocks.merge_actor(actor, HOST)
    return Access(start, end, write, actor, clocks.tick(actor), "op", None, (end - start,))


def test_a_later_read_does_not_hide_a_write_from_other_readers():
    clocks = Clocks()
    a, b, c = clocks.new_actor(), clocks.new_actor(), clocks.new_actor()
    log = AccessLog()
    log.add(_access(clocks, a, True), clocks)
    clocks.merge(b, clocks.snapshot(a))  # b waits for the write
    read = _access(clocks, b, False)
    assert log.conflict(read, clocks) is None
    log.add(read, clocks)
    assert log.conflict(_access(clocks, c, False), clocks) is not None  # c never waited


def test_pruning_keeps_records_the_host_has_not_seen(monkeypatch):
    monkeypatch.setattr(AccessLog, "_PRUNE_AT", 1)
    clocks = Clocks()
    a, b = clocks.new_actor(), clocks.new_actor()
    log = AccessLog()
    log.add(_access(clocks, a, True, 0, 8), clocks)  # e.g. a D2H into host memory
    clocks.merge(b, clocks.snapshot(a))  # every stream has seen it, the host has not
    log.add(_access(clocks, b, False, 8, 16), clocks)
    log.add(_access(clocks, b, False, 16, 24), clocks)
    assert log.conflict(_access(clocks, HOST, False, 0, 8), clocks) is not None


def test_a_log_of_many_disjoint_ranges_costs_constant_work_per_access(monkeypatch):
    """Note [amortized pruning]: a slot that a chunk's 2,000 state views share keeps a record per view while the
    step is in flight (no access supersedes another, none is seen by every stream yet); each access must not
    re-scan the whole log."""
    clocks = Clocks()
    swap, compute = clocks.new_actor(), clocks.new_actor()
    looked = []
    seen_by_all = clocks.seen_by_all
    monkeypatch.setattr(clocks, "seen_by_all", lambda acc: looked.append(acc) or seen_by_all(acc))
    log = AccessLog()
    n = 2000
    for i in range(n):
        acc = _access(clocks, swap, True, 8 * i, 8 * i + 8)
        assert log.conflict(acc, clocks) is None
        log.add(acc, clocks)
    assert len(log.records) == n  # the compute stream has seen none of them: all kept
    assert len(looked) <= 4 * n
    # once the compute stream and the host wait for the swap stream, the next prune drops them all
    clocks.merge_actor(compute, swap)
    clocks.merge_actor(HOST, swap)
    for i in range(n, 2 * n + 1):
        log.add(_access(clocks, compute, False, 8 * i, 8 * i + 8), clocks)
    assert all(rec.actor == compute for rec in log.records)
    assert log.conflict(_access(clocks, compute, True, 0, 8), clocks) is None


def test_dropped_streams_leave_the_clocks(clean_device_env):
    """Per-op cost depends on live streams only: thousands of dropped streams leave no clock entries."""
    import gc

    import torch

    import simdevice as simulator

    with simulator.activate() as sim:
        x = torch.ones(16)
        for i in range(2000):
            if i % 100 == 0:
                sim.synchronize()  # the host catches up: dropped streams can be compacted
            s = sim.Stream()
            s.wait_stream(sim.default_stream())
            with sim.stream(s):
                x.add_(1)
            sim.current_stream().wait_stream(s)
            del s
        gc.collect()
        sim.synchronize()
        x.add_(1)
        sizes = [len(sim._clocks.clock(a)) for a in sim._clocks._live]
        assert max(sizes) <= 2 * Clocks._COMPACT_AT + 8, sizes
        assert torch.equal(x, torch.full((16,), 2002.0))
        side = sim.Stream()
        side.wait_stream(sim.default_stream())
        with sim.stream(side):
            x.mul_(2)
        with pytest.raises(simulator.StreamRaceError):
            x.sum()  # races are still found after compaction
        sim.synchronize()


def test_unsynchronized_dropped_stream_keeps_its_records(clean_device_env):
    import gc

    import torch

    import simdevice as simulator

    with simulator.activate() as sim:
        x = torch.ones(16)
        s = sim.Stream()
        s.wait_stream(sim.default_stream())
        with sim.stream(s):
            x.add_(1)
        del s
        gc.collect()
        sim._clocks.compact()  # nobody has seen the add yet: it must stay
        with pytest.raises(simulator.StreamRaceError):
            x.sum()
        sim.synchronize()
