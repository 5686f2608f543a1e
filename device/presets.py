"""Device presets for the simulator: link and memory figures of real accelerators, with their sources."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1024**3


@dataclass(frozen=True)
class SimPreset:
    """Figures the timeline model and memory accounting use. Bandwidths in GB/s (1e9 bytes/s)."""

    name: str
    h2d_gbps: float  # pinned host -> device copy bandwidth
    d2h_gbps: float  # device -> pinned host copy bandwidth
    hbm_gbps: float  # device memory bandwidth: compute ops cost bytes touched / this
    launch_us: float  # host time to launch one op (kernel or copy)
    host_gbps: float  # host memory bandwidth for ops that run on the CPU
    capacity_bytes: int  # device memory
    sources: dict[str, str] = field(default_factory=dict)  # field name -> where the figure comes from


PRESETS: dict[str, SimPreset] = {
    "h100": SimPreset(
        name="h100",
        h2d_gbps=55.0,
        d2h_gbps=55.0,
        hbm_gbps=3350.0,
        launch_us=5.0,
        host_gbps=20.0,
        capacity_bytes=80 * GiB,
        sources={
            "h2d_gbps": "measured pinned H2D on H100 over PCIe Gen5 x16, about 55-57 GB/s per direction "
            "(swapopt design notes; PCIe Gen5 x16 peak is 64 GB/s)",
            "d2h_gbps": "measured pinned D2H on H100, about 55 GB/s (swapopt design notes)",
            "hbm_gbps": "NVIDIA H100 Tensor Core GPU datasheet: GPU memory bandwidth 3.35 TB/s (H100 SXM)",
            "capacity_bytes": "NVIDIA H100 Tensor Core GPU datasheet: GPU memory 80 GB (H100 SXM)",
            "launch_us": "assumed: typical CUDA kernel launch overhead of a few microseconds",
            "host_gbps": "assumed: single-threaded CPU memory bandwidth",
        },
    ),
    "910b": SimPreset(
        name="910b",
        h2d_gbps=25.0,
        d2h_gbps=25.0,
        hbm_gbps=1600.0,
        launch_us=10.0,
        host_gbps=20.0,
        capacity_bytes=64 * GiB,
        sources={
            "h2d_gbps": "assumed: PCIe 4.0 x16 host link (31.5 GB/s theoretical, as third-party 910B spec summaries "
            "list it) at the ~80% of theoretical that Huawei's mxRec PCIe tuning guide says transfers reach",
            "d2h_gbps": "assumed: same as h2d_gbps",
            "hbm_gbps": "CANN cross-platform migration guide (gitcode.com/cann/ops-cv, docs/zh/develop/"
            "cross_platform_migration_guide.md), Atlas A2 column: memory bandwidth 1.6 TB/s",
            "capacity_bytes": "same guide, Atlas A2 column: 64 GB memory per Ascend 910B",
            "launch_us": "assumed: NPU op launch through the ACL runtime",
            "host_gbps": "assumed: single-threaded CPU memory bandwidth",
        },
    ),
}


def get_preset(preset: str | SimPreset) -> SimPreset:
    """Return `preset` itself or the named entry of PRESETS (ValueError listing the names otherwise)."""
    if isinstance(preset, SimPreset):
        return preset
    try:
        return PRESETS[preset.lower()]
    except KeyError:
        raise ValueError(f"unknown simulator preset {preset!r}; choices: {', '.join(sorted(PRESETS))}") from None
