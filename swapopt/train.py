"""The main job: ``python -m swapopt.train CONFIG [--cfg-options key=value ...] [--resume DIR]``.

Trains the reference engine on the shipped corpus, printing loss, tokens/s, step and optimizer time, device
memory peak and swap traffic; writes per-step metrics as JSONL when ``train.metrics_path`` is set. Without
an accelerator it runs on the simulated device (``device.sim``) and says so: memory figures are then the
simulator's exact byte counts and GB/s its modeled rates. With ``train.compare_resident=N`` it then runs N
steps of the same config with swapping off and prints both device-memory peaks.
Works under ``torchrun --nproc-per-node 2`` (gloo on CPU, FSDP2).

Start-up mistakes (bad keys, unwritable paths, a bad checkpoint, an unknown device) end with one ``error:``
line and exit code 2 before anything is written; Ctrl-C ends with one line saying where to resume, exit 130.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from loguru import logger
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.text import Text

from swapopt.engine.config import ConfigError, EngineConfig, TrainConfig, load_config
from swapopt.engine.interrupt import InterruptGuard
from swapopt.engine.preflight import (DEVICE_ENV, DevicePlan, check_fits, check_host_memory, check_paths,
                                      count_params, describe, estimate, local_world_size, plan_device, slow_hint)
from swapopt.hostmem import HostMemoryError
from swapopt.engine.resume import check_resume

# The trainer (swapopt.engine.trainer) is imported where it is used, in run() and the summary: it loads
# torch.distributed.checkpoint and DTensor (1.4 s on a 2-core host), and a mistake in the config or the command line
# is reported before it would be needed.
if TYPE_CHECKING:
    from swapopt.engine.trainer import StepMetrics

MiB = 2**20
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C


class Interrupted(Exception):
    """Ctrl-C during training: the last finished step and the newest checkpoint, if any."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        super().__init__(step)
        self.step, self.checkpoint = step, checkpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="swapopt-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="engine config: a .py or .yaml file (see configs/)")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. optim.swap_optimizer=false train.steps=20")
    parser.add_argument("--resume", metavar="DIR", help="checkpoint step directory, or a checkpoint_dir (latest)")
    return parser.parse_args(argv)


@contextmanager
def device_context(cfg: EngineConfig, plan: DevicePlan) -> Iterator[str]:
    """Yield a line saying what really runs; activates the simulator when asked or when no accelerator is
    found (``plan_device`` has already resolved and checked the choice)."""
    tcfg = cfg.train
    if plan.kind == "sim":
        from device import sim

        capacity = int(tcfg.sim_capacity_mb * MiB) if tcfg.sim_capacity_mb else None
        with sim.activate(plan.preset, capacity_bytes=capacity) as simdev:
            yield (f"{plan.reason}: running on the simulated {simdev.preset.name} device "
                   f"({_fmt_bytes(simdev.mem_get_info()[1])}); device memory is the simulator's exact count; "
                   "step times, tok/s and GB/s are modeled")
        return
    previous = os.environ.get(DEVICE_ENV)
    forced = "cpu" if plan.kind == "plain-cpu" else (tcfg.device if tcfg.device != "auto" else None)
    if forced:  # swapopt's core asks device.get_device(), which reads this variable
        os.environ[DEVICE_ENV] = forced
    try:
        if plan.kind == "plain-cpu":
            swap = ("swap_optimizer=True steps in place and moves nothing" if cfg.optim.swap_optimizer
                    else "optimizer states stay in host memory")
            yield f"{plan.reason}: {swap}; memory figures n/a, times are wall clock"
        else:
            import device

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


def _gbps(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} GB/s"


def step_line(m: dict[str, Any], modeled: bool = False, prefix: str = "") -> str:
    tag = " (modeled)" if modeled else ""
    line = (f"{prefix}step {m['step']:>5}  loss {m['loss']:.4f}  tok/s {m['tokens_per_s']:,.0f}  "
            f"step {m['step_ms']:.1f} ms  optim {m['optim_ms']:.1f} ms{tag}  mem peak {_fmt_bytes(m['mem_peak_bytes'])}")
    if m.get("swap_bytes") or m.get("h2d_gbps") is not None:  # nothing to say when it stepped in place
        line += (f"  swap in {_fmt_bytes(m['swap_h2d_bytes'])} @ {_gbps(m['h2d_gbps'])}, "
                 f"out {_fmt_bytes(m['swap_d2h_bytes'])} @ {_gbps(m['d2h_gbps'])}{tag}")
    return line


def _trim_metrics(path: Path, last_step: int) -> None:
    """Drop lines of steps after ``last_step`` (written by a run that went on past its last checkpoint), so a
    resumed run appends each step once."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def run(cfg: EngineConfig, console: Console, label: str = "train", modeled: bool = False,
        guard: InterruptGuard | None = None, progress_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train to ``train.steps``; returns a summary (losses, peak memory, swap totals). Ctrl-C raises
    Interrupted after an optional checkpoint (``train.save_on_interrupt``). ``progress_state`` gets the last
    finished step and checkpoint as they happen (read by the interrupt watchdog)."""
    from swapopt.engine.trainer import PERIOD_MIN_STEPS, TrainEngine, elapsed_ms

    tcfg = cfg.train
    state = progress_state if progress_state is not None else {}
    bookkeeping = guard.critical if guard is not None else contextlib.nullcontext
    prefix = "" if label == "train" else f"{label}: "
    engine = None
    checkpoint: Path | None = None
    metrics_file = None
    summary: dict[str, Any] = {"start_step": 0}
    written = 0  # newest step whose metrics line is in the file
    unwritten: list[StepMetrics] = []  # finished steps whose metrics are not read yet, in order

    def flush() -> int:
        """Read the metrics of the unwritten steps (waiting for the device once), add them to the summary and
        write their lines; returns the newest step written. A step leaves the list only once its line is out."""
        last = written
        while unwritten:
            m = unwritten[0]
            if m.step > last:
                line = m.resolve()
                summary["losses"].append(line["loss"])
                summary["swap_bytes"] += line.get("swap_bytes", 0)
                summary["h2d_bytes"] += line.get("swap_h2d_bytes", 0)
                summary["d2h_bytes"] += line.get("swap_d2h_bytes", 0)
                if line["mem_peak_bytes"] is not None:
                    summary["mem_peak_bytes"] = max(summary["mem_peak_bytes"] or 0, line["mem_peak_bytes"])
                if metrics_file:
                    metrics_file.write(json.dumps(line) + "\n")
                last = m.step
            unwritten.pop(0)
        if metrics_file:
            metrics_file.flush()  # a killed run keeps every step written so far
        return last

    try:
        engine = TrainEngine(cfg)
        if guard is not None:
            engine.critical = guard.critical
        checkpoint = Path(tcfg.resume) if tcfg.resume else None
        state.update(step=engine.step, checkpoint=checkpoint)
        main_rank = engine.rank == 0
        if main_rank and tcfg.metrics_path:
            path = Path(tcfg.metrics_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if tcfg.resume:
                _trim_metrics(path, engine.step)
            metrics_file = open(path, "a" if tcfg.resume else "w")
        summary = {"start_step": engine.step, "losses": [], "mem_peak_bytes": None, "swap_bytes": 0,
                   "h2d_bytes": 0, "d2h_bytes": 0, "n_params": engine.n_params, "swapping": engine.swapping,
                   "master_weights": cfg.optim.master_weights and engine.swapping, "dtype": cfg.model.dtype,
                   "world_size": engine.world_size, "rank": engine.rank}
        written = engine.step
        start = time.perf_counter()
        # The step period is taken over a synchronized window from the end of the first step (which pins host
        # memory and plans) to the end of the last, when there are enough steps for one.
        window: tuple[int, Any] | None = None
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn())
        with Progress(*columns, console=console, disable=not main_rank, transient=True) as progress:
            task = progress.add_task(label, total=tcfg.steps, completed=engine.step)
            while engine.step < tcfg.steps:
                m = engine.train_step()
                step = m.step
                at_log = step % tcfg.log_interval == 0 or step in (1, tcfg.steps)
                logged = main_rank and at_log
                saving = bool(tcfg.checkpoint_dir and tcfg.checkpoint_interval and step % tcfg.checkpoint_interval == 0)
                rollout = bool(cfg.rl and step % cfg.rl.rollout_every == 0 and step < tcfg.steps)
                # Reading metrics waits for the device, so they are read in batches: at the log interval, before
                # a checkpoint or a rollout (the file then holds every step up to it) and at the end.
                due = at_log or saving or rollout
                with bookkeeping():  # a Ctrl-C here waits until the step is queued (and, when due, written) once
                    state["step"] = engine.step
                    unwritten.append(m)
                    if due:
                        written = flush()
                if due:
                    progress.update(task, description=f"{label}  loss {m['loss']:.4f}")
                if logged:
                    progress.console.print(step_line(m, modeled, prefix))
                progress.update(task, completed=engine.step)
                if window is None and engine.step == summary["start_step"] + 1 \
                        and tcfg.steps - engine.step >= PERIOD_MIN_STEPS:
                    window = (engine.step, engine.synchronized_mark())
                if saving:
                    checkpoint = state["checkpoint"] = engine.save_checkpoint()
                if rollout:
                    r = engine.rollout(cfg.rl.rollout_buffer_mb, cfg.rl.empty_cache)
                    if metrics_file:
                        metrics_file.write(json.dumps(r) + "\n")
                        metrics_file.flush()
                    if main_rank:
                        progress.console.print(
                            f"rollout after step {r['step']}: optimizer offloaded, {r['rollout_buffer_mb']:.0f} MiB "
                            f"buffer held, mem peak {_fmt_bytes(r['rollout_mem_peak_bytes'])}")
        if window is not None:
            first, mark = window
            summary["period_ms"] = elapsed_ms(mark, engine.synchronized_mark()) / (engine.step - first)
            summary["period_steps"] = (first + 1, engine.step)
        if tcfg.checkpoint_dir and not (tcfg.checkpoint_interval and engine.step % tcfg.checkpoint_interval == 0):
            checkpoint = engine.save_checkpoint()
    except KeyboardInterrupt:
        if guard is not None:
            guard.acknowledge()
        step = engine.step if engine is not None else 0
        last = engine.last_metrics if engine is not None else None
        if engine is not None:
            written = flush()
        if last is not None and last.step == step and written < step:
            # Ctrl-C landed between the end of a step and its queueing: the step is done, so is its line.
            unwritten.append(last)
            written = flush()
        saved_now = checkpoint is not None and checkpoint.name == f"step_{step:08d}"
        if (engine is not None and step > summary["start_step"] and tcfg.save_on_interrupt and tcfg.checkpoint_dir and not saved_now
                and not (guard is not None and guard.torn)):
            checkpoint = engine.save_checkpoint()
        raise Interrupted(step, checkpoint) from None
    finally:
        if engine is not None:
            engine.close()
        if metrics_file:
            metrics_file.close()
    summary["seconds"] = time.perf_counter() - start
    return summary


def baselines(cfg: EngineConfig) -> list[tuple[str, EngineConfig]]:
    """The jobs the summary compares with, short and writing nothing: swapping off; for a job that swaps fp32
    masters of bf16 params (master_weights), the recipe it reproduces: the same bf16 params with their fp32 masters
    and states on the device (optim.device_masters), not an fp32 job."""
    def variant(**optim: Any) -> EngineConfig:
        raw = cfg.model_dump()
        raw["optim"].update(optim)
        raw["train"].update(steps=cfg.train.compare_resident, checkpoint_dir=None, resume=None, metrics_path=None,
                            compare_resident=0)
        raw["rl"] = None
        return EngineConfig.model_validate(raw)

    if not cfg.optim.master_weights:
        return [("resident baseline (swap_optimizer=False)", variant(swap_optimizer=False))]
    return [(f"resident recipe ({cfg.model.dtype} params, fp32 masters and states on the device, "
             "swap_optimizer=False)", variant(swap_optimizer=False, master_weights=False, device_masters=True))]


def print_summary(console: Console, s: dict[str, Any], bases: list[tuple[str, dict[str, Any]]], plan: DevicePlan) -> None:
    steps = len(s["losses"])
    final = f"{s['losses'][-1]:.4f}" if steps else "n/a"
    clock = " wall clock (the simulator's CPU time; step times above are modeled)" if plan.kind == "sim" else ""
    console.print(f"done: {steps} steps ({s['start_step']} -> {s['start_step'] + steps}) in {s['seconds']:.1f} s"
                  f"{clock}, final loss {final}, {s['n_params'] / 1e6:.2f}M params, world size {s['world_size']}")
    mode = "swap_optimizer=True" if s["swapping"] else "swap_optimizer=False (resident)"
    if s.get("master_weights"):
        mode += f", master_weights=True ({s.get('dtype', 'bf16')} params)"
    if s["world_size"] > 1:
        mode += f", rank 0 of {s['world_size']}"
    console.print(f"peak device memory, {mode}: {_fmt_bytes(s['mem_peak_bytes'])}")
    console.print(f"step period: {_period(s, plan)}")
    if s["swapping"] and steps:
        if plan.kind == "plain-cpu":
            console.print("optimizer traffic: none (plain CPU: no device to swap to, the optimizer stepped in place)")
        else:
            console.print(f"optimizer traffic per step: {_fmt_bytes(s['h2d_bytes'] // steps)} in (H2D), "
                          f"{_fmt_bytes(s['d2h_bytes'] // steps)} out (D2H)")
    for label, base in bases:
        if "oom" in base:
            console.print(f"{label}: out of device memory: {base['oom']}")
            continue
        console.print(f"{label}, {len(base['losses'])} steps, peak device memory: {_fmt_bytes(base['mem_peak_bytes'])}")
        if s["mem_peak_bytes"] and base["mem_peak_bytes"]:
            saved = base["mem_peak_bytes"] - s["mem_peak_bytes"]
            console.print(f"  this job saves {_fmt_bytes(saved)} of device memory against it "
                          f"({100 * saved / base['mem_peak_bytes']:.0f}% of its peak)")
        console.print(f"  step period: {_period(base, plan)}")
        if s.get("period_ms") and base.get("period_ms"):
            console.print(f"  this job's step period is {s['period_ms'] / base['period_ms']:.2f}x the "
                          f"{label.split(' (')[0]}'s")
        if s["start_step"] == 0:  # the same numbers (master_weights: the recipe it reproduces): bitwise equal losses
            n = min(len(base["losses"]), steps)
            same = s["losses"][:n] == base["losses"][:n]
            console.print(f"  losses of the first {n} steps bitwise equal to the {label.split(' (')[0]}: {same}")


def _period(s: dict[str, Any], plan: DevicePlan) -> str:
    """The train-step period of a run's summary, or why it has none."""
    from swapopt.engine.trainer import PERIOD_MIN_STEPS

    if not s.get("period_ms"):
        return (f"not measured ({len(s['losses'])} steps; a period is taken over at least {PERIOD_MIN_STEPS} steps "
                "after the first)")
    first, last = s["period_steps"]
    how = {"sim": "modeled", "plain-cpu": "wall clock"}.get(plan.kind, "device time")
    return (f"{s['period_ms']:.1f} ms ({how}, steps {first}-{last}: one synchronized window, the host waiting for "
            "every update and swap-out at both ends)")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _setup_logging() -> int:
    try:
        logger.remove(0)  # loguru's default DEBUG sink; ours below is INFO
    except ValueError:
        pass
    logger.enable("swapopt")
    logger.enable("device")
    rank = f"[rank {_rank()}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    # Resolve sys.stderr at write time so rich's progress display can route log lines above the bar.
    return logger.add(lambda msg: sys.stderr.write(msg), level=os.environ.get("SWAPOPT_LOG_LEVEL", "INFO"),
                      format=rank + "{time:HH:mm:ss} | {level: <7} | {name} | {message}")


def main(argv: list[str] | None = None) -> int:
    handler = _setup_logging()
    args = parse_args(argv)
    raw_args = list(sys.argv[1:] if argv is None else argv)
    rc: int | None = None
    try:
        rc = _main(args, raw_args)
        if rc == 0 and dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank tears the group down while a peer still talks to it
        return rc
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        logger.remove(handler)
        logger.disable("swapopt")
        logger.disable("device")


def resume_command(raw_args: list[str], checkpoint: Path) -> str:
    """The command line that continues this run from ``checkpoint`` (any --resume replaced)."""
    out, skip = [], False
    for arg in raw_args:
        if skip:
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        if arg.startswith("--resume="):
            continue
        out.append(arg)
    return shlex.join([Path(sys.executable).name, "-m", "swapopt.train", *out, "--resume", str(checkpoint)])


def interrupted_line(step: int, checkpoint: Path | None, raw_args: list[str], train: TrainConfig) -> str:
    """The last line of an interrupted run; without a checkpoint, what was missing for Ctrl-C to leave one."""
    if checkpoint is None:
        missing = [key for key, unset in (("train.checkpoint_dir", not train.checkpoint_dir),
                                          ("train.save_on_interrupt=true", not train.save_on_interrupt)) if unset]
        why = f"set {' and '.join(missing)} to save one on Ctrl-C" if missing else "none had been saved when it stopped"
        return f"interrupted at step {step}: no checkpoint to resume from ({why})"
    return f"interrupted at step {step}: last checkpoint {checkpoint}; resume with: {resume_command(raw_args, checkpoint)}"


def _error(console: Console, err: BaseException) -> int:
    if _rank() == 0:  # every rank runs the same checks; one line is enough
        console.print(Text("error: ", style="red") + Text(" ".join(str(err).split())))
    return 2


def _preflight(cfg: EngineConfig, out: Console) -> tuple[DevicePlan, int | None]:
    """Every start-up check; returns the device plan and, when resuming, the checkpoint's step."""
    plan = plan_device(cfg)
    check_paths(cfg)
    resumed_step = None
    if cfg.train.resume:
        step_dir, resumed_step = check_resume(cfg)
        cfg.train.resume = str(step_dir)
    finished = resumed_step is not None and resumed_step >= cfg.train.steps
    if finished:
        return plan, resumed_step
    n_params = count_params(cfg)
    est = None
    if plan.kind in ("sim", "plain-cpu") and n_params is not None:  # device memory is host memory here
        est = estimate(cfg, n_params, local_world_size(), plan)
        check_fits(cfg, est)  # this machine's RAM first: the job itself must fit here
    # Pinned host memory for the swapped states (the simulated host's under the simulator):
    # swapopt.HostMemoryError before anything is built.
    check_host_memory(cfg, plan, n_params, local_world_size())
    if est is not None:
        out.print(describe(est))
        hint = slow_hint(est)
        if hint:
            out.print(hint)
    return plan, resumed_step


def _main(args: argparse.Namespace, raw_args: list[str]) -> int:
    console = Console(highlight=False, soft_wrap=True)
    main_rank = _rank() == 0
    out = console if main_rank else Console(quiet=True)
    try:
        cfg = load_config(args.config, args.cfg_options)
        if args.resume:
            cfg.train.resume = args.resume
        plan, resumed_step = _preflight(cfg, out)
    except (ConfigError, HostMemoryError) as err:
        return _error(console, err)
    if resumed_step is not None and resumed_step >= cfg.train.steps:
        out.print(f"nothing to do: checkpoint {cfg.train.resume} is at step {resumed_step} and train.steps is "
                  f"{cfg.train.steps}, so this run is finished; raise train.steps to train further")
        return 0
    modeled = plan.kind == "sim"
    state: dict[str, Any] = {"step": resumed_step or 0,
                             "checkpoint": Path(cfg.train.resume) if cfg.train.resume else None}

    def stuck() -> None:  # the watchdog's last word when one long operation holds the main thread
        if main_rank:
            sys.stdout.write("\n" + interrupted_line(state["step"], state["checkpoint"], raw_args, cfg.train) + "\n")
            sys.stdout.flush()

    with InterruptGuard(on_stuck=stuck, exit_code=EXIT_INTERRUPTED) as guard:
        try:
            try:
                with device_context(cfg, plan) as where:
                    out.print(where)
                    summary = run(cfg, out, modeled=modeled, guard=guard, progress_state=state)
            except KeyboardInterrupt:  # before the engine existed (simulator start-up)
                guard.acknowledge()
                raise Interrupted(resumed_step or 0, Path(cfg.train.resume) if cfg.train.resume else None) from None
            bases: list[tuple[str, dict[str, Any]]] = []
            for label, base_cfg in baselines(cfg) if cfg.train.compare_resident and cfg.optim.swap_optimizer else ():
                gc.collect()
                try:
                    with device_context(cfg, plan):
                        bases.append((label, run(base_cfg, out, label=label.split(" (")[0], modeled=modeled,
                                                 guard=guard)))  # fmt: skip
                except torch.OutOfMemoryError as err:  # the point of swapping: the resident job does not fit
                    bases.append((label, {"oom": str(err).splitlines()[0]}))
                except (Interrupted, KeyboardInterrupt):
                    guard.acknowledge()
                    if main_rank:
                        console.print(f"interrupted during the {label}; training itself had finished")
                    return EXIT_INTERRUPTED
        except (ConfigError, HostMemoryError) as err:  # the swap engine refused: nothing was trained or written
            return _error(console, err)
        except Interrupted as stop:
            if main_rank:
                console.print(interrupted_line(stop.step, stop.checkpoint, raw_args, cfg.train))
            return EXIT_INTERRUPTED
    if main_rank:
        print_summary(console, summary, bases, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
