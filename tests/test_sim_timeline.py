"""The deterministic timeline: lanes overlap, streams serialize, waits and blocking calls are honored,
and work is priced like the hardware: kernels by max(bytes / HBM, FLOPs / peak), copies by their direction's
latency + bytes / link rate, both directions at once sharing the link by the preset's rule (the h100 preset's:
rates per copy size with both busy, as measured; the cap rules on a symmetric preset)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import device
import simdevice as simulator
from device.sim.costs import Flops, op_flops
from device.sim.presets import SimPreset, figure_names
from device.sim.timeline import Timeline

H100 = simulator.PRESETS["h100"]
N = 1 << 20  # floats per copy: 4 MiB
BYTES = 4 * N
GB = 10**9
# The h100 preset, per direction: rate alone (bytes per us), latency, one copy of BYTES alone.
H2D_RATE, D2H_RATE = H100.h2d_gbps * 1e3, H100.d2h_gbps * 1e3
H2D_LAT, D2H_LAT = H100.latency_us("h2d"), H100.latency_us("d2h")
H2D_US, D2H_US = H2D_LAT + BYTES / H2D_RATE, D2H_LAT + BYTES / D2H_RATE
# The cap rules (Note [link sharing]) on a symmetric preset, the figures the h100 preset had before its
# calibration, so that their arithmetic stays plain: one rate, one latency, one cap.
RULES = dataclasses.replace(H100, h2d_gbps=55.0, d2h_gbps=55.0, duplex_gbps=80.0, copy_latency_us=2.0,
                            h2d_latency_share=0.5, link_sharing="first", launch_us=0.0)
RATE = RULES.h2d_gbps * 1e3  # bytes per us, one direction alone
CAP = RULES.duplex_gbps * 1e3  # bytes per us, both directions together
LAT = RULES.copy_latency_us
COPY_US = LAT + BYTES / RATE  # one copy alone on RULES


def _span(sim) -> float:
    ops = sim.timeline
    return max(op.end_us for op in ops) - min(op.start_us for op in ops)


def _opposite_copies(sim, h2d_stream, d2h_stream):
    h_src = device.pinned_empty(N)
    d_dst = torch.empty(N)
    d_src = torch.empty(N)
    h_dst = device.pinned_empty(N)
    for s in {h2d_stream, d2h_stream}:
        s.wait_stream(sim.default_stream())
    sim.reset_timeline()
    with sim.stream(h2d_stream):
        d_dst.copy_(h_src, non_blocking=True)
    with sim.stream(d2h_stream):
        h_dst.copy_(d_src, non_blocking=True)
    sim.synchronize()
    return [op.lane for op in sim.timeline]


def test_opposite_copies_on_two_streams_share_the_link(sim_no_launch):
    sim = sim_no_launch
    lanes = _opposite_copies(sim, sim.Stream(), sim.Stream())
    assert lanes == ["h2d", "d2h"]
    h2d, d2h = sim.timeline
    # The H2D, scheduled first with nothing beside it, runs at its full rate.
    assert h2d.end_us - h2d.start_us == pytest.approx(H2D_US)
    # The D2H runs alone until the H2D's bytes start flowing, then at its rate with both busy for its size until
    # the H2D is done, then alone again.
    both = H100.both_gbps("d2h", BYTES) * 1e3
    assert both < D2H_RATE
    alone = (H2D_LAT - D2H_LAT) * D2H_RATE
    beside = (H2D_US - H2D_LAT) * both  # what it moves while the H2D's bytes flow
    assert alone + beside < BYTES  # this D2H outlasts the H2D
    assert d2h.start_us == h2d.start_us  # launched at the same host time: launches cost none here
    assert d2h.end_us - d2h.start_us == pytest.approx(H2D_US + (BYTES - alone - beside) / D2H_RATE)
    # Overlap still pays, but not the full duplex: at least both copies' bytes through the most the link carries.
    assert D2H_LAT + 2 * BYTES / (H100.duplex_gbps * 1e3) <= _span(sim) < H2D_US + D2H_US


def test_opposite_copies_on_one_stream_take_two(sim_no_launch):
    sim = sim_no_launch
    s = sim.Stream()
    _opposite_copies(sim, s, s)
    assert _span(sim) == pytest.approx(H2D_US + D2H_US)


def test_same_direction_copies_share_the_link(sim_no_launch):
    sim = sim_no_launch
    a, b = sim.Stream(), sim.Stream()
    srcs = [device.pinned_empty(N) for _ in range(2)]
    dsts = [torch.empty(N) for _ in range(2)]
    a.wait_stream(sim.default_stream())
    b.wait_stream(sim.default_stream())
    sim.reset_timeline()
    for s, src, dst in zip((a, b), srcs, dsts):
        with sim.stream(s):
            dst.copy_(src, non_blocking=True)
    assert _span(sim) == pytest.approx(2 * H2D_US)
    sim.synchronize()  # side-stream work ends before its tensors are freed


def test_copy_beside_compute_overlaps(sim_no_launch):
    sim = sim_no_launch
    side = sim.Stream()
    host = device.pinned_empty(N)
    staging = torch.empty(N)
    x = torch.empty(N)
    side.wait_stream(sim.default_stream())
    sim.reset_timeline()
    with sim.stream(side):
        staging.copy_(host, non_blocking=True)
    x.mul_(2)  # compute stream: reads and writes 4 MiB at HBM speed
    compute_us = 2 * 4 * N / (H100.hbm_gbps * 1e3)
    assert [op.lane for op in sim.timeline] == ["h2d", "compute"]
    start = sim.timeline[0].start_us  # the host's time when both were launched (pinning the host buffer took some)
    assert sim.timeline[1].start_us == start
    assert sim.timeline[1].end_us == pytest.approx(start + compute_us)
    assert _span(sim) == pytest.approx(max(H2D_US, compute_us))
    sim.synchronize()  # side-stream work ends before its tensors are freed


def test_wait_event_delays_the_waiting_stream(sim_no_launch):
    sim = sim_no_launch
    side = sim.Stream()
    host = device.pinned_empty(N)
    staging = torch.empty(N)
    side.wait_stream(sim.default_stream())
    sim.reset_timeline()
    with sim.stream(side):
        staging.copy_(host, non_blocking=True)
    sim.current_stream().wait_event(side.record_event())
    staging.mul_(2)
    copy, compute = sim.timeline
    assert compute.start_us == pytest.approx(copy.end_us)


def test_blocking_calls_advance_host_time(sim_no_launch):
    sim = sim_no_launch
    host = device.pinned_empty(N)
    dev = torch.empty(N)
    start = sim.now_us()  # pinning the host buffer took host time
    dev.copy_(host, non_blocking=True)
    assert sim.now_us() == start
    dev.copy_(host)  # non_blocking=False: the host waits for both copies on the stream
    assert sim.now_us() - start == pytest.approx(2 * H2D_US)
    dev[0].item()
    assert sim.now_us() - start == pytest.approx(2 * H2D_US + D2H_LAT + 4 / D2H_RATE)


def test_launches_cost_host_time(sim):
    x = torch.empty(4)
    sim.reset_timeline()
    start = sim.now_us()
    for _ in range(10):
        x.add_(1)
    assert sim.now_us() - start == pytest.approx(10 * sim.preset.launch_us)


def test_elapsed_time_matches_the_model(sim):
    side = sim.Stream()
    host = device.pinned_empty(N)
    dev = torch.empty(N)
    side.wait_stream(sim.default_stream())
    start = sim.Event(enable_timing=True)
    end = sim.Event(enable_timing=True)
    with sim.stream(side):
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
    with pytest.raises(RuntimeError, match="not ready"):
        start.elapsed_time(end)
    end.synchronize()
    assert end.query()
    (copy,) = [op for op in sim.timeline if op.lane == "h2d"]
    assert start.elapsed_time(end) == pytest.approx((copy.end_us - start.time_us) / 1e3)
    assert start.elapsed_time(end) == pytest.approx((sim.preset.launch_us + H2D_US) / 1e3)
    with pytest.raises(RuntimeError, match="enable_timing"):
        sim.Event().elapsed_time(end)


def test_presets_change_the_model(clean_device_env):
    times = {}
    for name in ("h100", "910b"):
        with simulator.activate(name) as sim:
            host = device.pinned_empty(N)
            dev = torch.empty(N)
            dev.copy_(host)
            times[name] = sim.now_us()
            assert sim.mem_get_info()[1] == simulator.PRESETS[name].capacity_bytes
    assert times["910b"] > times["h100"]
    with pytest.raises(ValueError, match="h100"):
        simulator.activate("a100").__enter__()


def test_chrome_trace_export(sim, tmp_path):
    side = sim.Stream(name="h2d")
    host = device.pinned_empty(64)
    dev = torch.empty(64)
    side.wait_stream(sim.default_stream())
    with torch.profiler.record_function("chunk 0"):
        with sim.stream(side):
            dev.copy_(host, non_blocking=True)
        sim.current_stream().wait_stream(side)
        dev.mul_(2)
    path = tmp_path / "trace.json"
    sim.export_chrome_trace(path)
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["lane"] for e in events} >= {"h2d", "compute"}
    tids = {e["args"]["lane"]: e["tid"] for e in events if e["args"]["label"] == "chunk 0"}
    assert tids["h2d"] != tids["compute"]
    names = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "M" and "tid" in e}
    assert names.get("h2d") == tids["h2d"] and names.get("compute") == tids["compute"]
    assert all(e["dur"] >= 0 and "ts" in e for e in events)


# ---- pricing: every preset figure has a source ----


def test_every_preset_figure_has_a_source_or_says_assumed():
    figures = figure_names()
    # Every numeric field of the preset is a figure, and so is the table of rates with both busy: nothing
    # escapes the check by being left off the list.
    numeric = [f.name for f in dataclasses.fields(SimPreset) if f.type in ("float", "int", float, int)]
    assert set(figures) == {*numeric, "duplex_table"} and len(figures) >= 16
    for preset in simulator.PRESETS.values():
        assert set(preset.sources) == set(figures), f"{preset.name}: sources for unknown or missing figures"
        for name in figures:
            source = preset.sources[name].strip()
            assert len(source) > 10, f"{preset.name}.{name} has no source"
            value = getattr(preset, name)
            assert value and (min(min(row) for row in value) if name == "duplex_table" else value) > 0, name
        # Calibration: a date goes with the figures measured then, never one without the other.
        assert (preset.calibrated is None) == (not preset.measured)
        assert set(preset.measured) <= set(figures)
    h100 = simulator.PRESETS["h100"]
    # The usable capacity the H100 run's runtime reported, not the datasheet's 80 GB nor 80 GiB.
    assert h100.capacity_bytes == 85_017_493_504 < 80 * 2**30
    assert "580.159.04" in h100.calibrated and h100.measured["capacity_bytes"] == h100.capacity_bytes
    # fp32 matmuls without TF32 run on CUDA cores: the 67 TFLOP/s row, far below the tensor-core ones.
    assert h100.fp32_tflops == 67.0 and h100.bf16_tflops > 10 * h100.fp32_tflops
    with pytest.raises(ValueError, match="duplex"):
        dataclasses.replace(h100, duplex_gbps=h100.h2d_gbps / 2)


# ---- pricing: kernels ----

M = 8192


def _mm_flops(dtype: torch.dtype) -> Flops:
    a = torch.empty(M, M, dtype=dtype, device="meta")  # shapes only: nothing allocated
    return op_flops(torch.ops.aten.mm.default, (a, a), {})


@pytest.mark.parametrize(("dtype", "precision"), [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_8192_cubed_matmul_takes_at_least_flops_over_peak(dtype, precision):
    flops = _mm_flops(dtype)
    assert flops == Flops(2.0 * M**3, precision)
    timeline = Timeline(H100)
    nbytes = 3 * M * M * dtype.itemsize
    op = timeline.launch("s", 0.0, "compute", nbytes, "aten.mm.default", None, flops)
    floor_us = 2 * M**3 / (H100.peak_tflops(precision) * 1e6)
    assert op.end_us - op.start_us >= floor_us
    assert op.end_us - op.start_us == pytest.approx(floor_us)  # arithmetic, not the 0.24 ms of its bytes, bounds it
    assert floor_us > 5 * nbytes / (H100.hbm_gbps * 1e3)
    assert op.flops == 2.0 * M**3
    if dtype is torch.float32:
        assert floor_us > 16_000  # the datasheet floor of an fp32 matmul this size on an H100: about 16 ms


def test_tf32_flag_selects_the_tf32_peak():
    old = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert _mm_flops(torch.float32).precision == "tf32"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert _mm_flops(torch.float32).precision == "fp32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = old
    assert _mm_flops(torch.float32).precision == "fp32"  # torch's default: no TF32 for matmuls


def _flop_counter(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _flops_seen(fn) -> float:
    """FLOPs op_flops assigns to every aten op `fn` dispatches."""
    total = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            found = op_flops(func, args, kwargs or {})
            total.append(found.count if found else 0.0)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return sum(total)


@pytest.mark.parametrize(
    "case",
    [
        "linear3d", "matmul_broadcast", "baddbmm", "conv2d", "conv2d_strided", "conv_transpose1d",
        "conv2d_groups_forward", "sdpa_math",
    ],
)  # fmt: skip
def test_flop_counts_agree_with_torchs_counter(case):
    """Forward and backward, counted from shapes, against torch.utils.flop_counter's own count. (Its count
    of a grouped convolution's weight gradient ignores the groups, so grouped ones are compared forward only.)"""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, requires_grad=True)

    def run():
        if case == "linear3d":
            out = F.linear(r(3, 5, 16), r(8, 16), r(8))
        elif case == "matmul_broadcast":
            out = torch.matmul(r(2, 1, 4, 6), r(3, 6, 5))
        elif case == "baddbmm":
            out = torch.baddbmm(r(2, 4, 5), r(2, 4, 6), r(2, 6, 5))
        elif case == "addmv":
            out = torch.addmv(r(4), r(4, 6), r(6))
        elif case == "conv2d":
            out = F.conv2d(r(2, 3, 9, 9), r(4, 3, 3, 3), r(4), padding=1)
        elif case == "conv2d_strided":
            out = F.conv2d(r(1, 4, 11, 11), r(6, 4, 3, 2), stride=(2, 3), padding=(1, 0), dilation=(2, 1))
        elif case == "conv2d_groups_forward":
            with torch.no_grad():
                F.conv2d(r(1, 4, 11, 11), r(6, 2, 3, 2), stride=(2, 3), padding=(1, 0), dilation=(2, 1), groups=2)
            return
        elif case == "sdpa_math":  # unequal head dims: the CPU flash kernel declines, the math path's bmms run
            out = F.scaled_dot_product_attention(r(2, 3, 24, 16), r(2, 3, 40, 16), r(2, 3, 40, 8))
        else:
            out = F.conv_transpose1d(r(2, 4, 7), r(4, 3, 3), stride=2)
        out.sum().backward()

    ours = _flops_seen(run)
    assert ours > 0
    assert ours == _flop_counter(run)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_forward_and_backward(causal):
    b, h, lq, lk, e, ev = 2, 3, 24, 40, 16, 16  # equal head dims: the CPU flash kernel takes it
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, lq, e, generator=g, requires_grad=True)
    k = torch.randn(b, h, lk, e, generator=g, requires_grad=True)
    v = torch.randn(b, h, lk, ev, generator=g, requires_grad=True)
    seen = {}

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            found = op_flops(func, args, kwargs or {})
            if found is not None:
                seen[func.overloadpacket.__name__] = found
            return func(*args, **(kwargs or {}))

    with Record():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
    # On CPU, SDPA reaches aten as the CPU flash kernel and its backward.
    fwd = seen["_scaled_dot_product_flash_attention_for_cpu"]
    bwd = seen["_scaled_dot_product_flash_attention_for_cpu_backward"]
    # A causal mask (top-left aligned) keeps key j <= i for query i: count the kept pairs outright.
    pairs = b * h * sum(min(i + 1, lk) for i in range(lq)) if causal else b * h * lq * lk
    assert fwd == Flops(2.0 * pairs * (e + ev), "fp32")
    assert bwd == Flops(2.0 * pairs * (3 * e + 2 * ev), "fp32")
    assert set(seen) == {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }


def test_matmul_on_the_simulator_is_priced_by_flops(sim_no_launch):
    sim = sim_no_launch
    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    sim.reset_timeline()
    a @ b
    (op,) = [op for op in sim.timeline if op.name == "aten.mm.default"]
    flops = 2.0 * 256**3
    assert op.flops == flops
    assert op.end_us - op.start_us == pytest.approx(max(op.nbytes / (H100.hbm_gbps * 1e3), flops / (67.0 * 1e6)))
    assert op.end_us - op.start_us > op.nbytes / (H100.hbm_gbps * 1e3)  # the arithmetic term decides here
    a.add_(b)  # element-wise: bytes alone
    add = sim.timeline[-1]
    assert add.flops == 0.0 and add.end_us - add.start_us == pytest.approx(add.nbytes / (H100.hbm_gbps * 1e3))


# ---- pricing: copies ----


def test_one_gb_each_way_at_once_takes_two_gb_over_the_cap():
    for preset in [RULES, *simulator.PRESETS.values()]:
        timeline = Timeline(dataclasses.replace(preset, launch_us=0.0))
        up = timeline.launch("up", 0.0, "h2d", GB, "h2d", None)
        down = timeline.launch("down", 0.0, "d2h", GB, "d2h", None)
        both = max(up.end_us, down.end_us) - min(up.start_us, down.start_us)
        if preset.link_sharing == "first":
            assert both >= 2 * GB / (preset.duplex_gbps * 1e3), preset.name
        else:
            # The H2D copy was scheduled alone and cannot be slowed: what it moved over its both-busy rate is
            # owed by the next H2D copy (Note [link debt]); with it, no faster than the link carries both ways.
            later = timeline.launch("up", up.end_us, "h2d", GB, "h2d", None)
            assert later.end_us - up.end_us > GB / (preset.h2d_gbps * 1e3), preset.name
            assert later.end_us >= 3 * GB / (preset.duplex_gbps * 1e3), preset.name
        # Each alone would take its own bytes / rate: sharing is what makes both at once slower than that.
        assert both > max(preset.latency_us(d) + GB / (preset.alone_gbps(d) * 1e3) for d in ("h2d", "d2h"))


def test_a_copy_after_both_directions_drained_pays_no_debt():
    """Under "sized" the debt carries only while the link stays busy: an H2D copy the host issues alone after a
    both-busy run has drained moves at its rate alone, as the H100 did (bench/results/cuda-h100-2026-11-26-verify-a.md: H2D alone at
    51.9-55.1 GB/s at 16 MB-1 GB, each size timed after the previous size's both-busy copies); while the other
    direction is still busy it pays what its direction owes."""
    size, reps = 134_761_944, 4  # the layout bench's probe copies on llama7b (bench/results/
    # sim-h100-2026-11-26-fidelity-e190371.md: 42.7 GB/s alone after both with the debt kept, 54.5 before)
    timeline = Timeline(dataclasses.replace(H100, launch_us=0.0))
    tails = {"h2d": 0.0, "d2h": 0.0}
    for _ in range(reps):
        for d in ("h2d", "d2h"):
            tails[d] = timeline.launch(d, tails[d], d, size, "copy", None).end_us
    assert timeline._debt["h2d"] > 0  # the H2D copies, scheduled first each time, moved over their both-busy rate
    drained = max(tails.values())
    timeline.wait_host(drained)  # a synchronize: the host sees both directions drained
    alone = timeline.launch("h2d", drained, "h2d", size, "copy", None)
    assert alone.end_us - alone.start_us == pytest.approx(H100.latency_us("h2d") + size / (H100.h2d_gbps * 1e3))
    assert timeline._debt == {"h2d": 0.0, "d2h": 0.0}
    # The same run with the next H2D copy issued while D2H is still busy: it moves the debt first.
    timeline = Timeline(dataclasses.replace(H100, launch_us=0.0))
    tails = {"h2d": 0.0, "d2h": 0.0}
    for _ in range(reps):
        for d in ("h2d", "d2h"):
            tails[d] = timeline.launch(d, tails[d], d, size, "copy", None).end_us
    timeline.launch("d2h", tails["d2h"], "d2h", size, "copy", None)  # D2H still busy when the next H2D starts
    owed = timeline._debt["h2d"]
    assert owed > 0
    busy = timeline.launch("h2d", tails["h2d"], "h2d", size, "copy", None)
    free = H100.latency_us("h2d") + size / (H100.h2d_gbps * 1e3)
    assert busy.end_us - busy.start_us > free + 0.5 * owed / (H100.h2d_gbps * 1e3)


class _RecordingTimeline(Timeline):
    """Keeps every flow segment the model schedules, which the timeline itself prunes."""

    def __init__(self, preset: SimPreset) -> None:
        super().__init__(preset)
        self.segments: dict[str, list[tuple[float, float, float]]] = {"h2d": [], "d2h": []}

    def _move(self, flow: list, start: float, end: float, rate: float, both: float = 0.0) -> float:
        lane = "h2d" if flow is self._flow["h2d"] else "d2h"
        if end > start:
            self.segments[lane].append((start, end, rate))
        return Timeline._move(flow, start, end, rate, both)


def test_the_link_never_carries_more_than_the_cap():
    """A deterministic mix of copies both ways, launched out of step: at every instant both directions
    together stay under the cap and each under its own rate, every copy moves exactly its bytes after its
    latency, and the same launches always give the same times."""

    def run() -> tuple[list, dict]:
        timeline = _RecordingTimeline(RULES)
        ops = []
        for i in range(40):
            lane = "h2d" if i % 3 else "d2h"
            nbytes = (1 + (7 * i) % 5) * (1 << 20)
            ops.append(timeline.launch(lane, 30.0 * i, lane, nbytes, "copy", None))
        return ops, timeline.segments

    ops, segments = run()
    assert ops == run()[0]
    for op in ops:
        mine = [seg for seg in segments[op.lane] if op.start_us <= seg[0] and seg[1] <= op.end_us + 1e-9]
        assert sum((end - start) * rate for start, end, rate in mine) == pytest.approx(op.nbytes)
        assert min(start for start, _, _ in mine) >= op.start_us + LAT - 1e-9
    cuts = sorted({t for lane in segments.values() for seg in lane for t in seg[:2]})
    overlapped = 0
    for lo, hi in zip(cuts, cuts[1:]):
        mid = (lo + hi) / 2
        rates = {lane: sum(r for a, b, r in segs if a <= mid < b) for lane, segs in segments.items()}
        assert rates["h2d"] <= RATE + 1e-6 and rates["d2h"] <= H100.d2h_gbps * 1e3 + 1e-6
        assert rates["h2d"] + rates["d2h"] <= CAP + 1e-6
        overlapped += rates["h2d"] > 0 and rates["d2h"] > 0
    assert overlapped > 5  # the mix did make the directions share the link


def test_latency_is_charged_per_copy(sim_no_launch):
    sim = sim_no_launch
    pieces, numel = 8, 1024
    host = device.pinned_empty(pieces * numel)
    dev = torch.empty(pieces * numel)
    sim.synchronize()
    sim.reset_timeline()
    start = sim.now_us()
    for i in range(pieces):
        dev[i * numel : (i + 1) * numel].copy_(host[i * numel : (i + 1) * numel], non_blocking=True)
    sim.synchronize()
    many = sim.now_us() - start
    assert many == pytest.approx(pieces * (H2D_LAT + 4 * numel / H2D_RATE))
    start = sim.now_us()
    dev.copy_(host, non_blocking=True)
    sim.synchronize()
    one = sim.now_us() - start
    assert one == pytest.approx(H2D_LAT + 4 * pieces * numel / H2D_RATE)
    assert many - one == pytest.approx((pieces - 1) * H2D_LAT)


# ---- pricing: which direction gives way (Note [link sharing]) ----


def _ruled(rule: str) -> Timeline:
    return Timeline(dataclasses.replace(RULES, link_sharing=rule))


YIELDED_US = COPY_US + (BYTES - (COPY_US - LAT) * (CAP - RATE)) / RATE  # a copy that gave way to a full-rate one
OVER_CAP = (COPY_US - LAT) * (2 * RATE - CAP)  # bytes two full-rate copies side by side carry over the cap


@pytest.mark.parametrize("first", ["h2d", "d2h"])
@pytest.mark.parametrize("rule", ["first", "d2h", "h2d"])
def test_each_sharing_rule_picks_the_direction_that_keeps_its_rate(rule, first):
    """Two copies of the same size, both ready at 0, launched in either order, then one more copy each way."""
    timeline = _ruled(rule)
    second = "d2h" if first == "h2d" else "h2d"
    ops = {lane: timeline.launch(lane, 0.0, lane, BYTES, "copy", None) for lane in (first, second)}
    keeps = first if rule == "first" else rule
    gives = "d2h" if keeps == "h2d" else "h2d"
    # The direction that keeps its rate moves at it, whenever it was launched.
    assert ops[keeps].end_us == pytest.approx(COPY_US)
    if gives == second:
        # Launched after, it gets what the cap leaves while the other runs.
        assert ops[gives].end_us == pytest.approx(YIELDED_US)
        owed = 0.0
    else:
        # Launched before, it was scheduled at its full rate and cannot be moved: the bytes the link carried
        # over the cap meanwhile go first in its direction's next copy (Note [link debt]).
        assert ops[gives].end_us == pytest.approx(COPY_US)
        owed = OVER_CAP
    later = timeline.launch(gives, 0.0, gives, BYTES, "copy", None)
    start = ops[gives].end_us
    assert later.start_us == pytest.approx(start)
    assert later.end_us == pytest.approx(start + LAT + (BYTES + owed) / RATE)
    # Either way the four copies take no less than their bytes through the cap, nor than the rule's floor.
    span = max(op.end_us for op in (*ops.values(), later))
    assert span >= 3 * BYTES / CAP
    assert span >= timeline.preset.link_floor_us(2 * BYTES if gives == "h2d" else BYTES, 2 * BYTES if gives == "d2h" else BYTES)


def test_presets_share_the_link_by_copy_size_and_refuse_unknown_rules():
    # Neither direction keeps its rate with both busy on the H100; the 910b preset says the same of its assumed
    # cap, split evenly.
    assert {p.link_sharing for p in simulator.PRESETS.values()} == {"sized"}
    assert simulator.PRESETS["910b"].both_gbps("h2d", GB) == simulator.PRESETS["910b"].duplex_gbps / 2
    with pytest.raises(ValueError, match="link_sharing"):
        dataclasses.replace(H100, link_sharing="fair")
    with pytest.raises(ValueError, match="duplex_table"):
        dataclasses.replace(H100, duplex_table=())
    with pytest.raises(ValueError, match="duplex_table"):
        dataclasses.replace(H100, duplex_table=((2.0, 1.0, 1.0), (1.0, 1.0, 1.0)))


@pytest.mark.parametrize("rule", ["d2h", "h2d"])
def test_a_fixed_rule_carries_no_more_than_the_cap_once_the_debt_is_paid(rule):
    """A deterministic mix of copies launched out of step, the last one of the direction that gives way: every
    copy of the favoured direction takes exactly latency + bytes / rate, and everything moved fits the cap over
    the span and the rule's floor."""
    timeline = _ruled(rule)
    gives = "d2h" if rule == "h2d" else "h2d"
    ops = []
    for i in range(41):
        lane = gives if i % 3 or i == 40 else rule
        nbytes = (1 + (7 * i) % 5) * (1 << 20)
        ops.append(timeline.launch(lane, 30.0 * i, lane, nbytes, "copy", None))
    assert timeline._debt == {"h2d": 0.0, "d2h": 0.0}
    for op in ops:
        if op.lane == rule:
            assert op.end_us - op.start_us == pytest.approx(LAT + op.nbytes / RATE)
    moved = {lane: sum(op.nbytes for op in ops if op.lane == lane) for lane in ("h2d", "d2h")}
    span = max(op.end_us for op in ops)
    assert sum(moved.values()) <= CAP * span
    assert span >= timeline.preset.link_floor_us(moved["h2d"], moved["d2h"])
    # The copies of the direction that gives way did give way: slower than alone, on average.
    given = [op for op in ops if op.lane == gives]
    assert sum(op.end_us - op.start_us for op in given) > sum(LAT + op.nbytes / RATE for op in given) * 1.05


def test_link_floor_per_rule():
    b = float(GB)
    even = RULES.link_floor_us(b, b)
    assert even == pytest.approx(2 * b / CAP)  # both directions' bytes through the cap
    assert RULES.link_floor_us(b, 0.0) == pytest.approx(b / RATE)  # one direction alone: its own rate
    for rule in ("d2h", "h2d"):
        fixed = dataclasses.replace(RULES, link_sharing=rule)
        # the favoured direction's bytes at its rate, the other moving cap - rate meanwhile, then the rest alone
        assert fixed.link_floor_us(b, b) == pytest.approx(b / RATE + (b - (CAP - RATE) * b / RATE) / RATE)
        assert fixed.link_floor_us(b, b) > 1.1 * even
        assert fixed.link_floor_us(b, 0.0) == pytest.approx(b / RATE)
