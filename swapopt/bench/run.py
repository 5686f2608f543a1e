"""The benchmark run: per model size, bandwidth and bound, then every strategy side by side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from loguru import logger
from pydantic import BaseModel, Field

import device
from swapopt.bench.measure import Bandwidth, bound_ms, free_device_memory, measure_bandwidth, time_steps
from swapopt.bench.model import ModelShape, make_params, shape_for
from swapopt.bench.proof import prove
from swapopt.bench.strategies import (
    DEFAULT_STRATEGIES,
    LOWBIT_STRATEGIES,
    MASTER_WEIGHT_STRATEGIES,
    STRATEGY_DOCS,
    AdamWSpec,
    Impl,
    lowbit_class,
    make_strategy,
    torchao_offload_class,
)

# The bandwidth probe copies at most this much per direction, so it fits beside the largest models.
MAX_PROBE_BYTES = 1 << 30
# With master_weights the resident row is the recipe the swapped rows reproduce, not an fp32 job: bf16 params, fp32
# masters and states on the device (strategies.Resident); the bound takes its time.
RESIDENT_RECIPE = "the bf16 recipe: bf16 params, fp32 masters and AdamW states on the device"
RESIDENT_LOWBIT_RECIPE = "the bf16 recipe over torchao AdamW8bit: fp32 masters and 8-bit states on the device"


class BenchConfig(BaseModel):
    sizes: list[float] = Field(default_factory=lambda: [0.1, 0.5])  # billions of params per device
    impl: Impl = "fused"
    times: list[int] = Field(default_factory=lambda: [8, 16, 32, 64])  # swap_optimizer_times sweep
    slots: list[int] = Field(default_factory=lambda: [2, 3])
    reference_times: list[int] = Field(default_factory=lambda: [16, 64])  # one-in-flight chunkings
    strategies: list[str] = Field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    warmup: int = 1
    repeats: int = 3
    bandwidth_repeats: int = 8
    # bf16 params stepped through fp32 masters swapped with the states (Note [master weights]), for the
    # strategies that have that form (strategies.MASTER_WEIGHT_STRATEGIES); the bound counts 12 bytes a param
    # each way instead of 8.
    master_weights: bool = False


class Row(BaseModel):
    size_b: float
    numel: int
    kind: str
    label: str
    reproduces: str
    times: int | None = None
    slots: int | None = None
    step_ms: float | None = None
    ratio: float | None = None  # step_ms / bound_ms
    peak_extra_bytes: int | None = None
    chunk_bytes: int | None = None
    cap_bytes: int | None = None  # (slots + 1) x chunk bytes, swapopt rows only
    host_bytes: int | None = None
    # What one more step after the timed ones really did (swapopt.bench.proof): bytes copied each way, the bytes it
    # must copy (its state bytes for a swap), and the params it changed. A row short of any of them has `error`
    # set and no step time: a step that did not do the work is no figure.
    h2d_bytes: int | None = None
    d2h_bytes: int | None = None
    need_h2d_bytes: int | None = None
    need_d2h_bytes: int | None = None
    params_changed: int | None = None
    params_total: int | None = None
    error: str | None = None
    note: str = ""
    # A row whose step moves other bytes than the size's states (the 8-bit rows, Note [low-bit rows]): its own
    # bound, max(its bytes each way / link rate, its resident optimizer's step), and step_ms over it.
    own_bound_ms: float | None = None
    own_ratio: float | None = None


class SizeResult(BaseModel):
    size_b: float
    shape: ModelShape
    numel: int
    state_bytes: int  # bytes moved each way per swap step
    bandwidth: Bandwidth
    resident_ms: float | None
    bound_ms: float
    bound_note: str = ""
    master_weights: bool = False  # bf16 params with fp32 masters swapped with the states
    rows: list[Row]


def _plan(cfg: BenchConfig) -> list[tuple[str, int, int]]:
    """(kind, times, slots) of every measurement, resident first: it gives the bound."""
    plan: list[tuple[str, int, int]] = []
    wanted = set(cfg.strategies)
    if cfg.master_weights:
        wanted &= set(MASTER_WEIGHT_STRATEGIES)
    if "resident" in wanted:
        plan += [("resident", 0, 0)]
    if "swapopt" in wanted:
        plan += [("swapopt", t, s) for t in cfg.times for s in cfg.slots]
    for kind in ("swapopt-auto-25", "swapopt-auto-75", "serial", "whole", "host-step"):
        if kind in wanted:
            plan.append((kind, 0, 0))
    if "one-in-flight" in wanted:
        plan += [("one-in-flight", t, 0) for t in cfg.reference_times]
    if "torchao-offload" in wanted and torchao_offload_class() is not None:
        plan.append(("torchao-offload", 0, 0))
    if wanted & set(LOWBIT_STRATEGIES) and lowbit_class() is not None:
        # resident first: its step is the floor of the swapped row's own bound; one swapped row, at the sweep's
        # point nearest the default 16 chunks / 3 slots
        if "resident-8bit" in wanted:
            plan.append(("resident-8bit", 0, 0))
        if "swapopt-8bit" in wanted:
            times = min(cfg.times, key=lambda t: abs(t - 16), default=16)
            plan.append(("swapopt-8bit", times, min(cfg.slots, key=lambda s: abs(s - 3), default=3)))
    return plan


def plan_length(cfg: BenchConfig) -> int:
    return len(_plan(cfg))


def swap_budget(opt: Any, slots: int) -> tuple[int | None, int | None]:
    """(chunk bytes, cap bytes) of a swapopt step: the largest chunk the engine planned (states, and with
    master_weights the masters and the grads upcast beside them), and (slots + 1) such chunks; None before a plan."""
    if opt._layout.prepared is None:  # no step planned (a row that did not step is an error anyway)
        return None, None
    chunk_bytes = opt._layout.prepared.plan.max_chunk_bytes
    return chunk_bytes, (slots + 1) * chunk_bytes


def check_row(row: Any, strategy: Any, params: list[torch.nn.Parameter]) -> None:
    """Run one more step of `strategy` under swapopt.bench.proof and record on `row` what it moved and changed;
    a step that moved fewer bytes than it must or left a param unchanged makes the row an error without a time."""
    proof = prove(lambda: (strategy.step(), strategy.drain()), params, strategy.moves())
    row.h2d_bytes, row.d2h_bytes = proof.h2d_bytes, proof.d2h_bytes
    row.need_h2d_bytes, row.need_d2h_bytes = proof.need_h2d_bytes, proof.need_d2h_bytes
    row.params_changed, row.params_total = proof.params_changed, proof.params_total
    if proof.error:
        timed = f" (its timed step took {row.step_ms:.3f} ms)" if row.step_ms is not None else ""
        row.error = proof.error + timed
        row.step_ms = None
        logger.error("{}: {}", row.label, row.error)


def measure_strategy(
    kind: str, params: list[torch.nn.Parameter], spec: AdamWSpec, times: int, slots: int, row: Any,
    measure: Callable[[Any], None], where: str = "",
) -> None:
    """Build `kind`'s strategy, label `row` after it and run `measure(strategy)`. Out of device memory,
    the row is noted "OOM"; the strategy is closed and device memory freed either way."""
    strategy = None
    try:
        strategy = make_strategy(kind, params, spec, times=times, slots=slots)
        row.label = strategy.label
        measure(strategy)
    except torch.OutOfMemoryError:
        row.note = "OOM"
        logger.warning("{}{}: out of device memory", row.label, where)
    finally:
        if strategy is not None:
            strategy.close()
        del strategy
        free_device_memory()


def run_size(
    size_b: float,
    cfg: BenchConfig,
    on_done: Callable[[str], None] = lambda label: None,
    timeline_hook: Callable[[object], None] | None = None,
) -> SizeResult:
    """Measure every planned strategy at one model size. `timeline_hook(strategy)` is called once
    with the swapopt strategy closest to 16 chunks / 3 slots, to capture one step's timeline."""
    spec = AdamWSpec(impl=cfg.impl, master_weights=cfg.master_weights)
    shape = shape_for(size_b)
    # exp_avg + exp_avg_sq, fp32, and the fp32 master with master_weights
    state_bytes = (3 if cfg.master_weights else 2) * 4 * shape.numel
    bandwidth = measure_bandwidth(min(state_bytes // 16, MAX_PROBE_BYTES), repeats=cfg.bandwidth_repeats)
    logger.info(
        "size {}B ({} params): H2D {:.1f}/{:.1f} GB/s, D2H {:.1f}/{:.1f} GB/s (alone/both)",
        size_b, shape.numel, bandwidth.h2d_alone, bandwidth.h2d_both, bandwidth.d2h_alone, bandwidth.d2h_both,
    )
    params = make_params(shape, dtype=torch.bfloat16 if cfg.master_weights else torch.float32)
    plan = _plan(cfg)
    timeline_target = min(
        (p for p in plan if p[0] == "swapopt"), key=lambda p: (abs(p[1] - 16), abs(p[2] - 3)), default=None
    )
    rows: list[Row] = []
    for kind, times, slots in plan:
        reproduces = STRATEGY_DOCS[kind]
        if cfg.master_weights and kind == "resident":
            reproduces = RESIDENT_RECIPE
        elif cfg.master_weights and kind == "resident-8bit":
            reproduces = RESIDENT_LOWBIT_RECIPE
        row = Row(size_b=size_b, numel=shape.numel, kind=kind, label=kind, reproduces=reproduces)

        def measure(strategy: Any) -> None:
            timing = time_steps(strategy, warmup=cfg.warmup, repeats=cfg.repeats)
            row.step_ms, row.peak_extra_bytes = timing.step_ms, timing.peak_extra_bytes
            row.host_bytes = strategy.host_bytes()
            check_row(row, strategy, params)
            if kind in ("swapopt", "swapopt-8bit"):
                row.times, row.slots = times, slots
                row.chunk_bytes, row.cap_bytes = swap_budget(strategy.opt, slots)
                if timeline_hook is not None and (kind, times, slots) == timeline_target:
                    timeline_hook(strategy)
            elif kind == "one-in-flight":
                row.times = times
                row.chunk_bytes = strategy.chunk_bytes()

        measure_strategy(kind, params, spec, times or 16, slots or 3, row, measure, where=f" at {size_b}B")
        rows.append(row)
        on_done(row.label)

    resident = next((r for r in rows if r.kind == "resident" and r.step_ms is not None), None)
    resident_ms, note = (resident.step_ms, "") if resident else (None, "resident step not measured (OOM or skipped)")
    bound = bound_ms(state_bytes, state_bytes, bandwidth, resident_ms or 0.0)
    for r in rows:
        if r.step_ms is not None:
            r.ratio = r.step_ms / bound
    lowbit_resident = next((r for r in rows if r.kind == "resident-8bit" and r.step_ms is not None), None)
    for r in rows:
        if r.kind == "swapopt-8bit" and r.step_ms is not None and r.need_h2d_bytes is not None:
            r.own_bound_ms = bound_ms(r.need_h2d_bytes, r.need_d2h_bytes, bandwidth,
                                      lowbit_resident.step_ms if lowbit_resident else 0.0)
            r.own_ratio = r.step_ms / r.own_bound_ms
            floor = f"resident-8bit {lowbit_resident.step_ms:.2f} ms" if lowbit_resident else "resident-8bit not run"
            r.note = "; ".join(x for x in (r.note, (
                f"{r.own_ratio:.2f}x its own bound {r.own_bound_ms:.2f} ms (its bytes over the link; {floor})")) if x)
    del params
    free_device_memory()
    return SizeResult(
        size_b=size_b, shape=shape, numel=shape.numel, state_bytes=state_bytes, bandwidth=bandwidth,
        resident_ms=resident_ms, bound_ms=bound, bound_note=note, master_weights=cfg.master_weights, rows=rows,
    )


def device_label() -> str:
    """'sim-h100', 'cuda-NVIDIA-H100-80GB-HBM3', ... for file names and the report header."""
    kind = device.get_device()
    mod = device.get_torch_device_module()
    if device.is_simulated():  # get_device() names the flavour it presents (cuda/npu)
        return f"sim-{mod.preset.name}"
    name = kind
    if kind in ("cuda", "npu"):
        try:
            name = f"{kind}-{mod.get_device_name(mod.current_device())}"
        except Exception:  # noqa: BLE001 - a name is cosmetic
            pass
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
