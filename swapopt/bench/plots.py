"""PNG charts: step time over the bound per strategy, and one step's lanes."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402

from swapopt.bench.run import SizeResult  # noqa: E402
from swapopt.bench.timeline import LANES, Span  # noqa: E402


def bar_chart(sizes: list[SizeResult], path: Path, title: str) -> Path:
    """Grouped bars of step time / bound per strategy (one group per size), lines at 1.0 and 1.1."""
    labels: list[str] = []
    for s in sizes:
        for r in s.rows:
            if r.ratio is not None and r.label not in labels:
                labels.append(r.label)
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(labels) * max(len(sizes), 1)), 4.8))
    width = 0.8 / max(len(sizes), 1)
    for i, s in enumerate(sizes):
        ratios = {r.label: r.ratio for r in s.rows if r.ratio is not None}
        xs = [j + i * width for j, lab in enumerate(labels) if lab in ratios]
        ys = [ratios[lab] for lab in labels if lab in ratios]
        ax.bar(xs, ys, width=width, label=f"{s.size_b:g}B params")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.1, color="red", linewidth=0.8, linestyle="--", label="1.10 x bound")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("step time / bound")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def timeline_chart(spans: list[Span], path: Path, title: str) -> Path:
    """One row per lane (H2D, update, D2H, host); spans coloured by chunk where known."""
    lanes = [lane for lane in LANES if any(s.lane == lane for s in spans)]
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.7 * max(len(lanes), 1)))
    cmap = plt.get_cmap("tab20")
    for row, lane in enumerate(lanes):
        for s in (s for s in spans if s.lane == lane):
            color = cmap(s.chunk % 20) if s.chunk is not None else "0.6"
            ax.broken_barh([(s.start_us / 1e3, (s.end_us - s.start_us) / 1e3)], (row - 0.35, 0.7),
                           facecolors=color, edgecolor="black", linewidth=0.2)
    names = {"h2d": "H2D (swap-in)", "compute": "update", "d2h": "D2H (swap-out)", "host": "host"}
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([names[lane] for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
