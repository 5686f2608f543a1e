"""From calibration probes to simulator figures: fit the model the simulator uses, write a preset.

The simulator prices a copy as latency + bytes / rate, a kernel as max(bytes / HBM rate, FLOPs / peak), and a
launch as launch_us of host time (device/sim/timeline.py). The figures are fitted to that model, not
read off one probe, so the calibrated simulator reproduces the measured times at every probed size:
- copy rate and latency: a least-squares line through (bytes, ms per copy) over all sizes, per direction;
- both directions at once: at the largest size, what the two directions moved together while both were
  busy gives the link's cap (see `_cap`), and the direction that kept (>= 95% of) its own rate in both
  issue orders is the one that keeps it; a direction that kept it only when issued first means the
  first-launched copy keeps it (the preset's link_sharing rule, where the preset has one);
- HBM rate: the slope of the fused AdamW step over its sizes, in the bytes the simulator charges that
  step per param (every tensor read and written: param, grad, exp_avg, exp_avg_sq, each in and out);
- bf16 peak: the matmul's rate, unless the matmul was launch-bound (then the base figure stays);
- launch: device time per back-to-back tiny kernel.
A figure that cannot be fitted keeps the base preset's value, and the preset's sources say which is which.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from pydantic import BaseModel

from device.sim.presets import SimPreset
from swapopt.verify.calibrate import Calibration, CopyPoint

# Bytes the simulator charges a fused AdamW step per fp32 param: param, grad, exp_avg and exp_avg_sq, each
# read and written (device/sim prices an op by the bytes of every tensor it touches). The kernel itself
# reads 16 and writes 12; fitting in the simulator's bytes makes the calibrated model reproduce the step time.
SIM_ADAMW_BYTES_PER_PARAM = 32
# A direction "keeps its rate" with both busy if it moves at least this share of its rate alone.
KEEPS_RATE = 0.95
# The preset's sharing rule (SimPreset.link_sharing) for each rule the probes can tell; "both" (no cap below
# the sum) and "neither" (both slowed) have no rule of their own, so the base preset's stays.
LINK_SHARING = {"first-launched": "first", "h2d": "h2d", "d2h": "d2h"}
# A matmul counts as compute-bound (its rate a FLOP rate) only when it takes this many launches or more.
COMPUTE_BOUND_LAUNCHES = 2.0


class Fit(BaseModel):
    h2d_gbps: float
    d2h_gbps: float
    copy_latency_us: float
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


def _cap(largest: CopyPoint, rule: str, fitted: dict[str, float]) -> float:
    """The link's cap with both busy. A direction that keeps its rate moves at its fitted rate, latency aside (the
    both-at-once runs count each copy's latency as idle link), so the cap is that rate plus what the other got
    beside it; without such a direction, the most both moved together, scaled up by the same latency share."""
    if rule in ("h2d", "d2h", "first-launched"):
        keepers = [(b, rule if rule != "first-launched" else b.first) for b in largest.both]
        return max(fitted[k] + getattr(b, f"{'d2h' if k == 'h2d' else 'h2d'}_gbps") for b, k in keepers)
    effective = (largest.h2d_gbps + largest.d2h_gbps) / 2
    return max(b.total_gbps for b in largest.both) * (fitted["h2d"] + fitted["d2h"]) / 2 / effective


def fit(cal: Calibration) -> Fit:
    notes: list[str] = []
    sizes = [float(p.nbytes) for p in cal.copies]
    lat_h, slope_h = _line(sizes, [p.h2d_ms for p in cal.copies])
    lat_d, slope_d = _line(sizes, [p.d2h_ms for p in cal.copies])
    h2d, d2h = 1 / (slope_h * 1e6), 1 / (slope_d * 1e6)  # ms per byte -> GB/s
    latency_us = max((lat_h + lat_d) / 2 * 1e3, 0.0)
    largest = cal.copies[-1]
    rule = keeps_rate(cal, largest.h2d_gbps, largest.d2h_gbps)
    duplex = max(_cap(largest, rule, {"h2d": h2d, "d2h": d2h}), h2d, d2h)  # never below one direction alone
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
    return Fit(h2d_gbps=h2d, d2h_gbps=d2h, copy_latency_us=latency_us, h2d_both_gbps=ordered.h2d_gbps,
               d2h_both_gbps=ordered.d2h_gbps, duplex_gbps=duplex, keeps_rate=rule, hbm_gbps=hbm,
               bf16_tflops=tflops, launch_us=launch_us, notes=notes)


def calibrated_preset(cal: Calibration, base: SimPreset, *, name: str, when: str, what_device: str) -> SimPreset:
    """`base` with every fitted figure replaced, its source naming the run, and `measured` filled in.

    `calibrated` says when and on what ("2026-11-25, NVIDIA H100 80GB HBM3, driver 570.86"); `measured`
    holds the fitted figures under their preset names plus the raw figures behind them."""
    f = fit(cal)
    origin = f"measured by python -m swapopt.verify on {when}, {what_device}"
    figures: dict[str, float] = {
        "h2d_gbps": f.h2d_gbps, "d2h_gbps": f.d2h_gbps, "copy_latency_us": f.copy_latency_us,
        "duplex_gbps": f.duplex_gbps, "launch_us": f.launch_us,
    }
    how = {
        "h2d_gbps": f"pinned copies {_mb(cal.copies[0].nbytes)}-{_mb(cal.copies[-1].nbytes)}, line fit",
        "d2h_gbps": f"pinned copies {_mb(cal.copies[0].nbytes)}-{_mb(cal.copies[-1].nbytes)}, line fit",
        "copy_latency_us": "intercept of the copy line fits",
        "duplex_gbps": f"both directions at once, {_mb(cal.copies[-1].nbytes)} copies; {f.keeps_rate} keeps its rate",
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
    sources = dict(base.sources)
    sources.update({k: f"{origin}: {how[k]}" for k in values})
    measured = {**values,
                "h2d_both_gbps": f.h2d_both_gbps, "d2h_both_gbps": f.d2h_both_gbps,
                "h2d_keeps_rate": float(f.keeps_rate in ("h2d", "both")),
                "d2h_keeps_rate": float(f.keeps_rate in ("d2h", "both")),
                "first_launched_keeps_rate": float(f.keeps_rate == "first-launched"),
                "matmul_bf16_tflops": cal.matmul.tflops, "event_gap_us": cal.launch.event_gap_us,
                "host_launch_us": cal.launch.host_launch_us}
    measured = {k: float(v) for k, v in measured.items()}
    calibrated = (f"{when}, {what_device}; {cal.pinned} copies {_mb(cal.copies[0].nbytes)}-"
                  f"{_mb(cal.copies[-1].nbytes)} each way and both at once ({f.keeps_rate} keeps its rate), "
                  "fused AdamW "
                  f"{cal.adamw[0].numel:,}-{cal.adamw[-1].numel:,} params, bf16 matmul {cal.matmul.n}^3, launches"
                  + ("; simulated: figures are the base preset's model read back" if cal.simulated else "")
                  + ("; " + "; ".join(f.notes) if f.notes else ""))
    rules: dict[str, str] = {}
    if "link_sharing" in {fl.name for fl in dataclasses.fields(base)} and f.keeps_rate in LINK_SHARING:
        rules["link_sharing"] = LINK_SHARING[f.keeps_rate]
    return dataclasses.replace(base, name=name, sources=sources, calibrated=calibrated, measured=measured,
                               **values, **rules)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MB" if nbytes < 2**30 else f"{nbytes / 2**30:g} GB"
