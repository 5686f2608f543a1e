"""The bench's timeline from profiler traces: torch_npu's (Ascend NPU) and torch.profiler's (CUDA) chrome traces,
synthetic, in the formats those profilers write (see swapopt/bench/timeline.py), and the NPU capture path with a
stand-in torch_npu whose profiler exports such a trace."""

from __future__ import annotations

import json
import sys
import types

import pytest

import device
from swapopt.bench import timeline
from swapopt.bench.timeline import trace_spans

PY, CANN, HW, OVERLAP, FREQ = 1738625, 1780352255, 1780352417, 1780352500, 1780352448
TID = 1748714
H2D_STREAM, UPD_STREAM, D2H_STREAM, OTHER_STREAM = 5, 2, 6, 9


def _meta() -> list[dict]:
    out = []
    for pid, name in ((PY, "Python"), (CANN, "CANN"), (HW, "Ascend Hardware"), (OVERLAP, "Overlap Analysis"),
                      (FREQ, "AI Core Freq")):  # fmt: skip
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
    out.append({"ph": "M", "name": "process_labels", "pid": HW, "tid": 0, "args": {"labels": "NPU 0"}})
    for stream in (H2D_STREAM, UPD_STREAM, D2H_STREAM, OTHER_STREAM):
        out.append({"ph": "M", "name": "thread_name", "pid": HW, "tid": stream, "args": {"name": f"Stream {stream}"}})
    return out


def _host(name: str, ts: str, dur: float) -> dict:
    return {"ph": "X", "name": name, "pid": PY, "tid": TID, "ts": ts, "dur": dur, "cat": "cpu_op", "args": {}}


def _task(name: str, task_type: str, stream: int, ts: str, dur: float) -> dict:
    # msprof writes device timestamps with a trailing tab
    return {"ph": "X", "name": name, "pid": HW, "tid": stream, "ts": ts + "\t", "dur": dur,
            "args": {"Model Id": 4294967295, "Task Type": task_type, "Stream Id": stream, "Task Id": 1,
                     "Batch Id": 0, "Subtask Id": 4294967295, "connection_id": 7}}  # fmt: skip


def _flow(fid: int, host_ts: str, stream: int, task_ts: str) -> list[dict]:
    return [
        {"ph": "s", "bp": "e", "name": "torch_to_npu", "id": fid, "pid": PY, "tid": TID, "ts": host_ts,
         "cat": "async_npu"},
        {"ph": "f", "bp": "e", "name": "torch_to_npu", "id": fid, "pid": HW, "tid": stream, "ts": task_ts,
         "cat": "async_npu"},
    ]  # fmt: skip


def npu_trace() -> list[dict]:
    """Two chunks of a swapped step as torch_npu's trace_view.json holds them, plus what must be left out."""
    ev = _meta()
    ev += [_host("aten::mm", "900.000", 4.0), _task("MatMul_xx_mix_aic", "MIX_AIC", UPD_STREAM, "905.000", 9.5)]
    ev += _flow(1, "901.000", UPD_STREAM, "905.000")
    for k, base in ((0, 1000), (1, 1200)):
        ev += [
            _host(f"swapopt.swap_in[{k}]", f"{base}.000", 20.0),
            _host("aten::copy_", f"{base + 2}.000", 5.0),
            _task("MEMCPY_ASYNC", "MEMCPY_ASYNC", H2D_STREAM, f"{base + 10}.250", 40.0),
            _task("EVENT_RECORD", "EVENT_RECORD", H2D_STREAM, f"{base + 51}.000", 0.5),
            _host(f"swapopt.update[{k}]", f"{base + 30}.000", 30.0),
            _host("aten::_foreach_addcmul_", f"{base + 35}.000", 6.0),
            _task("EVENT_WAIT", "EVENT_WAIT", UPD_STREAM, f"{base + 52}.000", 3.0),
            _task("ForeachAddcmulScalar_x_aiv", "AI_VECTOR_CORE", UPD_STREAM, f"{base + 55}.000", 12.0),
            _host(f"swapopt.swap_out[{k}]", f"{base + 65}.000", 10.0),
            _host("aten::copy_", f"{base + 66}.000", 4.0),
            _task("MEMCPY_ASYNC", "MEMCPY_ASYNC", D2H_STREAM, f"{base + 70}.000", 30.0),
        ]
        ev += _flow(10 + k, f"{base + 2}.000", H2D_STREAM, f"{base + 10}.250")
        ev += _flow(20 + k, f"{base + 35}.500", UPD_STREAM, f"{base + 55}.000")
        ev += _flow(30 + k, f"{base + 66}.000", D2H_STREAM, f"{base + 70}.000")
    # A copy on the swap-in stream with no flow: its stream's lane. A copy on a stream with no known copies: left out.
    ev += [_task("MEMCPY_ASYNC", "MEMCPY_ASYNC", H2D_STREAM, "1400.000", 8.0),
           _task("MEMCPY_ASYNC", "MEMCPY_ASYNC", OTHER_STREAM, "1400.000", 8.0)]  # fmt: skip
    # Not device spans: CANN API calls, the overlap analysis, counters, msprof's own HostToDevice flows.
    ev += [
        {"ph": "X", "name": "AscendCL@aclrtMemcpyAsync", "pid": CANN, "tid": TID, "ts": "1003.000", "dur": 2.0},
        {"ph": "X", "name": "Computing", "pid": OVERLAP, "tid": 0, "ts": "905.000", "dur": 500.0},
        {"ph": "C", "name": "AI Core Freq", "pid": FREQ, "tid": 0, "ts": "900.000", "args": {"MHz": 1800}},
        {"ph": "s", "name": "HostToDevice1", "id": 99, "pid": CANN, "tid": TID, "ts": "1003.000",
         "cat": "HostToDevice"},
        {"ph": "f", "name": "HostToDevice1", "id": 99, "pid": HW, "tid": H2D_STREAM, "ts": "1010.250",
         "cat": "HostToDevice", "bp": "e"},
    ]  # fmt: skip
    return ev


def test_npu_trace_spans_lanes_chunks_and_times(tmp_path):
    path = tmp_path / "trace_view.json"
    path.write_text(json.dumps(npu_trace()))  # torch_npu writes a bare list of events
    spans = trace_spans(path)
    got = sorted((s.start_us, s.end_us, s.lane, s.chunk, s.name) for s in spans)
    # times from the first span (the forward's MatMul at 905 us)
    expected = [(0.0, 9.5, "compute", None, "MatMul_xx_mix_aic")]
    for k, off in ((0, 95.0), (1, 295.0)):
        expected += [
            (off + 10.25, off + 50.25, "h2d", k, "MEMCPY_ASYNC"),
            (off + 55.0, off + 67.0, "compute", k, "ForeachAddcmulScalar_x_aiv"),
            (off + 70.0, off + 100.0, "d2h", k, "MEMCPY_ASYNC"),
        ]
    expected.append((495.0, 503.0, "h2d", None, "MEMCPY_ASYNC"))
    assert got == sorted(expected)
    assert trace_spans({"traceEvents": npu_trace()}) == spans


def test_cuda_chrome_trace_spans():
    ann = {"ph": "X", "cat": "gpu_user_annotation", "pid": 0, "tid": 7}
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 11, "tid": 11, "ts": 95.0, "dur": 3.0},
        {**ann, "name": "swapopt.swap_in[0]", "ts": 100.0, "dur": 50.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 7,
         "ts": 101.0, "dur": 40.0},
        {**ann, "name": "swapopt.update[0]", "pid": 0, "tid": 8, "ts": 141.0, "dur": 20.0},
        {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel", "pid": 0, "tid": 8, "ts": 142.0, "dur": 9.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 9,
         "ts": 160.0, "dur": 30.0},
    ]}  # fmt: skip
    got = sorted((s.start_us, s.end_us, s.lane, s.chunk) for s in trace_spans(trace))
    assert got == [(0.0, 40.0, "h2d", 0), (41.0, 50.0, "compute", 0), (59.0, 89.0, "d2h", None)]


def test_npu_capture_exports_and_reads_torch_npu_trace(monkeypatch):
    calls: list[str] = []
    seen_activities: list = []

    class Profile:
        def __init__(self, activities):
            seen_activities.extend(activities)

        def __enter__(self):
            calls.append("start")
            return self

        def __exit__(self, *exc):
            calls.append("stop")

        def export_chrome_trace(self, path):
            calls.append("export")
            with open(path, "w") as f:
                json.dump(npu_trace(), f)

    activity = types.SimpleNamespace(CPU="CPU", NPU="NPU")
    fake = types.ModuleType("torch_npu")
    fake.profiler = types.SimpleNamespace(profile=Profile, ProfilerActivity=activity)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(device, "is_simulated", lambda: False)
    monkeypatch.setattr(device, "get_device", lambda: "npu")
    monkeypatch.setattr(device, "get_torch_device_module", lambda: types.SimpleNamespace(synchronize=lambda: None))

    class Strategy:
        def step(self):
            calls.append("step")

        def drain(self):
            calls.append("drain")

    spans = timeline.capture_step(Strategy())
    assert calls == ["start", "step", "drain", "stop", "export"]
    assert seen_activities == ["CPU", "NPU"]
    assert spans == trace_spans(npu_trace()) and {s.lane for s in spans} == {"h2d", "compute", "d2h"}


def test_npu_spans_draw(tmp_path):
    pytest.importorskip("matplotlib")
    from swapopt.bench.plots import timeline_chart

    path = timeline_chart(trace_spans(npu_trace()), tmp_path / "npu.png", "npu")
    assert path.stat().st_size > 0
