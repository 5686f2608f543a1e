"""Modeled step time on the simulator's H100 preset (sanitizer on): the swap pipeline stays within
1.10 x the bound of design.md at 16 chunks, and the reference schedules (XTuner's serial, MindSpeed's
one chunk in flight) come out slower by exactly what the timeline model predicts for them.

Layout: 16 equal fp32 params of 2**20 elements, so 16 chunks hold one param each and every copy,
update and chunk has the same cost. Let t = one param's AdamW state bytes (8 MiB) / link rate. The
model serves each of the H2D, D2H and compute lanes one op at a time and a stream one op at a time:
- bound    = max(16 t in, 16 t out, resident step) = 16 t (the update is ~0.2% of it);
- serial   = sum over params of (t in + update + t out), one stream: 32 t + C;
- one-in-flight with K chunks of n params: inside a chunk the update of param i overlaps the H2D of
  param i + 1 and its D2H the next H2D, but the next chunk starts after the last D2H, so each chunk
  costs (n + 1) t + c: K (n + 1) t + K c, i.e. 32 t + C at n = 1 and 24 t + C / 2 at n = 2;
where c is one param's update and C = 16 c that of all params (measured as the resident step).
"""

from __future__ import annotations

import pytest

from device import sim
from swapopt.bench.measure import bound_ms, measure_bandwidth, time_steps
from swapopt.bench.model import make_params
from swapopt.bench.strategies import AdamWSpec, make_strategy

N_PARAMS = 16
SHAPE = (1024, 1024)
NUMEL = SHAPE[0] * SHAPE[1]
STATE_BYTES = 2 * 4 * NUMEL  # exp_avg + exp_avg_sq per param, fp32
TOL = 0.01  # launch latencies (5 us per op on this preset) against ~150 us copies


@pytest.fixture(scope="module")
def h100():
    with sim.activate("h100", sanitize=True) as dev:
        yield dev


def _modeled(kind: str, **kw):
    params = make_params([SHAPE] * N_PARAMS, seed=0)
    strategy = make_strategy(kind, params, AdamWSpec(impl="fused"), **kw)
    timing = time_steps(strategy, warmup=1, repeats=2)
    assert timing.all_ms[0] == pytest.approx(timing.all_ms[1], rel=1e-9)  # the model is deterministic
    strategy.close()
    return timing


@pytest.fixture(scope="module")
def model(h100):
    t_ms = STATE_BYTES / (h100.preset.h2d_gbps * 1e6)
    assert h100.preset.h2d_gbps == h100.preset.d2h_gbps  # the formulas below use one t for both ways
    resident = _modeled("resident")
    return {"t": t_ms, "C": resident.step_ms, "bound": max(N_PARAMS * t_ms, resident.step_ms)}


def test_measured_bandwidth_is_the_preset_link_rate(h100, model):
    bw = measure_bandwidth(STATE_BYTES)
    for rate in (bw.h2d_alone, bw.h2d_both):
        assert rate == pytest.approx(h100.preset.h2d_gbps, rel=TOL)
    for rate in (bw.d2h_alone, bw.d2h_both):
        assert rate == pytest.approx(h100.preset.d2h_gbps, rel=TOL)
    total = N_PARAMS * STATE_BYTES
    assert bound_ms(total, total, bw, model["C"]) == pytest.approx(model["bound"], rel=TOL)
    # The update is small next to the link: the bound is the copy time.
    assert model["C"] < 0.1 * N_PARAMS * model["t"] and model["bound"] == N_PARAMS * model["t"]


def test_swap_step_within_1_10_bound_at_16_chunks(h100, model):
    timing = _modeled("swapopt", times=16, slots=3)
    assert timing.step_ms <= 1.10 * model["bound"], (timing.step_ms, model["bound"])


@pytest.mark.parametrize("slots", [2, 3])
def test_swap_peak_extra_memory_within_slots_plus_one_chunks(h100, slots):
    params = make_params([SHAPE] * N_PARAMS, seed=0)
    strategy = make_strategy("swapopt", params, AdamWSpec(impl="fused"), times=16, slots=slots)
    chunk = N_PARAMS * STATE_BYTES // 16
    for _ in range(2):  # the first step (lazy state creation) included
        h100.synchronize()
        base = h100.memory_allocated()
        h100.reset_peak_memory_stats()
        strategy.step()
        strategy.drain()
        assert h100.max_memory_allocated() - base <= (slots + 1) * chunk
    strategy.close()


def test_serial_costs_every_copy_and_update_in_sequence(model):
    timing = _modeled("serial")
    expected = 2 * N_PARAMS * model["t"] + model["C"]
    assert timing.step_ms == pytest.approx(expected, rel=TOL)
    # A single param's states on the device at a time.
    assert timing.peak_extra_bytes <= STATE_BYTES


@pytest.mark.parametrize("per_chunk", [1, 2, 4])
def test_one_in_flight_costs_n_plus_one_copies_per_chunk(model, per_chunk):
    chunks = N_PARAMS // per_chunk
    timing = _modeled("one-in-flight", times=chunks)
    expected = chunks * (per_chunk + 1) * model["t"] + chunks * model["C"] / N_PARAMS
    assert timing.step_ms == pytest.approx(expected, rel=TOL)
    # One chunk of staging.
    assert timing.peak_extra_bytes == per_chunk * STATE_BYTES


def test_reference_schedules_slower_than_swap_by_the_model(model):
    swap = _modeled("swapopt", times=16, slots=3).step_ms
    serial = _modeled("serial").step_ms
    one = _modeled("one-in-flight", times=16).step_ms
    # 32 t against at most 1.10 x 16 t.
    assert serial / swap >= (2 * N_PARAMS * model["t"]) / (1.10 * model["bound"])
    assert one / swap >= (2 * N_PARAMS * model["t"]) / (1.10 * model["bound"])
