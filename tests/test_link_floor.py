"""The swapped step against the link floor on the simulator (modeled times, deterministic; Note [link sharing]
in device/sim/presets.py, Note [swap-in after swap-out] in swapopt/operate.py).

A scaled-down Llama-2-7B layout (291 tensors, about 4 M params) on the H100 preset with no fixed cost per op
(launch host time, copy latency): scaling a layout down shrinks its copies, not those costs, which at this
size would be a large share of ~35 us chunk copies (several per chunk: the norms' states are copies of their
own) and are a small one at real sizes (bench/results/sim-h100-2026-11-25-layouts-floor.md has those, with
them). For the same reason the ramp's smallest chunks may go down to 64 KiB here (Note [ramp] leaves out
those below RAMP_MIN_BYTES because their launches would cost more host time than their copies take).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from stepping import Boom, fail_on_call

import simdevice as simulator
from swapopt import SwapOptimizer, plan
from swapopt.bench.floor import FloorRow, measure
from swapopt.bench.layouts import llama7b, scale_to_fit
from swapopt.operate import SwapOptimizerOperate

TARGET = 1.05
LAYOUT = scale_to_fit(llama7b(), 4_000_000)
# The cap rules on the figures the h100 preset had before its calibration (55 GB/s each way, 80 together), where
# a fixed rule is far from an even split; the calibrated preset's own rule ("sized") on its figures.
SIZED = dataclasses.replace(
    simulator.PRESETS["h100"], launch_us=0.0, event_us=0.0, copy_latency_us=0.0, host_tensor_us=0.0
)
BASE = dataclasses.replace(SIZED, h2d_gbps=55.0, d2h_gbps=55.0, duplex_gbps=80.0, link_sharing="first")


@pytest.fixture(scope="module")
def small_ramp() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "RAMP_MIN_BYTES", 64 << 10)
        yield


@pytest.fixture(scope="module")
def rows(small_ramp) -> dict[str, FloorRow]:
    return {rule: measure(LAYOUT, 16, rule, BASE) for rule in ("first", "d2h")}


def test_step_within_1_05_of_the_measured_links_floor(small_ramp):
    # Neither direction keeps its rate: each moves at what the H100 measured for its copy size with both busy.
    # Whichever is launched first, so no launch order lets D2H catch up with H2D once H2D has run alone while the
    # first chunk came in: at 16 chunks (20 with the ramp) that fill is about 5% of the step (1.050x); at 64 it
    # is a quarter of that.
    row = measure(LAYOUT, 64, "sized", SIZED)
    assert row.rule_ratio <= TARGET, row
    # Nothing beats the floor, but for what the last copies leave owed to the next step (Note [link debt]).
    assert row.step_ms >= row.rule_floor_ms * 0.99
    assert row.peak_extra_bytes <= row.cap_bytes and row.bitwise


@pytest.mark.parametrize("rule", ["first", "d2h"])
def test_step_within_1_05_of_the_rule_floor_peak_and_bitwise(rows, rule):
    row = rows[rule]
    assert row.rule_ratio <= TARGET, row
    # Nothing beats the floor, but for what the timeline lets a step leave owed to the next one under a fixed
    # rule (Note [link debt] in device/sim/timeline.py): never more than a share of the last chunks' bytes.
    assert row.step_ms >= row.rule_floor_ms * (0.99 if rule != "first" else 1.0)
    assert row.peak_extra_bytes <= row.cap_bytes and row.bitwise


def test_first_launched_rule_reaches_the_cap_floor(rows):
    # Taking turns at launching first splits the cap: both directions' bytes through it, within 5%.
    assert rows["first"].cap_ratio <= TARGET
    # Where D2H always keeps its rate, H2D gets only the rest while it runs: no schedule reaches the cap floor.
    d2h = rows["d2h"]
    assert d2h.rule_floor_ms > 1.1 * d2h.cap_floor_ms and d2h.cap_ratio > 1.1


def test_swap_in_launched_before_the_swap_out_makes_the_swap_outs_give_way(rows, small_ramp, monkeypatch):
    # The order the pipeline asks for the copies in, kept: each swap-in runs at its full rate and the swap-out
    # beside it gives way, then runs on alone while the swap-in waits for its slot.
    def issue_when_asked(self: SwapOptimizerOperate, k: int, copies) -> None:
        if copies:
            self._issue_in(k, copies)

    monkeypatch.setattr(SwapOptimizerOperate, "swap_in", issue_when_asked)
    before = measure(LAYOUT, 16, "first", BASE, check_bitwise=False)
    assert before.cap_ratio > 1.1 > TARGET >= rows["first"].cap_ratio


def _swap_ops(dev) -> list[tuple[str, int]]:
    """(kind, chunk) of every copy of the last step, in launch order."""
    out = []
    for op in dev.timeline:
        if op.lane in ("h2d", "d2h") and op.label and op.label.startswith("swapopt.swap_"):
            kind, k = op.label[len("swapopt.") :].rstrip("]").split("[")
            out.append((kind, int(k)))
    return out


def _params(n: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 64, generator=gen)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(64, 64, generator=gen)
    return ps


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_each_swap_in_is_launched_after_the_swap_out_that_frees_its_slot(sim, slots):
    opt = SwapOptimizer(torch.optim.AdamW(_params(8), fused=True), swap_optimizer_times=8, slots=slots)
    opt.step()
    opt.wait_for_swap_out()
    sim.reset_timeline()
    opt.step()
    opt.wait_for_swap_out()
    ops = _swap_ops(sim)
    first = {}
    for i, key in enumerate(ops):
        first.setdefault(key, i)
    last_out = {k: i for i, (kind, k) in enumerate(ops) if kind == "swap_out"}
    for (kind, k), i in first.items():
        if kind == "swap_in" and k >= slots - 1:
            # after every copy of the swap-out that frees its slot, before the next swap-out
            assert i > last_out[k - slots + 1]
            assert k - slots + 2 not in last_out or i < first[("swap_out", k - slots + 2)]
        elif kind == "swap_in":  # the first S - 1 chunks: before any swap-out
            assert i < first[("swap_out", 0)]
    assert sorted(k for kind, k in first if kind == "swap_in") == list(range(8))


def test_a_failing_update_never_issues_the_swap_in_held_back(sim):
    ps = _params(8)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, r in zip(ps, ref):
        r.grad = p.grad.clone()
    opt = SwapOptimizer(torch.optim.AdamW(ps, fused=True), swap_optimizer_times=8, slots=3)
    ref_opt = torch.optim.AdamW(ref, fused=True)
    opt.step()
    ref_opt.step()
    opt.wait_for_swap_out()
    sim.reset_timeline()
    restore = fail_on_call(opt, 1)  # chunk 1's update raises: chunk 3's swap-in waits for chunk 1's swap-out
    with pytest.raises(Boom):
        opt.step()
    restore()
    assert ("swap_in", 3) not in _swap_ops(sim) and opt.operate._held_in is None
    # Chunk 0 was stepped, the rest untouched (Note [failure semantics]); the next step carries on bitwise.
    for r in ref[1:]:  # one param a chunk
        r.grad = None
    ref_opt.step()
    for p, r in zip(ps, ref):
        r.grad = p.grad.clone()
    opt.step()
    ref_opt.step()
    opt.wait_for_swap_out()
    assert all(torch.equal(p.detach(), r.detach()) for p, r in zip(ps, ref))
