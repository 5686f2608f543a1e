"""The main job: ``python -m swapopt.train CONFIG [--cfg-options key=value ...] [--resume DIR]``.

Trains the reference engine on the shipped corpus, printing loss, tokens/s, step and optimizer time, device
memory peak and swap traffic; writes per-step metrics as JSONL when ``train.metrics_path`` is set. Without
an accelerator it runs on the simulated device (``device.sim``) and says so: memory figures are then the
simulator's exact byte counts and GB/s its modeled rates. With ``train.compare_resident=N`` it then runs N
steps of the same config with swapping off and prints both device-memory peaks.
Works under ``torchrun --nproc-per-node 2`` (gloo on CPU, FSDP2).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from loguru import logger
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

import device
from swapopt.engine.config import ConfigError, EngineConfig, load_config
from swapopt.engine.trainer import TrainEngine, resolve_checkpoint

MiB = 2**20
DEVICE_ENV = "SWAPOPT_DEVICE"  # read by device.get_device()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="swapopt-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="engine config: a .py or .yaml file (see configs/)")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. optim.swap_optimizer=false train.steps=20")
    parser.add_argument("--resume", metavar="DIR", help="checkpoint step directory, or a checkpoint_dir (latest)")
    return parser.parse_args(argv)


@contextmanager
def device_context(cfg: EngineConfig) -> Iterator[str]:
    """Yield a line saying where training runs; activates the simulator when asked or when no accelerator
    is found."""
    tcfg = cfg.train
    if tcfg.device == "sim" or (tcfg.device == "auto" and device.get_device() == "cpu"):
        from device import sim

        capacity = int(tcfg.sim_capacity_mb * MiB) if tcfg.sim_capacity_mb else None
        with sim.activate(tcfg.sim_preset, capacity_bytes=capacity) as simdev:
            reason = "simulator requested" if tcfg.device == "sim" else "no accelerator found"
            yield (f"{reason}: running on the simulated {simdev.preset.name} device "
                   f"({_fmt_bytes(simdev.mem_get_info()[1])}); device memory is the simulator's exact count, "
                   "GB/s its modeled rate")
        return
    previous = os.environ.get(DEVICE_ENV)
    if tcfg.device != "auto":  # swapopt's core asks device.get_device(), which reads this variable
        os.environ[DEVICE_ENV] = tcfg.device
    try:
        yield f"device: {device.get_device()} ({device.torch_device()})"
    finally:
        if previous is None:
            os.environ.pop(DEVICE_ENV, None)
        else:
            os.environ[DEVICE_ENV] = previous


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / MiB:.2f} MiB"


def step_line(m: dict[str, Any]) -> str:
    line = (f"step {m['step']:>5}  loss {m['loss']:.4f}  tok/s {m['tokens_per_s']:,.0f}  "
            f"step {m['step_ms']:.1f} ms  optim {m['optim_ms']:.1f} ms  mem peak {_fmt_bytes(m['mem_peak_bytes'])}")
    if "swap_bytes" in m:
        gbps = "n/a" if m["swap_gbps"] is None else f"{m['swap_gbps']:.1f} GB/s"
        line += f"  swapped {_fmt_bytes(m['swap_bytes'])} @ {gbps}"
    return line


def run(cfg: EngineConfig, console: Console, label: str = "train") -> dict[str, Any]:
    """Train to ``train.steps``; returns a summary (losses, peak memory, swap totals)."""
    tcfg = cfg.train
    engine = TrainEngine(cfg)
    main_rank = engine.rank == 0
    metrics_file = None
    if main_rank and tcfg.metrics_path:
        Path(tcfg.metrics_path).parent.mkdir(parents=True, exist_ok=True)
        metrics_file = open(tcfg.metrics_path, "a" if tcfg.resume else "w")
    summary: dict[str, Any] = {"start_step": engine.step, "losses": [], "mem_peak_bytes": None,
                               "swap_bytes": 0, "n_params": engine.n_params, "swapping": engine.swapping,
                               "world_size": engine.world_size, "rank": engine.rank}
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, disable=not main_rank, transient=True) as progress:
            task = progress.add_task(label, total=tcfg.steps, completed=engine.step)
            while engine.step < tcfg.steps:
                m = engine.train_step()
                summary["losses"].append(m["loss"])
                summary["swap_bytes"] += m.get("swap_bytes", 0)
                if m["mem_peak_bytes"] is not None:
                    summary["mem_peak_bytes"] = max(summary["mem_peak_bytes"] or 0, m["mem_peak_bytes"])
                if metrics_file:
                    metrics_file.write(json.dumps(m) + "\n")
                if main_rank and (m["step"] % tcfg.log_interval == 0 or m["step"] in (1, tcfg.steps)):
                    progress.console.print(step_line(m))
                progress.update(task, completed=engine.step, description=f"{label}  loss {m['loss']:.4f}")
                if tcfg.checkpoint_dir and tcfg.checkpoint_interval and engine.step % tcfg.checkpoint_interval == 0:
                    engine.save_checkpoint()
                if cfg.rl and engine.step % cfg.rl.rollout_every == 0 and engine.step < tcfg.steps:
                    r = engine.rollout(cfg.rl.rollout_buffer_mb, cfg.rl.empty_cache)
                    if metrics_file:
                        metrics_file.write(json.dumps(r) + "\n")
                    if main_rank:
                        progress.console.print(
                            f"rollout after step {r['step']}: optimizer offloaded, {r['rollout_buffer_mb']:.0f} MiB "
                            f"buffer held, mem peak {_fmt_bytes(r['rollout_mem_peak_bytes'])}")
        if tcfg.checkpoint_dir and not (tcfg.checkpoint_interval and engine.step % tcfg.checkpoint_interval == 0):
            engine.save_checkpoint()
    finally:
        engine.close()
        if metrics_file:
            metrics_file.close()
    summary["seconds"] = time.perf_counter() - start
    return summary


def resident_baseline(cfg: EngineConfig) -> EngineConfig:
    """The same job with swapping off, short, writing nothing."""
    raw = cfg.model_dump()
    raw["optim"]["swap_optimizer"] = False
    raw["train"].update(steps=cfg.train.compare_resident, checkpoint_dir=None, resume=None, metrics_path=None,
                        compare_resident=0)
    raw["rl"] = None
    return EngineConfig.model_validate(raw)


def print_summary(console: Console, s: dict[str, Any], base: dict[str, Any] | None) -> None:
    steps = len(s["losses"])
    final = f"{s['losses'][-1]:.4f}" if steps else "n/a"
    console.print(f"done: {steps} steps ({s['start_step']} -> {s['start_step'] + steps}) in {s['seconds']:.1f} s, "
                  f"final loss {final}, {s['n_params'] / 1e6:.2f}M params, world size {s['world_size']}")
    mode = "swap_optimizer=True" if s["swapping"] else "swap_optimizer=False (resident)"
    if s["world_size"] > 1:
        mode += f", rank 0 of {s['world_size']}"
    console.print(f"peak device memory, {mode}: {_fmt_bytes(s['mem_peak_bytes'])}")
    if s["swapping"] and steps:
        console.print(f"optimizer traffic: {_fmt_bytes(s['swap_bytes'] // steps)} per step (H2D + D2H)")
    if base is None:
        return
    if "oom" in base:
        console.print(f"resident baseline (swap_optimizer=False): out of device memory: {base['oom']}")
        return
    console.print(f"peak device memory, resident baseline ({len(base['losses'])} steps, swap_optimizer=False): "
                  f"{_fmt_bytes(base['mem_peak_bytes'])}")
    if s["mem_peak_bytes"] and base["mem_peak_bytes"]:
        saved = base["mem_peak_bytes"] - s["mem_peak_bytes"]
        console.print(f"swapping saves {_fmt_bytes(saved)} of device memory "
                      f"({100 * saved / base['mem_peak_bytes']:.0f}% of the resident peak)")
    if s["start_step"] == 0:
        n = min(len(base["losses"]), steps)
        same = s["losses"][:n] == base["losses"][:n]
        console.print(f"losses of the first {n} steps bitwise equal to the resident baseline: {same}")


def _setup_logging() -> int:
    try:
        logger.remove(0)  # loguru's default DEBUG sink; ours below is INFO
    except ValueError:
        pass
    logger.enable("swapopt")
    logger.enable("device")
    # Resolve sys.stderr at write time so rich's progress display can route log lines above the bar.
    return logger.add(lambda msg: sys.stderr.write(msg), level=os.environ.get("SWAPOPT_LOG_LEVEL", "INFO"),
                      format="{time:HH:mm:ss} | {level: <7} | {name} | {message}")


def main(argv: list[str] | None = None) -> int:
    handler = _setup_logging()
    try:
        rc = _main(parse_args(argv))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank tears the group down while a peer still talks to it
        return rc
    finally:
        if dist.is_available() and dist.is_initialized():
            # A process group left to the interpreter's shutdown can abort the process
            # ("terminate called without an active exception").
            dist.destroy_process_group()
        logger.remove(handler)
        logger.disable("swapopt")
        logger.disable("device")


def _main(args: argparse.Namespace) -> int:
    console = Console(highlight=False, soft_wrap=True)
    try:
        cfg = load_config(args.config, args.cfg_options)
        if args.resume:
            cfg.train.resume = args.resume
        if cfg.train.resume:
            resolve_checkpoint(cfg.train.resume)  # fail now, not after building the model
    except (ConfigError, FileNotFoundError) as err:
        console.print(Text("error: ", style="red") + Text(str(err)))
        return 2
    main_rank = int(os.environ.get("RANK", "0")) == 0
    out = console if main_rank else Console(quiet=True)
    try:
        with device_context(cfg) as where:
            out.print(where)
            summary = run(cfg, out)
    except ConfigError as err:  # the swap engine refused the optimizer: nothing was trained or written
        console.print(Text("error: ", style="red") + Text(str(err)))
        return 2
    baseline = None
    if cfg.train.compare_resident and cfg.optim.swap_optimizer:
        gc.collect()
        try:
            with device_context(cfg):
                baseline = run(resident_baseline(cfg), out, label="resident baseline")
        except torch.OutOfMemoryError as err:  # the point of swapping: the resident job does not fit
            baseline = {"oom": str(err).splitlines()[0]}
    if main_rank:
        print_summary(console, summary, baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
