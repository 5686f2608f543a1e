"""The verify report: `<device>-<date>-verify.md` and `.json` (and a chart of copy rates where matplotlib is
installed), with every figure measured and modeled side by side and the ratio of each."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from swapopt.bench.layout_run import layouts_markdown
from swapopt.bench.report import e2e_table, size_table
from swapopt.verify.bench_runs import BenchParts, HostTime
from swapopt.verify.calibrate import Calibration, CopyPoint
from swapopt.verify.comparison import Comparison, bench_rows, calibration_rows
from swapopt.verify.device_tests import DeviceTests
from swapopt.verify.environment import Environment
from swapopt.verify.plan import VerifyPlan

# Preset figures shown base against calibrated (the rest of a preset is not measured here).
PRESET_FIGURES = ("h2d_gbps", "d2h_gbps", "duplex_gbps", "copy_latency_us", "hbm_gbps", "bf16_tflops", "launch_us",
                  "event_us", "capacity_bytes")


class Phase(BaseModel):
    name: str
    seconds: float
    status: str = "ok"  # "ok", "skipped: why", "stopped: ..." (past its time limit) or "failed: why"
    limit_s: float | None = None  # the time limit it ran under


class VerifyReport(BaseModel):
    dry_run: bool
    quick: bool = False  # the quick plan (--quick): no peers, the modeled side left to --model
    date: str
    label: str  # device label of the measured side
    environment: Environment
    device_tests: DeviceTests | None = None
    calibration: Calibration | None = None  # measured
    # NPU only: the same copies with torch_npu's expandable segments on (swapopt/verify/copy_sweep.py).
    expandable_copies: list[CopyPoint] | None = None
    modeled_calibration: Calibration | None = None  # the same probes on the calibrated simulator
    base_preset: dict[str, Any] | None = None
    calibrated_preset: dict[str, Any] | None = None
    preset_path: str | None = None
    preset_round_trip: bool | None = None  # the written file loads back into the same preset
    preset_env_ok: bool | None = None  # SWAPOPT_SIM_PRESET takes the file's path in this swapopt
    measured: BenchParts | None = None
    modeled: BenchParts | None = None
    peers: list[dict[str, Any]] = []
    peers_note: str | None = None
    phases: list[Phase] = []
    notes: list[str] = []
    plan: VerifyPlan | None = None  # what was run (python -m swapopt.verify --model runs its modeled side)
    capacity: Any = None  # swapopt.bench.capacity's table, as that module returns it

    def comparisons(self) -> list[Comparison]:
        rows: list[Comparison] = []
        if self.calibration:
            rows += calibration_rows(self.calibration, self.modeled_calibration)
        if self.measured:
            rows += bench_rows(self.measured, self.modeled)
        return rows

    def host_fractions(self) -> list[tuple[str, float | None, float | None, float | None]]:
        """(what, host ms, step ms, host / step) per swapped optimizer step of a layout and per train step."""
        out: list[tuple[str, float | None, float | None, float | None]] = []
        for lay in self.measured.layouts if self.measured else []:
            for r in lay.rows:
                if r.step_ms:
                    host = r.host_ms
                    out.append((f"optimizer step, {lay.layout}, {r.label}", host, r.step_ms,
                                host / r.step_ms if host is not None else None))
        for h in self.measured.host if self.measured else []:
            out.append((f"train step, {h.config} (overlap_forward)", h.host_ms, h.train_step_ms, h.fraction))
        return out


def _num(v: float | None, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def _figure(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return "-" if v is None else str(v)


def comparison_table(rows: list[Comparison]) -> str:
    lines = ["| section | figure | unit | measured | modeled | measured / modeled | note |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.section} | {r.item} | {r.unit} | {_num(r.measured, '.4g')} | {_num(r.modeled, '.4g')} | "
                     f"{_num(r.ratio, '.3f')} | {r.note} |")
    return "\n".join(lines)


def preset_table(base: dict[str, Any], calibrated: dict[str, Any]) -> str:
    lines = ["| figure | base preset | calibrated | calibrated / base |", "|---|---:|---:|---:|"]
    for key in PRESET_FIGURES:
        b, c = base.get(key), calibrated.get(key)
        ratio = c / b if isinstance(b, (int, float)) and isinstance(c, (int, float)) and b else None
        lines.append(f"| {key} | {_figure(b)} | {_figure(c)} | {_num(ratio, '.3f')} |")
    return "\n".join(lines)


def _device_tests(t: DeviceTests) -> str:
    what = "ran" if t.ran else "collected only (dry run: no device)"
    counts = ", ".join(f"{v} {k}" for k, v in t.counts.items()) or "-"
    lines = [f"`python {' '.join(t.command)}`: {what}; exit code {t.returncode}, {t.seconds:.0f} s; {counts}.",
             f"pytest: {t.summary or '-'}"]
    if t.failures:
        lines += ["", *[f"- {f}" for f in t.failures]]
    elif t.returncode not in (0, 5):
        lines += ["", "```", *t.tail, "```"]
    return "\n".join(lines)


def _host_table(rows: list[tuple[str, float | None, float | None, float | None]], host: list[HostTime],
                simulated: bool) -> str:
    lines = ["| what | host ms per step | step ms | host / step |", "|---|---:|---:|---:|"]
    for what, h, s, f in rows:
        lines.append(f"| {what} | {_num(h)} | {_num(s)} | {_num(f, '.1%')} |")
    notes = sorted({h.note for h in host if h.note})
    text = ("Host ms of an optimizer step: the layout benchmark's own host ms (CPU time of the counted step, less "
            "the counter's cost); of a train step: CPU time of the thread issuing the steps, no host sync between "
            "them. A fraction near or above 100% means the host, not the device, sets the pace.")
    if simulated:
        text += (" Dry run: the simulator's ops run on the host, so these fractions describe the simulator, not a "
                 "device.")
    return "\n".join([text, "", *lines] + ([""] + [f"- {n}" for n in notes] if notes else []))


def _peers(report: VerifyReport) -> str:
    if not report.peers:
        return report.peers_note or "no peer rows"
    lines = ["| peer | available | step ms | peak device MB | note |", "|---|---|---:|---:|---|"]
    for p in report.peers:
        peak = p.get("device_peak_bytes")
        note = p.get("note") or p.get("reason") or ""
        ran = "FAILED" if p.get("failed") else ("yes" if p.get("available") else "no")
        lines.append(f"| {p.get('name')} | {ran} | {_num(p.get('step_ms'), '.2f')} | "
                     f"{_num(None if peak is None else peak / 2**20, '.1f')} | {note} |")
    return "\n".join(lines)


def _capacity(capacity: Any) -> str:
    """swapopt.bench.capacity's rows as a table when they are records, else as JSON."""
    if isinstance(capacity, str):
        return capacity
    if isinstance(capacity, list) and capacity and all(isinstance(r, dict) for r in capacity):
        keys = list(capacity[0])
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_figure(r.get(k)) for k in keys) + " |" for r in capacity]
        return "\n".join(lines)
    return "```json\n" + json.dumps(capacity, indent=1) + "\n```"


def markdown(report: VerifyReport, chart: str | None = None) -> str:
    env = report.environment
    kind = "dry run on the simulator" if report.dry_run else "on a device"
    parts = [f"# swapopt verify: {report.label}\n\n"
             f"{report.date}, {kind}. Measured: " + (
                 "the simulator itself, with its stock preset (a dry run: these are modeled figures, labelled "
                 "measured only to exercise the same path)" if report.dry_run else "device events on the device")
             + (". Modeled: the simulator with the preset calibrated in this run." if report.modeled_calibration
                else ". Modeled: not run yet; `python -m swapopt.verify --model` on this report's JSON adds it on any "
                     "CPU machine.")
             + (" Quick plan: each phase ran under its own time limit (see Phases)." if report.quick else "")]
    parts.append("## Environment\n\n" + "\n".join(f"- {line}" for line in env.lines()))
    if report.device_tests:
        parts.append(f"## Device tests (`-m {report.device_tests.marker}`)\n\n" + _device_tests(report.device_tests))
    if report.calibrated_preset and report.base_preset:
        rt = {True: "loads back into the same preset", False: "DOES NOT load back the same", None: "not checked"}
        parts.append(
            "## Calibrated preset\n\n"
            f"Written to `{report.preset_path}` ({rt[report.preset_round_trip]}); run the simulator on it with "
            + (f"`SWAPOPT_SIM_PRESET={report.preset_path}`, " if report.preset_env_ok else "")
            + f"`device.sim.activate(path)` or `python -m swapopt.bench --sim {report.preset_path}`.\n\n"
            f"Calibrated: {report.calibrated_preset.get('calibrated')}\n\n"
            + preset_table(report.base_preset, report.calibrated_preset))
    if report.expandable_copies and report.calibration:
        lines = ["| copy size | H2D GB/s pinned | expandable | D2H GB/s pinned | expandable |",
                 "|---|---:|---:|---:|---:|"]
        pinned = {p.nbytes: p for p in report.calibration.copies}
        for e in report.expandable_copies:
            p = pinned.get(e.nbytes)
            lines.append(f"| {e.nbytes / 2**20:g} MB | {_num(p.h2d_gbps if p else None, '.1f')} | {e.h2d_gbps:.1f} | "
                         f"{_num(p.d2h_gbps if p else None, '.1f')} | {e.d2h_gbps:.1f} |")
        parts.append("## Pinned against expandable-segment pinned (PYTORCH_NPU_ALLOC_CONF=expandable_segments:True)"
                     "\n\n" + "\n".join(lines))
    rows = report.comparisons()
    if rows:
        parts.append("## Measured and modeled\n\n" + comparison_table(rows))
    if chart:
        parts.append(f"![pinned copy rates, measured and modeled]({chart})")
    fractions = report.host_fractions()
    if fractions:
        host = report.measured.host if report.measured else []
        parts.append("## Host time per step\n\n" + _host_table(fractions, host, report.dry_run))
    if not report.quick:
        parts.append("## Peers\n\n" + _peers(report))
    if report.capacity is not None:
        parts.append("## Capacity (the largest model that fits)\n\n" + _capacity(report.capacity))
    if report.measured:
        m = report.measured
        modeled = report.dry_run
        if m.sizes:
            parts.append("## Quick table (measured)\n\n" + "\n\n".join(size_table(s) for s in m.sizes))
        if m.e2e:
            parts.append("## End to end (measured)\n\n" + e2e_table(m.e2e, modeled=modeled))
        if m.layouts:
            parts.append(layouts_markdown(m.layouts).rstrip().replace("## Layouts", "## Layouts (measured)", 1))
    parts.append("## Phases\n\n| phase | seconds | limit s | status |\n|---|---:|---:|---|\n"
                 + "\n".join(f"| {p.name} | {p.seconds:.1f} | {_num(p.limit_s, '.0f')} | {p.status} |"
                              for p in report.phases))
    if report.notes:
        parts.append("## Notes\n\n" + "\n".join(f"- {n}" for n in report.notes))
    return "\n\n".join(parts) + "\n"


def write(report: VerifyReport, out_dir: Path, stem: str) -> list[Path]:
    """JSON, the copy-rate chart (where matplotlib is installed) and the markdown; the paths written."""
    from swapopt.verify.charts import copy_chart

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(report.model_dump_json(indent=1))
    chart = None
    if report.calibration:
        title = f"pinned copies, {report.label}" + (" (dry run: both sides modeled)" if report.dry_run else "")
        chart = copy_chart(report.calibration, report.modeled_calibration, out_dir / f"{stem}-copies.png", title)
    md_path.write_text(markdown(report, chart.name if chart else None))
    return [p for p in (json_path, md_path, chart) if p]
