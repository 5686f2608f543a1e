"""The layout bench on the simulator prints, beside each modeled row, what the preset's device measured for the same
row in committed results (Note [hardware beside the model] in swapopt/bench/hardware_refs.py)."""

from __future__ import annotations

import json

import pytest

import device
from swapopt.bench import hardware_refs
from swapopt.bench.hardware_refs import HardwareRuns, measured_ratios
from swapopt.bench.layout_run import (
    LayoutResult, attach_hardware, derive, layouts_markdown, layouts_summary, run_layout,
)
from swapopt.bench.layouts import Layout, get_layout, scale_to_fit

CAP = 100_000_000  # the lease's --layout-max-params


def _sized(name: str) -> Layout:
    return scale_to_fit(get_layout(name), CAP)


@pytest.fixture
def fresh_table():
    hardware_refs._table.cache_clear()
    yield
    hardware_refs._table.cache_clear()


# The lease's own table (bench/results/cuda-h100-2026-11-28-lease.md), rounded as it prints them.
@pytest.mark.parametrize(
    "layout, label, printed",
    [
        ("fsdp256", "swapopt t=64 s=3", "2.68 / 1.53 / 1.49"),
        ("llama7b", "swapopt t=16 s=3", "1.05 / 1.08 / 1.04"),
        ("moe", "swapopt-graph t=64 s=3", "2.08 / 1.31 / 1.41"),
        ("tiny10k", "swapopt-graph t=16 s=3", "0.34 / 0.56 / 0.34"),
    ],
)
def test_the_h100_rows_of_the_layouts_as_the_bench_sizes_them_today(layout, label, printed):
    # The bench's layouts at 100 M params must still be the ones the lease ran, or no row would find its figures.
    lay = _sized(layout)
    found = measured_ratios("h100", layout, lay.count, lay.numel, label)
    assert found is not None and " / ".join(f"{v:.2f}" for v in found) == printed


def test_a_row_the_device_never_ran_has_no_figures():
    lay = _sized("fsdp256")
    assert measured_ratios("h100", "fsdp256", lay.count, lay.numel + 1, "swapopt t=16 s=3") is None  # other size
    assert measured_ratios("h100", "fsdp256", lay.count, lay.numel, "swapopt t=32 s=3") is None  # other chunks
    assert measured_ratios("910b", "fsdp256", lay.count, lay.numel, "swapopt t=16 s=3") is None  # no NPU runs yet
    assert hardware_refs.source("910b") is None
    assert "H100, 2026-11-28, swapopt 8dc00cf, 3 runs" in hardware_refs.source("h100")


def test_without_the_results_no_figures_rather_than_some(fresh_table, monkeypatch, tmp_path):
    lay = _sized("fsdp256")
    monkeypatch.setattr(hardware_refs, "RESULTS_DIR", tmp_path)
    assert measured_ratios("h100", "fsdp256", lay.count, lay.numel, "swapopt t=16 s=3") is None
    assert hardware_refs.source("h100") is None


def _result(layout: str, numel: int, labels: list[str]) -> LayoutResult:
    return derive(LayoutResult.model_validate({
        "layout": layout, "source": "test", "scale": 1, "tensors": 291, "numel": numel, "state_bytes": 8 * numel,
        "bandwidth": {"chunk_bytes": 1, "h2d_alone": 50.0, "d2h_alone": 50.0, "h2d_both": 50.0, "d2h_both": 50.0},
        "resident_ms": 1.0, "bound_ms": 4.0,
        "rows": [{"kind": "swapopt", "label": label, "chunks": 28, "step_ms": 4.4} for label in labels],
    }))


def test_the_report_prints_the_measured_column_only_where_there_are_figures():
    lay = _sized("fsdp256")
    res = attach_hardware(_result("fsdp256", lay.numel, ["swapopt t=16 s=3", "swapopt t=32 s=3"]), "h100")
    assert [r.hardware_ratios is not None for r in res.rows] == [True, False]
    md = layouts_markdown([res])
    assert "Measured step / bound: the same rows (layout, sizes, strategy, chunks asked, slots) on the device, H100, 2026-11-28" in md
    assert "| swapopt t=16 s=3 | 28 | 4.400 | 1.10 | 1.12 / 1.14 / 1.23 | " in md
    assert "| swapopt t=32 s=3 | 28 | 4.400 | 1.10 | - | " in md
    assert "| 1.10x | 1.12 / 1.14 / 1.23 |" in layouts_summary([res])
    # A device's own run (or a size the device never ran) renders as before: no column, no line.
    plain = attach_hardware(_result("fsdp256", lay.numel + 1, ["swapopt t=16 s=3"]), "h100")
    assert plain.hardware is None and "measured step / bound" not in layouts_markdown([plain])
    header = next(line for line in layouts_markdown([plain]).splitlines() if line.startswith("| strategy"))
    assert header.count("|") == 24  # 23 columns


def test_a_simulated_run_attaches_its_presets_device_figures(sim, fresh_table, monkeypatch, tmp_path):
    """run_layout on the simulator looks its rows up under its preset's name (h100, or 910b in the npu flavour)."""
    lay = Layout(name="pair", source="test", tensors=(("w", (64, 48)), ("b", (48,))))
    (tmp_path / "runs.json").write_text(json.dumps({"layouts": [{
        "layout": "pair", "tensors": 2, "numel": lay.numel,
        "rows": [{"label": "swapopt t=2 s=3", "ratio": 1.25}, {"label": "resident-fused", "ratio": 0.5}],
    }]}))
    preset = device.get_torch_device_module().preset.name
    monkeypatch.setattr(hardware_refs, "RESULTS_DIR", tmp_path)
    monkeypatch.setitem(hardware_refs.REFERENCES, preset,
                        HardwareRuns(device="Some GPU", date="2026-01-01", code="abc1234", files=("runs.json",)))
    res = run_layout(lay, times=(2,), bandwidth_repeats=1, host_repeats=1)
    assert [(r.label, r.hardware_ratios) for r in res.rows] == [("resident-fused", [0.5]), ("swapopt t=2 s=3", [1.25])]
    assert res.hardware.startswith("Some GPU, 2026-01-01, swapopt abc1234, 1 runs")
