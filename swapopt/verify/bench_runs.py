"""The benchmark's parts in a verify run: the quick table, the real layouts, the end-to-end configs, the peers.

Each part is the benchmark's own function (swapopt.bench), run once on the device (measured) and once on the
simulator with the calibrated preset (modeled). The simulator runs every op as real CPU work, so its runs are
capped in size; `report.py` compares a larger measured row with its capped modeled row scaled by state bytes
and says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger
from pydantic import BaseModel

import device
from swapopt.bench.e2e import VARIANTS, parse_spec, run_e2e
from swapopt.bench.layout_run import LayoutResult, default_max_numel, run_layout
from swapopt.bench.layouts import Layout, get_layout
from swapopt.bench.run import BenchConfig, SizeResult, plan_length, run_size
from swapopt.bench.sizes import auto_sizes
from swapopt.bench.strategies import LOWBIT_STRATEGIES, SIM_LOWBIT_SIZE
from swapopt.verify.plan import VerifyPlan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class HostTime(BaseModel):
    """Host CPU time the calling thread spends issuing one train step, against the step's period."""

    config: str
    host_ms: float | None
    train_step_ms: float | None  # the overlap variant's period, from the end-to-end row
    fraction: float | None
    note: str = ""


class BenchParts(BaseModel):
    sizes: list[SizeResult] = []
    layouts: list[LayoutResult] = []
    e2e: list[dict] = []
    host: list[HostTime] = []


def measured_sizes(plan: VerifyPlan) -> list[float]:
    """The plan's sizes, or as the quick benchmark picks them on a device: the largest up to 1B that fits."""
    if plan.bench_sizes is not None:
        return plan.bench_sizes
    fitting = auto_sizes()
    return [max([b for b in fitting if b <= 1.0] or fitting[:1])]


def bench_config(plan: VerifyPlan, sizes: list[float]) -> BenchConfig:
    simulated = device.is_simulated()
    cfg = BenchConfig(sizes=sizes, times=plan.bench_times, slots=plan.bench_slots,
                      reference_times=plan.reference_times, warmup=1 if simulated else 2,
                      repeats=1 if simulated else 5)
    if plan.strategies is not None:
        cfg.strategies = list(plan.strategies)
    if simulated and any(s > SIM_LOWBIT_SIZE for s in sizes):
        # torchao's eager 8-bit rows cost minutes there at these sizes (Note [low-bit rows] in swapopt.bench.strategies)
        cfg.strategies = [s for s in cfg.strategies if s not in LOWBIT_STRATEGIES]
    return cfg


def plan_layout(plan: VerifyPlan, name: str) -> Layout:
    """The named layout, cut to the plan's first tensors where it sets a limit (said in its name and source)."""
    layout = get_layout(name)
    limit = plan.layout_tensor_limit
    if limit is None or layout.count <= limit:
        return layout
    return layout.model_copy(update={
        "name": f"{layout.name}[:{limit}]", "tensors": layout.tensors[:limit],
        "source": f"the first {limit} of {layout.count} tensors of: {layout.source}"})


def _resolve_spec(spec: str) -> tuple[str, str]:
    """(spec with the config as a path, its short name): configs/ of this checkout, wherever the run starts."""
    name, options = parse_spec(spec)
    path = CONFIGS / f"{name}.py"
    if path.exists():
        return ":".join([str(path), *options]), name
    return spec, name


def work_count(plan: VerifyPlan, sizes: list[float], e2e: bool) -> int:
    """Progress steps of `run_parts`."""
    per_size = plan_length(bench_config(plan, sizes))
    return per_size * len(sizes) + len(plan.layouts) + (len(plan.e2e) * (len(VARIANTS) + 1) if e2e else 0)


def run_parts(plan: VerifyPlan, sizes: list[float], *, layout_caps: dict[str, int] | None, e2e: bool,
              host_time: bool = True, progress: Callable[[], None] = lambda: None) -> BenchParts:
    """The quick table at `sizes`; the plan's layouts, each at no more than its cap in `layout_caps` params (keyed
    by the layout's name as run; None: the plan's cap, else what fits the device); with `e2e`, the end-to-end
    configs and, with `host_time`, the host time of their train steps."""
    parts = BenchParts()
    run_sizes(plan, sizes, parts, progress)
    run_layouts(plan, parts, layout_caps, progress)
    if e2e:
        run_e2e_configs(plan, parts, host_time, progress)
    return parts


def run_sizes(plan: VerifyPlan, sizes: list[float], parts: BenchParts,
              progress: Callable[[], None] = lambda: None) -> None:
    """The quick table at `sizes`, each size appended to `parts` as it is done (a stopped phase keeps them)."""
    cfg = bench_config(plan, sizes)
    for size in sizes:
        parts.sizes.append(run_size(size, cfg, on_done=lambda _: progress()))


def run_layouts(plan: VerifyPlan, parts: BenchParts, layout_caps: dict[str, int] | None,
                progress: Callable[[], None] = lambda: None) -> None:
    """The plan's layouts (see run_parts), each appended to `parts` as it is done."""
    cfg = bench_config(plan, [])
    default_cap = plan.layout_max_numel if plan.layout_max_numel is not None else None
    for name in plan.layouts:
        layout = plan_layout(plan, name)
        if layout_caps is not None and layout.name not in layout_caps:
            continue  # not measured, so nothing to model
        cap = layout_caps[layout.name] if layout_caps is not None else (default_cap or default_max_numel())
        parts.layouts.append(run_layout(layout, times=plan.layout_times, max_numel=cap, impl=cfg.impl,
                                        warmup=cfg.warmup, repeats=cfg.repeats, flat=plan.layout_flat,
                                        host_repeats=plan.layout_host_repeats))
        progress()


def run_e2e_configs(plan: VerifyPlan, parts: BenchParts, host_time: bool = True,
                    progress: Callable[[], None] = lambda: None) -> None:
    """The plan's end-to-end configs (and with `host_time` their host time), each appended to `parts` when done."""
    for spec in plan.e2e:
        path_spec, short = _resolve_spec(spec)
        row, _ = run_e2e(path_spec, steps=plan.e2e_steps, warmup=plan.e2e_warmup, on_done=progress, capture=False)
        row["config"] = short
        parts.e2e.append(row)
        if host_time:
            parts.host.append(train_host_time(path_spec, short, row, warmup=plan.e2e_warmup, steps=plan.e2e_steps))
        progress()


def train_host_time(spec: str, short: str, row: dict, *, warmup: int, steps: int) -> HostTime:
    """Host CPU time per train step of the overlap variant (overlap_forward, and the config's prefetch), the
    steps issued without a host sync as in training; against the period the end-to-end row measured."""
    from swapopt.bench.e2e import _cfg
    from swapopt.engine.trainer import TrainEngine

    name, options = parse_spec(spec)
    mod = device.get_torch_device_module()
    note = ("simulator: the host runs the simulated device's work too, so this is not a device's host time"
            if device.is_simulated() else "")
    try:
        engine = TrainEngine(_cfg(name, options, "overlap", warmup + steps))
    except Exception as err:  # noqa: BLE001 - e.g. out of memory: reported, the run goes on
        return HostTime(config=short, host_ms=None, train_step_ms=None, fraction=None,
                        note=f"{type(err).__name__}: {err}")
    try:
        for _ in range(warmup):
            engine.train_step()
        mod.synchronize()
        started = time.thread_time()
        for _ in range(steps):
            engine.train_step()
        host_ms = (time.thread_time() - started) * 1e3 / steps
        engine.wait_for_update()
        mod.synchronize()
    finally:
        engine.close()
        del engine
        mod.empty_cache()
    period = row.get("train_on_ms")
    return HostTime(config=short, host_ms=host_ms, train_step_ms=period,
                    fraction=host_ms / period if period else None, note=note)


def peer_rows(steps: int, dry_run: bool) -> tuple[list[dict[str, Any]], str | None]:
    """Rows of the peer comparison (swapopt.bench.peers) where that module is installed, and why not otherwise."""
    try:
        from swapopt.bench import peers
    except ImportError:
        return [], "peer comparison not available (swapopt.bench.peers is not installed)"
    try:
        return [r.model_dump(mode="json") for r in peers.compare(steps=steps, dry_run=dry_run)], None
    except Exception as err:  # noqa: BLE001 - a peer that breaks must not lose the rest of the run
        logger.warning("peer comparison failed: {}", err)
        return [], f"peer comparison failed: {type(err).__name__}: {err}"
