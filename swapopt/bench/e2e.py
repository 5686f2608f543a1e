"""End to end: the engine's train step with optimizer states resident, swapped, and swapped with
``overlap_forward``, per engine config. The overlap variant also keeps the config's ``prefetch`` setting
(the resident and swap variants run without it), so it measures the config as it would train.

Each variant trains ``warmup`` steps, then ``steps`` more (at least 5) in one loop that never makes the host
wait, between two synchronized marks (TrainEngine.synchronized_mark: the host waits for every queued step, its
update and swap-outs included, before each mark): the train-step period is the device time between the marks
over ``steps``. With overlap the host runs ahead of the device and each step's own events end before its update
does, so per-step times under-report; the synchronized window counts every update and swap-out once.
Forward time, the optimizer step alone and peak memory come from the same steps' metrics, read afterwards.

overlap efficiency = hidden swap time / min(swap step, forward time), where hidden swap time = swap step -
(train step with overlap on - resident train step): the part of the optimizer's swap step that the train step
does not pay for, over the most of it that a forward could hide. Train step off - on would miss what is hidden
without overlap too (the last swap-out always runs under the next forward).
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

import device
from swapopt.bench.timeline import Span, engine_spans
from swapopt.engine.trainer import PERIOD_MIN_STEPS, elapsed_ms

WARMUP = 2
VARIANTS = ("resident", "swap", "overlap")  # swap_optimizer off; on; on with overlap_forward
TARGET_EFFICIENCY = 0.90
TARGET_OVERHEAD = 0.05


def config_path(name: str) -> Path:
    """'tiny' -> configs/tiny.py; paths are taken as they are."""
    path = Path(name)
    return path if path.suffix in (".py", ".yaml", ".yml") else Path("configs") / f"{name}.py"


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """'llm_1b:model.n_layers=2:train.batch=1' -> ('llm_1b', ['model.n_layers=2', 'train.batch=1'])."""
    name, *options = spec.split(":")
    if not name:
        raise ValueError(f"end-to-end config spec {spec!r} has no config name")
    bad = [o for o in options if "=" not in o]
    if bad:
        raise ValueError(f"end-to-end config spec {spec!r}: options must be key=value, got {bad}")
    return name, options


def _cfg(name: str, options: list[str], variant: str, steps: int) -> Any:
    from swapopt.engine.config import load_config, parse_cfg_options

    fixed = {
        "train.steps": steps,
        "train.compare_resident": 0,
        "train.checkpoint_dir": None,
        "train.checkpoint_interval": 0,
        "train.metrics_path": None,
        "train.resume": None,
        "rl": None,
    }
    overrides = {**parse_cfg_options(options), **fixed,
                 "optim.swap_optimizer": variant != "resident", "optim.overlap_forward": variant == "overlap"}
    if variant != "overlap":  # the overlap variant keeps the config's prefetch setting; the baselines run without
        overrides["optim.prefetch"] = False
    return load_config(config_path(name), overrides)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _variant(name: str, options: list[str], variant: str, steps: int, warmup: int,
             capture: bool) -> tuple[dict, tuple[list[Span], list[float]]]:
    from swapopt.engine.trainer import TrainEngine

    mod = device.get_torch_device_module()
    engine = TrainEngine(_cfg(name, options, variant, warmup + steps))
    cfg = engine.cfg
    picture: tuple[list[Span], list[float]] = ([], [])
    try:
        for _ in range(warmup):
            engine.train_step()
        start = engine.synchronized_mark()
        timed = []
        for i in range(steps):  # no host sync in this loop
            if capture and i == steps - 2 and hasattr(mod, "reset_timeline"):
                mod.reset_timeline()  # the picture: the last two steps
            timed.append(engine.train_step())
        period_ms = elapsed_ms(start, engine.synchronized_mark()) / steps
        if capture:  # step starts: the simulator's event times
            picture = engine_spans([m.start.time_us for m in timed[-2:] if getattr(m.start, "time_us", None) is not None])
        lines = [m.resolve() for m in timed]
        row = {
            "variant": variant,
            "params": engine.n_params,
            "layers": cfg.model.n_layers,
            "tokens": cfg.train.batch * cfg.train.seq_len,
            "train_step_ms": period_ms,
            "forward_ms": _median([m["forward_ms"] for m in lines]),
            "optim_ms": _median([m["optim_ms"] for m in lines]),
            "swap_ms": _median([m.get("swap_ms") for m in lines]),
            "peak_bytes": max(m["mem_peak_bytes"] or 0 for m in lines),
            "losses": [m["loss"] for m in lines],
        }
    finally:
        engine.close()
        del engine
        gc.collect()
        mod.empty_cache()
    return row, picture


def summarize(config: str, options: list[str], runs: dict[str, dict]) -> dict:
    """One report row from the three variants' runs (pure arithmetic, tested on its own)."""
    res, swap, ovl = (runs.get(v, {}) for v in VARIANTS)
    row: dict[str, Any] = {"config": config, "options": options}
    for key in ("params", "layers", "tokens"):
        row[key] = next((r[key] for r in (res, swap, ovl) if key in r), None)
    row.update(
        resident_step_ms=res.get("optim_ms"),  # the optimizer step alone, states resident
        swap_step_ms=swap.get("swap_ms"),  # the optimizer step alone, swapped: entry to last swap-out
        resident_train_ms=res.get("train_step_ms"),
        train_off_ms=swap.get("train_step_ms"),
        train_on_ms=ovl.get("train_step_ms"),
        forward_ms=res.get("forward_ms"),  # resident: no update to wait for inside it
        peak_resident_bytes=res.get("peak_bytes"),
        peak_swap_bytes=swap.get("peak_bytes"),
        peak_overlap_bytes=ovl.get("peak_bytes"),
    )
    notes = [f"{v}: {runs[v]['note']}" for v in VARIANTS if "note" in runs.get(v, {})]
    off, on, base = row["train_off_ms"], row["train_on_ms"], row["resident_train_ms"]
    if on is not None and base is not None and row["swap_step_ms"] is not None:
        row["hidden_ms"] = min(max(row["swap_step_ms"] - (on - base), 0.0), row["swap_step_ms"])
        window = min(x for x in (row["swap_step_ms"], row["forward_ms"]) if x is not None) \
            if (row["swap_step_ms"] is not None or row["forward_ms"] is not None) else None
        row["efficiency"] = row["hidden_ms"] / window if window else None
    if base:
        row["overhead_off"] = off / base - 1 if off is not None else None
        row["overhead_on"] = on / base - 1 if on is not None else None
    losses = [runs[v]["losses"] for v in VARIANTS if "losses" in runs.get(v, {})]
    row["losses_equal"] = len(losses) == len(VARIANTS) and all(x == losses[0] for x in losses)
    if row["forward_ms"] is not None and row["swap_step_ms"] is not None:
        row["forward_covers_swap"] = row["forward_ms"] >= row["swap_step_ms"]
    eff, over = row.get("efficiency"), row.get("overhead_on")
    row["efficiency_met"] = None if eff is None else eff >= TARGET_EFFICIENCY
    row["overhead_met"] = None if over is None else over <= TARGET_OVERHEAD
    if notes:
        row["note"] = "; ".join(notes)
    return row


def run_e2e(spec: str, steps: int = 2, warmup: int = WARMUP, on_done: Callable[[], None] = lambda: None,
            capture: bool = True) -> tuple[dict, tuple[list[Span], list[float]]]:
    """The row of engine config ``spec`` ('name' or 'name:key=value:...') and, with ``capture``, the spans of
    two consecutive overlapped train steps and their start times (simulator only)."""
    if steps < PERIOD_MIN_STEPS:
        raise ValueError(f"--e2e-steps must be at least {PERIOD_MIN_STEPS} (a train-step period is taken over a "
                         f"synchronized window of at least that many steps), got {steps}")
    name, options = parse_spec(spec)
    runs: dict[str, dict] = {}
    picture: tuple[list[Span], list[float]] = ([], [])
    for variant in VARIANTS:
        try:
            runs[variant], got = _variant(name, options, variant, steps, warmup, capture and variant == "overlap")
            picture = got if got[0] else picture
        except Exception as err:  # noqa: BLE001 - report why a variant could not run (OOM, missing file)
            logger.warning("end-to-end {} {}: {}", spec, variant, err)
            runs[variant] = {"note": f"{type(err).__name__}: {err}"}
        on_done()
    row = summarize(name, options, runs)
    logger.info("end to end {}: train step resident {}, overlap off {}, on {} ms; efficiency {}", spec,
                row.get("resident_train_ms"), row.get("train_off_ms"), row.get("train_on_ms"), row.get("efficiency"))
    return row, picture
