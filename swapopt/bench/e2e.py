"""End to end: train-step time and peak device memory of an engine config, swap on and off.

Step time comes from device events around ``TrainEngine.train_step`` (which synchronizes at its end),
so the simulator reports modeled time and a real device its own; the engine's wall-clock figures
would measure the simulator's CPU work instead. The first steps warm up and are not counted.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from pathlib import Path

from loguru import logger

import device

WARMUP = 2


def config_path(name: str) -> Path:
    """'tiny' -> configs/tiny.py; paths are taken as they are."""
    path = Path(name)
    return path if path.suffix in (".py", ".yaml", ".yml") else Path("configs") / f"{name}.py"


def _steps(name: str, swap: bool, steps: int) -> dict:
    from swapopt.engine.config import load_config
    from swapopt.engine.trainer import TrainEngine

    cfg = load_config(
        config_path(name),
        {
            "optim.swap_optimizer": swap,
            "train.steps": steps,
            "train.compare_resident": 0,
            "train.checkpoint_dir": None,
            "train.checkpoint_interval": 0,
            "train.metrics_path": None,
        },
    )
    mod = device.get_torch_device_module()
    engine = TrainEngine(cfg)
    n_params = engine.n_params
    times, peaks = [], []
    try:
        for i in range(steps):
            start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
            start.record()
            metrics = engine.train_step()
            end.record()
            end.synchronize()
            if i >= WARMUP:
                times.append(start.elapsed_time(end))
                peaks.append(metrics.get("mem_peak_bytes") or 0)
    finally:
        del engine
        gc.collect()
        mod.empty_cache()
    return {
        "config": name,
        "swap": swap,
        "params": n_params,
        "steps": len(times),
        "step_ms": statistics.median(times),
        "peak_bytes": max(peaks),
    }


def run_e2e(name: str, steps: int = 6, on_done: Callable[[], None] = lambda: None) -> list[dict]:
    """[resident row, swap row] for engine config `name`; the swap row carries its overhead."""
    if steps <= WARMUP:
        raise ValueError(f"--e2e-steps must exceed the {WARMUP} warm-up steps, got {steps}")
    rows = []
    for swap in (False, True):
        try:
            rows.append(_steps(name, swap, steps))
        except Exception as err:  # noqa: BLE001 - report why a config could not run (OOM, missing file)
            logger.warning("end-to-end {} swap={}: {}", name, swap, err)
            rows.append({"config": name, "swap": swap, "note": f"{type(err).__name__}: {err}"})
        on_done()
    resident, swapped = rows
    if resident.get("step_ms") and swapped.get("step_ms"):
        swapped["overhead"] = swapped["step_ms"] / resident["step_ms"] - 1
        swapped["memory_saved_bytes"] = resident["peak_bytes"] - swapped["peak_bytes"]
    return rows
