"""The device's own figures beside the simulator's: for a layout row modeled on a preset calibrated on a device,
the step / bound that device measured for the very same row in committed results.

Note [hardware beside the model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A modeled figure is worth what the hardware it stands for would give. So the layout bench on the simulator prints,
next to each row's modeled step / bound, what the preset's device measured for the same row: the same layout at
the same sizes (tensor count and params), the same strategy, chunk count asked and slots (the row's label). The
references are whole runs of the layout bench on that device (``REFERENCES``), named with the code they ran and
when; they show the run-to-run spread of one lease, which on host-bound rows is wider than any one figure
(bench/results/cuda-h100-2026-11-27-repeatability.md). A row the device never ran (another size, another
strategy) gets none. They are read from the repository's ``bench/results``, so an installed package without it
prints none.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pydantic import BaseModel

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"


class HardwareRuns(BaseModel):
    """Layout bench runs on one device, read as that device's figures for the preset calibrated on it."""

    device: str  # as the report names it
    date: str
    code: str  # the swapopt commit the runs measured
    files: tuple[str, ...]  # layout bench results (JSON) under RESULTS_DIR, in the order run

    def describe(self) -> str:
        names = ", ".join(f"`bench/results/{f}`" for f in self.files)
        return f"{self.device}, {self.date}, swapopt {self.code}, {len(self.files)} runs ({names})"


# Per simulator preset: the device it was calibrated on, and its latest lease of the layout bench at 100 M params
# (fused AdamW, 3 slots, 16 and 64 chunks asked, eager and replayed rows; cuda-h100-2026-11-28-lease.md).
REFERENCES: dict[str, HardwareRuns] = {
    "h100": HardwareRuns(
        device="H100", date="2026-11-28", code="8dc00cf",
        files=tuple(f"cuda-h100-2026-11-28-layouts-100m-{i}.json" for i in (1, 2, 3)),
    ),
}

# (layout, tensors, params, row label) -> step / bound of each run, in the order run
RowKey = tuple[str, int, int, str]


@functools.cache
def _table(preset: str) -> dict[RowKey, tuple[float, ...]]:
    runs = REFERENCES.get(preset)
    if runs is None:
        return {}
    found: dict[RowKey, list[float]] = {}
    for name in runs.files:
        path = RESULTS_DIR / name
        if not path.is_file():
            return {}  # not a checkout with the results: no reference rather than part of one
        for lay in json.loads(path.read_text())["layouts"]:
            for row in lay["rows"]:
                if row.get("ratio") is not None:
                    key = (lay["layout"], lay["tensors"], lay["numel"], row["label"])
                    found.setdefault(key, []).append(row["ratio"])
    return {key: tuple(ratios) for key, ratios in found.items()}


def measured_ratios(preset: str, layout: str, tensors: int, numel: int, label: str) -> tuple[float, ...] | None:
    """Step / bound of each reference run of ``preset``'s device for this row (Note [hardware beside the
    model]); None where that device never ran it."""
    return _table(preset).get((layout, tensors, numel, label))


def source(preset: str) -> str | None:
    """Where ``preset``'s reference figures come from, for the report; None without any."""
    runs = REFERENCES.get(preset)
    return runs.describe() if runs is not None and _table(preset) else None
