"""Calibration probes: pinned copies each way and both at once, a fused AdamW step, a bf16 matmul, launches.

Every time comes from device events on the current device module, so the same probes measure a GPU, an
NPU or the simulator (whose events report its timeline model). `calibrated_preset.py` turns the result
into simulator figures.

Both directions at once: the two directions' copies are issued in turn, each on its own stream, once with an
H2D copy leading each pair and once with a D2H copy leading, because which direction gives way may depend on
the order. In turn, not as two blocks, because that is how a swapped step issues them (the swap-in of one
chunk beside the swap-out of another), and because a model that cannot slow copies already scheduled (the
simulator's) would otherwise let the whole first block keep its rate. The H100 run of 2026-11-26 issued blocks
and saw the same rates in both orders from 16 MB on (device/sim/presets.py, Note [link sharing]). The copies
of the two directions neither start nor end together, so each direction's rate while both were busy is worked
out from the bytes it moved outside that window at its own rate (see `_duplex`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from loguru import logger
from pydantic import BaseModel

import device
from swapopt.verify.plan import CalibrationPlan

DIRECTIONS = ("h2d", "d2h")


class DuplexPoint(BaseModel):
    """Rates in GB/s of the two directions while both were busy."""

    first: str  # the direction issued first
    h2d_gbps: float
    d2h_gbps: float

    @property
    def total_gbps(self) -> float:
        return self.h2d_gbps + self.d2h_gbps


class CopyPoint(BaseModel):
    nbytes: int  # bytes per copy
    repeats: int  # copies per direction in each run
    h2d_ms: float  # per copy, alone
    d2h_ms: float
    h2d_gbps: float
    d2h_gbps: float
    both: list[DuplexPoint]  # one per issue order


class StepPoint(BaseModel):
    numel: int
    ms: float  # one fused AdamW step


class MatmulPoint(BaseModel):
    n: int
    ms: float  # one n x n x n bf16 matmul, the stream kept busy so no launch gap is timed
    tflops: float


class LaunchCost(BaseModel):
    kernel_us: float  # device time per back-to-back tiny kernel: the launch rate bounds it
    host_launch_us: float  # host wall time per launch (on the simulator: its own Python, not modeled)
    event_record_us: float  # host wall time per event record (same caveat)
    event_gap_us: float  # device time between two events recorded back to back
    # Host wall time per stream wait on a recorded event (same caveat). None in calibrations made before it.
    event_wait_us: float | None = None
    # Host wall time of a resident fused AdamW step over many small tensors, per tensor its ops take (the
    # preset's host_tensor_us; on the simulator, its own Python). None in calibrations made before it.
    host_tensor_us: float | None = None
    # The host's CPU time for device.sim.host_time.reference_work() (the preset's host_ref_us: how fast this host
    # runs Python, which the simulator's measured host clock scales to). None in calibrations made before it.
    host_ref_us: float | None = None


class Calibration(BaseModel):
    device: str  # device label of the run
    simulated: bool
    pinned: str = "pinned"  # "pinned" or "expandable-segment pinned"
    copies: list[CopyPoint]
    adamw: list[StepPoint]
    matmul: MatmulPoint
    launch: LaunchCost
    capacity_bytes: int | None = None  # total device memory the runtime reports
    notes: list[str] = []


def _event() -> object:
    return device.get_torch_device_module().Event(enable_timing=True)


# Note [queued copies]: a copy's latency is the device's time per copy beyond its bytes; the host's time to issue
# it is another figure, which the simulator charges apart (Note [host clock] in device/sim/timeline.py). Copies
# timed as the host issues them measure the host's pace wherever it is slower than the device's: on the H100 a
# 1 MB H2D copy took 47 us issued one after another from Python and 22 us queued, whose line fit gives 28.3 us of
# latency against 2.7 (bench/results/cuda-h100-2026-11-27-copy-latency.md). So every timed run of copies waits
# for a head start: one copy of HEAD_START_BYTES on a stream of its own (4.9 ms on an H100), during which the host
# issues every timed copy, so none waits for the host once the first has begun.
HEAD_START_BYTES = 256 << 20


class _HeadStart:
    """A long copy that the timed copies' streams wait for (Note [queued copies])."""

    def __init__(self, nbytes: int = HEAD_START_BYTES) -> None:
        numel = max(nbytes // 4, 1)
        self.mod = device.get_torch_device_module()
        self.host = device.pinned_empty((numel,), dtype=torch.float32)
        self.host.zero_()
        self.buf = torch.empty(numel, dtype=torch.float32, device=device.torch_device())
        self.stream = self.mod.Stream()

    def start(self) -> Any:
        """An event recorded at the end of a fresh head-start copy: the timed copies' origin."""
        with self.mod.stream(self.stream):
            self.buf.copy_(self.host, non_blocking=True)
        done = _event()
        done.record(self.stream)
        return done


def _copy_runs(nbytes: int, repeats: int, head: _HeadStart) -> tuple[dict[str, float], list[DuplexPoint]]:
    """Per-copy ms of each direction alone, and the rates of both at once in either issue order, each run
    queued behind the head start."""
    mod = device.get_torch_device_module()
    numel = max(nbytes // 4, 1)
    host = {d: device.pinned_empty((numel,), dtype=torch.float32) for d in DIRECTIONS}
    for h in host.values():
        h.zero_()
    dev = device.torch_device()
    buf = {d: torch.zeros(numel, dtype=torch.float32, device=dev) for d in DIRECTIONS}
    streams = {d: mod.Stream() for d in DIRECTIONS}
    mod.synchronize()  # the buffers were filled on the compute stream; the copies run on their own

    def copy(d: str) -> None:
        with mod.stream(streams[d]):
            if d == "h2d":
                buf[d].copy_(host[d], non_blocking=True)
            else:
                host[d].copy_(buf[d], non_blocking=True)

    def alone(d: str) -> float:
        """ms per copy of `repeats` copies queued behind the head start (Note [queued copies])."""
        mod.synchronize()
        streams[d].wait_event(head.start())
        start, end = _event(), _event()
        start.record(streams[d])
        for _ in range(repeats):
            copy(d)
        end.record(streams[d])
        end.synchronize()
        return start.elapsed_time(end) / repeats

    def both(order: tuple[str, str]) -> dict[str, tuple[float, float]]:
        """(start, end) ms of each direction's copies, issued in turn with `order[0]` leading each pair, from
        one common origin."""
        mod.synchronize()
        origin = head.start()
        starts = {}
        for d in order:
            streams[d].wait_event(origin)
            starts[d] = _event()
            starts[d].record(streams[d])
        for _ in range(repeats):
            for d in order:
                copy(d)
        marks = {}
        for d in order:
            end = _event()
            end.record(streams[d])
            marks[d] = (starts[d], end)
        mod.synchronize()
        return {d: (origin.elapsed_time(s), origin.elapsed_time(e)) for d, (s, e) in marks.items()}

    for d in DIRECTIONS:  # warm-up: first touch of the pinned pages, stream creation
        copy(d)
    per_copy = {d: alone(d) for d in DIRECTIONS}
    rates = {d: nbytes / per_copy[d] for d in DIRECTIONS}  # bytes per ms
    total = numel * 4 * repeats
    duplex = [_duplex(both(order), rates, total, first=order[0]) for order in (("h2d", "d2h"), ("d2h", "h2d"))]
    del host, buf
    return per_copy, duplex


def _duplex(spans: dict[str, tuple[float, float]], alone_rate: dict[str, float], nbytes: int,
            first: str) -> DuplexPoint:
    """Rates (GB/s) while both directions were busy, from when each started and ended: outside the window
    where both ran, a direction ran alone at its own rate; what it moved inside the window is the rest."""
    begin = max(s for s, _ in spans.values())
    finish = min(e for _, e in spans.values())
    if finish <= begin:  # they never ran together: each had the link to itself
        return DuplexPoint(first=first, **{f"{d}_gbps": alone_rate[d] / 1e6 for d in DIRECTIONS})
    gbps = {}
    for d, (s, e) in spans.items():
        outside = ((begin - s) + (e - finish)) * alone_rate[d]
        gbps[f"{d}_gbps"] = max(nbytes - outside, 0.0) / (finish - begin) / 1e6
    return DuplexPoint(first=first, **gbps)


def measure_copies(sizes: list[int], target_bytes: int, on_done: Callable[[], None] = lambda: None) -> list[CopyPoint]:
    points = []
    head = _HeadStart()
    for nbytes in sizes:
        repeats = int(min(max(round(target_bytes / nbytes), 3), 64))
        per_copy, both = _copy_runs(nbytes, repeats, head)
        points.append(CopyPoint(
            nbytes=nbytes, repeats=repeats, h2d_ms=per_copy["h2d"], d2h_ms=per_copy["d2h"],
            h2d_gbps=nbytes / (per_copy["h2d"] * 1e6), d2h_gbps=nbytes / (per_copy["d2h"] * 1e6), both=both,
        ))
        logger.info("copies of {:.0f} MB: H2D {:.1f} GB/s, D2H {:.1f} GB/s alone; both at once {}", nbytes / 2**20,
                    points[-1].h2d_gbps, points[-1].d2h_gbps,
                    ", ".join(f"{b.first} first {b.h2d_gbps:.1f} + {b.d2h_gbps:.1f}" for b in both))
        on_done()
    return points


def _timed(fn: Callable[[], None], repeats: int, busy: Callable[[], None] | None = None) -> float:
    """Median ms of `fn` between two events. `busy` is queued first so the host runs ahead of the device
    and the timed window holds the device's work only, not the launch of its first op."""
    mod = device.get_torch_device_module()
    times = []
    for _ in range(repeats):
        mod.synchronize()
        if busy is not None:
            busy()
        start, end = _event(), _event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_adamw(numels: list[int], repeats: int, on_done: Callable[[], None] = lambda: None) -> list[StepPoint]:
    """One fused AdamW step over one fp32 tensor of each size (the kernel swapopt runs per chunk), timed behind a
    head start (Note [queued copies]): the host's calls, the window's end record among them, are issued before
    the device reaches them, so the window holds the kernels' time alone, as the simulator prices a kernel."""
    dev = device.torch_device()
    mod = device.get_torch_device_module()
    head = _HeadStart()
    points = []
    for numel in numels:
        param = torch.nn.Parameter(torch.zeros(numel, device=dev))
        param.grad = torch.full_like(param, 1e-3)
        opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
        opt.step()  # creates the states
        ms = _timed(opt.step, repeats, busy=lambda: mod.current_stream().wait_event(head.start()))
        points.append(StepPoint(numel=numel, ms=ms))
        logger.info("fused AdamW step, {:,} params: {:.3f} ms", numel, ms)
        del opt, param
        on_done()
    return points


def measure_matmul(n: int, per_window: int, repeats: int) -> MatmulPoint:
    dev = device.torch_device()
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def mm() -> None:
        for _ in range(per_window):
            torch.mm(a, b)

    mm()  # warm-up: library handles, kernel selection
    ms = _timed(mm, repeats, busy=mm) / per_window
    point = MatmulPoint(n=n, ms=ms, tflops=2 * n**3 / (ms * 1e-3) / 1e12)
    logger.info("bf16 matmul {}^3: {:.3f} ms, {:.1f} TFLOP/s", n, ms, point.tflops)
    return point


def measure_launch(count: int, host_tensors: int) -> LaunchCost:
    """Launch, event and host costs: `count` tiny kernels back to back, as many events, and a resident fused AdamW
    step over `host_tensors` small params (measure_host_per_tensor)."""
    mod = device.get_torch_device_module()
    x = torch.zeros(1, device=device.torch_device())

    def tiny(n: int = count) -> None:
        for _ in range(n):
            x.add_(1)

    tiny()
    mod.synchronize()
    t0 = time.perf_counter()
    ms = _timed(tiny, 1)
    host_s = time.perf_counter() - t0
    # A window's end is recorded once the host has issued that call too: with the device waiting on the host, its
    # time is in the window. Two windows of count and 2 x count launches, differenced, leave it out.
    ms = _timed(lambda: tiny(2 * count), 1) - ms
    events = [_event() for _ in range(count)]
    mod.synchronize()
    t0 = time.perf_counter()
    for e in events:
        e.record()
    record_s = time.perf_counter() - t0
    events[-1].synchronize()
    gap_ms = events[0].elapsed_time(events[-1]) / max(count - 1, 1)
    stream = mod.current_stream()
    t0 = time.perf_counter()
    for e in events:  # every one done: the waits cost the host their calls, the device nothing
        stream.wait_event(e)
    wait_s = time.perf_counter() - t0
    mod.synchronize()
    return LaunchCost(kernel_us=ms * 1e3 / count, host_launch_us=host_s * 1e6 / count,
                      event_record_us=record_s * 1e6 / count, event_gap_us=gap_ms * 1e3,
                      event_wait_us=wait_s * 1e6 / count,
                      host_tensor_us=measure_host_per_tensor(host_tensors, host_s * 1e6 / count),
                      host_ref_us=_reference_us())


def _reference_us() -> float:
    from device.sim import host_time  # only its stdlib yardstick: no simulator is started

    return host_time.reference_us()


# Tensors a fused AdamW step's ops take per param: params, grads, exp_avgs, exp_avg_sqs and steps in the fused
# kernel, the steps again in the foreach increment before it.
FUSED_ADAMW_TENSORS_PER_PARAM = 6


def measure_host_per_tensor(n: int, host_us_per_launch: float, repeats: int = 5) -> float:
    """Host wall time of a resident fused AdamW step over `n` small params, less its two launches, per tensor
    its ops take (the median of `repeats` steps)."""
    dev = device.torch_device()
    params = [torch.nn.Parameter(torch.zeros(16, device=dev)) for _ in range(n)]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    opt.step()
    opt.step()  # first steps do one-time work (state creation, lazy imports)
    times = []
    for _ in range(repeats):
        device.get_torch_device_module().synchronize()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    device.get_torch_device_module().synchronize()
    host_us = statistics.median(times) * 1e6 - 2 * host_us_per_launch
    return max(host_us, 0.0) / (FUSED_ADAMW_TENSORS_PER_PARAM * n)


def capacity_bytes() -> int | None:
    try:
        return int(device.get_torch_device_module().mem_get_info()[1])
    except Exception:  # noqa: BLE001 - a runtime without mem_get_info: the preset keeps its figure
        return None


def measure(plan: CalibrationPlan, label: str, *, max_copy_bytes: int | None = None,
            max_adamw_numel: int | None = None, matmul_n: int | None = None,
            progress: Callable[[], None] = lambda: None) -> Calibration:
    """Every probe of `plan` on the current device module; sizes above the caps are left out, and `matmul_n`
    replaces the plan's matmul size (with one matmul per timed window)."""
    copy_sizes = [s for s in plan.copy_sizes if max_copy_bytes is None or s <= max_copy_bytes]
    numels = [n for n in plan.adamw_numels if max_adamw_numel is None or n <= max_adamw_numel]
    simulated = device.is_simulated()
    repeats = 1 if simulated else plan.repeats  # modeled times are deterministic
    copies = measure_copies(copy_sizes, plan.copy_target_bytes, on_done=progress)
    adamw = measure_adamw(numels, repeats, on_done=progress)
    matmul = measure_matmul(matmul_n or plan.matmul_n, 1 if matmul_n else plan.matmul_repeats, repeats)
    progress()
    launch = measure_launch(plan.launches, plan.host_probe_tensors)
    progress()
    notes = []
    if simulated:
        notes.append("simulated: every time is the simulator's timeline model; host-side launch and event "
                     "times are the simulator's own Python, which no device has")
    return Calibration(device=label, simulated=simulated, copies=copies, adamw=adamw, matmul=matmul,
                       launch=launch, capacity_bytes=capacity_bytes(), notes=notes)


def probe_count(plan: CalibrationPlan, max_copy_bytes: int | None = None, max_adamw_numel: int | None = None) -> int:
    """How many progress steps `measure` reports."""
    copies = sum(1 for s in plan.copy_sizes if max_copy_bytes is None or s <= max_copy_bytes)
    numels = sum(1 for n in plan.adamw_numels if max_adamw_numel is None or n <= max_adamw_numel)
    return copies + numels + 2
