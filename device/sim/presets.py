"""Device presets for the simulator: link, memory and compute figures of real accelerators, with their sources.

Every figure a preset carries names where it comes from in `sources` (a datasheet, a measurement, or
"assumed: ..." with the reasoning), so a reader can tell a cited number from a guess.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field, fields
from typing import Literal, get_args

GiB = 1024**3
MiB = 1024**2

# Fields that are not figures of the device and so need no source.
_NOT_FIGURES = frozenset({"name", "flavour", "sources", "calibrated", "measured", "link_sharing"})

# Note [link sharing]: with copies running both ways at once the link carries at most `duplex_gbps`, and
# which direction gives way is a property of the part (nvbandwidth's bidirectional tests show one direction
# keeping its one-way rate and the other getting the rest, often H2D giving way):
# - "first": the copy launched first keeps its full rate; a copy launched while the other direction is
#   already scheduled gets what the cap leaves. The simulator's rule before calibration.
# - "d2h" / "h2d": that direction always keeps its full rate, even against copies the other way launched
#   before it; the other direction gets what the cap leaves beside it.
# Under "first" a schedule that takes turns at launching first can split the cap evenly, so both directions'
# bytes can cross in (H2D + D2H) / cap. Under a fixed rule nothing can: while the favoured direction is busy
# the other gets only cap - its rate, so the floor is higher (link_floor_us).
LinkSharing = Literal["first", "d2h", "h2d"]
LINK_SHARING_RULES: tuple[str, ...] = get_args(LinkSharing)


@dataclass(frozen=True)
class SimPreset:
    """Figures the timeline model and memory accounting use. Bandwidths in GB/s (1e9 bytes/s), FLOP rates in
    TFLOP/s (1e12 FLOP/s, dense: no structured-sparsity factor)."""

    name: str
    h2d_gbps: float  # pinned host -> device copy bandwidth, one direction alone
    d2h_gbps: float  # device -> pinned host copy bandwidth, one direction alone
    duplex_gbps: float  # aggregate cap of both directions at once (below h2d + d2h on PCIe parts)
    copy_latency_us: float  # fixed cost of one host<->device copy before its bytes flow
    hbm_gbps: float  # device memory bandwidth: kernels cost at least bytes touched / this
    bf16_tflops: float  # dense tensor-core peak, bfloat16 inputs
    fp16_tflops: float  # dense tensor-core peak, float16 inputs
    tf32_tflops: float  # dense tensor-core peak for float32 inputs when TF32 is allowed
    fp32_tflops: float  # float32 without tensor cores (TF32 off, torch's default for matmul)
    fp64_tflops: float  # float64 peak (tensor cores where the part has them)
    launch_us: float  # host time to launch one op (kernel or copy)
    host_gbps: float  # host memory bandwidth for ops that run on the CPU
    capacity_bytes: int  # device memory usable by allocations
    sources: dict[str, str] = field(default_factory=dict)  # field name -> where the figure comes from
    flavour: str = "cuda"  # the device surface it presents: "cuda" (torch.cuda) or "npu" (torch_npu)
    # Calibration on real hardware: when it was done and on what ("2026-01-31, H100 SXM5, driver 570"), and the
    # raw figures measured (same names and units as the fields above). Empty until a device run fills them in:
    # nothing here is measured yet.
    calibrated: str | None = None
    measured: dict[str, float] = field(default_factory=dict)
    # Which direction keeps its rate with both busy (Note [link sharing]). Not a figure: a rule, which
    # calibration reads off the two issue orders of its both-at-once copies.
    link_sharing: LinkSharing = "first"

    def __post_init__(self) -> None:
        if self.duplex_gbps < max(self.h2d_gbps, self.d2h_gbps):
            raise ValueError(f"{self.name}: duplex_gbps must be at least the faster single direction")
        if self.link_sharing not in LINK_SHARING_RULES:
            raise ValueError(
                f"{self.name}: link_sharing must be one of {', '.join(LINK_SHARING_RULES)}, got {self.link_sharing!r}"
            )

    def link_floor_us(self, h2d_bytes: float, d2h_bytes: float) -> float:
        """The least time in which `h2d_bytes` and `d2h_bytes` can cross this link, copy latencies aside
        (Note [link sharing]): never below either direction alone at its rate; under "first" both
        directions' bytes through the cap; under a fixed rule the favoured direction's bytes at its rate,
        while the other gets cap - that rate, and then the rest of the other's bytes alone."""
        h_rate, d_rate, cap = self.h2d_gbps * 1e3, self.d2h_gbps * 1e3, self.duplex_gbps * 1e3  # bytes per us
        alone = max(h2d_bytes / h_rate, d2h_bytes / d_rate)
        if self.link_sharing == "first":
            return max(alone, (h2d_bytes + d2h_bytes) / cap)
        if self.link_sharing == "d2h":
            fav, fav_rate, other, other_rate = d2h_bytes, d_rate, h2d_bytes, h_rate
        else:
            fav, fav_rate, other, other_rate = h2d_bytes, h_rate, d2h_bytes, d_rate
        busy = fav / fav_rate
        beside = min(other_rate, cap - fav_rate) * busy  # what the other direction moves meanwhile
        return max(alone, busy + max(other - beside, 0.0) / other_rate)

    def peak_tflops(self, precision: str) -> float:
        """Peak rate for a precision key of device.costs ("bf16", "fp16", "tf32", "fp32", "fp64")."""
        return float(getattr(self, f"{precision}_tflops"))


def figure_names() -> list[str]:
    """The SimPreset fields that are device figures, each of which must have a source."""
    return [f.name for f in fields(SimPreset) if f.name not in _NOT_FIGURES]


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

PRESETS: dict[str, SimPreset] = {
    "h100": SimPreset(
        name="h100",
        h2d_gbps=55.0,
        d2h_gbps=55.0,
        duplex_gbps=80.0,
        copy_latency_us=2.0,
        hbm_gbps=3350.0,
        bf16_tflops=989.5,
        fp16_tflops=989.5,
        tf32_tflops=494.5,
        fp32_tflops=67.0,
        fp64_tflops=67.0,
        launch_us=5.0,
        host_gbps=20.0,
        capacity_bytes=81559 * MiB,
        sources={
            "h2d_gbps": "measured pinned H2D on H100 over PCIe Gen5 x16, about 55-57 GB/s per direction "
            "(swapopt design notes; PCIe Gen5 x16 peak is 64 GB/s)",
            "d2h_gbps": "measured pinned D2H on H100, about 55 GB/s (swapopt design notes)",
            "duplex_gbps": f"assumed: 55 GB/s one way times {_DUPLEX_RATIO}; no published H100 figure",
            "copy_latency_us": "assumed: a few microseconds of DMA setup and PCIe round trip per cudaMemcpyAsync",
            "hbm_gbps": f"{_H100_DATASHEET}: GPU memory bandwidth 3.35 TB/s",
            "bf16_tflops": f"{_H100_DATASHEET}: BFLOAT16 Tensor Core 1,979 TFLOPS, {_DENSE}",
            "fp16_tflops": f"{_H100_DATASHEET}: FP16 Tensor Core 1,979 TFLOPS, {_DENSE}",
            "tf32_tflops": f"{_H100_DATASHEET}: TF32 Tensor Core 989 TFLOPS, {_DENSE}",
            "fp32_tflops": f"{_H100_DATASHEET}: FP32 67 TFLOPS (CUDA cores, no tensor cores)",
            "fp64_tflops": f"{_H100_DATASHEET}: FP64 Tensor Core 67 TFLOPS",
            "launch_us": "assumed: typical CUDA kernel launch overhead of a few microseconds",
            "host_gbps": "assumed: single-threaded CPU memory bandwidth",
            "capacity_bytes": "total memory the driver reports for an H100 80GB HBM3: 81559 MiB in nvidia-smi "
            "(85,520,809,984 bytes; e.g. github.com/modal-labs/modal-client/pull/2797 and "
            "github.com/wilicc/gpu-burn/issues/114), not the datasheet's 80 GB; the CUDA context's few hundred "
            "MiB are not subtracted (calibrate with torch.cuda.mem_get_info)",
        },
    ),
    "910b": SimPreset(
        name="910b",
        flavour="npu",
        h2d_gbps=25.0,
        d2h_gbps=25.0,
        duplex_gbps=36.0,
        copy_latency_us=5.0,
        hbm_gbps=1600.0,
        bf16_tflops=313.0,
        fp16_tflops=313.0,
        tf32_tflops=78.0,
        fp32_tflops=78.0,
        fp64_tflops=39.0,
        launch_us=10.0,
        host_gbps=20.0,
        capacity_bytes=64 * GiB,
        sources={
            "h2d_gbps": "assumed: PCIe 4.0 x16 host link (31.5 GB/s theoretical, as third-party 910B spec summaries "
            "list it) at the ~80% of theoretical that Huawei's mxRec PCIe tuning guide says transfers reach",
            "d2h_gbps": "assumed: same as h2d_gbps",
            "duplex_gbps": f"assumed: 25 GB/s one way times {_DUPLEX_RATIO}, a PCIe Gen4 part like this one",
            "copy_latency_us": "assumed: aclrtMemcpyAsync setup through the ACL runtime, above CUDA's",
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
            "host_gbps": "assumed: single-threaded CPU memory bandwidth",
        },
    ),
}


def get_preset(preset: str | os.PathLike[str] | SimPreset) -> SimPreset:
    """Return `preset` itself, the preset a JSON file holds (a path: device.sim.preset_file), or the named
    entry of PRESETS (ValueError listing the names otherwise)."""
    if isinstance(preset, SimPreset):
        return preset
    from device.sim.preset_file import load_preset, looks_like_path  # preset_file imports this module

    if looks_like_path(preset):
        return load_preset(preset)
    try:
        return PRESETS[preset.lower()]
    except KeyError:
        raise ValueError(f"unknown simulator preset {preset!r}; choices: {', '.join(sorted(PRESETS))}") from None
