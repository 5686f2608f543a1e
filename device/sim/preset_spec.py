"""SimPreset: the link, memory and compute figures a simulator preset carries, and the rules they follow (Note
[link sharing]). The presets themselves, with their sources, are in device/sim/presets.py; a preset as a JSON
file in device/sim/preset_file.py.

Every figure a preset carries names where it comes from in `sources` (a datasheet, a measurement, or
"assumed: ..." with the reasoning), so a reader can tell a cited number from a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from device.link_table import duplex_rate

GiB = 1024**3
MiB = 1024**2

# Fields that are not figures of the device and so need no source.
_NOT_FIGURES = frozenset({"name", "flavour", "sources", "calibrated", "measured", "link_sharing"})
DIRECTIONS = ("h2d", "d2h")

# Note [link sharing]: with copies running both ways at once the link carries less than the two directions
# alone, and how the two share it is a property of the part. The preset's `link_sharing` names the rule:
# - "sized": neither direction keeps its rate; while the other direction is busy each moves at the rate
#   `duplex_table` gives for its copy size. The table's rows are (copy bytes, H2D GB/s, D2H GB/s) with both
#   busy, latency excluded (bytes / (time - latency) of back-to-back copies), interpolated in log size and
#   clamped at its ends: below the smallest row the rates of that row, above the largest those of the largest.
#   What the H100 showed (bench/results/cuda-h100-2026-11-26-verify-a.md: 16 MB 51.5 + 50.0 GB/s, 256 MB 34.2 + 47.0,
#   1 GB 44.0 + 51.7, whichever direction was issued first); 1 MB copies there depend on issue order (H2D 32
#   or 75 GB/s beside D2H) and are not modeled: the smallest row's rates apply to them.
# - "first": with both busy the link carries at most `duplex_gbps`; the copy launched first keeps its full
#   rate and one launched while the other direction is already scheduled gets what the cap leaves.
# - "d2h" / "h2d": that direction always keeps its full rate, even against copies the other way launched
#   before it; the other direction gets what the cap leaves beside it.
# Under "first" a schedule that takes turns at launching first can split the cap evenly, so both directions'
# bytes can cross in (H2D + D2H) / cap. Under a fixed rule nothing can: while the favoured direction is busy
# the other gets only cap - its rate, so the floor is higher (link_floor_us). Under "sized" both directions'
# bytes cross at the table's pair of rates while both are busy, then the rest alone.
LinkSharing = Literal["sized", "first", "d2h", "h2d"]
LINK_SHARING_RULES: tuple[str, ...] = get_args(LinkSharing)


@dataclass(frozen=True)
class SimPreset:
    """Figures the timeline model and memory accounting use. Bandwidths in GB/s (1e9 bytes/s), FLOP rates in
    TFLOP/s (1e12 FLOP/s, dense: no structured-sparsity factor)."""

    name: str
    h2d_gbps: float  # pinned host -> device copy bandwidth, one direction alone
    d2h_gbps: float  # device -> pinned host copy bandwidth, one direction alone
    duplex_gbps: float  # the most both directions carry together (below h2d + d2h on PCIe parts)
    copy_latency_us: float  # fixed cost of one host<->device copy before its bytes flow, mean of the directions
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
    # How the two directions share the link with both busy (Note [link sharing]). Not a figure: a rule.
    link_sharing: LinkSharing = "first"
    # The share of the two directions' latencies an H2D copy pays: H2D waits 2 x share x copy_latency_us, D2H
    # 2 x (1 - share) x copy_latency_us (0.5: both pay copy_latency_us). A share, not a second latency, so that
    # a preset with copy_latency_us replaced by 0 has no latency either way.
    h2d_latency_share: float = 0.5
    # Rows (copy bytes, H2D GB/s, D2H GB/s) with both directions busy, latency excluded, ascending in bytes: the
    # rates of link_sharing "sized" (Note [link sharing]); other rules ignore it. Files written before it load
    # with none.
    duplex_table: tuple[tuple[float, float, float], ...] = ()
    # Host time per tensor an op takes beyond its first two (multi-tensor foreach and fused ops, whose
    # launcher and the Python that gathers their lists walk every tensor): Note [host clock] in
    # device/sim/timeline.py. Files written before it load with none.
    host_tensor_us: float = 0.0
    # The "measured" host clock (Note [host clock]; Note [scaled Python] in device/sim/host_time.py): the device
    # host's CPU time, in microseconds, for host_time.reference_work() (0: the clock charges this machine's Python
    # unscaled), and the launcher's own host time per tensor beyond an op's first two (the part of host_tensor_us
    # that is not the Python gathering the op's lists, which that clock measures). Files written before them load
    # with none.
    host_ref_us: float = 0.0
    launcher_tensor_us: float = 0.0
    # Host time of one event record or stream wait outside a capture (Note [host clock] in device/sim/timeline.py):
    # a call into the runtime's stream queue, which a swapped step makes six times a chunk. Files written before it
    # load with none.
    event_us: float = 0.0
    # The host beside the device (device/sim/host_memory.py): RAM that pinned host memory is counted against
    # (SWAPOPT_SIM_HOST_MB overrides it), and how fast one thread pins host memory, in GB/s.
    host_capacity_bytes: int = 125 * GiB
    pin_gbps: float = 1.66
    # A replayed graph (CUDA graph / NPU graph: Note [graph capture] in device/sim/graphs.py): the host's time for one
    # launch, and per node of the graph on top; and the device's own gap between the nodes it issues on one stream,
    # in place of launch_us per op. The H100's, measured once by a probe until python -m swapopt.verify calibrates
    # them (device/sim/presets.py). Files written before them load with these.
    graph_launch_us: float = 5.3
    graph_node_host_us: float = 0.0285
    graph_node_gap_us: float = 1.15

    def __post_init__(self) -> None:
        if self.duplex_gbps < max(self.h2d_gbps, self.d2h_gbps):
            raise ValueError(f"{self.name}: duplex_gbps must be at least the faster single direction")
        if self.link_sharing not in LINK_SHARING_RULES:
            raise ValueError(
                f"{self.name}: link_sharing must be one of {', '.join(LINK_SHARING_RULES)}, got {self.link_sharing!r}"
            )
        if not 0.0 <= self.h2d_latency_share <= 1.0:
            raise ValueError(f"{self.name}: h2d_latency_share must lie in [0, 1], got {self.h2d_latency_share}")
        # JSON gives lists: rows become tuples, so the preset stays hashable and compares equal to its file.
        table = tuple((float(n), float(h), float(d)) for n, h, d in self.duplex_table)
        object.__setattr__(self, "duplex_table", table)
        if any(n <= 0 or h <= 0 or d <= 0 for n, h, d in table) or any(
            a[0] >= b[0] for a, b in zip(table, table[1:])
        ):
            raise ValueError(
                f"{self.name}: duplex_table rows must be (bytes, GB/s, GB/s), all positive, bytes ascending"
            )
        if self.link_sharing == "sized" and not table:
            raise ValueError(f"{self.name}: link_sharing 'sized' needs a duplex_table")

    def latency_us(self, direction: str) -> float:
        """The fixed cost of one copy of `direction` ("h2d" or "d2h") before its bytes flow."""
        share = self.h2d_latency_share if direction == "h2d" else 1.0 - self.h2d_latency_share
        return 2.0 * share * self.copy_latency_us

    def alone_gbps(self, direction: str) -> float:
        return self.h2d_gbps if direction == "h2d" else self.d2h_gbps

    def both_gbps(self, direction: str, nbytes: float) -> float:
        """Rate of a copy of `direction` and `nbytes` while the other direction is busy, under "sized": the
        table's, interpolated in log size, clamped at its ends and never above the direction's rate alone."""
        table = self.duplex_table
        if not table:  # other rules: half the cap, as "first" splits it when the two take turns
            return min(self.alone_gbps(direction), self.duplex_gbps / 2)
        rate = duplex_rate(table, direction, nbytes)
        return min(rate, self.alone_gbps(direction))

    def link_floor_us(self, h2d_bytes: float, d2h_bytes: float, copy_bytes: float | None = None) -> float:
        """The least time in which `h2d_bytes` and `d2h_bytes` can cross this link, copy latencies aside
        (Note [link sharing]): never below either direction alone at its rate. Under "sized" both move at the
        table's rates for copies of `copy_bytes` while both are busy, then the rest alone at its own rate;
        without `copy_bytes`, the least of that over the table's sizes. Under "first" both directions' bytes
        through the cap; under a fixed rule the favoured direction's bytes at its rate, while the other gets
        cap - that rate, and then the rest of the other's bytes alone."""
        h_rate, d_rate, cap = self.h2d_gbps * 1e3, self.d2h_gbps * 1e3, self.duplex_gbps * 1e3  # bytes per us
        alone = max(h2d_bytes / h_rate, d2h_bytes / d_rate)
        if self.link_sharing == "sized":
            sizes = [copy_bytes] if copy_bytes is not None else [row[0] for row in self.duplex_table]
            return max(alone, min(self._sized_floor_us(h2d_bytes, d2h_bytes, n) for n in sizes))
        if self.link_sharing == "first":
            return max(alone, (h2d_bytes + d2h_bytes) / cap)
        if self.link_sharing == "d2h":
            fav, fav_rate, other, other_rate = d2h_bytes, d_rate, h2d_bytes, h_rate
        else:
            fav, fav_rate, other, other_rate = h2d_bytes, h_rate, d2h_bytes, d_rate
        busy = fav / fav_rate
        beside = min(other_rate, cap - fav_rate) * busy  # what the other direction moves meanwhile
        return max(alone, busy + max(other - beside, 0.0) / other_rate)

    def _sized_floor_us(self, h2d_bytes: float, d2h_bytes: float, copy_bytes: float) -> float:
        """Both directions at the table's rates for `copy_bytes` until one is done, then the other alone."""
        both = {d: self.both_gbps(d, copy_bytes) * 1e3 for d in DIRECTIONS}
        left = {"h2d": h2d_bytes, "d2h": d2h_bytes}
        together = min(left[d] / both[d] for d in DIRECTIONS)
        rest = max((left[d] - together * both[d]) / (self.alone_gbps(d) * 1e3) for d in DIRECTIONS)
        return together + rest

    def peak_tflops(self, precision: str) -> float:
        """Peak rate for a precision key of device.costs ("bf16", "fp16", "tf32", "fp32", "fp64")."""
        return float(getattr(self, f"{precision}_tflops"))


def figure_names() -> list[str]:
    """The SimPreset fields that are device figures, each of which must have a source."""
    return [f.name for f in fields(SimPreset) if f.name not in _NOT_FIGURES]
