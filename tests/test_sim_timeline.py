"""The deterministic timeline: lanes overlap, streams serialize, waits and blocking calls are honored."""

from __future__ import annotations

import json

import pytest
import torch

import device
from device import sim as simulator

N = 1 << 20  # floats per copy: 4 MiB
COPY_US = 4 * N / (55.0 * 1e3)  # bytes / (GB/s) on the h100 preset


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


def test_opposite_copies_on_two_streams_take_one_copy_time(sim_no_launch):
    sim = sim_no_launch
    lanes = _opposite_copies(sim, sim.Stream(), sim.Stream())
    assert lanes == ["h2d", "d2h"]
    assert _span(sim) == pytest.approx(COPY_US)


def test_opposite_copies_on_one_stream_take_two(sim_no_launch):
    sim = sim_no_launch
    s = sim.Stream()
    _opposite_copies(sim, s, s)
    assert _span(sim) == pytest.approx(2 * COPY_US)


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
    assert _span(sim) == pytest.approx(2 * COPY_US)
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
    compute_us = 2 * 4 * N / (3350.0 * 1e3)
    assert [op.lane for op in sim.timeline] == ["h2d", "compute"]
    assert sim.timeline[1].start_us == 0.0
    assert sim.timeline[1].end_us == pytest.approx(compute_us)
    assert _span(sim) == pytest.approx(max(COPY_US, compute_us))
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
    dev.copy_(host, non_blocking=True)
    assert sim.now_us() == 0.0
    dev.copy_(host)  # non_blocking=False: the host waits for both copies on the stream
    assert sim.now_us() == pytest.approx(2 * COPY_US)
    dev[0].item()
    assert sim.now_us() == pytest.approx(2 * COPY_US + 4 / (55.0 * 1e3))


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
    assert start.elapsed_time(end) == pytest.approx((sim.preset.launch_us + COPY_US) / 1e3)
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
    for preset in simulator.PRESETS.values():
        for figure in ("h2d_gbps", "d2h_gbps", "hbm_gbps", "capacity_bytes"):
            assert preset.sources.get(figure), f"{preset.name}.{figure} has no source"
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
