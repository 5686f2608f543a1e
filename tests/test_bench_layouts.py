"""Benchmark layouts and step counters: real model shapes, FSDP2 sharding, and counts that match the
simulator's own timeline."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest
import torch

import device
from swapopt import flat
from swapopt.bench import layout_run
from swapopt.bench.counts import LaunchCounter, StepCounts, count_call, pinned_host_bytes
from swapopt.bench.layout_run import LayoutResult, derive, layout_targets, layouts_markdown, run_layout
from swapopt.bench.layouts import (
    Layout,
    fsdp256,
    fsdp_shard,
    fsdp_shard_rows,
    get_layout,
    llama7b,
    make_layout_params,
    moe,
    scale_to_fit,
    scaled,
    tiny10k,
)


def _by_suffix(layout: Layout, suffix: str) -> list[tuple[int, ...]]:
    return [shape for name, shape in layout.tensors if name.endswith(suffix)]


def test_llama7b_has_llama2_7b_tensors():
    lay = llama7b()
    assert lay.count == 291
    shapes = dict(lay.tensors)
    assert shapes["model.embed_tokens.weight"] == (32000, 4096)
    assert shapes["lm_head.weight"] == (32000, 4096)
    assert shapes["model.norm.weight"] == (4096,)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert _by_suffix(lay, f"{proj}.weight") == [(4096, 4096)] * 32
    assert _by_suffix(lay, "gate_proj.weight") == _by_suffix(lay, "up_proj.weight") == [(11008, 4096)] * 32
    assert _by_suffix(lay, "down_proj.weight") == [(4096, 11008)] * 32
    assert len(_by_suffix(lay, "layernorm.weight")) == 64
    # The published parameter count of Llama-2-7B (untied embeddings).
    assert lay.numel == 6_738_415_616
    assert len({name for name, _ in lay.tensors}) == lay.count


def test_moe_has_thousands_of_mixtral_shaped_tensors():
    lay = moe()
    assert lay.count >= 3000
    assert len({name for name, _ in lay.tensors}) == lay.count
    w1, w2, w3 = (_by_suffix(lay, f"{w}.weight") for w in ("w1", "w2", "w3"))
    assert len(w1) == len(w2) == len(w3) == 32 * 32
    assert set(w1) == set(w3) == {(14336, 4096)} and set(w2) == {(4096, 14336)}
    assert set(_by_suffix(lay, "k_proj.weight")) == {(1024, 4096)}  # grouped-query attention, 8 kv heads
    assert set(_by_suffix(lay, "gate.weight")) == {(32, 4096)}
    assert moe(experts=8).count == 32 * (7 + 3 * 8) + 3


def test_tiny10k():
    lay = tiny10k()
    assert lay.count == 10_000 and set(lay.shapes) == {(128,)} and lay.numel == 1_280_000


@pytest.mark.parametrize("rows", [1, 5, 255, 256, 257, 4096, 11008, 32000, 32001])
@pytest.mark.parametrize("world", [1, 7, 256])
def test_fsdp_shards_cover_dim0_padded_as_fsdp2_pads(rows, world):
    local = [fsdp_shard_rows(rows, world, r) for r in range(world)]
    assert sum(n for n, _ in local) == rows  # the shards are the param, no more, no less
    padded = {p for _, p in local}
    assert padded == {math.ceil(rows / world)}  # every rank's buffer has the same padded size
    assert rows <= world * padded.pop() < rows + world
    # torch.chunk's split: full shards first, then at most one partial one, then empty ones.
    chunks = [len(c) for c in torch.arange(rows).chunk(world)]
    assert [n for n, _ in local] == chunks + [0] * (world - len(chunks))


def test_fsdp256_is_rank0_of_llama7b():
    full, shard = llama7b(), fsdp256()
    assert shard.count == full.count == 291
    for (name, fs), (sname, ss) in zip(full.tensors, shard.tensors):
        assert name == sname and ss[1:] == fs[1:]
        assert sum(fsdp_shard_rows(fs[0], 256, r)[0] for r in range(256)) == fs[0]
    total = sum(fsdp_shard(full, 256, r).numel for r in (0, 100, 255))
    assert total == 3 * full.numel // 256  # Llama-2-7B's dims 0 divide evenly by 256: no rank is short
    assert fsdp_shard(full, 256, 0).shapes == shard.shapes


def test_scaled_keeps_count_and_relative_shapes():
    lay = llama7b()
    small = scaled(lay, 8)
    assert small.count == lay.count and small.scale == 8
    assert dict(small.tensors)["model.layers.0.mlp.gate_proj.weight"] == (1376, 512)
    assert dict(small.tensors)["model.embed_tokens.weight"] == (4000, 512)
    assert all(d >= 1 for s in scaled(lay, 100_000).shapes for d in s)
    fit = scale_to_fit(lay, 50_000_000)
    assert fit.numel <= 50_000_000 and scaled(lay, fit.scale - 1).numel > 50_000_000
    assert scale_to_fit(tiny10k(), 10**9).scale == 1
    with pytest.raises(ValueError):
        get_layout("gpt5")


def test_counter_counts_copies_and_kernels_like_the_timeline(sim):
    host = device.pinned_empty((1000,))
    host.zero_()
    scratch = device.pinned_empty((10,))
    scratch.zero_()
    dev = torch.zeros(1000)  # created on the simulated device

    def program():
        dev.copy_(host, non_blocking=True)  # H2D
        half = dev[:500]  # a view: no launch
        half.mul_(2.0)  # one kernel
        torch.empty_like(dev)  # an allocation: no launch
        host.copy_(dev, non_blocking=True)  # D2H
        host[500:].copy_(dev[500:], non_blocking=True)  # D2H of a view
        scratch.add_(1.0)  # host-only work: no launch

    sim.reset_timeline()
    counts = count_call(program)
    sim.synchronize()
    assert (counts.launches, counts.h2d_copies, counts.d2h_copies) == (4, 1, 2)
    assert counts.h2d_bytes == 4000 and counts.d2h_bytes == 6000
    assert counts.aten_ops == 9  # 4 launches, 3 slices, 1 allocation, 1 host add
    lanes = [op.lane for op in sim.timeline]
    assert counts.launches == sum(lane != "host" for lane in lanes)
    assert counts.h2d_copies == lanes.count("h2d") and counts.d2h_copies == lanes.count("d2h")
    # CPU time splits into the ops' own, the counter's and the rest; the device's share is left out on the simulator.
    assert counts.cpu_s >= counts.launch_cpu_s + counts.counting_cpu_s > 0
    assert 0 <= counts.own_host_s(device_work_on_host=True) <= counts.own_host_s(device_work_on_host=False)
    # Python host time leaves out every op and simulator frame as well: never more than the own host time.
    assert counts.outside_host_s >= counts.op_cpu_s + counts.counting_cpu_s
    assert counts.outside_calls >= counts.aten_ops
    assert 0 <= counts.python_host_s() <= counts.own_host_s(device_work_on_host=True)
    # Nested counting: an inner counter sees only its own block.
    with LaunchCounter() as outer:
        dev.add_(1.0)
        inner = count_call(lambda: dev.add_(1.0))
    assert inner.launches == 1 and outer.counts.launches == 2
    # Every tensor an op is handed counts, list members included (Note [counting a tensor list costs per tensor]).
    xs, ys = [torch.zeros(4) for _ in range(7)], [torch.ones(4) for _ in range(7)]
    many = count_call(lambda: torch._foreach_add_(xs, ys, alpha=2.0))
    assert (many.dispatched, many.tensor_args, many.launches) == (1, 14, 1)
    assert count_call(lambda: torch.add(xs[0], ys[0], out=xs[1])).tensor_args == 3  # out= too


def test_pinned_host_bytes_counts_each_storage_once(sim):
    arena = device.pinned_empty((100,))
    views = [arena[:40], arena[40:], arena[10:20]]
    assert pinned_host_bytes(views) == 400
    assert pinned_host_bytes([torch.zeros(10)]) == 0  # device memory


def _small_layout(name: str = "small") -> Layout:
    # A param larger than a chunk, a vector, odd shapes: what chunkers get wrong.
    shapes = [(64, 48), (48,), (200, 16), (7, 5, 3), (1,), (96, 32)] * 2
    return Layout(name=name, source="test", tensors=tuple((f"w{i}", s) for i, s in enumerate(shapes)))


def test_layout_run_rows_have_every_field(sim):
    lay = _small_layout()
    res = run_layout(lay, times=(2, 4), bandwidth_repeats=1, host_repeats=2)
    assert (res.tensors, res.numel, res.state_bytes) == (lay.count, lay.numel, 8 * lay.numel)
    assert [r.kind for r in res.rows] == ["resident", "swapopt", "swapopt"]
    resident, *swapped = res.rows
    assert resident.launches >= 1 and resident.h2d_copies == resident.d2h_copies == 0
    assert res.bound_ms >= res.resident_ms > 0
    assert res.link_sharing == sim.preset.link_sharing
    assert res.floor_ms == pytest.approx(sim.preset.link_floor_us(res.state_bytes, res.state_bytes) / 1e3)
    for r, k in zip(swapped, (2, 4)):
        assert r.times == k and r.slots == 3 and r.chunks >= 1
        assert r.launch_target == (resident.launches + 3) * r.chunks + 8
        # Every chunk's states go in and come back at least once.
        assert r.h2d_copies >= r.chunks and r.d2h_copies >= r.chunks
        assert r.launches >= r.h2d_copies + r.d2h_copies
        assert r.step_ms > 0 and r.ratio == pytest.approx(r.step_ms / res.bound_ms)
        assert r.b2b_ms > 0 and r.b2b_ratio == pytest.approx(r.b2b_ms / res.bound_ms)
        assert r.cap_bytes == 4 * r.chunk_bytes and 0 < r.peak_extra_bytes <= r.cap_bytes
        # the floor: never above the step, and the simulator's preset's under its sharing rule
        assert r.floor_ratio == pytest.approx(r.step_ms / res.floor_ms) and r.floor_ratio >= 1.0
        assert r.pinned_bytes > 0 and r.cpu_ms > 0 and r.host_ms is not None
        assert r.extra_host_us_per_param is not None
    # each row's Python scaled to the preset's host by the factors timed beside its counted steps
    assert all(r.python_scale > 0 for r in res.rows)
    assert res.python_scale == statistics.median(r.python_scale for r in res.rows)
    again = derive(LayoutResult.model_validate_json(res.model_dump_json()))
    assert again == res  # a result read back from JSON renders the same
    md = layouts_markdown([res])
    assert "### small: 12 tensors" in md and md.count("| swapopt t=") == 2
    assert "each counted step's by the factor timed beside it" in md
    # the host's Python speed, so that runs on two hosts compare beside it
    assert res.host_ref_us > 0 and f"Host reference Python {res.host_ref_us:,.0f} us" in md
    targets = layout_targets(res)
    assert len(targets) == 2 and all("launches" in t and "pinned" in t and "peak" in t for t in targets)
    assert all(t in md for t in targets)


def test_layout_rows_scale_each_counted_steps_python_by_the_factor_timed_beside_it(sim, monkeypatch):
    """This machine's speed drifts within seconds: a counted step's Python is scaled by the mean of the factors timed
    right before and right after it (one step's after is the next one's before), and the row's Python ms is the median
    of the scaled steps, each with the preset's event_us per event record and stream wait it made (unscaled: the
    device host's own figure)."""
    cycle, factors = itertools.cycle([1.0, 3.0, 5.0, 9.0]), []
    monkeypatch.setattr(layout_run, "step_python_scale", lambda: factors.append(next(cycle)) or factors[-1])
    seen: list[float] = []
    calls: list[int] = []
    python_host_s = StepCounts.python_host_s

    def counted(self: StepCounts) -> float:
        calls.append(self.runtime_calls)
        seen.append(python_host_s(self))
        return seen[-1]

    monkeypatch.setattr(StepCounts, "python_host_s", counted)
    event_s = sim.preset.event_us * 1e-6
    assert event_s > 0
    res = run_layout(_small_layout(), times=(2,), bandwidth_repeats=1)
    n = layout_run.HOST_REPEATS
    assert len(seen) == n * len(res.rows) and len(factors) == (n + 1) * len(res.rows)
    for i, r in enumerate(res.rows):
        steps = range(i * n, (i + 1) * n)
        timed = factors[i * (n + 1) : (i + 1) * (n + 1)]  # before the first step, then after each
        scales = [(a + b) / 2 for a, b in zip(timed, timed[1:])]
        assert len(set(scales)) > 1  # each step its own pair: 2, 4, 7, 5, ... from the cycle 1, 3, 5, 9
        assert r.python_scale == statistics.median(scales)
        assert r.python_ms == pytest.approx(
            statistics.median(seen[j] * f + calls[j] * event_s for j, f in zip(steps, scales)) * 1e3
        )
        if r.kind == "swapopt":
            assert min(calls[j] for j in steps) >= 6 * r.chunks  # three records and three waits a chunk


def test_layout_run_flat_rows_take_the_flat_update(sim):
    # Whole multiples of swapopt.flat.CPU_BLOCK elements, small chunks: the flat update is taken on the simulator.
    shapes = [(64, 4), (128,), (32, 8), (64,)] * 3
    lay = Layout(name="flat", source="test", tensors=tuple((f"w{i}", s) for i, s in enumerate(shapes)))
    res = run_layout(lay, times=(2,), bandwidth_repeats=1, flat=True, host_repeats=2)
    assert [(r.kind, r.flat) for r in res.rows] == [("resident", False), ("swapopt", False), ("swapopt", True)]
    direct, flat_row = res.rows[1:]
    assert (direct.label, flat_row.label) == ("swapopt t=2 s=3", "swapopt-flat t=2 s=3")
    assert flat_row.note == "" and flat_row.chunks == direct.chunks
    # The flat update's kernels are the chunk's gathers, one fused step over its flat tensors and the write-back,
    # where the direct step hands the fused kernel every param: other launches, the same copies each way.
    assert flat_row.launches != direct.launches
    assert (flat_row.h2d_copies, flat_row.d2h_copies) == (direct.h2d_copies, direct.d2h_copies)
    assert flat.ENABLED is False  # put back after the row
    assert "| swapopt-flat t=2 s=3 |" in layouts_markdown([res])


def test_layout_run_graph_rows_time_replays(sim):
    # 400 small tensors: an eager step is host-bound (per-op launches, per-tensor lists), a replay issues nothing
    shapes = [(128,)] * 400
    lay = Layout(name="many", source="test", tensors=tuple((f"w{i}", s) for i, s in enumerate(shapes)))
    # two counted steps a row, as the tests above: their count is not this test's subject, and 400 tensors make each dear
    res = run_layout(lay, times=(4,), bandwidth_repeats=1, graph=True, host_repeats=2)
    assert [r.kind for r in res.rows] == ["resident", "swapopt", "swapopt-graph"]
    eager, graphed = res.rows[1:]
    assert graphed.note == "" and graphed.chunks == eager.chunks
    # the timed step is a replay (the fourth step is captured), not one of the eager steps before it
    assert graphed.step_ms < 0.5 * eager.step_ms and graphed.b2b_ms < 0.5 * eager.b2b_ms
    # A replay dispatches no aten op; its Python (a replay's address checks, a data_ptr per param and grad) is
    # counted, not taken out with the simulator's frames. Which of the two rows spends less Python is not asserted:
    # on 400 tensors this machine read 4.4-7.4 ms unscaled for the replay against 5.3-10.6 for the eager step,
    # closer than its own noise under load.
    assert graphed.launches == 0 and graphed.aten_ops == 0 and eager.aten_ops > 0
    assert graphed.python_ms > 0


def test_make_layout_params_builds_the_layout(sim):
    lay = scaled(llama7b(), 512)
    params = make_layout_params("llama7b", scale=512)
    assert [tuple(p.shape) for p in params] == lay.shapes
    assert all(not device.is_host_tensor(p) and p.grad is not None for p in params)


@pytest.mark.usefixtures("quiet_library_after")
def test_cli_runs_layouts_alone_and_renders_them(tmp_path, capsys, monkeypatch):
    from swapopt.bench import layouts
    from swapopt.bench.__main__ import main

    # A 12-tensor stand-in keeps this test fast; the named layouts differ only in their shapes.
    monkeypatch.setitem(layouts.LAYOUTS, "llama7b", lambda: _small_layout("llama7b"))
    rc = main([
        "--sim", "h100", "--sizes", "none", "--layouts", "llama7b", "--layout-max-params", "2000",
        "--layout-times", "4", "--out", str(tmp_path), "--no-progress",
    ])
    assert rc == 0
    (js,) = tmp_path.glob("*.json")
    data = json.loads(js.read_text())
    assert data["sizes"] == [] and [r["layout"] for r in data["layouts"]] == ["llama7b"]
    (lay,) = data["layouts"]
    assert lay["tensors"] == 12 and lay["scale"] > 1 and lay["numel"] <= 2000
    assert [r["label"] for r in lay["rows"]] == ["resident-fused", "swapopt t=4 s=3"]
    md = js.with_suffix(".md").read_text()
    assert "### llama7b: 12 tensors" in md and "## Step of each strategy" not in md
    assert not list(tmp_path.glob("*.png"))  # no size rows: no chart
    assert "| llama7b | 12 | swapopt t=4 s=3 |" in capsys.readouterr().out
    js.with_suffix(".md").unlink()
    assert main(["--render", str(js)]) == 0
    assert js.with_suffix(".md").read_text() == md
    assert main(["--sim", "h100", "--layouts", "gpt5", "--out", str(tmp_path)]) == 2


def test_host_cpu_prints_one_line_per_run(capsys, clean_device_env):
    """python -m swapopt.bench.host_cpu: one line with the plan's chunks and the step's host CPU, saying where it ran."""
    from swapopt.bench import host_cpu

    host_cpu.main(["fsdp256", "16", "--numel", "2e5", "--steps", "2", "--label", "code-a"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("fsdp256 t=16 chunks=") and "cpu_med=" in line and "code-a" in line
    assert "(the simulator: thread CPU includes its own work)" in line
    assert int(line.split("chunks=")[1].split()[0]) >= 1
    for bad in (["fsdp256", "0"], ["fsdp256", "16", "--steps", "x"], ["nope", "16"]):
        with pytest.raises(SystemExit):
            host_cpu.main(bad)
    assert "must be at least 1, got 0" in capsys.readouterr().err


def test_run_layout_refuses_a_row_without_counted_steps():
    with pytest.raises(ValueError, match="host_repeats must be at least 1, got 0"):
        run_layout(_small_layout(), times=(2,), host_repeats=0)
