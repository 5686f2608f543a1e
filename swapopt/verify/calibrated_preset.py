"""From calibration probes to simulator figures: fit the model the simulator uses, write a preset.

The simulator prices a copy as latency + bytes / rate, a kernel as max(bytes / HBM rate, FLOPs / peak), and a
launch as launch_us of host time (device/sim/timeline.py). The figures are fitted to that model, not
read off one probe, so the calibrated simulator reproduces the measured times at every probed size:
- copy rate: the slope of a least-squares line through (bytes, ms per copy) over all sizes, per direction;
- copy latency, per direction: what each copy takes beyond its bytes at that rate, fitted in relative error
  (weights 1 / time^2), so small copies keep their measured rate (a plain intercept fits the large copies and
  can be off by half at 1 MB); `copy_latency_us` is their mean and `h2d_latency_share` H2D's part of them;
- both directions at once (link_sharing "sized", Note [link sharing] in device/sim/presets.py): per copy size
  from TABLE_MIN_BYTES on (all sizes when none is that large), each direction's rate while both were busy,
  the issue orders averaged, with its latency taken out (the both-busy window holds whole copies, latencies
  included) and capped at its rate alone: the rows of `duplex_table`; `duplex_gbps` is the most the rows carry
  together. Which direction kept (>= 95% of) its rate is reported as well (`keeps_rate`, in `measured`);
- HBM rate: the slope of the fused AdamW step over its sizes, in the bytes the simulator charges that
  step per param (every tensor read and written: param, grad, exp_avg, exp_avg_sq, each in and out);
- bf16 peak: the matmul's rate, unless the matmul was launch-bound (then the base figure stays);
- launch: device time per back-to-back tiny kernel;
- host time per tensor (`host_tensor_us`, Note [host clock] in device/sim/timeline.py): the host wall time of a
  resident fused AdamW step over many small tensors, less its two launches, per tensor its ops take; on a
  device only (on the simulator the probe times the simulator's own Python);
- host time per event record or stream wait (`event_us`): those calls issued back to back, their mean; on a device
  only, as above.
A figure that cannot be fitted keeps the base preset's value, and the preset's sources say which is which.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from pydantic import BaseModel

from device.sim.presets import SimPreset
from swapopt.verify.calibrate import Calibration

# Bytes the simulator charges a fused AdamW step per fp32 param: param, grad, exp_avg and exp_avg_sq, each
# read and written (device/sim prices an op by the bytes of every tensor it touches). The kernel itself
# reads 16 and writes 12; fitting in the simulator's bytes makes the calibrated model reproduce the step time.
SIM_ADAMW_BYTES_PER_PARAM = 32
# A direction "keeps its rate" with both busy if it moves at least this share of its rate alone.
KEEPS_RATE = 0.95
# Copies below this size showed issue-order effects on the H100 (1 MB: H2D 32 or 75 GB/s beside D2H): the
# table of rates with both busy starts here when the calibration has such sizes.
TABLE_MIN_BYTES = 16 * 2**20
# A matmul counts as compute-bound (its rate a FLOP rate) only when it takes this many launches or more.
COMPUTE_BOUND_LAUNCHES = 2.0


class Fit(BaseModel):
    h2d_gbps: float
    d2h_gbps: float
    copy_latency_us: float  # mean of the two directions' latencies
    h2d_latency_us: float
    d2h_latency_us: float
    # (copy bytes, H2D GB/s, D2H GB/s) with both busy, latency excluded: SimPreset.duplex_table
    duplex_table: list[tuple[float, float, float]]
    h2d_both_gbps: float  # rates at the largest size with both busy (the order the rule below applies to)
    d2h_both_gbps: float
    duplex_gbps: float
    # Which direction keeps its rate with both busy: "h2d", "d2h", "first-launched", "both" (no shared cap
    # below the sum) or "neither".
    keeps_rate: str
    hbm_gbps: float | None
    bf16_tflops: float | None
    launch_us: float
    notes: list[str] = []


def _line(x: list[float], y: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; one point: through the origin."""
    if len(x) == 1:
        return 0.0, y[0] / x[0]
    slope, intercept = np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)
    return float(intercept), float(slope)


def _latency_us(sizes: list[float], ms: list[float], gbps: float) -> float:
    """Per-copy time beyond the bytes at `gbps`, least squares in relative error (weights 1 / time^2)."""
    times = [t * 1e3 for t in ms]
    extra = sum((t - n / (gbps * 1e3)) / t**2 for n, t in zip(sizes, times))
    return max(extra / sum(1 / t**2 for t in times), 0.0)


def duplex_rows(
    cal: Calibration, latency: dict[str, float], alone: dict[str, float]
) -> list[tuple[float, float, float]]:
    """Rows of SimPreset.duplex_table: per size from TABLE_MIN_BYTES on (all when none is), each direction's
    rate with both busy, issue orders averaged, latency taken out, capped at its rate alone."""
    points = [p for p in cal.copies if p.both and p.nbytes >= TABLE_MIN_BYTES] or [p for p in cal.copies if p.both]
    rows = []
    for p in points:
        rates = []
        for d in ("h2d", "d2h"):
            window = sum(getattr(b, f"{d}_gbps") for b in p.both) / len(p.both)
            per_copy_us = p.nbytes / (window * 1e3) - latency[d]
            rates.append(alone[d] if per_copy_us <= 0 else min(p.nbytes / per_copy_us / 1e3, alone[d]))
        rows.append((float(p.nbytes), rates[0], rates[1]))
    return rows


def keeps_rate(cal: Calibration, h2d_alone: float, d2h_alone: float) -> str:
    """Which direction keeps its rate with both busy, from the largest size's two issue orders."""
    both = cal.copies[-1].both
    kept = {b.first: {d for d, rate, alone in (("h2d", b.h2d_gbps, h2d_alone), ("d2h", b.d2h_gbps, d2h_alone))
                      if rate >= KEEPS_RATE * alone} for b in both}
    in_all = set.intersection(*kept.values()) if kept else set()
    if len(in_all) == 1:
        return next(iter(in_all))
    if len(in_all) == 2:
        return "both"  # no cap below the sum: a full-duplex link with room for both
    if kept and all(first in dirs for first, dirs in kept.items()):
        return "first-launched"
    return "neither"


def fit(cal: Calibration) -> Fit:
    notes: list[str] = []
    sizes = [float(p.nbytes) for p in cal.copies]
    _, slope_h = _line(sizes, [p.h2d_ms for p in cal.copies])
    _, slope_d = _line(sizes, [p.d2h_ms for p in cal.copies])
    h2d, d2h = 1 / (slope_h * 1e6), 1 / (slope_d * 1e6)  # ms per byte -> GB/s
    latency = {"h2d": _latency_us(sizes, [p.h2d_ms for p in cal.copies], h2d),
               "d2h": _latency_us(sizes, [p.d2h_ms for p in cal.copies], d2h)}
    largest = cal.copies[-1]
    rule = keeps_rate(cal, largest.h2d_gbps, largest.d2h_gbps)
    table = duplex_rows(cal, latency, {"h2d": h2d, "d2h": d2h})
    duplex = max([h + d for _, h, d in table] + [h2d, d2h])  # never below one direction alone
    ordered = next((b for b in largest.both if b.first == "h2d"), largest.both[0])

    hbm = None
    if len(cal.adamw) >= 2:
        _, ms_per_param = _line([float(p.numel) for p in cal.adamw], [p.ms for p in cal.adamw])
        if ms_per_param > 0:
            hbm = SIM_ADAMW_BYTES_PER_PARAM / (ms_per_param * 1e6)
    if hbm is None:
        notes.append("HBM rate not fitted: needs two AdamW sizes with a rising step time")

    launch_us = cal.launch.kernel_us
    tflops = cal.matmul.tflops
    if cal.matmul.ms * 1e3 < COMPUTE_BOUND_LAUNCHES * launch_us:
        notes.append(f"bf16 rate not fitted: the {cal.matmul.n}^3 matmul took {cal.matmul.ms * 1e3:.1f} us, "
                     f"under {COMPUTE_BOUND_LAUNCHES:g} launches")
        tflops = None
    return Fit(h2d_gbps=h2d, d2h_gbps=d2h, copy_latency_us=(latency["h2d"] + latency["d2h"]) / 2,
               h2d_latency_us=latency["h2d"], d2h_latency_us=latency["d2h"], duplex_table=table,
               h2d_both_gbps=ordered.h2d_gbps,
               d2h_both_gbps=ordered.d2h_gbps, duplex_gbps=duplex, keeps_rate=rule, hbm_gbps=hbm,
               bf16_tflops=tflops, launch_us=launch_us, notes=notes)


def calibrated_preset(cal: Calibration, base: SimPreset, *, name: str, when: str, what_device: str) -> SimPreset:
    """`base` with every fitted figure replaced, its source naming the run, and `measured` filled in.

    `calibrated` says when and on what ("2026-11-25, NVIDIA H100 80GB HBM3, driver 570.86"); `measured`
    holds the fitted figures under their preset names plus the raw figures behind them."""
    f = fit(cal)
    origin = f"measured by python -m swapopt.verify on {when}, {what_device}"
    share = f.h2d_latency_us / (f.h2d_latency_us + f.d2h_latency_us) if f.h2d_latency_us + f.d2h_latency_us else 0.5
    figures: dict[str, float] = {
        "h2d_gbps": f.h2d_gbps, "d2h_gbps": f.d2h_gbps, "copy_latency_us": f.copy_latency_us,
        "h2d_latency_share": share, "duplex_gbps": f.duplex_gbps, "launch_us": f.launch_us,
    }
    rows = f.duplex_table
    how = {
        "h2d_gbps": f"pinned copies {_mb(cal.copies[0].nbytes)}-{_mb(cal.copies[-1].nbytes)}, slope of the line fit",
        "d2h_gbps": f"pinned copies {_mb(cal.copies[0].nbytes)}-{_mb(cal.copies[-1].nbytes)}, slope of the line fit",
        "copy_latency_us": f"mean of the two directions' latencies fitted in relative error (H2D "
                           f"{f.h2d_latency_us:.1f} us, D2H {f.d2h_latency_us:.1f} us)",
        "h2d_latency_share": "H2D's part of the two directions' fitted latencies",
        "duplex_gbps": "the most duplex_table's rows carry together",
        "duplex_table": f"both directions at once, {_mb(int(rows[0][0]))}-{_mb(int(rows[-1][0]))} copies, issue orders "
                        f"averaged, latency taken out ({f.keeps_rate} kept its rate)",
        "launch_us": "device time per back-to-back tiny kernel",
    }
    if f.hbm_gbps is not None:
        figures["hbm_gbps"] = f.hbm_gbps
        how["hbm_gbps"] = (f"fused AdamW step {cal.adamw[0].numel:,}-{cal.adamw[-1].numel:,} params, slope, "
                           f"{SIM_ADAMW_BYTES_PER_PARAM} B/param as the simulator charges it")
    if f.bf16_tflops is not None:
        figures["bf16_tflops"] = f.bf16_tflops
        how["bf16_tflops"] = f"bf16 matmul {cal.matmul.n}^3"
    if cal.capacity_bytes:
        figures["capacity_bytes"] = cal.capacity_bytes
        how["capacity_bytes"] = "total device memory the runtime reports (mem_get_info)"
    # duplex_gbps must not fall below either direction (SimPreset checks it): set the rates with it.
    values = {k: (int(v) if k == "capacity_bytes" else float(v)) for k, v in figures.items()}
    # On the simulator the probe times the simulator's own Python, which no device has: the base figure stays.
    if cal.launch.host_tensor_us is not None and not cal.simulated:
        values["host_tensor_us"] = cal.launch.host_tensor_us
        how["host_tensor_us"] = ("host time of a resident fused AdamW step over many small tensors, per tensor its "
                                 "ops take")
    if not cal.simulated:  # a record and a wait are charged alike (SimPreset.event_us): their mean where both timed
        timed = [t for t in (cal.launch.event_record_us, cal.launch.event_wait_us) if t is not None]
        values["event_us"] = sum(timed) / len(timed)
        how["event_us"] = ("host wall time per event record and per stream wait, issued back to back, their mean"
                           if len(timed) == 2 else "host wall time per event record, issued back to back")
    if cal.launch.host_ref_us is not None and not cal.simulated:
        values["host_ref_us"] = cal.launch.host_ref_us
        how["host_ref_us"] = "the host's CPU time for device.sim.host_time.reference_work(), least of 15 runs"
    sources = dict(base.sources)
    sources.update({k: f"{origin}: {how[k]}" for k in [*values, "duplex_table"]})
    measured = {**values,
                "h2d_both_gbps": f.h2d_both_gbps, "d2h_both_gbps": f.d2h_both_gbps,
                "h2d_keeps_rate": float(f.keeps_rate in ("h2d", "both")),
                "d2h_keeps_rate": float(f.keeps_rate in ("d2h", "both")),
                "first_launched_keeps_rate": float(f.keeps_rate == "first-launched"),
                "matmul_bf16_tflops": cal.matmul.tflops, "event_gap_us": cal.launch.event_gap_us,
                "host_launch_us": cal.launch.host_launch_us,
                "h2d_latency_us": f.h2d_latency_us, "d2h_latency_us": f.d2h_latency_us}
    measured = {k: float(v) for k, v in measured.items()}
    calibrated = (f"{when}, {what_device}; {cal.pinned} copies {_mb(cal.copies[0].nbytes)}-"
                  f"{_mb(cal.copies[-1].nbytes)} each way and both at once ({f.keeps_rate} keeps its rate), "
                  "fused AdamW "
                  f"{cal.adamw[0].numel:,}-{cal.adamw[-1].numel:,} params, bf16 matmul {cal.matmul.n}^3, launches"
                  + ("; simulated: figures are the base preset's model read back" if cal.simulated else "")
                  + ("; " + "; ".join(f.notes) if f.notes else ""))
    table = tuple((n, h, d) for n, h, d in rows)
    return dataclasses.replace(base, name=name, sources=sources, calibrated=calibrated, measured=measured,
                               link_sharing="sized", duplex_table=table, **values)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MB" if nbytes < 2**30 else f"{nbytes / 2**30:g} GB"
