"""Device presets for the simulator: link, memory and compute figures of real accelerators, with their sources,
and get_preset, which finds one by name or reads one from a file (device/sim/preset_file.py).

Every figure a preset carries names where it comes from in `sources` (a datasheet, a measurement, or
"assumed: ..." with the reasoning), so a reader can tell a cited number from a guess. What the figures mean:
device/sim/preset_spec.py.
"""

from __future__ import annotations

import os

from device.sim.preset_file import load_preset, looks_like_path
from device.sim.preset_spec import (
    DIRECTIONS,
    LINK_SHARING_RULES,
    GiB,
    LinkSharing,
    MiB,
    SimPreset,
    figure_names,
)

# Note [link sharing] (how both directions share the link): in device/sim/preset_spec.py, beside the field.

__all__ = [
    "DIRECTIONS",
    "LINK_SHARING_RULES",
    "PRESETS",
    "GiB",
    "LinkSharing",
    "MiB",
    "SimPreset",
    "figure_names",
    "get_preset",
    "resolve_preset",
]

_H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column"
# The datasheet's tensor-core rows are quoted with 2:4 structured sparsity; dense peaks are half of them.
_DENSE = "halved: the datasheet's tensor-core figures are with sparsity"
# Published measurements of both directions at once: A100 on PCIe Gen4 moves 25-26 GB/s each way alone but
# about 37 GB/s in total with both running (nvbandwidth host_to_device_bidirectional_memcpy_ce and
# device_to_host_bidirectional_memcpy_ce, github.com/NVIDIA/nvbandwidth/issues/11 and issues/53).
_DUPLEX_RATIO = (
    "the ~1.45x single-direction total that nvbandwidth reports on A100 PCIe Gen4 (about 37 GB/s with both "
    "directions busy against 25-26 GB/s one way; github.com/NVIDIA/nvbandwidth issues 11 and 53)"
)

# The H100 run these figures come from (bench/results/cuda-h100-2026-11-26-verify-a.md, python -m swapopt.verify).
_H100_RUN = "2026-11-26, NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0, torch 2.11.0, PCIe gen 5 x16"
_H100_MEASURED = f"measured by python -m swapopt.verify on {_H100_RUN} (h100-2026-11-26)"

# Graph launches (Note [graph capture] in device/sim/graphs.py), measured once on an H100 by a probe of this
# simulator's graph model, not by python -m swapopt.verify, which does not time a graph replay yet: they await a
# calibration there. The probe: torch 2.11.0+cu130, driver 580.159.04, 2026-11-27; straight-line graphs of n
# one-element add_ kernels, each replay timed on the host (median of 30) and by events on the device.
_GRAPH_PROBE = (
    "measured once on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, driver 580.159.04, 2026-11-27) by a probe"
)
_GRAPH_LAUNCH = (
    f"{_GRAPH_PROBE}: host time of CUDAGraph.replay() for straight-line graphs of n one-element add_ kernels, median "
    "of 30: 5.56 us at n=10, 7.49 at n=100, 33.79 at n=1000 (5.82 at n=1, 6.6-7.7 for graphs of two streams forked "
    "and joined every 10 nodes, n=10-100); the line through n=10 and n=1000 starts at 5.3 us. Awaits a calibration "
    "by python -m swapopt.verify"
)
_GRAPH_NODE_HOST = (
    f"{_GRAPH_PROBE}: the slope of the same host times, (33.79 - 5.56) us / 990 nodes = 0.0285 us a node. Awaits a "
    "calibration by python -m swapopt.verify"
)
_GRAPH_NODE_GAP = (
    f"{_GRAPH_PROBE}: device time of the same replays, between events around them: 1.110 us a node at n=100, 1.189 "
    "at n=1000, for kernels whose own time is next to nothing here (eager: 11.4-11.9 us an op, the host's launch "
    "rate); 1.15 taken. Awaits a calibration by python -m swapopt.verify"
)

# Copy latency, the device's own (Note [queued copies] in swapopt/verify/calibrate.py): pinned copies of 256 KB-64
# MB queued behind a sleeping kernel so the host had issued them all before the first ran, each direction alone
# and on one stream, median of 3 runs of 8-64 copies (bench/results/cuda-h100-2026-11-27-copy-latency.{md,json}).
# Fitted in relative error at the line fit's rates: H2D 2.72 us, D2H 1.70 us a copy. The first calibration
# (verify-a.json) timed copies as the host issued them and fitted H2D 28.3 us, D2H 2.0: at 1 MB its H2D copies took
# 47 us each where queued ones take 22, the host's pace rather than the device's, which the simulator charges
# apart (its host clock).
_H100_LATENCY = {"h2d": 2.7175823898514424, "d2h": 1.7012219699448172}
_H100_LATENCY_RUN = ("measured on one H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-27, copies queued behind a "
                     "sleeping kernel (bench/results/cuda-h100-2026-11-27-copy-latency.md)")

# The H100 host's time per tensor argument: tiny10k's resident fused AdamW step, 34.792 ms, is the host's (the
# device works 13 us of it): 2 launches, then 59,996 tensors beyond two per op (Note [host clock]).
_TINY10K_HOST_TENSOR_US = (34_792.0 - 2 * 6.170815944671631 - 13.3) / 59_996
# The measured host clock's figures for the H100's host (Note [scaled Python] in device/sim/host_time.py), derived
# from the layout rows as the sources below say.
HOST_REF_US = 1424.0
LAUNCHER_TENSOR_US = 0.261
# The H100 host's time per event record (verify-a.json, launch.event_record_us; 6.89 and 6.16 us in the runs of
# verify-b.json and cuda-h100-2026-11-27-verify-quick.json). A stream wait is not timed there and is taken as a record.
EVENT_US = 6.317325999994238

PRESETS: dict[str, SimPreset] = {
    "h100": SimPreset(
        name="h100",
        h2d_gbps=55.16,
        d2h_gbps=55.13,
        duplex_gbps=105.35,
        copy_latency_us=2.21,
        h2d_latency_share=0.6150,
        link_sharing="sized",
        duplex_table=(
            (16 * MiB, 51.78, 50.17),
            (256 * MiB, 34.48, 47.08),
            (1024 * MiB, 44.09, 51.61),
        ),
        hbm_gbps=3075.4,
        bf16_tflops=793.7,
        fp16_tflops=989.5,
        tf32_tflops=494.5,
        fp32_tflops=67.0,
        fp64_tflops=67.0,
        launch_us=6.17,
        host_tensor_us=0.580,
        host_ref_us=HOST_REF_US,
        launcher_tensor_us=LAUNCHER_TENSOR_US,
        event_us=EVENT_US,
        host_gbps=20.0,
        capacity_bytes=85_017_493_504,
        graph_launch_us=5.3,
        graph_node_host_us=0.0285,
        graph_node_gap_us=1.15,
        calibrated=_H100_RUN,
        # The fitted figures unrounded, as swapopt.verify.calibrated_preset makes them from the run's calibration
        # (tests/data/cuda-h100-2026-11-26-calibration.json); host_tensor_us from the layout bench.
        measured={
            "h2d_gbps": 55.160927335100055,
            "d2h_gbps": 55.12678529955366,
            "duplex_gbps": 105.34930268607675,
            "copy_latency_us": (_H100_LATENCY["h2d"] + _H100_LATENCY["d2h"]) / 2,
            "h2d_latency_share": _H100_LATENCY["h2d"] / (_H100_LATENCY["h2d"] + _H100_LATENCY["d2h"]),
            "hbm_gbps": 3075.3742416380114,
            "bf16_tflops": 793.7217666453665,
            "launch_us": 6.170815944671631,
            "host_tensor_us": _TINY10K_HOST_TENSOR_US,
            "host_ref_us": HOST_REF_US,
            "launcher_tensor_us": LAUNCHER_TENSOR_US,
            "event_us": EVENT_US,
            "capacity_bytes": 85_017_493_504,
        },
        sources={
            "h2d_gbps": f"{_H100_MEASURED}: pinned copies 1 MB-1 GB, slope of the line fit (verify-a.json)",
            "d2h_gbps": f"{_H100_MEASURED}: pinned copies 1 MB-1 GB, slope of the line fit (verify-a.json)",
            "duplex_gbps": f"{_H100_MEASURED}: the most duplex_table's rows carry together (16 MB copies); "
            "the cap the run's file names, 95.9, is the 1 GB copies' (verify-a.json)",
            "copy_latency_us": f"{_H100_LATENCY_RUN}: mean of the two directions' latencies, H2D 2.72 us, D2H "
            "1.70 us, each fitted in relative error at the line fit's rate to the per-copy times of queued copies",
            "h2d_latency_share": f"{_H100_LATENCY_RUN}: H2D's part of the two latencies, 2.72 / (2.72 + 1.70)",
            "duplex_table": f"{_H100_MEASURED}: both directions at once, 16 MB-1 GB copies, the two issue orders "
            "averaged (16 MB: 51.5 + 49.9 GB/s, 256 MB: 34.5 + 47.1, 1 GB: 44.1 + 51.6 as measured), each "
            "direction's latency (copy_latency_us) taken out, capped at its rate alone; 1 MB is left out: there H2D "
            "moved 32 or 75 GB/s beside D2H depending on issue order (verify-a.json)",
            "hbm_gbps": f"{_H100_MEASURED}: fused AdamW step 1,000,000-100,000,000 params, slope, 32 B/param as "
            "the simulator charges it (verify-a.json)",
            "bf16_tflops": f"{_H100_MEASURED}: bf16 matmul 8192^3, 1.385 ms (verify-a.json)",
            "fp16_tflops": f"{_H100_DATASHEET}: FP16 Tensor Core 1,979 TFLOPS, {_DENSE}",
            "tf32_tflops": f"{_H100_DATASHEET}: TF32 Tensor Core 989 TFLOPS, {_DENSE}",
            "fp32_tflops": f"{_H100_DATASHEET}: FP32 67 TFLOPS (CUDA cores, no tensor cores)",
            "fp64_tflops": f"{_H100_DATASHEET}: FP64 Tensor Core 67 TFLOPS",
            "launch_us": f"{_H100_MEASURED}: device time per back-to-back tiny kernel, which the host's issue "
            "rate sets (host wall time per launch 6.24 us) (verify-a.json)",
            "host_tensor_us": f"{_H100_MEASURED}: the layout bench's resident fused AdamW step on tiny10k, a step the "
            "host sets (10,000 tensors; torch's fused AdamW launches _foreach_add_ over the 10,000 steps and "
            "_fused_adamw_ over 5 lists of 10,000: 59,996 tensors beyond two per op): (34.792 ms step - 2 launches - "
            "13 us of device work) / 59,996 (bench/results/cuda-h100-2026-11-26-verify-b.md, Layouts, tiny10k, "
            "resident-fused, step ms)",
            "host_ref_us": f"derived from the layout rows of the run on {_H100_RUN}: "
            "it is the time that puts the measured clock's scaled Python of e190371's swapped fsdp256 step at 64 "
            "chunks, with its launches, its 415 event records and waits at event_us and its tensors at "
            "launcher_tensor_us, on the H100's host CPU time for it, 14.5 ms (bench/results/cuda-h100-2026-11-26-"
            "verify-b.md, Layouts, fsdp256, swapopt t=64 s=3, host CPU ms), times this machine's reference_us() in "
            "that run (bench/results/sim-h100-2026-11-26-fidelity-e190371-after.md, Calibration of the measured "
            "clock's figures; refitted with event_us in sim-h100-2026-11-28-events.md). "
            "So it maps the simulator's Python (slower than torch's own on the same host: every op enters the "
            "simulator's modes) to the H100 host's, and is not that host's time for reference_work(), which leases "
            "of 2026-11-27 measured at 5,894-6,105 and 9,144-11,566 us (bench/results/cuda-h100-2026-11-27-undo.md)",
            "launcher_tensor_us": f"derived from the layout rows of the run on {_H100_RUN}: tiny10k's resident "
            "fused AdamW step (34.792 ms, "
            "bench/results/cuda-h100-2026-11-26-verify-b.md, Layouts, tiny10k, resident-fused, step ms) less "
            "2 launches, 13 us of device work and the measured clock's scaled Python of that step, over its 59,996 "
            "tensors beyond two per op (bench/results/sim-h100-2026-11-26-fidelity-e190371-after.md, Calibration; "
            "refitted with host_ref_us in sim-h100-2026-11-28-events.md)",
            "event_us": f"{_H100_MEASURED}: host wall time per event record, records issued back to back "
            "(verify-a.json, launch.event_record_us; 6.89 and 6.16 us in verify-b.json and "
            "cuda-h100-2026-11-27-verify-quick.json); a stream wait, not timed there, taken as a record",
            "host_gbps": "assumed: single-threaded CPU memory bandwidth",
            "capacity_bytes": f"{_H100_MEASURED}: total device memory the runtime reports (mem_get_info), "
            "79.2 GiB (verify-a.json)",
            "host_capacity_bytes": "measured on the H100 run's host (h100-2026-11-26, env.txt): 125 GiB of RAM",
            "pin_gbps": "measured on the H100 run's host (h100-2026-11-26, pinned.txt): 24 GiB + 4 KiB pinned by one "
            "thread in 15.54 s, 1.66 GB/s",
            "graph_launch_us": _GRAPH_LAUNCH,
            "graph_node_host_us": _GRAPH_NODE_HOST,
            "graph_node_gap_us": _GRAPH_NODE_GAP,
        },
    ),
    "910b": SimPreset(
        name="910b",
        flavour="npu",
        h2d_gbps=25.0,
        d2h_gbps=25.0,
        duplex_gbps=36.0,
        copy_latency_us=5.0,
        link_sharing="sized",
        duplex_table=((1 * MiB, 18.0, 18.0),),
        host_tensor_us=0.580,
        host_ref_us=HOST_REF_US,
        launcher_tensor_us=LAUNCHER_TENSOR_US,
        hbm_gbps=1600.0,
        bf16_tflops=313.0,
        fp16_tflops=313.0,
        tf32_tflops=78.0,
        fp32_tflops=78.0,
        fp64_tflops=39.0,
        launch_us=10.0,
        event_us=10.0,
        host_gbps=20.0,
        capacity_bytes=64 * GiB,
        graph_launch_us=8.6,
        graph_node_host_us=0.046,
        graph_node_gap_us=1.9,
        sources={
            "h2d_gbps": "assumed: PCIe 4.0 x16 host link (31.5 GB/s theoretical, as third-party 910B spec summaries "
            "list it) at the ~80% of theoretical that Huawei's mxRec PCIe tuning guide says transfers reach",
            "d2h_gbps": "assumed: same as h2d_gbps",
            "duplex_gbps": f"assumed: 25 GB/s one way times {_DUPLEX_RATIO}, a PCIe Gen4 part like this one",
            "copy_latency_us": "assumed: aclrtMemcpyAsync setup through the ACL runtime, above CUDA's",
            "h2d_latency_share": "assumed: both directions pay copy_latency_us",
            "duplex_table": "assumed: duplex_gbps split evenly at every copy size, neither direction keeping its "
            "rate, as neither did on the H100 (h100-2026-11-26)",
            "host_tensor_us": "assumed: as measured on the H100's host (h100-2026-11-26): the Python and launcher "
            "walking an op's tensors are host work, not the device's",
            "host_ref_us": "assumed: as the H100's host (h100-2026-11-26): Python speed is the host CPU's",
            "launcher_tensor_us": "assumed: as the H100's host (h100-2026-11-26)",
            "hbm_gbps": "CANN cross-platform migration guide (gitcode.com/cann/ops-cv, docs/zh/develop/"
            "cross_platform_migration_guide.md), Atlas A2 column: memory bandwidth 1.6 TB/s",
            "bf16_tflops": "assumed: Huawei publishes no per-chip figure; third-party summaries of the 910B "
            "variants list 256-376 TFLOPS FP16, the 313 of the 910B3 (Atlas 800T A2) is taken",
            "fp16_tflops": "assumed: as bf16_tflops",
            "tf32_tflops": "assumed: float32 matmuls on the cube unit at a quarter of the fp16 rate (HF32 off)",
            "fp32_tflops": "assumed: as tf32_tflops",
            "fp64_tflops": "assumed: half the fp32 rate; the cube unit has no fp64 path",
            "capacity_bytes": "same guide, Atlas A2 column: 64 GB memory per Ascend 910B",
            "launch_us": "assumed: NPU op launch through the ACL runtime",
            "event_us": "assumed: an event record or stream wait through the ACL runtime (aclrtRecordEvent, "
            "aclrtStreamWaitEvent) costs the host a launch, as a record did on the H100 (6.3 us against 6.2)",
            "host_gbps": "assumed: single-threaded CPU memory bandwidth",
            "host_capacity_bytes": "assumed: 125 GiB, as the H100 host; Atlas 800T A2 servers carry more per NPU, "
            "set SWAPOPT_SIM_HOST_MB for the host at hand",
            "pin_gbps": "assumed: as the H100 host's measured 1.66 GB/s (page pinning is host-side work)",
            "graph_launch_us": "assumed, awaits calibration on hardware: an NPU graph replay (torch_npu NPUGraph, "
            "aclmdlRIExecuteAsync) through the ACL runtime, the H100's measured 5.3 us scaled as launch_us is (10 / "
            "6.17)",
            "graph_node_host_us": "assumed, awaits calibration on hardware: the H100's measured 0.0285 us a node, "
            "scaled as launch_us is (10 / 6.17)",
            "graph_node_gap_us": "assumed, awaits calibration on hardware: the H100's measured 1.15 us between a "
            "graph's nodes on the device, scaled as launch_us is (10 / 6.17)",
        },
    ),
}


def get_preset(preset: str | os.PathLike[str] | SimPreset) -> SimPreset:
    """Return `preset` itself, the preset a JSON file holds (a path: device.sim.preset_file), or the named
    entry of PRESETS (ValueError listing the names otherwise)."""
    if isinstance(preset, SimPreset):
        return preset
    if looks_like_path(preset):
        return load_preset(preset)
    try:
        return PRESETS[preset.lower()]
    except KeyError:
        raise ValueError(f"unknown simulator preset {preset!r}; choices: {', '.join(sorted(PRESETS))}") from None


def resolve_preset(preset: str | os.PathLike[str] | SimPreset) -> SimPreset:
    """A SimPreset from a preset object, a preset name (h100, 910b) or the path of a preset file."""
    if isinstance(preset, (SimPreset, os.PathLike)):
        return get_preset(preset)
    return get_preset(str(preset))
