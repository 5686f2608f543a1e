"""Modeled step time on the simulator's H100 preset (sanitizer on): the swap pipeline stays within
1.10 x the bound of design.md at 16 chunks, and the reference schedules (XTuner's serial, MindSpeed's
one chunk in flight) come out slower by what the timeline model predicts for them.

Layout: 16 equal fp32 params of 2**20 elements, so 16 chunks hold one param each and every copy,
update and chunk has the same cost. Let t_in, t_out = one param's AdamW state bytes (8 MiB) / link rate
of H2D, of D2H, t = their mean, L_in, L_out the fixed latency of one copy each way (each param moves exp_avg
and exp_avg_sq: 2 copies each way) and F the link floor of the step's bytes (both directions at the preset's
rates with both busy, Note [link sharing]). The model serves each of the H2D, D2H and compute lanes one op at
a time and a stream one op at a time:
- bound    = design.md's: max(16 t in, 16 t out, resident step) with the rates measured with both
  directions busy; no schedule beats the floor either: step >= F;
- serial   = sum over params of (t in + update + t out), one stream, no two copies at once:
  16 (t_in + t_out) + 32 (L_in + L_out) + C;
- one-in-flight with K chunks of n params: each chunk ends with its last D2H and the next chunk starts
  after it. At n = 1 nothing overlaps a copy: as serial. At n > 1 the update of param i overlaps
  the H2D of param i + 1 and its D2H the next H2D; with a full-duplex link each chunk would cost
  (n + 1) t + c, and the shared link makes the overlapped copies slower than that, never slower than
  running every copy in sequence;
where c is one param's update and C = 16 c that of all params: its kernels' time (32 B per param at the
HBM rate, as the simulator charges fused AdamW). The resident step takes C plus the host's time to issue its
fused step over 16 params (Note [host clock] in device/sim/timeline.py); in the swapped schedules that time
hides behind the copies.
"""

from __future__ import annotations

import pytest

from device import sim
from swapopt.verify.calibrated_preset import SIM_ADAMW_BYTES_PER_PARAM
from swapopt.bench.measure import bound_ms, measure_bandwidth, time_steps
from swapopt.bench.model import make_params
from swapopt.bench.strategies import AdamWSpec, make_strategy

N_PARAMS = 16
SHAPE = (1024, 1024)
NUMEL = SHAPE[0] * SHAPE[1]
STATE_BYTES = 2 * 4 * NUMEL  # exp_avg + exp_avg_sq per param, fp32
TOL = 0.01  # launch latencies (6 us per op on this preset) against ~150 us copies
COPIES = 2 * 2 * N_PARAMS  # two state tensors per param, each copied in and out


@pytest.fixture(scope="module")
def h100():
    with sim.activate("h100", sanitize=True) as dev:
        yield dev


def _modeled(kind: str, **kw):
    params = make_params([SHAPE] * N_PARAMS, seed=0)
    strategy = make_strategy(kind, params, AdamWSpec(impl="fused"), **kw)
    # two warm-ups: the first step makes the states, the second steps the dicts made for it (with a copy of the step
    # counts, Note [undone step counts] in swapopt.internals), the third on steadily
    timing = time_steps(strategy, warmup=2, repeats=2)
    assert timing.all_ms[0] == pytest.approx(timing.all_ms[1], rel=1e-9)  # the model is deterministic
    strategy.close()
    return timing


@pytest.fixture(scope="module")
def model(h100):
    preset = h100.preset
    t_in, t_out = (STATE_BYTES / (rate * 1e6) for rate in (preset.h2d_gbps, preset.d2h_gbps))
    resident = _modeled("resident")
    bw = measure_bandwidth(STATE_BYTES)
    total = N_PARAMS * STATE_BYTES
    return {
        "t": (t_in + t_out) / 2,
        "t_in_out": t_in + t_out,
        "L_in_out": (preset.latency_us("h2d") + preset.latency_us("d2h")) / 1e3,
        "C": N_PARAMS * NUMEL * SIM_ADAMW_BYTES_PER_PARAM / (preset.hbm_gbps * 1e6),
        "resident": resident.step_ms,
        "bw": bw,
        "bound": bound_ms(total, total, bw, resident.step_ms),
        # both directions' bytes through the link as it shares them (the least over copy sizes)
        "floor": preset.link_floor_us(total, total) / 1e3,
    }


def test_measured_bandwidth_follows_the_preset_link(h100, model):
    preset, bw = h100.preset, model["bw"]
    # One direction alone: the link rate, less the per-copy latency (and launch gaps) of the probe's copies.
    for alone, rate, d in ((bw.h2d_alone, preset.h2d_gbps, "h2d"), (bw.d2h_alone, preset.d2h_gbps, "d2h")):
        assert alone <= rate
        assert alone == pytest.approx(STATE_BYTES / (STATE_BYTES / rate + preset.latency_us(d) * 1e3), rel=TOL)
    # Both at once: neither beats its own direction and together they stay under the most the link carries,
    # which is below the sum of the two directions: running both costs each of them something.
    assert preset.duplex_gbps < preset.h2d_gbps + preset.d2h_gbps
    assert bw.h2d_both <= preset.h2d_gbps and bw.d2h_both <= preset.d2h_gbps
    # At these 8 MiB copies the H100 kept H2D's rate and slowed D2H (16 MB: 51.5 + 50.0 GB/s with both busy
    # against 51.9 + 55.0 alone): together they move less than the two alone.
    assert bw.h2d_both + bw.d2h_both < (bw.h2d_alone + bw.d2h_alone) * (1 - TOL)
    # The bound follows the slower measured direction; it is at least the cap's floor.
    assert model["bound"] >= model["floor"]
    # The update is small next to the link: the bound is the copy time. The resident step is its kernels and
    # the host's time to issue them, which for 16 params' fused step is most of it.
    assert model["C"] < 0.1 * N_PARAMS * model["t"] and model["bound"] > model["resident"] > model["C"]


def test_swap_step_within_1_10_bound_at_16_chunks(h100, model):
    params = make_params([SHAPE] * N_PARAMS, seed=0)
    strategy = make_strategy("swapopt", params, AdamWSpec(impl="fused"), times=16, slots=3)
    timing = time_steps(strategy, warmup=1, repeats=2)
    h100.reset_timeline()
    strategy.step()
    strategy.drain()
    h100.synchronize()
    swap_ins = sum(1 for op in h100.timeline if op.lane == "h2d" and (op.label or "").startswith("swapopt.swap_in"))
    prep = strategy.opt._layout.prepared
    strategy.close()
    # One H2D copy per merged run of whole params' arena ranges, and one per state (exp_avg, exp_avg_sq) of each
    # piece of a cut param (Note [chunk count from costs]): nothing else crosses the link.
    cut = sum(1 for chunk in prep.plan.chunks for piece in chunk.pieces if piece.stop - piece.start < params[0].numel())
    assert swap_ins == sum(len(runs) for runs in prep.runs) + 2 * cut
    assert len(prep.plan.chunks) >= 16
    assert timing.step_ms <= 1.10 * model["bound"], (timing.step_ms, model["bound"])
    # Never faster than the link can carry both directions' bytes.
    assert timing.step_ms >= model["floor"], (timing.step_ms, model["floor"])


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
    expected = N_PARAMS * model["t_in_out"] + COPIES // 2 * model["L_in_out"] + model["C"]
    assert timing.step_ms == pytest.approx(expected, rel=TOL)
    # A single param's states on the device at a time.
    assert timing.peak_extra_bytes <= STATE_BYTES


@pytest.mark.parametrize("per_chunk", [1, 2, 4])
def test_one_in_flight_costs_n_plus_one_copies_per_chunk(model, per_chunk):
    chunks = N_PARAMS // per_chunk
    timing = _modeled("one-in-flight", times=chunks)
    in_sequence = N_PARAMS * model["t_in_out"] + COPIES // 2 * model["L_in_out"] + model["C"]
    if per_chunk == 1:  # no two copies ever run at once: every copy at its full rate
        assert timing.step_ms == pytest.approx(in_sequence, rel=TOL)
    else:
        full_duplex = chunks * (per_chunk + 1) * model["t"] + chunks * model["C"] / N_PARAMS
        # Overlapped copies share the cap: slower than on a full-duplex link, faster than no overlap at all.
        assert full_duplex * (1 + TOL) < timing.step_ms < in_sequence * (1 - TOL)
    # One chunk of staging.
    assert timing.peak_extra_bytes == per_chunk * STATE_BYTES


def test_reference_schedules_slower_than_swap_by_the_model(model):
    swap = _modeled("swapopt", times=16, slots=3).step_ms
    serial = _modeled("serial").step_ms
    one = _modeled("one-in-flight", times=16).step_ms
    # 32 t against at most 1.10 x the bound.
    assert serial / swap >= (2 * N_PARAMS * model["t"]) / (1.10 * model["bound"])
    assert one / swap >= (2 * N_PARAMS * model["t"]) / (1.10 * model["bound"])
