"""One step's device timeline: H2D, update (compute) and D2H spans, from the simulator's modeled
timeline, on a real GPU from a torch.profiler trace, on an Ascend NPU from a torch_npu.profiler trace.

``trace_spans`` reads a saved chrome trace of either kind (``prof.export_chrome_trace(path)``, or torch_npu's
``ASCEND_PROFILER_OUTPUT/trace_view.json``):

- CUDA (torch.profiler / kineto): device activity is ``ph: "X"`` events of ``cat`` ``kernel``,
  ``gpu_memcpy`` and ``gpu_memset``; a copy's direction is in its name (``Memcpy HtoD (Pinned -> Device)``);
  swapopt's ranges are repeated on the device as ``gpu_user_annotation`` events spanning the work they launched.
- NPU (torch_npu.profiler): device tasks are the ``X`` events of the process named ``Ascend Hardware``
  (one thread per stream, ``Stream N``), named after the kernel, or after the task type for copies and syncs
  (``MEMCPY_ASYNC``, ``EVENT_RECORD``, ...; ``args["Task Type"]`` says it too); a copy's name does not give
  its direction. Host ops (swapopt's ranges among them, ``cat: "cpu_op"``) are in the ``Python`` process, and
  a ``torch_to_npu`` flow (``ph`` ``s`` on the host op, ``f`` on the device task, same ``id``) links each
  device task to the op that launched it. A task's lane and chunk are those of the swapopt range around its
  launching op on the same host thread. Timestamps are strings of microseconds (``"1010.250"``, msprof's
  with a trailing tab). Other processes (``CANN`` API calls, ``Overlap Analysis``, ``AI Core Freq``
  counters, ``HCCL``) are not device spans and are left out, and so are sync tasks (event record / wait,
  notify), which move no data and compute nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

import torch
from pydantic import BaseModel

import device

LANES = ("h2d", "compute", "update", "d2h", "host")
# swapopt's record_function ranges name the chunk: "swapopt.swap_in[3]", "swapopt.update[3]".
_CHUNK = re.compile(r"\[(\d+)\]|chunk\D{0,3}(\d+)", re.IGNORECASE)


class Span(BaseModel):
    lane: str
    name: str
    start_us: float
    end_us: float
    chunk: int | None = None


def _chunk_of(*texts: str | None) -> int | None:
    for text in texts:
        m = _CHUNK.search(text or "")
        if m:
            return int(m.group(1) or m.group(2))
    return None


def _sim_spans(strategy) -> list[Span]:
    mod = device.get_torch_device_module()
    mod.synchronize()
    mod.reset_timeline()
    strategy.step()
    strategy.drain()
    mod.synchronize()
    return _from_zero([
        Span(lane=op.lane, name=op.name, start_us=op.start_us, end_us=op.end_us, chunk=_chunk_of(op.label))
        for op in mod.timeline
        if op.end_us > op.start_us
    ])


def _from_zero(spans: list[Span]) -> list[Span]:
    if not spans:
        return spans
    t0 = min(s.start_us for s in spans)
    return [s.model_copy(update={"start_us": s.start_us - t0, "end_us": s.end_us - t0}) for s in spans]


def _lane_of(name: str) -> str:
    if "swap_in" in name or "HtoD" in name:
        return "h2d"
    if "swap_out" in name or "DtoH" in name:
        return "d2h"
    return "compute"


_CUDA_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_NPU_DEVICE_PROCESS = "Ascend Hardware"
_NPU_FLOW = "torch_to_npu"
# Task types (and task names) of NPU sync tasks: no data moved, nothing computed.
_NPU_SYNC = re.compile(
    r"EVENT_(RECORD|WAIT|RESET)|NOTIFY_(RECORD|WAIT)|STREAM_WAIT|CAPTURE_(RECORD|WAIT)|PROFILER_TRACE"
)
_NPU_COPY = re.compile(r"MEMCPY|SDMA|memcpy", re.IGNORECASE)
_RANGE_LANE = {"swap_in": "h2d", "swap_out": "d2h", "update": "compute"}
_SWAPOPT_RANGE = re.compile(r"^swapopt\.(swap_in|swap_out|update)\[")


def _ns(ts: Any) -> int:
    """A chrome-trace timestamp (us, a number or torch_npu's string, maybe tab-terminated) in integer ns."""
    return round(float(str(ts).strip()) * 1000)


def _range_lane(name: str) -> str | None:
    m = _SWAPOPT_RANGE.match(name)
    return _RANGE_LANE[m.group(1)] if m else None


def trace_spans(trace: dict | list | str | Path) -> list[Span]:
    """Device spans of a chrome trace written by torch.profiler (CUDA) or torch_npu.profiler (NPU): a path, the
    loaded JSON (``{"traceEvents": [...]}``) or its event list; times from the first span. See the module
    docstring for what each kind holds."""
    if isinstance(trace, (str, Path)):
        trace = json.loads(Path(trace).read_text())
    events: list[dict] = trace.get("traceEvents", []) if isinstance(trace, dict) else list(trace)
    process = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    npu = {pid for pid, name in process.items() if str(name).startswith(_NPU_DEVICE_PROCESS)}
    if npu:
        return _from_zero(_npu_spans(events, npu))
    return _from_zero(_cuda_trace_spans(events))


def _cuda_trace_spans(events: Iterable[dict]) -> list[Span]:
    device_ops, ranges = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        start, end = _ns(e["ts"]), _ns(e["ts"]) + round(float(e.get("dur", 0)) * 1000)
        if e.get("cat") == "gpu_user_annotation" and _range_lane(e["name"]):
            ranges.append((_range_lane(e["name"]), start, end, _chunk_of(e["name"])))
        elif e.get("cat") in _CUDA_DEVICE_CATS and end > start:
            device_ops.append((_lane_of(e["name"]), e["name"], start, end))
    spans = []
    for lane, name, start, end in device_ops:
        chunk = next((c for ln, s, t, c in ranges if ln == lane and s <= start <= t), None)
        spans.append(Span(lane=lane, name=name, start_us=start / 1e3, end_us=end / 1e3, chunk=chunk))
    return spans


def _npu_spans(events: list[dict], device_pids: set) -> list[Span]:
    ranges: dict[tuple, list[tuple[int, int, str]]] = {}  # host (pid, tid) -> swapopt ranges (start, end, name)
    tasks, flow_start, flow_end = [], {}, {}
    for e in events:
        ph, pid = e.get("ph"), e.get("pid")
        if ph == "X" and pid in device_pids:
            task_type = str(e.get("args", {}).get("Task Type", ""))
            dur = round(float(e.get("dur", 0)) * 1000)
            if dur > 0 and not _NPU_SYNC.search(task_type) and not _NPU_SYNC.search(e.get("name", "")):
                tasks.append(e)
        elif ph == "X" and _range_lane(e.get("name", "")):
            start = _ns(e["ts"])
            ranges.setdefault((pid, e.get("tid")), []).append((start, start + round(float(e["dur"]) * 1000), e["name"]))
        elif ph in ("s", "f") and e.get("name") == _NPU_FLOW:
            (flow_start if ph == "s" else flow_end)[e.get("id")] = (pid, e.get("tid"), _ns(e["ts"]))
    # device task (pid, tid, ns) -> the host (pid, tid, ns) of the op that launched it
    launched_by = {flow_end[i]: flow_start[i] for i in flow_end if i in flow_start}

    def launching_range(task: dict) -> str | None:
        host = launched_by.get((task["pid"], task.get("tid"), _ns(task["ts"])))
        if host is None:
            return None
        around = [r for r in ranges.get(host[:2], ()) if r[0] <= host[2] <= r[1]]
        return min(around, key=lambda r: r[1] - r[0])[2] if around else None  # the innermost

    placed, stream_lanes = [], {}
    for task in tasks:
        name = task.get("name", "")
        is_copy = bool(_NPU_COPY.search(str(task.get("args", {}).get("Task Type", ""))) or _NPU_COPY.search(name))
        label = launching_range(task)
        lane = _range_lane(label) if label else None
        if lane is None and is_copy and ("HtoD" in name or "DtoH" in name):
            lane = _lane_of(name)
        if lane is None and not is_copy:
            lane = "compute"
        if lane is not None and is_copy:
            stream_lanes.setdefault((task["pid"], task.get("tid")), []).append(lane)
        placed.append((task, lane, _chunk_of(label) if label else None))
    spans = []
    for task, lane, chunk in placed:
        if lane is None:  # a copy launched outside swapopt's ranges: the lane its stream's other copies are on
            seen = stream_lanes.get((task["pid"], task.get("tid")))
            if not seen:
                continue
            lane = max(set(seen), key=seen.count)
        start = _ns(task["ts"])
        end = start + round(float(task["dur"]) * 1000)
        spans.append(Span(lane=lane, name=task.get("name", ""), start_us=start / 1e3, end_us=end / 1e3, chunk=chunk))
    return spans


def _npu_profiler_spans(strategy) -> list[Span]:
    """One step under torch_npu's profiler (CPU and NPU activity), exported as a chrome trace and read back."""
    import tempfile

    import torch_npu

    mod = device.get_torch_device_module()
    mod.synchronize()
    activities = [torch_npu.profiler.ProfilerActivity.CPU, torch_npu.profiler.ProfilerActivity.NPU]
    with tempfile.TemporaryDirectory(prefix="swapopt-npu-trace-") as tmp:
        with torch_npu.profiler.profile(activities=activities) as prof:
            strategy.step()
            strategy.drain()
            mod.synchronize()
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))  # parses the CANN data: device tasks, torch_to_npu flows
        if not path.exists():
            return []
        return trace_spans(path)


def _profiler_spans(strategy) -> list[Span]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    mod = device.get_torch_device_module()
    mod.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        strategy.step()
        strategy.drain()
        mod.synchronize()
    on_device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    # swapopt's record_function ranges also appear on the GPU timeline (user annotations spanning the
    # work they launched): a copy or kernel belongs to the chunk whose range of the same lane holds it.
    ranges = [
        (_lane_of(e.name), e.time_range.start, e.time_range.end, _chunk_of(e.name))
        for e in on_device
        if _chunk_of(e.name) is not None
    ]
    spans = []
    for e in on_device:
        if _chunk_of(e.name) is not None:
            continue
        lane, start = _lane_of(e.name), e.time_range.start
        chunk = next((c for ln, s, t, c in ranges if ln == lane and s <= start <= t), None)
        spans.append(Span(lane=lane, name=e.name, start_us=start, end_us=e.time_range.end, chunk=chunk))
    return _from_zero(spans)


def capture_step(strategy) -> list[Span]:
    """Run one step of `strategy` and return its device spans (empty where no trace is available)."""
    kind = device.get_device()
    if device.is_simulated():  # get_device() names the flavour it presents (cuda/npu)
        return _sim_spans(strategy)
    if kind == "cuda" and torch.cuda.is_available():
        return _profiler_spans(strategy)
    if kind == "npu":
        return _npu_profiler_spans(strategy)
    return []


def engine_spans(marks_us: list[float] = ()) -> tuple[list[Span], list[float]]:
    """The simulator's device spans since its last ``reset_timeline`` (call after a synchronize): copies on
    their lanes, kernels of the compute stream (forward, backward) on "compute" and kernels of any other
    stream (the optimizer's update stream under ``overlap_forward``) on "update"; and ``marks_us`` (simulator
    times, e.g. step starts) on the spans' time axis. Empty off the simulator."""
    if not device.is_simulated():
        return [], []
    mod = device.get_torch_device_module()
    compute = mod.default_stream().name
    spans = []
    for op in mod.timeline:
        if op.end_us <= op.start_us or op.lane == "host":
            continue
        lane = op.lane if op.lane != "compute" or op.stream == compute else "update"
        spans.append(Span(lane=lane, name=op.name, start_us=op.start_us, end_us=op.end_us, chunk=_chunk_of(op.label)))
    if not spans:
        return [], []
    t0 = min([s.start_us for s in spans] + list(marks_us))  # a step starts a launch before its first kernel
    shifted = [s.model_copy(update={"start_us": s.start_us - t0, "end_us": s.end_us - t0}) for s in spans]
    return shifted, [m - t0 for m in marks_us]
