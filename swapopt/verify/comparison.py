"""Measured against modeled: one row per figure, with the ratio measured / modeled.

Modeled figures are the simulator's, with the preset calibrated in the same run. Where the simulator ran a
smaller size than the device (its ops are real CPU work), step times are scaled by the ratio of state
bytes, which the model makes exact once copies dwarf launches, and the row says it was scaled. Ratios to
the bound (step / bound) need no scaling and are compared as they are.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from swapopt.bench.layout_run import LayoutResult
from swapopt.bench.run import SizeResult
from swapopt.verify.bench_runs import BenchParts
from swapopt.verify.calibrate import Calibration


class Comparison(BaseModel):
    section: str
    item: str
    unit: str
    measured: float | None
    modeled: float | None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.measured is None or self.modeled is None or self.modeled == 0:
            return None
        return self.measured / self.modeled


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MB"


def calibration_rows(measured: Calibration, modeled: Calibration | None) -> list[Comparison]:
    rows = []
    model_copies = {p.nbytes: p for p in modeled.copies} if modeled else {}
    for p in measured.copies:
        m = model_copies.get(p.nbytes)
        rows += [
            Comparison(section="copies", item=f"H2D {_mb(p.nbytes)}", unit="GB/s", measured=p.h2d_gbps,
                       modeled=m.h2d_gbps if m else None),
            Comparison(section="copies", item=f"D2H {_mb(p.nbytes)}", unit="GB/s", measured=p.d2h_gbps,
                       modeled=m.d2h_gbps if m else None),
        ]
        for b in p.both:
            mb = next((x for x in m.both if x.first == b.first), None) if m else None
            for d in ("h2d", "d2h"):
                rows.append(Comparison(
                    section="copies", item=f"{d.upper()} with both busy, {b.first.upper()} issued first, "
                    f"{_mb(p.nbytes)}", unit="GB/s", measured=getattr(b, f"{d}_gbps"),
                    modeled=getattr(mb, f"{d}_gbps") if mb else None))
    model_steps = {p.numel: p for p in modeled.adamw} if modeled else {}
    for p in measured.adamw:
        m = model_steps.get(p.numel)
        rows.append(Comparison(section="fused AdamW step", item=f"{p.numel:,} params", unit="ms", measured=p.ms,
                               modeled=m.ms if m else None, note="" if m else "not modeled: above the simulator's cap"))
    if modeled:
        n, model_n = measured.matmul.n, modeled.matmul.n
        rows.append(Comparison(section="bf16 matmul", item=f"{n}^3", unit="TFLOP/s", measured=measured.matmul.tflops,
                               modeled=modeled.matmul.tflops, note="" if n == model_n else f"modeled at {model_n}^3"))
        rows.append(Comparison(section="launch", item="tiny kernel, back to back", unit="us",
                               measured=measured.launch.kernel_us, modeled=modeled.launch.kernel_us))
    return rows


def _scale(measured_bytes: int, modeled_bytes: int) -> tuple[float, str]:
    if measured_bytes == modeled_bytes:
        return 1.0, ""
    factor = measured_bytes / modeled_bytes
    return factor, f"modeled at {_mb(modeled_bytes)} of states, times scaled x{factor:.3g}"


def _step_rows(section: str, state_bytes: int, rows: list[Any], modeled: Any | None) -> list[Comparison]:
    """Step time and step / bound of each measured row beside the modeled row of the same label (a quick-table
    size or a layout: both have ``state_bytes`` and rows with ``label``, ``step_ms`` and ``ratio``)."""
    factor, scaled = _scale(state_bytes, modeled.state_bytes) if modeled else (1.0, "")
    out = []
    for r in rows:
        m = next((x for x in modeled.rows if x.label == r.label), None) if modeled else None
        # A quick-table row proves its work (swapopt.bench.proof); one that did not is an error, and a row written
        # before rows carried the proof says so. Layout rows carry no proof.
        error, proof = getattr(r, "error", None), getattr(r, "params_total", 0)
        why = f"measured row is an error: {error}" if error else (
            "measured before rows proved their work (bytes moved, params changed)" if proof is None else "")
        note = "; ".join(x for x in (scaled, why) if x)
        out.append(Comparison(section=section, item=f"{r.label} step", unit="ms", measured=r.step_ms,
                              modeled=m.step_ms * factor if m and m.step_ms is not None else None, note=note))
        out.append(Comparison(section=section, item=f"{r.label} step / bound", unit="x", measured=r.ratio,
                              modeled=m.ratio if m else None, note=why))
    return out


def _size_rows(measured: SizeResult, modeled: SizeResult | None) -> list[Comparison]:
    return _step_rows(f"quick table {measured.size_b:g}B", measured.state_bytes, measured.rows, modeled)


def _layout_rows(measured: LayoutResult, modeled: LayoutResult | None) -> list[Comparison]:
    return _step_rows(f"layout {measured.layout}", measured.state_bytes, measured.rows, modeled)


E2E_FIGURES = (
    ("resident_train_ms", "train step, states resident", "ms"),
    ("train_off_ms", "train step, swapped", "ms"),
    ("train_on_ms", "train step, swapped with overlap_forward + prefetch", "ms"),
    ("swap_step_ms", "optimizer step alone, swapped", "ms"),
    ("forward_ms", "forward", "ms"),
    ("overhead_on", "overhead with overlap over resident", "fraction"),
)


def _e2e_rows(measured: dict, modeled: dict | None) -> list[Comparison]:
    note = "" if modeled else "not modeled: the simulator would run this model's forward as host CPU work"
    return [Comparison(section=f"end to end {measured['config']}", item=label, unit=unit, measured=measured.get(key),
                       modeled=modeled.get(key) if modeled else None, note=note)
            for key, label, unit in E2E_FIGURES]


def bench_rows(measured: BenchParts, modeled: BenchParts | None) -> list[Comparison]:
    rows: list[Comparison] = []
    for i, s in enumerate(measured.sizes):
        rows += _size_rows(s, modeled.sizes[i] if modeled and i < len(modeled.sizes) else None)
    for lay in measured.layouts:
        twin = next((x for x in modeled.layouts if x.layout == lay.layout), None) if modeled else None
        rows += _layout_rows(lay, twin)
    for e in measured.e2e:
        rows += _e2e_rows(e, next((x for x in modeled.e2e if x["config"] == e["config"]), None) if modeled else None)
    return rows
