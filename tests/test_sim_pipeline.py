"""A three-slot swap pipeline on the simulator: exact data when every wait is there, a StreamRaceError when
any one is missing, and modeled time close to the link bound."""

from __future__ import annotations

import pytest
import torch

import device
from device.sim import StreamRaceError

CHUNKS, SLOTS, N = 6, 3, 1 << 16
DROPS = ["alloc_wait", "slot_reuse", "compute_wait", "d2h_wait", "host_sync", "record_stream"]


def _pipeline(sim, drop: str | None = None) -> list[torch.Tensor]:
    """Each chunk: H2D into a slot, `slot = slot * 0.5 + grad` on compute, D2H back into the host state."""
    states = [device.pinned_empty(N) for _ in range(CHUNKS)]
    for i, s in enumerate(states):
        s.fill_(float(i))
    grads = [torch.full((N,), float(i + 1)) for i in range(CHUNKS)]
    compute = sim.current_stream()
    h2d, d2h = sim.Stream(name="h2d"), sim.Stream(name="d2h")
    staging = [torch.empty(N) for _ in range(SLOTS)]  # allocated on compute
    if drop != "alloc_wait":
        h2d.wait_stream(compute)  # swap-in starts once compute reaches the step and the slots exist
    drained = [None] * SLOTS
    for i in range(CHUNKS):
        slot = staging[i % SLOTS]
        with sim.stream(h2d):
            if drained[i % SLOTS] is not None and drop != "slot_reuse":
                h2d.wait_event(drained[i % SLOTS])
            slot.copy_(states[i], non_blocking=True)
            loaded = h2d.record_event()
        if drop != "compute_wait":
            compute.wait_event(loaded)
        slot.mul_(0.5).add_(grads[i])
        stepped = compute.record_event()
        with sim.stream(d2h):
            if drop != "d2h_wait":
                d2h.wait_event(stepped)
            states[i].copy_(slot, non_blocking=True)
            drained[i % SLOTS] = d2h.record_event()
    if drop != "record_stream":
        for slot in staging:
            device.record_stream(slot, h2d)
            device.record_stream(slot, d2h)
    del staging, slot
    if drop == "record_stream":
        # compute allocates and writes before the drains are waited for: a dropped slot comes back to it while
        # the side streams may still use it (an allocation never written would harm nothing, as on CUDA)
        torch.zeros(N)
    if drop != "host_sync":
        for event in drained:
            event.synchronize()
    return states


def test_pipeline_with_every_wait_is_exact_and_race_free(sim):
    states = _pipeline(sim)
    for i, s in enumerate(states):
        assert torch.equal(s, torch.full((N,), i * 0.5 + i + 1, device="cpu"))


@pytest.mark.parametrize("drop", DROPS)
def test_pipeline_missing_any_wait_races(sim, drop):
    with pytest.raises(StreamRaceError):
        states = _pipeline(sim, drop)
        [s.sum() for s in states]  # the host reads its states
    try:
        sim.synchronize()  # side-stream work ends before the fixture's exit
    except StreamRaceError as err:  # the raced program also dropped buffers a stream still used
        assert err.kind == "free"


def test_pipeline_time_approaches_the_link_bound(sim_no_launch):
    sim = sim_no_launch
    sim.reset_timeline()
    _pipeline(sim)
    preset = sim.preset
    nbytes = 4 * N
    copy_us = preset.latency_us("h2d") + nbytes / (preset.h2d_gbps * 1e3)  # one H2D copy alone on the link
    copy_out = preset.latency_us("d2h") + nbytes / (preset.d2h_gbps * 1e3)  # one D2H copy alone
    h2d = [op for op in sim.timeline if op.lane == "h2d"]
    assert len(h2d) == CHUNKS and all(op.end_us - op.start_us >= copy_us * (1 - 1e-9) for op in h2d)
    # Pipelined: the D2H of chunk k runs beside the H2D of chunk k+1, so the H2D lane never idles. Both
    # directions share the link's aggregate cap, so overlapped copies take longer than one alone, and the
    # whole cannot beat every byte through the cap; serialized it would be CHUNKS copies each way.
    for before, after in zip(h2d, h2d[1:]):
        assert after.start_us == pytest.approx(before.end_us)
    end = max(op.end_us for op in sim.timeline)
    start = min(op.start_us for op in h2d)
    assert end - h2d[-1].end_us < 1.2 * copy_us  # then only the last update and swap-out
    serial = CHUNKS * (copy_us + copy_out)
    # a copy beside one of the other direction: its latency, then its bytes at its both-busy rate for its size
    beside = max(preset.latency_us(d) + nbytes / (preset.both_gbps(d, nbytes) * 1e3) for d in ("h2d", "d2h"))
    assert 2 * CHUNKS * nbytes / (preset.duplex_gbps * 1e3) <= end - start
    assert end - start < (CHUNKS + 1) * beside < serial
    assert sim.now_us() == pytest.approx(end)  # the host waited for the last D2H
