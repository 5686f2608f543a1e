"""The layout benchmark: fused AdamW resident against swapopt at a few chunk counts, on one model layout.

Per row: modeled (or measured) step time against the bound, and the structural counts that explain
it: kernel launches against the target (resident launches + 3) x chunks + 8, copies each way, host
CPU time per step, peak extra device memory against (slots + 1) x chunk and pinned host bytes
against state bytes.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from loguru import logger
from pydantic import BaseModel

import device
from device.sim import host_time
from device.sim.presets import SimPreset
from swapopt import flat as flat_update
from swapopt.bench import hardware_refs
from swapopt.bench.counts import count_call, host_cpu_seconds, pinned_host_bytes
from swapopt.bench.layouts import Layout, get_layout, make_layout_params, scale_to_fit
from swapopt.bench.measure import (
    Bandwidth, bound_ms, free_device_memory, measure_bandwidth, time_back_to_back, time_steps,
)
from swapopt.bench.run import MAX_PROBE_BYTES, measure_strategy
from swapopt.bench.strategies import AdamWSpec, Impl

DEFAULT_TIMES = (16, 64)
# On the simulator every tensor is real host memory, shared with whatever else runs there: 64 M params
# (1 GiB of params, grads and states) keeps a layout run within a few minutes and a few GiB.
SIM_MAX_NUMEL = 64_000_000
DEFAULT_SLOTS = 3
HOST_REPEATS = 5  # counted steps per row; host times are their median
B2B_STEPS = 3  # steps timed back to back per row (at least the timed steps' count)
# Steps before a step_graph row is timed: the first two make and settle the states, the third runs steadily, the
# fourth is captured and replayed (Note [graphed step] in swapopt.graphed); the fifth on replay only.
GRAPH_WARMUP = 4
# The launch budget of a swapped step when copies move whole chunks: per chunk, the resident step's
# launches plus an H2D, a D2H and one more; per step, a few fixed ones.
LAUNCHES_PER_CHUNK, LAUNCHES_PER_STEP = 3, 8


class LayoutRow(BaseModel):
    kind: str  # "resident" | "swapopt" | "swapopt-graph"
    label: str
    flat: bool = False  # swapopt rows: the flat chunk update on (swapopt.flat.ENABLED), labelled "swapopt-flat"
    times: int | None = None
    slots: int | None = None
    chunks: int | None = None
    step_ms: float | None = None
    ratio: float | None = None  # step_ms / bound_ms
    # Steps issued back to back (bench.measure.time_back_to_back): the mean step, and it against the bound. None in
    # older results.
    b2b_ms: float | None = None
    b2b_ratio: float | None = None
    floor_ratio: float | None = None  # step_ms / floor_ms (the row's own, else the layout's)
    floor_ms: float | None = None  # the link floor at this row's copy size (swapopt rows; None in older results)
    aten_ops: int | None = None
    launches: int | None = None
    launch_target: int | None = None  # (resident launches + 3) x chunks + 8, swapopt rows only
    h2d_copies: int | None = None
    d2h_copies: int | None = None
    cpu_ms: float | None = None  # CPU time of the calling thread over one step() call
    # Host CPU time of the step's own work, from the counted step: less the counter's cost and (on the
    # simulator, where the device's work runs on the host) the CPU time inside launched ops.
    host_ms: float | None = None
    # Python host time: the counted step's CPU time outside every aten op (less the counter's cost). On
    # the simulator each op also runs the simulator's Python accounting, which no device has: this is the
    # part of host_ms that carries over to a GPU or NPU; on the simulator scaled to the preset's host
    # (python_scale), plus the preset's event_us per event record and stream wait (runtime calls, which on a
    # device are in this figure as the CPU time they take).
    python_ms: float | None = None
    # What python_ms was scaled by: 1 on a device; on the simulator the median of the counted steps' factors, each
    # timed beside its step (step_python_scale). None in results written before.
    python_scale: float | None = None
    host_ratio: float | None = None  # python_ms / the resident row's python_ms
    # The host budget of a swapped step: HOST_CHUNK_US per chunk plus HOST_TENSOR_US per tensor, and python_ms
    # against it (swapopt rows)
    python_limit_ms: float | None = None
    python_over_limit: float | None = None
    extra_host_us_per_param: float | None = None  # (python_ms - the resident row's) per tensor, in us
    peak_extra_bytes: int | None = None
    chunk_bytes: int | None = None
    cap_bytes: int | None = None  # (slots + 1) x chunk bytes
    pinned_bytes: int | None = None
    note: str = ""
    # On the simulator: step / bound of each run of this very row on the preset's device, from committed results
    # (Note [hardware beside the model] in swapopt.bench.hardware_refs); None where it never ran it, and on a device.
    hardware_ratios: list[float] | None = None


class LayoutResult(BaseModel):
    layout: str
    source: str
    scale: int
    tensors: int
    numel: int
    state_bytes: int  # exp_avg + exp_avg_sq, fp32: bytes moved each way per swapped step
    bandwidth: Bandwidth
    resident_ms: float | None
    bound_ms: float
    rows: list[LayoutRow]
    # What the rows' Python ms were scaled by: 1 on a device; on the simulator the median of the rows' factors
    # (LayoutRow.python_scale); None in results written before
    python_scale: float | None = None
    # The link floor of the step's bytes (link_floor_ms) and the sharing rule it assumes; None in results
    # written before they were reported.
    floor_ms: float | None = None
    link_sharing: str | None = None
    # This host's CPU time for host_time.reference_work(), the least of the timings before and after the rows (us):
    # the Python speed of the host the rows ran on. Host-bound rows move with it from host to host (a device lease
    # is a different host each time), so results of two runs compare only beside it. None in results written before.
    host_ref_us: float | None = None
    # Where the rows' hardware_ratios come from (the device, the date, the code it ran, the files); None without.
    hardware: str | None = None


def default_max_numel() -> int:
    """The largest layout (in params) to run here, larger ones being scaled: SIM_MAX_NUMEL on the
    simulator; on a device, what fits the resident row (params, grads and two fp32 states: 16 B/param)
    in 85% of free device memory and the pinned states (8 B/param) in half the host's memory."""
    if device.is_simulated():
        return SIM_MAX_NUMEL
    free, _ = device.get_torch_device_module().mem_get_info()
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(0.85 * free / 16, 0.5 * host / 8))


def _pinned_now() -> int | None:
    """Live pinned host bytes where the device can tell (the simulator); None elsewhere."""
    mod = device.get_torch_device_module()
    counter = getattr(mod, "host_memory_allocated", None)
    return counter() if callable(counter) else None


def _state_tensors(strategy) -> list[torch.Tensor]:
    opt = getattr(strategy, "opt", None)
    if opt is None:
        return []
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@contextlib.contextmanager
def _flat_update(on: bool):
    """The flat chunk update on or off while a row is built and measured (it is read when chunks are planned)."""
    before = flat_update.ENABLED
    flat_update.ENABLED = on
    try:
        yield
    finally:
        flat_update.ENABLED = before


def _measure(
    kind: str, params: list[torch.nn.Parameter], spec: AdamWSpec, times: int, slots: int,
    state_bytes: int, warmup: int, repeats: int, host_repeats: int, flat: bool = False,
) -> LayoutRow:
    row = LayoutRow(kind=kind, label=kind, flat=flat)
    pinned_before = _pinned_now()

    def measure(strategy: Any) -> None:
        # torch's optimizer does one-time host work (lazy imports, wrappers) in its first steps: two
        # warm-up steps at least keep it out of the host-time figures below. A step_graph row captures its fourth
        # step: its timed steps come after, or they time eager steps.
        graph = kind == "swapopt-graph"
        timing = time_steps(strategy, warmup=max(warmup, GRAPH_WARMUP if graph else 2), repeats=repeats)
        if graph and strategy.opt._graphed is None:
            row.note = f"not replayed: {strategy.opt._graph_off or 'no capture'}"
        row.b2b_ms = time_back_to_back(strategy, steps=max(repeats, B2B_STEPS))
        row.step_ms, row.peak_extra_bytes = timing.step_ms, timing.peak_extra_bytes
        # Host CPU time on a step of its own: the counting mode below costs host time too.
        row.cpu_ms = host_cpu_seconds(strategy.step) * 1e3
        strategy.drain()
        mod = device.get_torch_device_module()
        # No autograd graph is recorded in a step: the simulator's stream tagging (a Python function mode,
        # a cost no device has) is left off while counting, so the Python host time below is the step's.
        # Host time on a shared machine varies from step to step: the median of host_repeats counted steps.
        # On the simulator each counted step's Python is scaled by the factor timed right before and after it
        # (step_python_scale): this machine's speed drifts within seconds. One step's "after" is the next one's
        # "before": only a drain lies between them.
        runs, scales = [], []
        before = step_python_scale()
        for _ in range(host_repeats):
            with mod.untagged() if hasattr(mod, "untagged") else contextlib.nullcontext():
                runs.append(count_call(strategy.step))
            after = step_python_scale()
            scales.append((before + after) / 2)
            before = after
            strategy.drain()
        counts = runs[-1]
        row.aten_ops, row.launches = counts.aten_ops, counts.launches
        on_host = device.is_simulated()
        row.host_ms = statistics.median(c.own_host_s(device_work_on_host=on_host) for c in runs) * 1e3
        event_s = preset.event_us * 1e-6 if (preset := _sim_preset()) is not None else 0.0
        row.python_ms = 1e3 * statistics.median(
            c.python_host_s() * f + c.runtime_calls * event_s for c, f in zip(runs, scales)
        )
        row.python_scale = statistics.median(scales)
        row.h2d_copies, row.d2h_copies = counts.h2d_copies, counts.d2h_copies
        pinned_after = _pinned_now()
        if pinned_before is not None and pinned_after is not None:
            row.pinned_bytes = pinned_after - pinned_before
        else:
            row.pinned_bytes = pinned_host_bytes(_state_tensors(strategy))
        if kind.startswith("swapopt"):
            if flat:
                row.label = row.label.replace("swapopt", "swapopt-flat", 1)
            row.times, row.slots = times, slots
            row.chunks = strategy.opt.swap_stats().chunks
            # the plan's largest chunk, not state bytes / chunks: the ramp's smaller chunks add to the count
            row.chunk_bytes = strategy.opt.operate.slot_bytes
            row.cap_bytes = (slots + 1) * row.chunk_bytes

    with _flat_update(flat):
        try:
            measure_strategy(kind, params, spec, times, slots, row, measure)
        except Exception as err:  # noqa: BLE001 - a flat row that fails is reported, the direct rows still run
            if not flat:
                raise
            row.note = f"failed: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
            logger.opt(exception=err).error("{}: the flat chunk update failed", row.label)
    return row


def _sim_preset() -> SimPreset | None:
    """The active simulator's preset; None on a device."""
    preset = getattr(device.get_torch_device_module(), "preset", None)
    return preset if isinstance(preset, SimPreset) else None


def _host_ref_us() -> float | None:
    """The device host's time for the reference Python: the simulator preset's host_ref_us; None on a device."""
    preset = _sim_preset()
    return preset.host_ref_us if preset is not None else None


def step_python_scale() -> float:
    """What one second of this machine's Python is on the device's host, now: 1 on a device; on the simulator, its
    preset's, with this machine's reference time taken now (host_time.python_scale_now; Note [scaled Python] in
    device/sim/host_time.py): beside a counted step."""
    ref = _host_ref_us()
    return 1.0 if ref is None else host_time.python_scale_now(ref)


def run_layout(
    layout: str | Layout,
    times: Sequence[int] = DEFAULT_TIMES,
    slots: int = DEFAULT_SLOTS,
    max_numel: int | None = None,
    impl: Impl = "fused",
    warmup: int = 1,
    repeats: int = 1,
    bandwidth_repeats: int = 4,
    on_done: Callable[[str], None] = lambda label: None,
    flat: bool = False,
    graph: bool = False,
    host_repeats: int = HOST_REPEATS,
) -> LayoutResult:
    """Resident AdamW, then swapopt at each of `times` chunk counts, over one layout's params (scaled
    to at most `max_numel` params when given); with `flat`, each chunk count also with the flat chunk update
    (Note [flat chunk update] in swapopt.flat) on, in a row of its own; with `graph`, each chunk count also with
    ``step_graph`` (Note [graphed step] in swapopt.graphed), in rows labelled swapopt-graph. Each row's host figures
    are the median of `host_repeats` counted steps."""
    if host_repeats < 1:
        raise ValueError(f"host_repeats must be at least 1, got {host_repeats}")
    shape = get_layout(layout) if isinstance(layout, str) else layout
    if max_numel is not None and shape.numel > max_numel:
        shape = scale_to_fit(shape, max_numel)
    spec = AdamWSpec(impl=impl)
    state_bytes = 2 * 4 * shape.numel
    bandwidth = measure_bandwidth(min(max(state_bytes // 16, 4), MAX_PROBE_BYTES), repeats=bandwidth_repeats)
    logger.info("layout {} (scale 1/{}): {} tensors, {} params", shape.name, shape.scale, shape.count, shape.numel)
    params = make_layout_params(shape)
    host_ref_us = host_time.reference_us(repeats=5)
    rows = []
    runs = [("resident", 0, False)] + [("swapopt", t, f) for t in times for f in ((False, True) if flat else (False,))]
    runs += [("swapopt-graph", t, False) for t in times] if graph else []
    for kind, t, f in runs:
        rows.append(_measure(kind, params, spec, t or 16, slots, state_bytes, warmup, repeats, host_repeats, flat=f))
        on_done(rows[-1].label)
    del params
    free_device_memory()
    host_ref_us = min(host_ref_us, host_time.reference_us(repeats=5))

    resident = rows[0] if rows[0].step_ms is not None else None
    resident_ms = resident.step_ms if resident else None
    bound = bound_ms(state_bytes, state_bytes, bandwidth, resident_ms or 0.0)
    floor, rule = link_floor_ms(state_bytes, state_bytes, bandwidth)
    for r in rows:  # the floor at the row's own copy size: a sized link moves small copies at lower rates
        if r.kind.startswith("swapopt") and r.chunk_bytes:
            r.floor_ms = link_floor_ms(state_bytes, state_bytes, bandwidth, r.chunk_bytes)[0]
    res = derive(LayoutResult(
        layout=shape.name, source=shape.source, scale=shape.scale, tensors=shape.count, numel=shape.numel,
        state_bytes=state_bytes, bandwidth=bandwidth, resident_ms=resident_ms, bound_ms=bound, rows=rows,
        floor_ms=floor, link_sharing=rule, host_ref_us=host_ref_us,
        python_scale=statistics.median(scales) if (scales := [r.python_scale for r in rows if r.python_scale]) else None,
    ))
    preset = _sim_preset()
    return attach_hardware(res, preset.name) if preset is not None else res


def attach_hardware(res: LayoutResult, preset: str) -> LayoutResult:
    """Each row's step / bound as ``preset``'s device measured it, where it ran that row (Note [hardware beside
    the model] in swapopt.bench.hardware_refs)."""
    for r in res.rows:
        found = hardware_refs.measured_ratios(preset, res.layout, res.tensors, res.numel, r.label)
        r.hardware_ratios = list(found) if found else None
    res.hardware = hardware_refs.source(preset) if any(r.hardware_ratios for r in res.rows) else None
    return res


def link_floor_ms(
    h2d_bytes: int, d2h_bytes: int, bw: Bandwidth, copy_bytes: int | None = None
) -> tuple[float, str | None]:
    """The least time these bytes can cross the link (Note [link sharing] in device/sim/presets.py) and the
    sharing rule it assumes: on the simulator its preset's, under the preset's rule, for copies of
    ``copy_bytes`` (a sized link's rates depend on it; None: the least over its sizes); on a device, from the
    measured rates (both directions' bytes through the most they moved together, no less than either alone
    at its own rate), which assumes a link that lets the two split that evenly (rule None)."""
    preset = _sim_preset()
    if preset is not None:
        return preset.link_floor_us(h2d_bytes, d2h_bytes, copy_bytes) / 1e3, preset.link_sharing
    both = (bw.h2d_both + bw.d2h_both) * 1e6  # bytes per ms
    alone = max(h2d_bytes / (bw.h2d_alone * 1e6), d2h_bytes / (bw.d2h_alone * 1e6))
    return max(alone, (h2d_bytes + d2h_bytes) / both), None


def derive(res: LayoutResult) -> LayoutResult:
    """Fill in every figure computed from the measured ones (ratios, launch targets, host time per
    param), so a result read back from JSON renders the same."""
    resident = next((r for r in res.rows if r.kind == "resident"), None)
    for r in res.rows:
        if r.b2b_ms is not None:
            r.b2b_ratio = r.b2b_ms / res.bound_ms
        if r.step_ms is not None:
            r.ratio = r.step_ms / res.bound_ms
            floor = r.floor_ms or res.floor_ms
            r.floor_ratio = r.step_ms / floor if floor else None
        if r.kind.startswith("swapopt") and r.chunks is not None:
            r.python_limit_ms = (HOST_CHUNK_US * r.chunks + HOST_TENSOR_US * res.tensors) / 1e3
            if r.python_ms is not None:
                r.python_over_limit = r.python_ms / r.python_limit_ms
        if r.kind != "swapopt" or resident is None:
            continue
        if resident.launches is not None and r.chunks is not None:
            r.launch_target = (resident.launches + LAUNCHES_PER_CHUNK) * r.chunks + LAUNCHES_PER_STEP
        if resident.python_ms and r.python_ms is not None:
            r.host_ratio = r.python_ms / resident.python_ms
        if resident.python_ms is not None and r.python_ms is not None:
            r.extra_host_us_per_param = (r.python_ms - resident.python_ms) * 1e3 / res.tensors
    return res


# Step / bound targets per chunk count: the launch-bound tiny layout gets a looser one.
RATIO_TARGETS = {16: 1.10, 64: 1.03}
TINY_RATIO_TARGET = 2.0
FLOOR_TARGET = 1.05  # step / link floor, for every layout but the launch-bound tiny one
HOST_US_PER_PARAM_TARGET = 5.0
# Pinned host bytes may exceed the state bytes by the arenas' alignment padding (well under 1% on every layout),
# not by an allocator's rounding (up to 2x where pinned memory rounds to powers of two).
PINNED_SLACK = 0.01
# The host budget of a swapped step, whatever its layout: Python and launches per chunk, and per tensor.
HOST_CHUNK_US, HOST_TENSOR_US = 60.0, 2.0


def layout_targets(res: LayoutResult) -> list[str]:
    """Each swapopt row checked against the targets (reported, never asserted: timings are not tests)."""
    lines = []
    for r in res.rows:
        if r.kind != "swapopt" or r.step_ms is None:
            continue
        ratio_target = TINY_RATIO_TARGET if res.layout == "tiny10k" else RATIO_TARGETS.get(r.times or 0)
        checks = []
        if ratio_target is not None and r.ratio is not None:
            checks.append(("step / bound", f"{r.ratio:.2f} <= {ratio_target}", r.ratio <= ratio_target))
        if res.layout != "tiny10k" and r.floor_ratio is not None:
            checks.append(("step / floor", f"{r.floor_ratio:.3f} <= {FLOOR_TARGET}", r.floor_ratio <= FLOOR_TARGET))
        if r.launch_target is not None:
            checks.append(("launches", f"{r.launches:,} <= {r.launch_target:,}", r.launches <= r.launch_target))
        if r.python_limit_ms is not None and r.python_ms is not None:
            text = (f"{r.python_ms:.1f} <= {r.python_limit_ms:.2f} ms ({HOST_CHUNK_US:g} us x chunks "
                    f"+ {HOST_TENSOR_US:g} us x tensors)")
            checks.append(("Python", text, r.python_ms <= r.python_limit_ms))
        if r.extra_host_us_per_param is not None:
            us = r.extra_host_us_per_param
            checks.append(("host", f"{us:.1f} <= {HOST_US_PER_PARAM_TARGET} us/param", us <= HOST_US_PER_PARAM_TARGET))
        if r.cap_bytes is not None:
            checks.append(("peak", f"{_mib(r.peak_extra_bytes)} <= {_mib(r.cap_bytes)} MiB",
                           r.peak_extra_bytes <= r.cap_bytes))
        if r.pinned_bytes is not None:
            slack = PINNED_SLACK * res.state_bytes
            checks.append(("pinned", f"{_mib(r.pinned_bytes)} <= {_mib(res.state_bytes + slack)} MiB (states + "
                           f"{PINNED_SLACK:.0%})", r.pinned_bytes <= res.state_bytes + slack))
        body = "; ".join(f"{name} {text} {'met' if ok else 'MISSED'}" for name, text, ok in checks)
        lines.append(f"- {r.label}: {body}")
    return lines


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _num(x: float | int | None, fmt: str = "{:,}") -> str:
    return "-" if x is None else fmt.format(x)


def _ratios(values: Sequence[float] | None) -> str:
    return "-" if not values else " / ".join(f"{v:.2f}" for v in values)


def layouts_markdown(results: Sequence[LayoutResult]) -> str:
    """A section per layout: the bound, then one row per strategy with its structural counts."""
    out = ["## Layouts: step against the bound, with the counts that explain it", ""]
    out.append(
        "Launches are aten ops that make the device work (copies and compute kernels; views and bare "
        "allocations excluded); target = (resident launches + 3) x chunks + 8. Host CPU is the calling thread's "
        "CPU time of one `step()` call; own host ms is that of a counted step (the median of five) less the counter's cost and, "
        "on the simulator (whose copies and kernels run on the host), less the time inside launched ops; "
        "it still includes the simulator's own per-op accounting. Python ms is the counted step's CPU time "
        "outside every aten op (the Python that issues the ops, which carries over to a device); extra host "
        "us/param = (Python ms - resident's) / tensors; Python limit = 60 us x chunks + 2 us x tensors. "
        "Step / floor: against the link floor at the row's own copy size. Back to back: the mean step of steps "
        "issued one after another, as a training loop issues them (each step timed alone starts from an idle device, "
        "so host work before its first device op, a replay's checks, counts in it). Cap = (slots + 1) x chunk."
    )
    scaled = [r.python_scale for res in results for r in [res, *res.rows] if r.python_scale not in (None, 1.0)]
    if scaled:
        per_step = any(r.python_scale is not None for res in results for r in res.rows)
        factor = (f"each counted step's by the factor timed beside it, x {min(scaled):.3f}-{max(scaled):.3f} over "
                  "this run" if per_step else f"x {scaled[0]:.3f}")
        out[-1] += (
            f" On the simulator Python ms is this machine's scaled to the preset's host: {factor} (the preset's "
            "host_ref_us over this machine's time for the same reference Python, Note [scaled Python] in "
            "device/sim/host_time.py), plus the preset's event_us for each event record and stream wait (calls into "
            "the runtime, in a device's Python ms as the CPU time they take)."
        )
    out.append("")
    for res in results:
        scale = "real sizes" if res.scale == 1 else f"every dim / {res.scale}"
        out.append(
            f"### {res.layout}: {res.tensors:,} tensors, {res.numel / 1e6:,.1f} M params ({scale}); "
            f"state {_mib(res.state_bytes)} MiB each way"
        )
        out.append("")
        out.append(
            f"Shapes: {res.source}. Bound {res.bound_ms:.3f} ms (H2D {res.bandwidth.h2d:.1f} GB/s, "
            f"D2H {res.bandwidth.d2h:.1f} GB/s, resident step {_num(res.resident_ms, '{:.3f}')} ms)."
            + ("" if res.floor_ms is None else
               f" Link floor {res.floor_ms:.3f} ms ({res.link_sharing or 'measured rates'}: both directions' "
               "bytes through the link as its sharing rule allows).")
            + ("" if res.host_ref_us is None else
               f" Host reference Python {res.host_ref_us:,.0f} us (this host's time for "
               "`device.sim.host_time.reference_work()`: host-bound rows move with it from host to host).")
        )
        if res.hardware:
            out.append("")
            out.append(f"Measured step / bound: the same rows (layout, sizes, strategy, chunks asked, slots) on the "
                       f"device, {res.hardware}, whose code may plan other chunk counts than this one (Note [hardware "
                       "beside the model] in swapopt/bench/hardware_refs.py).")
        measured = res.hardware is not None
        out.append("")
        out.append(
            "| strategy | chunks | step ms | step / bound | " + ("measured step / bound | " if measured else "")
            + "back to back ms | back to back / bound | step / floor | "
            "launches | target | H2D copies | D2H copies | "
            "aten ops | host CPU ms | own host ms | Python ms | Python limit ms | Python / limit | Python / resident | "
            "extra host us/param | peak extra MiB | cap MiB | pinned MiB | state MiB |"
        )
        out.append("|" + "---|" * (23 + measured))
        for r in res.rows:
            state = _mib(res.state_bytes) if r.kind.startswith("swapopt") else "-"
            out.append(
                f"| {r.label}{' (' + r.note + ')' if r.note else ''} | {_num(r.chunks)} | "
                f"{_num(r.step_ms, '{:.3f}')} | {_num(r.ratio, '{:.2f}')} | "
                + (f"{_ratios(r.hardware_ratios)} | " if measured else "")
                + f"{_num(r.b2b_ms, '{:.3f}')} | "
                f"{_num(r.b2b_ratio, '{:.2f}')} | {_num(r.floor_ratio, '{:.3f}')} | "
                f"{_num(r.launches)} | "
                f"{_num(r.launch_target)} | {_num(r.h2d_copies)} | {_num(r.d2h_copies)} | {_num(r.aten_ops)} | "
                f"{_num(r.cpu_ms, '{:.1f}')} | {_num(r.host_ms, '{:.1f}')} | {_num(r.python_ms, '{:.1f}')} | "
                f"{_num(r.python_limit_ms, '{:.2f}')} | {_num(r.python_over_limit, '{:.1f}')} | "
                f"{_num(r.host_ratio, '{:.1f}')} | "
                f"{_num(r.extra_host_us_per_param, '{:.1f}')} | {_mib(r.peak_extra_bytes)} | {_mib(r.cap_bytes)} | "
                f"{_mib(r.pinned_bytes)} | {state} |"
            )
        out.append("")
        targets = layout_targets(res)
        if targets:
            out += ["Targets:", "", *targets, ""]
    return "\n".join(out)


def layouts_summary(results: Sequence[LayoutResult]) -> str:
    """One line per swapopt row, for the terminal: step / bound and the counts against their targets."""
    measured = any(res.hardware for res in results)
    lines = [
        "| layout | tensors | strategy | step / bound | " + ("measured step / bound | " if measured else "")
        + "back to back / bound | launches (target) | H2D / D2H copies | extra host us/param |",
        "|---|---:|---|---:|" + ("---:|" if measured else "") + "---:|---:|---:|---:|",
    ]
    for res in results:
        for r in res.rows:
            if not r.kind.startswith("swapopt"):
                continue
            lines.append(
                f"| {res.layout} | {res.tensors:,} | {r.label}{' ' + r.note if r.note else ''} | "
                f"{_num(r.ratio, '{:.2f}x')} | " + (f"{_ratios(r.hardware_ratios)} | " if measured else "")
                + f"{_num(r.b2b_ratio, '{:.2f}x')} | "
                f"{_num(r.launches)} ({_num(r.launch_target)}) | "
                f"{_num(r.h2d_copies)} / {_num(r.d2h_copies)} | {_num(r.extra_host_us_per_param, '{:.1f}')} |"
            )
    return "\n".join(lines)
