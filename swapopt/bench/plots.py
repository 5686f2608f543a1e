"""PNG charts: step time over the bound per strategy, and one step's lanes."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402

from swapopt.bench.run import SizeResult  # noqa: E402
from swapopt.bench.timeline import LANES, Span  # noqa: E402


RATIO_FLOOR = 0.9  # the axis starts here so that 1.00-1.20, where swapopt's settings differ, keeps its height


def _ratio_top(sizes: list[SizeResult]) -> float:
    """Top of the ratio axis: above every swapopt bar and the 1.1 line; taller bars are clipped and labelled."""
    swap = [r.ratio for s in sizes for r in s.rows if r.kind == "swapopt" and r.ratio is not None]
    return max(1.25, 1.08 * max(swap, default=1.0))


def bar_chart(sizes: list[SizeResult], path: Path, title: str) -> Path:
    fig = bar_figure(sizes, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bar_figure(sizes: list[SizeResult], title: str) -> plt.Figure:
    """Two panels, grouped by size: step time / bound per strategy (axis from 0.9, bars beyond the top
    clipped, hatched and labelled with their value) and peak extra device memory (log scale, labelled)."""
    labels: list[str] = []
    for s in sizes:
        for r in s.rows:
            if r.ratio is not None and r.label not in labels:
                labels.append(r.label)
    n = max(len(sizes), 1)
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(max(9, 0.75 * len(labels) * n), 8.5), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    width = 0.8 / n
    top = _ratio_top(sizes)
    colors = plt.get_cmap("tab10")
    for i, s in enumerate(sizes):
        rows = {r.label: r for r in s.rows if r.ratio is not None}
        xs = [j + i * width for j, lab in enumerate(labels) if lab in rows]
        picked = [rows[lab] for lab in labels if lab in rows]
        heights = [max(min(r.ratio, top) - RATIO_FLOOR, 0.0) for r in picked]
        bars = ax.bar(xs, heights, bottom=RATIO_FLOOR, width=width, color=colors(i), label=f"{s.size_b:g}B params")
        for bar, r in zip(bars, picked):
            clipped = r.ratio > top
            if clipped:
                bar.set_hatch("//")
            y = top if clipped else max(r.ratio, RATIO_FLOOR)
            text = f"{r.ratio:.2f}x" + (" (clipped)" if clipped else "")
            ax.annotate(text.replace(" (clipped)", "\nclipped") if clipped else text,
                        (bar.get_x() + bar.get_width() / 2, y), xytext=(0, -4 if clipped else 2),
                        textcoords="offset points", ha="center", va="top" if clipped else "bottom",
                        rotation=90 if n > 2 else 0, fontsize=7,
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none") if clipped else None)
        peaks = [max(r.peak_extra_bytes or 0, 0) / 2**20 for r in picked]
        mbars = mem.bar(xs, [max(v, 1e-3) for v in peaks], width=width, color=colors(i))
        for bar, v in zip(mbars, peaks):
            # Zero (host-side strategies) has no place on a log axis: its label sits on the axis floor.
            mem.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, max(v, 0.6)), xytext=(0, 2),
                         textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.1, color="red", linewidth=0.8, linestyle="--", label="1.10 x bound")
    ax.set_ylim(RATIO_FLOOR, top + 0.02)
    ax.set_ylabel(f"step time / bound (axis from {RATIO_FLOOR}, clipped at {top:.2f})")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    mem.set_yscale("log")
    mem.set_ylim(0.5, None)
    mem.set_ylabel("peak extra device MB (log)")
    mem.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    mem.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    fig.tight_layout()
    return fig


def timeline_chart(spans: list[Span], path: Path, title: str, marks: list[float] | None = None) -> Path:
    """One row per lane (H2D, compute, update, D2H, host); spans coloured by chunk where known; ``marks``:
    times (us) drawn as dashed vertical lines (step starts)."""
    lanes = [lane for lane in LANES if any(s.lane == lane for s in spans)]
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.7 * max(len(lanes), 1)))
    cmap = plt.get_cmap("tab20")
    for row, lane in enumerate(lanes):
        for s in (s for s in spans if s.lane == lane):
            color = cmap(s.chunk % 20) if s.chunk is not None else "0.6"
            ax.broken_barh([(s.start_us / 1e3, (s.end_us - s.start_us) / 1e3)], (row - 0.35, 0.7),
                           facecolors=color, edgecolor="black", linewidth=0.2)
    # Without an "update" lane the optimizer's update runs on the compute stream: that lane is the update.
    separate = any(s.lane == "update" for s in spans)
    names = {"h2d": "H2D (swap-in)", "compute": "forward / backward" if separate else "update",
             "update": "update (own stream)", "d2h": "D2H (swap-out)", "host": "host"}
    for x in marks or []:
        ax.axvline(x / 1e3, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([names[lane] for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
