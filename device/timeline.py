"""Deterministic timeline model of a simulated accelerator.

The host issues ops; each launch costs `launch_us` of host time. An op starts once it is launched,
its stream has finished everything before it (including waited events) and its lane is free:
lanes "h2d", "d2h" and "compute" each serve one op at a time, so copies in opposite directions
overlap each other and compute. Copies cost bytes / link bandwidth, compute ops bytes touched /
device memory bandwidth. Ops that touch no device memory run on the host ("host" lane).
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import NamedTuple

from device.presets import SimPreset

LANES = ("h2d", "d2h", "compute")


class TimelineOp(NamedTuple):
    stream: str
    lane: str  # "h2d" | "d2h" | "compute" | "host"
    name: str  # "aten.copy_.default"
    label: str | None  # innermost torch.profiler.record_function range
    start_us: float
    end_us: float
    nbytes: int


class Timeline:
    def __init__(self, preset: SimPreset, max_ops: int = 200_000) -> None:
        self.preset = preset
        self.host_us = 0.0
        self._lane_free = dict.fromkeys(LANES, 0.0)
        # Long training loops keep only the most recent ops; clocks are unaffected.
        self._ops: deque[TimelineOp] = deque(maxlen=max_ops)

    @property
    def ops(self) -> list[TimelineOp]:
        return list(self._ops)

    def lane_cost_us(self, lane: str, nbytes: int) -> float:
        gbps = {"h2d": self.preset.h2d_gbps, "d2h": self.preset.d2h_gbps, "compute": self.preset.hbm_gbps}[lane]
        return nbytes / (gbps * 1e3)  # GB/s = 1e3 bytes/us

    def launch(self, stream: str, ready_us: float, lane: str, nbytes: int, name: str, label: str | None) -> TimelineOp:
        """Launch a stream op that may start no earlier than `ready_us` (its stream's tail); return it."""
        self.host_us += self.preset.launch_us
        start = max(self.host_us, ready_us, self._lane_free[lane])
        op = TimelineOp(stream, lane, name, label, start, start + self.lane_cost_us(lane, nbytes), nbytes)
        self._lane_free[lane] = op.end_us
        self._ops.append(op)
        return op

    def host_op(self, nbytes: int, name: str, label: str | None) -> None:
        start = self.host_us
        self.host_us += nbytes / (self.preset.host_gbps * 1e3)
        self._ops.append(TimelineOp("host", "host", name, label, start, self.host_us, nbytes))

    def device_tail_us(self) -> float:
        """When everything launched so far has finished."""
        return max(self._lane_free.values())

    def wait_host(self, until_us: float) -> None:
        """A blocking call: the host resumes when the awaited work is done."""
        self.host_us = max(self.host_us, until_us)

    def clear(self) -> None:
        """Forget recorded ops; clocks keep running so later ops stay consistent with in-flight work."""
        self._ops.clear()

    def chrome_trace(self) -> dict:
        tids: dict[str, int] = {"host": 0}
        events = []
        for op in self._ops:
            tid = tids.setdefault(op.stream, len(tids))
            args = op._asdict()
            events.append(
                {
                    "name": op.label or op.name,
                    "cat": op.lane,
                    "ph": "X",
                    "ts": op.start_us,
                    "dur": op.end_us - op.start_us,
                    "pid": 0,
                    "tid": tid,
                    "args": {k: args[k] for k in ("lane", "name", "label", "nbytes")},
                }
            )
        meta = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": stream}}
            for stream, tid in tids.items()
        ]
        meta.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"sim:{self.preset.name}"}})
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()))
