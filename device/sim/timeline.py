"""Deterministic timeline model of a simulated accelerator.

The host issues ops; each launch costs `launch_us` of host time. An op starts once it is launched,
its stream has finished everything before it (including waited events) and its lane is free:
lanes "h2d", "d2h" and "compute" each serve one op at a time, so copies in opposite directions
overlap each other and compute. Copy lanes serve ops in launch order; the compute lane runs an op in
the idle time after it is ready, in pieces if kernels booked earlier lie ahead (work-conserving, as a
GPU runs kernels of two streams at once): a kernel of one stream runs while a kernel of another stream
launched before it still waits for an event. Ops that touch no device memory run on the host ("host"
lane).

Costs, as on the hardware:
- a kernel takes max(bytes touched / HBM bandwidth, FLOPs / peak FLOP rate of its precision); only
  contractions carry FLOPs (device/costs.py), everything else is bound by its bytes;
- a copy takes a fixed latency (its direction's: SimPreset.latency_us), then moves its bytes at the link
  rate of its direction. How both directions at once share the link is the preset's `link_sharing` (Note
  [link sharing] in device/sim/presets.py):
  - "sized": a copy that overlaps copies already scheduled the other way moves, meanwhile, at the rate the
    preset's table gives for its size with both busy. Scheduled ops are never moved (their end times are
    already visible through streams and events), so what those copies moved over their own both-busy rate
    meanwhile is owed by their direction (Note [link debt]).
  - "first": a copy that overlaps copies already scheduled the other way gets what the cap (`duplex_gbps`)
    leaves it, never more than its own direction's rate; the copy launched later absorbs the sharing, and
    the link never carries more than the cap.
  - "d2h" / "h2d": a copy of the favoured direction always moves at its full rate; one of the other
    direction gets what the cap leaves beside favoured copies already scheduled. A favoured copy launched
    after other-way copies it overlaps cannot slow them (they are scheduled), so what the link carried
    over the cap there is owed by the other direction (Note [link debt]).

Note [host clock]: a device op cannot start before the host has issued it. The host clock advances by
`launch_us` per launched op, plus per tensor the op takes beyond its first two (a fused or foreach op over many
tensors: its launcher, and the optimizer's Python that gathered its lists, walk every one), plus `event_us` per
event record and per stream wait outside a capture (calls into the runtime's stream queue: on the H100 a record
cost the host 6.3 us, a launch 6.2; a swapped step makes six a chunk), plus the host's own work (host ops at
`host_gbps`, blocking waits). Two clocks:
- "ops" (the default): the per-tensor cost is `host_tensor_us`, the launcher's and the optimizer's Python together
  (calibrated on a resident fused step, where nothing else runs on the host). The program's own Python between ops
  is not charged. Deterministic, so tests may assert modeled times.
- "measured" (SWAPOPT_SIM_HOST_CLOCK=measured, or `Timeline(host_clock="measured")`): before each op the clock
  also advances by the CPU time the issuing thread spent outside the simulator's own frames since its previous op
  (device/sim/host_time.py), the Python of the program itself, as the device's host would run it (Note [scaled
  Python] there): less what entering the simulator cost (no device has it), times `host_ref_us` over this
  machine's time for the same reference work. The per-tensor cost is then `launcher_tensor_us`, the launcher's
  part alone, since the Python that gathered the lists is in the measured time. Not deterministic (it is this
  machine's CPU time, scaled): for a program's host cost against hardware (bench/results/
  sim-h100-2026-11-26-fidelity-e190371-after.md), not for tests. A preset without `host_ref_us` charges this
  machine's Python unscaled.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

from device.sim import host_time
from device.sim.costs import Flops
from device.sim.presets import SimPreset

LANES = ("h2d", "d2h", "compute")


class TimelineOp(NamedTuple):
    stream: str
    lane: str  # "h2d" | "d2h" | "compute" | "host"
    name: str  # "aten.copy_.default"
    label: str | None  # innermost torch.profiler.record_function range
    start_us: float
    end_us: float
    nbytes: int
    flops: float = 0.0  # arithmetic the op was priced for (0: priced by bytes alone)


_new_tuple = tuple.__new__

# The other direction of each copy lane: they share the link's aggregate cap.
_OPPOSITE = {"h2d": "d2h", "d2h": "h2d"}
HOST_CLOCKS = ("ops", "measured")  # Note [host clock]
# The measured clock times this machine's reference work again after this many CPU seconds of the issuing thread.
SCALE_EVERY_S = 1.0
HOST_CLOCK_ENV = "SWAPOPT_SIM_HOST_CLOCK"
# A flow segment of a copy lane: (start_us, end_us, bytes per us, bytes per us the copy moves with both busy).
Segment = tuple[float, float, float, float]


def host_clock_from_env() -> str:
    """SWAPOPT_SIM_HOST_CLOCK: "ops" (the default) or "measured" (Note [host clock])."""
    value = os.environ.get(HOST_CLOCK_ENV, "ops").strip().lower() or "ops"
    if value not in HOST_CLOCKS:
        raise ValueError(f"{HOST_CLOCK_ENV} must be one of {', '.join(HOST_CLOCKS)}, got {value!r}")
    return value


class Timeline:
    def __init__(self, preset: SimPreset, max_ops: int = 200_000, host_clock: str | None = None) -> None:
        self.preset = preset
        self.host_us = 0.0
        self.runtime_calls = 0  # event records and stream waits the host made outside a capture (runtime_call)
        self.host_clock = host_clock or host_clock_from_env()
        if self.host_clock not in HOST_CLOCKS:
            raise ValueError(f"host_clock must be one of {', '.join(HOST_CLOCKS)}, got {self.host_clock!r}")
        # "measured": per thread, (CPU seconds, seconds inside simulator frames, simulator entries, of them frame
        # calls) when its last op was charged (last) and its CPU seconds when it last timed the reference work
        # (scale_at); this machine's entry costs and the device host's speed against it (Note [scaled Python]).
        self._python_mark = threading.local()
        self.python_scale, self._entry_us, self._entry_tensor_us, self._frame_us = 1.0, 0.0, 0.0, 0.0
        if self.host_clock == "measured":
            self._entry_us, self._entry_tensor_us = host_time.entry_costs()
            self._frame_us = host_time.frame_entry_us()
            self.python_scale = host_time.python_scale(preset.host_ref_us)
        self._lane_free = dict.fromkeys(LANES, 0.0)  # when each lane's last scheduled op ends
        # Busy intervals of the compute lane, sorted and disjoint, kept from the host's time on (nothing
        # launched later can start before it): the idle gaps between them take later-ready kernels, in pieces
        # (see _fit).
        self._busy_start: list[float] = []
        self._busy_end: list[float] = []
        # Per copy lane, the link rate it uses over time: (start_us, end_us, bytes per us) segments in time
        # order. Kept only as far back as the other lane could still overlap them.
        self._flow: dict[str, list[Segment]] = {"h2d": [], "d2h": []}
        # Note [link debt]: under a fixed sharing rule, bytes the link carried over its cap because a favoured
        # copy was launched after other-way copies it overlapped (already scheduled, so never slowed); under
        # "sized", bytes other-way copies moved over their both-busy rate beside a copy launched after them.
        # That direction's next copy moves them first, as if its earlier copies had given way in time: over
        # any span that ends after that copy the link carries no more than the rule allows, and a direction
        # that is busy all along moves what it would under the rule. A direction with no later copy keeps its
        # debt until it has one (the end of a burst of copies is modeled a little fast, by at most what was owed).
        # Under "sized" a copy issued once both directions have drained pays none: on the H100 a direction alone
        # after a both-busy run moves at its rate alone, so the debt only carries from copy to copy while the link
        # stays busy (a both-busy run followed by a synchronize is modeled short by what it owed).
        self._debt: dict[str, float] = {"h2d": 0.0, "d2h": 0.0}
        # Long training loops keep only the most recent ops; clocks are unaffected.
        self._ops: deque[TimelineOp] = deque(maxlen=max_ops)

    @property
    def ops(self) -> list[TimelineOp]:
        return list(self._ops)

    def _rate(self, lane: str) -> float:
        """Bytes per microsecond of a copy lane alone (GB/s = 1e3 bytes/us)."""
        return (self.preset.h2d_gbps if lane == "h2d" else self.preset.d2h_gbps) * 1e3

    def kernel_cost_us(self, nbytes: int, flops: Flops | None = None) -> float:
        """A compute op: max(bytes / HBM bandwidth, FLOPs / peak rate of its precision)."""
        memory = nbytes / (self.preset.hbm_gbps * 1e3)
        if flops is None or flops.count <= 0:
            return memory
        return max(memory, flops.count / (self.preset.peak_tflops(flops.precision) * 1e6))  # TFLOP/s = 1e6 FLOP/us

    def _copy_end_us(self, lane: str, start_us: float, nbytes: int) -> float:
        """When a copy starting at `start_us` ends: its direction's latency, then its bytes at its direction's
        rate, less what copies already scheduled the other way leave it meanwhile (Note [link sharing]).
        Records its own flow."""
        if self.preset.link_sharing == "sized":
            return self._sized_end_us(lane, start_us, nbytes)
        if self.preset.link_sharing == lane:
            return self._favoured_end_us(lane, start_us, nbytes)
        own = self._rate(lane)
        cap = self.preset.duplex_gbps * 1e3
        opposite = self._flow[_OPPOSITE[lane]]
        flow = self._flow[lane]
        t = start_us + self.preset.latency_us(lane)
        left = float(nbytes) + self._debt[lane]  # Note [link debt]: what this direction owes goes first
        self._debt[lane] = 0.0
        for seg_start, seg_end, other, _ in opposite:
            if left <= 0:
                break
            if seg_end <= t:
                continue
            for rate, until in ((own, seg_start), (min(own, cap - other), seg_end)):
                if until <= t or left <= 0:
                    continue
                if rate <= 0:  # the other direction holds the whole cap: wait it out
                    t = until
                    continue
                done = t + left / rate
                if done <= until:
                    t, left = self._move(flow, t, done, rate), 0.0
                else:
                    left -= (until - t) * rate
                    t = self._move(flow, t, until, rate)
        if left > 0:
            t = self._move(flow, t, t + left / own, own)
        self._prune(lane, t)
        return t

    def _sized_end_us(self, lane: str, start_us: float, nbytes: int) -> float:
        """A copy under "sized": alone at its direction's rate; beside other-way copies already scheduled at the
        rate the preset's table gives its size with both busy. Those copies keep their times; what they moved
        over their own both-busy rate meanwhile becomes their direction's debt (Note [link debt])."""
        own = self._rate(lane)
        both = self.preset.both_gbps(lane, nbytes) * 1e3
        other_lane = _OPPOSITE[lane]
        flow = self._flow[lane]
        t = start_us + self.preset.latency_us(lane)
        left = float(nbytes) + self._debt[lane]
        self._debt[lane] = 0.0
        for seg_start, seg_end, other, other_both in self._flow[other_lane]:
            if left <= 0:
                break
            if seg_end <= t:
                continue
            if seg_start > t:  # alone until the other direction starts
                done = t + left / own
                if done <= seg_start:
                    t, left = self._move(flow, t, done, own, both), 0.0
                    break
                left -= (seg_start - t) * own
                t = self._move(flow, t, seg_start, own, both)
            until = min(seg_end, t + left / both)
            left -= (until - t) * both
            if other > other_both:
                self._debt[other_lane] += (until - t) * (other - other_both)
            t = self._move(flow, t, until, both, both)
        if left > 1e-9:
            t = self._move(flow, t, t + left / own, own, both)
        self._prune(lane, t)
        return t

    def _favoured_end_us(self, lane: str, start_us: float, nbytes: int) -> float:
        """A copy of the direction that keeps its rate: latency, then its bytes at its full rate. Where
        other-way copies already scheduled overlap it and the two exceed the cap, the excess becomes the
        other direction's debt (Note [link debt])."""
        own = self._rate(lane)
        cap = self.preset.duplex_gbps * 1e3
        t = start_us + self.preset.latency_us(lane)
        end = t + nbytes / own
        other = _OPPOSITE[lane]
        for seg_start, seg_end, rate, _ in self._flow[other]:
            overlap = min(end, seg_end) - max(t, seg_start)
            if overlap > 0 and rate + own > cap:
                self._debt[other] += overlap * (rate + own - cap)
        self._move(self._flow[lane], t, end, own)
        self._prune(lane, end)
        return end

    def _prune(self, lane: str, t: float) -> None:
        """Drop flow segments no later copy can overlap, after a copy of `lane` that ends at `t`."""
        # Later copies of this lane start after `t`; later ones the other way no earlier than that lane is free
        # and the host has launched them: segments ending before those can no longer overlap anything.
        opposite, flow = self._flow[_OPPOSITE[lane]], self._flow[lane]
        while opposite and opposite[0][1] <= t:
            opposite.pop(0)
        horizon = max(self._lane_free[_OPPOSITE[lane]], self.host_us)
        while flow and flow[0][1] <= horizon:
            flow.pop(0)

    @staticmethod
    def _move(flow: list[Segment], start: float, end: float, rate: float, both: float = 0.0) -> float:
        """Append a segment moving `rate` bytes/us over [start, end) (`both`: the copy's rate with both
        directions busy, under "sized"); return `end`."""
        if end > start:
            if flow and flow[-1][1] == start and flow[-1][2] == rate and flow[-1][3] == both:
                flow[-1] = (flow[-1][0], end, rate, both)
            else:
                flow.append((start, end, rate, both))
        return end

    def launch(
        self,
        stream: str,
        ready_us: float,
        lane: str,
        nbytes: int,
        name: str,
        label: str | None,
        flops: Flops | None = None,
        tensors: int = 0,
        issued_us: float | None = None,
    ) -> TimelineOp:
        """Launch a stream op that may start no earlier than `ready_us` (its stream's tail); return it.
        `flops` prices a compute op by arithmetic as well as by bytes (device.costs.op_flops); `tensors` is how
        many tensors it takes, for the host's cost of issuing it (Note [host clock]). `issued_us`: a node of a
        replayed graph, which the device issues itself at that time (never before the host's clock): the host
        pays nothing for it (Note [graph capture] in device/sim/graphs.py)."""
        preset = self.preset
        if issued_us is None:
            if self.host_clock == "measured":
                self.charge_python(tensors)
            # issue_us(tensors), written out (this runs for every device op)
            per_tensor = preset.host_tensor_us if self.host_clock == "ops" else preset.launcher_tensor_us
            self.host_us += preset.launch_us + per_tensor * max(tensors - 2, 0)
            now = self.host_us
        else:
            now = max(issued_us, self.host_us)
        if lane in _OPPOSITE:
            start = max(now, ready_us, self._lane_free[lane])
            if self.preset.link_sharing == "sized" and now >= max(self._lane_free[d] for d in _OPPOSITE):
                # Note [link debt]: under "sized", a copy the host issues once both directions have drained (after
                # a synchronize, say) pays nothing for copies before it, as on the H100: H2D copies alone right
                # after both directions were busy moved at their rate alone (bench/results/
                # cuda-h100-2026-11-26-verify-a.md, copies, H2D alone after the both-busy rows, 16 MB-1 GB:
                # 51.9-55.1 GB/s). Drained as the host sees it: a copy issued later starts no earlier than the
                # host issues it, so none can overlap the copies before any more; a lane merely free at this
                # copy's start may still take a copy issued after it that starts before it.
                self._debt["h2d"] = self._debt["d2h"] = 0.0
            end = self._copy_end_us(lane, start, nbytes)
        else:
            cost = self.kernel_cost_us(nbytes, flops)
            start, end = self._fit(max(now, ready_us), cost)
        work = flops.count if flops is not None and lane == "compute" else 0.0
        op = _new_tuple(TimelineOp, (stream, lane, name, label, start, end, nbytes, work))  # without a Python frame
        self._lane_free[lane] = max(self._lane_free[lane], op.end_us)
        self._ops.append(op)
        return op

    def _fit(self, ready: float, cost: float) -> tuple[float, float]:
        """Book `cost` us of the compute lane from `ready` on, in the idle gaps between kernels booked
        earlier (another stream's, waiting on their own events), and return (first start, last end).

        Work-conserving, like a GPU running kernels of two streams at once: a long forward kernel that
        becomes ready while a dedicated stream's short kernels are queued further ahead shares the
        lane with them instead of waiting for a gap it would fit whole (which, with gaps shorter than it,
        would be after the last of them). Kernels already booked keep their times."""
        starts, ends = self._busy_start, self._busy_end
        drop = bisect.bisect_right(ends, self.host_us)
        if drop:
            del starts[:drop], ends[:drop]
        t, left = ready, cost
        j = bisect.bisect_right(ends, t)  # the first interval still busy after t
        first = None
        pieces: list[tuple[float, float]] = []
        while left > 0:
            if j < len(starts) and starts[j] <= t:  # inside a busy interval: skip to its end
                t = ends[j]
                j += 1
                continue
            gap_end = starts[j] if j < len(starts) else math.inf
            take = min(left, gap_end - t)
            if take > 0:
                pieces.append((t, t + take))
                first = t if first is None else first
                left -= take
                t += take
            if left > 0:
                t = max(t, gap_end)
        if first is None:  # a zero-cost kernel
            first = t
            pieces.append((t, t))
        for a, b in pieces:
            self._book(a, b)
        return first, pieces[-1][1]

    def _book(self, start: float, end: float) -> None:
        """Mark [start, end) busy, merged with the intervals it touches."""
        starts, ends = self._busy_start, self._busy_end
        j = bisect.bisect_left(ends, start)
        while j < len(starts) and starts[j] <= end:
            start, end = min(start, starts[j]), max(end, ends[j])
            del starts[j], ends[j]
        starts.insert(j, start)
        ends.insert(j, end)

    def issue_us(self, tensors: int) -> float:
        """Host time to issue one device op taking `tensors` tensors (Note [host clock])."""
        per_tensor = self.preset.host_tensor_us if self.host_clock == "ops" else self.preset.launcher_tensor_us
        return self.preset.launch_us + per_tensor * max(tensors - 2, 0)

    def charge_python(self, tensors: int = 0) -> None:
        """Under the "measured" host clock, advance it by the calling thread's CPU time outside the simulator's
        frames since its previous op, less this machine's cost of entering the simulator (the entries since then,
        each at its kind's cost, and the `tensors` of the op being issued), scaled to the device's host (Note [host
        clock]); under "ops", nothing."""
        if self.host_clock != "measured":
            return
        now, inside, entries, frames = time.thread_time(), host_time.seconds(), host_time.calls(), host_time.frames()
        mark = getattr(self._python_mark, "last", None)
        self._python_mark.last = (now, inside, entries, frames)
        if mark is not None:
            then, then_inside, then_entries, then_frames = mark
            new_frames = frames - then_frames
            python_us = ((now - then) - (inside - then_inside)) * 1e6
            python_us -= (entries - then_entries - new_frames) * self._entry_us + new_frames * self._frame_us
            python_us -= tensors * self._entry_tensor_us
            self.host_us += max(python_us, 0.0) * self.python_scale
        # This machine's speed drifts within seconds (Note [scaled Python]): every SCALE_EVERY_S of a thread's CPU
        # time, the reference is timed again, in a simulator frame, so its CPU time is not charged as the program's.
        taken = getattr(self._python_mark, "scale_at", None)
        if taken is None:
            self._python_mark.scale_at = now
        elif self.preset.host_ref_us > 0 and now - taken > SCALE_EVERY_S:
            self._python_mark.scale_at = now
            host_time.enter()
            try:
                self.python_scale = host_time.python_scale_now(self.preset.host_ref_us)
            finally:
                host_time.leave()

    def runtime_call(self) -> None:
        """The host records an event or makes a stream wait for one (not while capturing): it pays `event_us`,
        after the program's Python before the call under the "measured" clock (Note [host clock])."""
        if self.host_clock == "measured":
            self.charge_python()
        self.host_us += self.preset.event_us
        self.runtime_calls += 1

    def host_op(self, nbytes: int, name: str, label: str | None) -> None:
        if self.host_clock == "measured":
            self.charge_python()
        start = self.host_us
        self.host_us += nbytes / (self.preset.host_gbps * 1e3)
        self._ops.append(_new_tuple(TimelineOp, ("host", "host", name, label, start, self.host_us, nbytes, 0.0)))

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
                    "args": {k: args[k] for k in ("lane", "name", "label", "nbytes", "flops")},
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
