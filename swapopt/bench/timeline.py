"""One step's device timeline: H2D, update (compute) and D2H spans, from the simulator's modeled
timeline or, on a real GPU, from a torch.profiler trace."""

from __future__ import annotations

import re

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
