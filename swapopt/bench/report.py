"""Markdown and JSON reports, and the target checks computed from the rows."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from swapopt.bench.layout_run import LayoutResult, layouts_markdown
from swapopt.bench.run import Row, SizeResult

MB = 1 << 20


class Targets(BaseModel):
    """Step targets per size, reported (never asserted on timings)."""

    size_b: float
    best_swap_16plus: str | None = None
    best_swap_ratio: float | None = None  # target <= 1.10
    # Speed-ups over the reference schedules. With both directions sharing one link cap, no schedule beats
    # serial by more than serial / (total bytes / cap) (1.51x on the h100 preset), so these are reported,
    # not held to a fixed figure.
    vs_serial: float | None = None  # serial / swapopt t=16 s=3
    vs_one_in_flight: list[str] = []  # per one-in-flight row: speedup of the best swapopt row at <= its peak
    peak_within_cap: bool | None = None  # every swapopt row: peak extra <= (slots + 1) x chunk


class Report(BaseModel):
    device: str
    device_name: str
    torch: str
    date: str
    preset: dict | None = None
    impl: str
    sizes: list[SizeResult]
    targets: list[Targets]
    e2e: list[dict] = []
    layouts: list[LayoutResult] = []
    notes: list[str] = []
    command: str = ""  # the command line that made the report


def _swap_rows(size: SizeResult) -> list[Row]:
    return [r for r in size.rows if r.kind == "swapopt" and r.step_ms is not None]


def targets_for(size: SizeResult) -> Targets:
    t = Targets(size_b=size.size_b)
    swaps = _swap_rows(size)
    deep = [r for r in swaps if (r.times or 0) >= 16]
    if deep:
        best = min(deep, key=lambda r: r.step_ms)
        t.best_swap_16plus, t.best_swap_ratio = best.label, best.ratio
    default = next((r for r in swaps if r.times == 16 and r.slots == 3), None)
    serial = next((r for r in size.rows if r.kind == "serial" and r.step_ms is not None), None)
    if default and serial:
        t.vs_serial = serial.step_ms / default.step_ms
    for ref in (r for r in size.rows if r.kind == "one-in-flight" and r.step_ms is not None):
        fits = [r for r in swaps if r.peak_extra_bytes <= ref.peak_extra_bytes]
        if fits:
            best = min(fits, key=lambda r: r.step_ms)
            t.vs_one_in_flight.append(
                f"{ref.label} ({ref.peak_extra_bytes / MB:.0f} MB): {ref.step_ms / best.step_ms:.2f}x by {best.label}"
                f" ({best.peak_extra_bytes / MB:.0f} MB)"
            )
        else:
            t.vs_one_in_flight.append(f"{ref.label}: no swapopt row at or below its peak")
    if swaps:
        t.peak_within_cap = all(r.peak_extra_bytes <= r.cap_bytes for r in swaps if r.cap_bytes)
    return t


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _mb(v: int | None) -> str:
    return _fmt(None if v is None else v / MB, ".1f")


def size_table(size: SizeResult) -> str:
    bw = size.bandwidth
    lines = [
        f"### {size.size_b:g}B params ({size.numel / 1e9:.3f}B; states {size.state_bytes / 1e9:.2f} GB each way"
        + (", bf16 params with fp32 masters swapped: 12 B a param" if size.master_weights else "") + ")",
        "",
        f"Pinned copies at {bw.chunk_bytes / MB:.1f} MB: H2D {bw.h2d_alone:.1f} GB/s alone, {bw.h2d_both:.1f} both ways;"
        f" D2H {bw.d2h_alone:.1f} alone, {bw.d2h_both:.1f} both ways. Bound {size.bound_ms:.2f} ms"
        + (f" ({size.bound_note})" if size.bound_note else "")
        + ".",
        "",
        "| strategy | reproduces | step ms | x bound | peak extra MB | chunk MB | cap MB | pinned host MB |"
        " one step moved in / out MB (needs) | B/param in / out | params changed | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in size.rows:
        mb = [_mb(v) for v in (r.peak_extra_bytes, r.chunk_bytes, r.cap_bytes, r.host_bytes)]
        step = "ERROR" if r.error else _fmt(r.step_ms, ".2f")
        note = "; ".join(x for x in (f"ERROR: {r.error}" if r.error else "", r.note) if x)
        lines.append(
            f"| {r.label} | {r.reproduces} | {step} | {_fmt(r.ratio, '.2f')} | {' | '.join(mb)} | {moved(r)} | "
            f"{per_param(r)} | {changed(r)} | {note} |"
        )
    return "\n".join(lines)


def moved(r: Row) -> str:
    """'in / out (needs in / out)' MB of a row's proof step, or '-' where none ran."""
    if r.h2d_bytes is None:
        return "-"
    return f"{_mb(r.h2d_bytes)} / {_mb(r.d2h_bytes)} ({_mb(r.need_h2d_bytes)} / {_mb(r.need_d2h_bytes)})"


def per_param(r: Row) -> str:
    """Bytes a param one step moved 'in / out', or '-' where none ran."""
    if r.h2d_bytes is None or not r.numel:
        return "-"
    return f"{r.h2d_bytes / r.numel:.3f} / {r.d2h_bytes / r.numel:.3f}"


def changed(r: Row) -> str:
    return "-" if r.params_total is None else f"{r.params_changed}/{r.params_total}"


def targets_table(targets: list[Targets]) -> str:
    lines = [
        "| size | best swapopt (16+ chunks) x bound (<= 1.10) | serial / swapopt t=16 s=3 |"
        " one-in-flight / swapopt at <= equal peak | peak <= (slots+1) x chunk |",
        "|---|---|---:|---|---|",
    ]
    for t in targets:
        lines.append(
            f"| {t.size_b:g}B | {t.best_swap_16plus or '-'}: {_fmt(t.best_swap_ratio, '.3f')} | {_fmt(t.vs_serial, '.2f')} | "
            f"{'; '.join(t.vs_one_in_flight) or '-'} | {'-' if t.peak_within_cap is None else t.peak_within_cap} |"
        )
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return _fmt(None if v is None else 100 * v, ".1f") + ("" if v is None else "%")


def _met(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def e2e_table(e2e: list[dict], modeled: bool = False) -> str:
    """Per engine config: the optimizer step alone (resident, swapped), the train step resident, swapped and
    swapped with overlap_forward, the forward, and how much of the swap the overlap hid."""
    tag = " (modeled)" if modeled else ""
    lines = [
        f"Times in ms{tag}. Train step = period start to start of consecutive steps, measured over a loop with no "
        "host sync. Overlap efficiency = hidden / min(swap step, forward), hidden = swap step - (train step on - resident "
        "train step) "
        f"(target >= {100 * 0.9:.0f}%); overhead = train step / resident train step - 1 (target with overlap <= 5%).",
        "",
        "| config | params | layers | tokens/step | resident step | swap step | forward | resident train step |"
        " train step, overlap off | train step, overlap on | hidden | overlap efficiency | overhead off | overhead on |"
        " forward >= swap step | targets met (eff / overhead) | losses bitwise equal | peak MB resident / swap / overlap |"
        " note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|",
    ]
    for e in e2e:
        params = e.get("params")
        name = e["config"] + (f" ({', '.join(e['options'])})" if e.get("options") else "")
        peaks = " / ".join(_mb(e.get(k)) for k in ("peak_resident_bytes", "peak_swap_bytes", "peak_overlap_bytes"))
        lines.append(
            f"| {name} | {'-' if params is None else f'{params / 1e6:.1f}M'} | {e.get('layers', '-')} | "
            f"{e.get('tokens', '-')} | "
            + " | ".join(_fmt(e.get(k), ".2f") for k in ("resident_step_ms", "swap_step_ms", "forward_ms",
                                                         "resident_train_ms", "train_off_ms", "train_on_ms",
                                                         "hidden_ms"))
            + f" | {_pct(e.get('efficiency'))} | {_fmt(e.get('overhead_off'), '+.1%')} | "
            f"{_fmt(e.get('overhead_on'), '+.1%')} | {_met(e.get('forward_covers_swap'))} | "
            f"{_met(e.get('efficiency_met'))} / {_met(e.get('overhead_met'))} | {_met(e.get('losses_equal'))} | "
            f"{peaks} | {e.get('note', '')} |"
        )
    return "\n".join(lines)


def markdown(report: Report, chart: str | None = None, timeline: str | None = None,
             e2e_timeline: str | None = None) -> str:
    head = [
        f"# swapopt benchmark: {report.device_name}",
        "",
        f"device `{report.device}`, torch {report.torch}, {report.date}, AdamW ({report.impl}) fp32 states.",
    ]
    if report.command:
        head.append(f"Command: `{report.command}`")
    if report.preset:
        head.append(
            f"Simulator preset: H2D {report.preset['h2d_gbps']} GB/s, D2H {report.preset['d2h_gbps']} GB/s, "
            f"both at once {report.preset.get('duplex_gbps', '-')} GB/s, copy latency "
            f"{report.preset.get('copy_latency_us', '-')} us, HBM {report.preset['hbm_gbps']} GB/s, host "
            f"{report.preset['host_gbps']} GB/s, launch {report.preset['launch_us']} us"
            + (f", event record or wait {report.preset['event_us']:.2f} us" if report.preset.get("event_us") else "")
            + "; times are modeled (deterministic)."
        )
    parts = ["\n".join(head)]
    if report.sizes:
        parts += ["## Targets", targets_table(report.targets)]
    if report.e2e:
        parts += ["## End to end (train step)", e2e_table(report.e2e, modeled=report.device == "sim")]
    if report.sizes:
        parts.append("## Step of each strategy")
        parts += [size_table(s) for s in report.sizes]
    if report.layouts:
        parts.append(layouts_markdown(report.layouts).rstrip())
    if chart:
        parts.append(f"![step time / bound]({chart})")
    if timeline:
        parts.append(f"![one swapopt step]({timeline})")
    if e2e_timeline:
        parts.append(f"![two consecutive train steps with overlap_forward]({e2e_timeline})")
    if report.notes:
        parts.append("## Notes\n\n" + "\n".join(f"- {n}" for n in report.notes))
    return "\n\n".join(parts) + "\n"


def write(report: Report, out_dir: Path, stem: str, chart: str | None, timeline: str | None,
          e2e_timeline: str | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report.model_dump(mode="json"), indent=1))
    md_path.write_text(markdown(report, chart, timeline, e2e_timeline))
    return json_path, md_path


def unique_stem(out_dir: Path, stem: str) -> str:
    """``stem``, or ``stem-2``, ``stem-3``... so that no earlier result (JSON, markdown, chart) is overwritten."""
    def taken(candidate: str) -> bool:
        return any(out_dir.glob(f"{candidate}.*")) or any(out_dir.glob(f"{candidate}-chart.png")) \
            or any(out_dir.glob(f"{candidate}-timeline.png")) or any(out_dir.glob(f"{candidate}-e2e-timeline.png"))

    if not taken(stem):
        return stem
    n = 2
    while taken(f"{stem}-{n}"):
        n += 1
    return f"{stem}-{n}"


def summary_table(report: Report) -> str:
    """The answer in one table: each strategy's step time over the bound per size, and its peak extra
    device memory at the largest size; modeled figures say so."""
    sizes = report.sizes
    labels: list[str] = []
    docs: dict[str, str] = {}
    for s in sizes:
        for r in s.rows:
            if r.label not in labels:
                labels.append(r.label)
                docs[r.label] = r.reproduces
    modeled = " (modeled)" if report.device == "sim" else ""
    last = sizes[-1] if sizes else None
    head = "| strategy | reproduces | " + " | ".join(f"{s.size_b:g}B x bound{modeled}" for s in sizes)
    head += f" | peak extra MB ({last.size_b:g}B) |" if last else " |"
    lines = [f"step time / bound on {report.device_name}{modeled}; bound = max(H2D, D2H, resident step)", "",
             head, "|---|---|" + "---:|" * (len(sizes) + (1 if last else 0))]
    for label in labels:
        cells = []
        for s in sizes:
            row = next((r for r in s.rows if r.label == label), None)
            if row is not None and row.error:
                cells.append("error: did not do the work (see the table)")
                continue
            cells.append("-" if row is None or row.ratio is None else f"{row.ratio:.2f}x" + (f" {row.note}" if row.note else ""))
        if last:
            row = next((r for r in last.rows if r.label == label), None)
            cells.append(_mb(row.peak_extra_bytes if row else None))
        lines.append(f"| {label} | {docs[label]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
