"""Measurements taken in the benchmark run itself: link bandwidth, the bound, step timings.

All timings come from device events on the current device module (CUDA, NPU or the simulator,
whose events report modeled time), so the same code produces the real and the modeled table.
"""

from __future__ import annotations

import gc
import statistics

import torch
from pydantic import BaseModel

import device
from swapopt.bench.strategies import Strategy


class Bandwidth(BaseModel):
    """Pinned copy rates in GB/s (1e9 B/s) at one chunk size."""

    chunk_bytes: int
    h2d_alone: float
    d2h_alone: float
    h2d_both: float
    d2h_both: float

    @property
    def h2d(self) -> float:
        # The bound uses the lower rate: a link may slow one direction while the other is busy.
        return min(self.h2d_alone, self.h2d_both)

    @property
    def d2h(self) -> float:
        return min(self.d2h_alone, self.d2h_both)


class StepTiming(BaseModel):
    step_ms: float  # median of the repeats
    all_ms: list[float]
    peak_extra_bytes: int  # max over repeats of max_memory_allocated - memory_allocated at step start


def _timed_event():
    return device.get_torch_device_module().Event(enable_timing=True)


def measure_bandwidth(chunk_bytes: int, repeats: int = 8) -> Bandwidth:
    """H2D and D2H rates of pinned copies of `chunk_bytes`, each alone and both at once."""
    mod = device.get_torch_device_module()
    numel = max(chunk_bytes // 4, 1)
    dev = device.torch_device()
    host = [device.pinned_empty((numel,), dtype=torch.float32) for _ in range(2)]
    for h in host:
        h.zero_()
    dst = [torch.zeros(numel, dtype=torch.float32, device=dev) for _ in range(2)]
    up, down = mod.Stream(), mod.Stream()
    nbytes = numel * 4 * repeats

    def run(directions: list[str]) -> dict[str, float]:
        mod.synchronize()
        go = mod.current_stream().record_event()
        marks = {}
        for name in directions:
            stream = up if name == "h2d" else down
            i = 0 if name == "h2d" else 1
            stream.wait_event(go)
            start, end = _timed_event(), _timed_event()
            start.record(stream)
            with mod.stream(stream):
                for _ in range(repeats):
                    if name == "h2d":
                        dst[i].copy_(host[i], non_blocking=True)
                    else:
                        host[i].copy_(dst[i], non_blocking=True)
            end.record(stream)
            marks[name] = (start, end)
        mod.synchronize()
        return {name: nbytes / (s.elapsed_time(e) * 1e-3) / 1e9 for name, (s, e) in marks.items()}

    run(["h2d", "d2h"])  # warm-up: first-touch, pinned page mapping, stream creation
    alone_up, alone_down = run(["h2d"]), run(["d2h"])
    both = run(["h2d", "d2h"])
    del dst, host
    return Bandwidth(
        chunk_bytes=numel * 4,
        h2d_alone=alone_up["h2d"],
        d2h_alone=alone_down["d2h"],
        h2d_both=both["h2d"],
        d2h_both=both["d2h"],
    )


def bound_ms(h2d_bytes: int, d2h_bytes: int, bw: Bandwidth, resident_ms: float) -> float:
    """design.md's bound: max(H2D bytes / H2D rate, D2H bytes / D2H rate, resident step time)."""
    return max(h2d_bytes / (bw.h2d * 1e9) * 1e3, d2h_bytes / (bw.d2h * 1e9) * 1e3, resident_ms)


def time_steps(strategy: Strategy, warmup: int = 1, repeats: int = 3) -> StepTiming:
    """Median step time (device events, including the drain of in-flight swap-outs) after warm-up,
    and the peak extra device memory of a step."""
    mod = device.get_torch_device_module()
    for _ in range(warmup):
        strategy.step()
        strategy.drain()
    times, peaks = [], []
    for _ in range(repeats):
        mod.synchronize()
        base = mod.memory_allocated()
        mod.reset_peak_memory_stats()
        start, end = _timed_event(), _timed_event()
        start.record()
        strategy.step()
        strategy.drain()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        peaks.append(mod.max_memory_allocated() - base)
    return StepTiming(step_ms=statistics.median(times), all_ms=times, peak_extra_bytes=max(peaks))


def time_back_to_back(strategy: Strategy, steps: int = 5) -> float:
    """Mean time of ``steps`` steps issued one after another with no wait between them, as a training loop issues
    them (each step's host work under the device work before it), drained once at the end (ms).

    ``time_steps`` times each step from an idle device: a step's host work before its first device op (a replayed
    step's checks, say) is then step time, where in a training loop it runs under the backward's device work."""
    mod = device.get_torch_device_module()
    mod.synchronize()
    start, end = _timed_event(), _timed_event()
    start.record()
    for _ in range(steps):
        strategy.step()
    strategy.drain()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def free_device_memory() -> None:
    """Return cached device memory between strategies (callers drop their references first)."""
    gc.collect()
    device.get_torch_device_module().empty_cache()
