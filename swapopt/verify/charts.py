"""The verify run's chart: pinned copy rate against copy size, measured and modeled, where matplotlib is
installed (the run writes its tables without it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from swapopt.verify.calibrate import Calibration


def copy_chart(measured: Calibration, modeled: Calibration | None, path: Path, title: str) -> Path | None:
    """Rate of H2D, D2H and both at once (H2D issued first) per copy size; None without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a device machine or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for cal, style, tag in ((measured, "-o", "measured"), (modeled, "--x", "modeled")):
        if cal is None:
            continue
        mb = [p.nbytes / 2**20 for p in cal.copies]
        ax.plot(mb, [p.h2d_gbps for p in cal.copies], style, color="tab:blue", label=f"H2D alone, {tag}")
        ax.plot(mb, [p.d2h_gbps for p in cal.copies], style, color="tab:orange", label=f"D2H alone, {tag}")
        both = [next((b for b in p.both if b.first == "h2d"), p.both[0]) for p in cal.copies]
        ax.plot(mb, [b.total_gbps for b in both], style, color="tab:green", label=f"both at once, total, {tag}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per copy (MB)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
