"""The rate a copy gets while the other direction is busy, read from a measured duplex table.

One function shared by the simulator's timeline (device/sim/preset_spec.py) and swapopt's planner
(swapopt/plan.py), so the two price a copy of the same size with the same rate. Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def duplex_rate(table: Sequence[tuple[float, float, float]], direction: str, nbytes: float) -> float:
    """GB/s of a ``direction`` ("h2d" or "d2h") copy of ``nbytes`` with both directions busy, from rows of
    (copy bytes, H2D GB/s, D2H GB/s) in ascending bytes: interpolated in log size, clamped at the table's ends.
    The caller caps it at the direction's rate alone."""
    column = 1 if direction == "h2d" else 2
    if nbytes <= table[0][0]:
        return table[0][column]
    if nbytes >= table[-1][0]:
        return table[-1][column]
    j = next(i for i, row in enumerate(table) if row[0] >= nbytes)
    lo, hi = table[j - 1], table[j]
    w = (math.log(nbytes) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
    return lo[column] + w * (hi[column] - lo[column])
