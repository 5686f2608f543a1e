"""Benchmark strategies and CLI on the simulator: the reference strategies are real (bitwise equal
to the plain optimizer) and the CLI writes its table, JSON and charts."""

from __future__ import annotations

import json

import pytest
import torch

import device
from device import sim
from swapopt.bench.__main__ import main
from swapopt.bench.model import clone_params, make_params, shape_for
from swapopt.bench.strategies import AdamWSpec, make_strategy, mindspeed_chunks

# A param larger than a chunk, a scalar-like vector, odd shapes: what chunkers get wrong.
SHAPES = [(96, 32), (32,), (7, 5, 3), (256, 16), (1,), (48, 48)]


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor (what .cpu() is on a real device; a no-op on the simulator)."""
    if device.is_host_tensor(t):
        return t
    h = device.pinned_empty(tuple(t.shape), dtype=t.dtype)
    h.copy_(t)
    return h


def _run(kind: str, spec: AdamWSpec, steps: int = 3, dtype: torch.dtype = torch.float32, **kw):
    params = make_params(SHAPES, seed=1, dtype=dtype)
    strategy = make_strategy(kind, params, spec, **kw)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for p in params:
            # Fresh grads each step, identical across strategies (same generator sequence).
            p.grad.copy_(torch.randn(p.shape, generator=gen).to(dtype))
        strategy.step()
        strategy.drain()
    return params, strategy


CASES = [
    ("serial", {}),
    ("one-in-flight", {"times": 1}),
    ("one-in-flight", {"times": 4}),
    ("one-in-flight", {"times": 100}),
    ("whole", {}),
    ("host-step", {}),
    ("swapopt", {"times": 3, "slots": 2}),
]


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize(("kind", "kw"), CASES, ids=[f"{k}-{kw}" for k, kw in CASES])
def test_strategy_bitwise_equals_resident(kind, kw, impl):
    if kind == "host-step" and impl == "foreach":
        pytest.skip("host-step always runs torch's fused CPU AdamW; compared with resident fused")
    spec = AdamWSpec(impl=impl)
    with sim.activate("h100", sanitize=True):
        ref_params, ref = _run("resident", spec)
        params, strategy = _run(kind, spec, **kw)
        for rp, p in zip(ref_params, params):
            assert torch.equal(rp, p), kind
            ref_state, state = ref.state_of(rp), strategy.state_of(p)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(_on_host(ref_state[key]), _on_host(state[key])), (kind, key)
        # The state really moved: nonzero and different from the initial params.
        assert any(strategy.state_of(p)["exp_avg"].abs().sum() > 0 for p in params)
        assert not torch.equal(params[0], make_params(SHAPES, seed=1)[0])


def test_reference_states_live_on_host_between_steps():
    with sim.activate("h100", sanitize=True) as dev:
        for kind in ("serial", "one-in-flight", "whole", "host-step"):
            params, strategy = _run(kind, AdamWSpec(), steps=1)
            for p in params:
                for key in ("exp_avg", "exp_avg_sq"):
                    assert dev.is_host(strategy.state_of(p)[key]), (kind, key)
            assert strategy.host_bytes() >= 8 * sum(p.numel() for p in params)


def test_mindspeed_chunks_whole_params_within_budget():
    params = make_params(SHAPES)
    for times in (1, 2, 5, 16, 1000):
        chunks = mindspeed_chunks(params, times)
        assert [p for c in chunks for p in c] == params
        budget = sum(p.numel() for p in params) // times
        assert all(len(c) == 1 or sum(p.numel() for p in c) <= budget for c in chunks)


def test_clone_params_independent():
    with sim.activate("h100"):
        params = make_params(shape_for(0.0001), seed=3)
        copies = clone_params(params)
        with torch.no_grad():
            copies[0].add_(1.0)
        assert not torch.equal(params[0], copies[0])
        assert torch.equal(params[1], copies[1]) and torch.equal(params[1].grad, copies[1].grad)


@pytest.mark.usefixtures("quiet_library_after")
def test_cli_sim_writes_table_json_and_charts(tmp_path, capsys):
    rc = main([
        "--sim", "h100", "--sizes", "0.001", "--times", "4,16", "--slots", "2,3", "--reference-times", "16",
        "--e2e", "none", "--out", str(tmp_path), "--no-progress",
    ])
    assert rc == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    stem = next(n for n in names if n.endswith(".json"))[: -len(".json")]
    assert stem.startswith("sim-h100-")
    assert {f"{stem}.json", f"{stem}.md", f"{stem}-chart.png", f"{stem}-timeline.png"} <= set(names)
    for png in ("-chart.png", "-timeline.png"):
        assert (tmp_path / f"{stem}{png}").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["device"] == "sim" and data["torch"] == torch.__version__ and data["preset"]["name"] == "h100"
    (size,) = data["sizes"]
    kinds = {r["kind"] for r in size["rows"]}
    assert {"resident", "swapopt", "serial", "one-in-flight", "whole", "host-step"} <= kinds
    assert len([r for r in size["rows"] if r["kind"] == "swapopt"]) == 4
    assert size["bound_ms"] > 0 and size["bandwidth"]["h2d_both"] > 0
    # Simulated bandwidth is modeled, so exact: 8 copies back to back (measure_bandwidth's repeats), each at
    # the preset's link rate plus its fixed latency, and one launch latency before the first starts. Only
    # float rounding is allowed for.
    chunk, preset = size["bandwidth"]["chunk_bytes"], data["preset"]
    h2d_latency_us = 2 * preset["h2d_latency_share"] * preset["copy_latency_us"]  # SimPreset.latency_us("h2d")
    repeats, copy_us = 8, chunk / (preset["h2d_gbps"] * 1e3) + h2d_latency_us
    modeled = repeats * chunk / (repeats * copy_us + preset["launch_us"]) / 1e3
    assert size["bandwidth"]["h2d_alone"] == pytest.approx(modeled, rel=1e-9, abs=0)
    for r in size["rows"]:
        assert r["step_ms"] > 0 and r["ratio"] == pytest.approx(r["step_ms"] / size["bound_ms"])
    md = (tmp_path / f"{stem}.md").read_text()
    assert "| strategy | reproduces | step ms | x bound |" in md and "serial" in md
    assert str(tmp_path / f"{stem}.json") in capsys.readouterr().out

    # --render rebuilds the markdown and chart from the JSON alone.
    (tmp_path / f"{stem}.md").unlink()
    (tmp_path / f"{stem}-chart.png").unlink()
    assert main(["--render", str(tmp_path / f"{stem}.json")]) == 0
    assert (tmp_path / f"{stem}.md").read_text() == md
    assert (tmp_path / f"{stem}-chart.png").exists()


def _size(ratios: dict[str, float], peaks: dict[str, int]):
    from swapopt.bench.measure import Bandwidth
    from swapopt.bench.run import Row, SizeResult

    rows = [Row(size_b=0.1, numel=1, kind="swapopt" if k.startswith("swapopt") else k, label=k, reproduces=k,
                step_ms=r, ratio=r, peak_extra_bytes=peaks[k]) for k, r in ratios.items()]
    bw = Bandwidth(chunk_bytes=1, h2d_alone=1, d2h_alone=1, h2d_both=1, d2h_both=1)
    return SizeResult(size_b=0.1, shape=shape_for(0.001), numel=1, state_bytes=8, bandwidth=bw, resident_ms=0.1,
                      bound_ms=1.0, rows=rows)


def test_chart_keeps_the_near_bound_range_readable_and_has_a_memory_panel():
    from swapopt.bench.plots import RATIO_FLOOR, bar_figure

    ratios = {"resident": 0.07, "swapopt t=16 s=3": 1.07, "swapopt t=64 s=3": 1.02, "host-step": 6.5}
    peaks = {"resident": 0, "swapopt t=16 s=3": 162 << 20, "swapopt t=64 s=3": 38 << 20, "host-step": 0}
    fig = bar_figure([_size(ratios, peaks)], "t")
    ratio_ax, mem_ax = fig.axes
    low, high = ratio_ax.get_ylim()
    # 1.00-1.10 spans at least a quarter of the axis: the 6.5x bar does not squash it.
    assert low == RATIO_FLOOR and (1.1 - 1.0) / (high - low) > 0.25
    texts = [t.get_text() for t in ratio_ax.texts]
    assert "1.07x" in texts and "1.02x" in texts and "0.07x" in texts
    assert "6.50x\nclipped" in texts
    assert mem_ax.get_yscale() == "log" and {"162", "38", "0"} <= {t.get_text() for t in mem_ax.texts}


@pytest.mark.usefixtures("quiet_library_after")
def test_timeline_title_counts_the_chunks_it_shows(tmp_path, monkeypatch):
    import swapopt.bench.plots as plots

    seen = []
    real = plots.timeline_chart

    def spy(spans, path, title):
        seen.append((len({s.chunk for s in spans if s.chunk is not None}), title))
        return real(spans, path, title)

    monkeypatch.setattr(plots, "timeline_chart", spy)
    assert main(["--sim", "h100", "--sizes", "0.001", "--times", "16", "--slots", "3", "--strategies", "swapopt",
                 "--e2e", "none", "--out", str(tmp_path), "--no-progress"]) == 0
    ((chunks, title),) = seen
    assert chunks > 1 and title.startswith(f"one swapopt step: {chunks} chunks, 3 slots")
    assert "(modeled)" in title


# ----- end to end: resident, swapped and overlapped train steps of an engine config -------------------------
E2E_SMALL = "tiny:model.dim=32:model.n_layers=2:model.n_heads=2:model.max_seq_len=16:train.batch=2:train.seq_len=16"


def test_e2e_summary_derives_hidden_time_efficiency_and_overheads():
    from swapopt.bench.e2e import summarize

    base = {"params": 1000, "layers": 2, "tokens": 64, "losses": [2.0, 1.5], "peak_bytes": 10}
    runs = {
        "resident": {**base, "train_step_ms": 10.0, "forward_ms": 4.0, "optim_ms": 1.0},
        # without overlap 1 ms of the 6 ms swap step already runs under the next forward (the last swap-out)
        "swap": {**base, "train_step_ms": 15.0, "forward_ms": 4.0, "optim_ms": 0.5, "swap_ms": 6.0},
        "overlap": {**base, "train_step_ms": 12.5, "forward_ms": 5.0, "optim_ms": 0.2, "swap_ms": 6.0},
    }
    row = summarize("cfg", ["train.batch=2"], runs)
    # hidden = swap step - what the train step still pays for it (12.5 - 10), not off - on (2.5)
    assert row["hidden_ms"] == pytest.approx(3.5)
    assert row["efficiency"] == pytest.approx(3.5 / 4.0)  # the forward (4 ms) is the smaller window
    assert row["overhead_off"] == pytest.approx(0.5) and row["overhead_on"] == pytest.approx(0.25)
    assert (row["resident_step_ms"], row["swap_step_ms"], row["forward_ms"]) == (1.0, 6.0, 4.0)
    assert row["forward_covers_swap"] is False
    assert row["efficiency_met"] is False and row["overhead_met"] is False and row["losses_equal"] is True

    runs["overlap"] = {**runs["overlap"], "train_step_ms": 10.2, "losses": [2.0, 1.25]}
    row = summarize("cfg", [], runs)
    assert row["efficiency"] == pytest.approx(5.8 / 4.0) and row["efficiency_met"] is True
    assert row["overhead_met"] is True and row["losses_equal"] is False

    failed = summarize("cfg", [], {**runs, "overlap": {"note": "OutOfMemoryError: x"}})
    assert failed["train_on_ms"] is None and "efficiency" not in failed and "overlap: OutOfMemoryError" in failed["note"]


def test_e2e_run_on_the_simulator_reports_every_field_and_draws_the_update_lane(clean_device_env):
    from swapopt.bench.e2e import run_e2e
    from swapopt.bench.report import e2e_table

    with sim.activate(sanitize=False):
        row, (spans, marks) = run_e2e(E2E_SMALL, steps=5, warmup=1)
    assert "note" not in row, row.get("note")
    for key in ("resident_step_ms", "swap_step_ms", "forward_ms", "resident_train_ms", "train_off_ms",
                "train_on_ms", "hidden_ms", "efficiency", "overhead_on", "peak_swap_bytes"):
        assert isinstance(row[key], float | int), key
    assert row["train_off_ms"] > row["resident_train_ms"] > 0 and row["swap_step_ms"] > 0
    assert row["losses_equal"] is True and row["tokens"] == 32 and row["layers"] == 2
    assert {s.lane for s in spans} >= {"h2d", "compute", "update", "d2h"}
    assert len(marks) == 2 and 0 <= marks[0] < marks[1]  # the two steps' starts
    table = e2e_table([row], modeled=True)
    assert "overlap efficiency" in table and "tiny (model.dim=32" in table and "(modeled)" in table


MASTER_CASES = [("serial", {}), ("one-in-flight", {"times": 4}), ("swapopt", {"times": 3, "slots": 2})]


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize(("kind", "kw"), MASTER_CASES, ids=[f"{k}-{kw}" for k, kw in MASTER_CASES])
def test_master_weight_strategies_equal_the_resident_recipe(kind, kw, impl):
    # bf16 params through fp32 masters: each schedule's params and states equal the recipe run resident
    spec = AdamWSpec(impl=impl, master_weights=True)
    with sim.activate("h100", sanitize=True):
        ref_params, ref = _run("resident", spec, dtype=torch.bfloat16)
        params, strategy = _run(kind, spec, dtype=torch.bfloat16, **kw)
        assert all(p.dtype == torch.bfloat16 for p in params)
        for rp, p in zip(ref_params, params):
            assert torch.equal(rp, p), kind
            ref_state, state = ref.state_of(rp), strategy.state_of(p)
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[key].dtype == torch.float32, (kind, key)
                assert torch.equal(_on_host(ref_state[key]), _on_host(state[key])), (kind, key)
        assert not torch.equal(params[0], make_params(SHAPES, seed=1, dtype=torch.bfloat16)[0])
    with pytest.raises(ValueError, match="no master-weights form"):
        make_strategy("host-step", params, spec)


# ----- every row proves it did the work (swapopt.bench.proof) ------------------------------------------------
def _rows(strategies: list[str], **kw):
    from swapopt.bench.run import BenchConfig, run_size

    cfg = BenchConfig(sizes=[0.0002], times=[4], slots=[3], reference_times=[4], repeats=1, strategies=strategies, **kw)
    with sim.activate("h100", sanitize=True):
        return run_size(0.0002, cfg)


def test_every_quick_table_row_on_the_simulator_moves_its_bytes_and_changes_every_param():
    size = _rows(["resident", "swapopt", "serial", "one-in-flight", "whole", "host-step", "torchao-offload"])
    by_kind = {r.kind: r for r in size.rows}
    # torchao runs on the simulator too, and its step (a backward driving its hooks, then step()) really steps
    assert set(by_kind) == {"resident", "swapopt", "serial", "one-in-flight", "whole", "host-step", "torchao-offload"}
    for r in size.rows:
        assert r.error is None, (r.label, r.error)
        assert r.step_ms > 0 and r.params_total == len(shape_for(0.0002).shapes())
        assert r.params_changed == r.params_total, r.label
        assert r.h2d_bytes >= r.need_h2d_bytes and r.d2h_bytes >= r.need_d2h_bytes, r.label
    # a swap moves exactly its state bytes each way, once
    for kind in ("swapopt", "serial", "one-in-flight", "whole"):
        r = by_kind[kind]
        assert r.h2d_bytes == r.d2h_bytes == r.need_h2d_bytes == size.state_bytes, kind
    assert by_kind["resident"].h2d_bytes == by_kind["resident"].d2h_bytes == 0
    # torchao: grads down and params up for its offloaded params (it keeps those under 4,096 elements on the device)
    ao = by_kind["torchao-offload"]
    big = sum(4 * p.numel() for p in make_params(shape_for(0.0002)) if p.numel() >= 4096)
    assert ao.need_h2d_bytes == ao.need_d2h_bytes == big > 0 and ao.h2d_bytes >= big and ao.d2h_bytes >= big


def test_a_row_that_did_not_do_the_work_is_an_error_without_a_time(monkeypatch):
    from swapopt.bench.report import size_table
    from swapopt.bench.strategies import SwapOpt, TorchaoOffload

    # torchao stepped without a backward (what the quick table did): no grad reaches the host, nothing is updated
    monkeypatch.setattr(TorchaoOffload, "step", lambda self: self.opt.step())
    monkeypatch.setattr(SwapOpt, "step", lambda self: None)  # a swap that does nothing at all
    size = _rows(["resident", "swapopt", "torchao-offload"])
    by_kind = {r.kind: r for r in size.rows}
    assert by_kind["resident"].error is None and by_kind["resident"].step_ms > 0
    swap, ao = by_kind["swapopt"], by_kind["torchao-offload"]
    for r in (swap, ao):
        assert r.step_ms is None and r.ratio is None
        assert "host to device, fewer than" in r.error and "device to host, fewer than" in r.error
        assert "params unchanged" in r.error and "its timed step took" in r.error
    assert swap.params_changed == ao.params_changed == 0  # without a backward torchao's leaves have no grad
    table = size_table(size)
    assert table.count("| ERROR |") == 2 and "ERROR: moved 0 bytes host to device" in table


def test_traffic_counts_copies_each_way_and_nothing_else():
    from swapopt.bench.proof import Traffic

    with sim.activate("h100", sanitize=True):
        dev = make_params([(256,)])[0].detach()
        host = device.pinned_empty((256,), dtype=torch.float32)
        with Traffic() as t:
            host.copy_(dev)  # D2H
            dev.copy_(host)  # H2D
            dev.add_(1.0)  # no copy
            dev.clone()  # a device copy, not a transfer
        assert (t.h2d_bytes, t.d2h_bytes) == (1024, 1024)


def test_master_weights_resident_row_is_the_bf16_recipe():
    size = _rows(["resident", "swapopt"], master_weights=True)
    res = next(r for r in size.rows if r.kind == "resident")
    assert "bf16 params, fp32 masters" in res.reproduces and res.error is None
    assert size.resident_ms == res.step_ms  # the bound takes the recipe's time
    swap = next(r for r in size.rows if r.kind == "swapopt")
    assert swap.h2d_bytes == swap.need_h2d_bytes == 12 * size.numel  # states and masters, fp32


# ----- the 8-bit rows: torchao's AdamW8bit resident and swapped (Note [low-bit rows]) ------------------------
def _lowbit_bytes(shape, block: int = 256, qmap: int = 256) -> int:
    """Bytes of AdamW8bit's two moments over params of these shapes: a param of at least 4096 elements (a multiple
    of the block) has per moment uint8 codes, an fp32 scale per block and an fp32 lookup table of `qmap` entries;
    any other keeps fp32 moments."""
    total = 0
    for s in shape.shapes():
        n = 1
        for d in s:
            n *= d
        total += 2 * (n + 4 * (n // block) + 4 * qmap) if n >= 4096 and n % block == 0 else 2 * 4 * n
    return total


@pytest.mark.parametrize("master_weights", [False, True], ids=["states", "master-weights"])
def test_lowbit_rows_move_the_parts_bytes_per_param(master_weights):
    pytest.importorskip("torchao.optim", reason="torchao is not installed")
    from swapopt.bench.report import per_param, size_table

    from swapopt.bench.run import BenchConfig, run_size

    # one block of the smallest shape: five params torchao quantizes, three it keeps in fp32
    cfg = BenchConfig(sizes=[0.00005], times=[4], slots=[3], repeats=1, strategies=["resident-8bit", "swapopt-8bit"],
                      master_weights=master_weights)
    with sim.activate("h100", sanitize=True):
        size = run_size(0.00005, cfg)
    by_kind = {r.kind: r for r in size.rows}
    assert set(by_kind) == {"resident-8bit", "swapopt-8bit"}
    res, swap = by_kind["resident-8bit"], by_kind["swapopt-8bit"]
    for r in (res, swap):
        assert r.error is None and r.step_ms > 0 and r.params_changed == r.params_total, r.label
    shape = shape_for(0.00005)
    want = _lowbit_bytes(shape) + (4 * shape.numel if master_weights else 0)
    # exactly the parts (and masters) each way, once: far fewer than fp32 states' 8 (12) bytes a param
    assert swap.h2d_bytes == swap.d2h_bytes == swap.need_h2d_bytes == swap.need_d2h_bytes == want
    assert res.h2d_bytes == res.d2h_bytes == 0
    assert per_param(swap) == f"{want / shape.numel:.3f} / {want / shape.numel:.3f}"
    # codes a byte a param per moment; scales and lookup tables add a few percent at this size
    assert 2 < want / shape.numel - (4 if master_weights else 0) < 2.25
    # its own bound: its bytes over the link, or resident-8bit's step if longer
    link_ms = want / (size.bandwidth.h2d * 1e9) * 1e3
    assert swap.own_bound_ms == pytest.approx(max(link_ms, want / (size.bandwidth.d2h * 1e9) * 1e3, res.step_ms))
    assert swap.own_ratio == pytest.approx(swap.step_ms / swap.own_bound_ms) and "its own bound" in swap.note
    if master_weights:
        assert "8-bit states on the device" in res.reproduces
    assert f"| {per_param(swap)} |" in size_table(size)
