"""``python -m swapopt.bench`` / ``swapopt-bench``: every optimizer-state strategy side by side.

Examples::

    swapopt-bench                       # quick run: one size, every strategy (simulator when no GPU/NPU)
    swapopt-bench --strategies resident,resident-8bit,swapopt-8bit --sizes 0.01   # the 8-bit rows at a size
    swapopt-bench --full                # the whole sweep: more sizes, chunk/slot sweeps, end to end
    swapopt-bench --sim 910b --sizes 0.1 --e2e none --out /tmp/bench
    swapopt-bench --sim bench/results/cuda-NVIDIA-H100-80GB-HBM3-2026-11-25-verify-preset.json  # calibrated
    swapopt-bench --sizes none --layouts llama7b,moe,fsdp256,tiny10k   # real model layouts only
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from loguru import logger
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import device
from swapopt.bench.report import Report, summary_table, targets_for, unique_stem, write
from swapopt.bench.run import BenchConfig, device_label, plan_length, run_size
from swapopt.bench.sizes import auto_sizes
from swapopt.bench.layout_run import DEFAULT_TIMES as LAYOUT_TIMES
from swapopt.bench.layout_run import SIM_MAX_NUMEL, default_max_numel, derive, layouts_summary, run_layout
from swapopt.bench.layouts import LAYOUTS, get_layout
from swapopt.bench.strategies import (
    ALL_STRATEGIES,
    DEFAULT_STRATEGIES,
    LOWBIT_STRATEGIES,
    SIM_LOWBIT_SIZE,
    STRATEGY_DOCS,
    lowbit_class,
)

DEFAULT_OUT = Path("bench/results")
FALLBACK_PRESET = "h100"
# Measured on the simulator (h100 preset) with 2 CPU cores: see README's Results section. The quick run was under 2
# minutes before each row ran one more step to prove its work and torchao's row joined it on the simulator (about
# 1.7x the steps); the 8-bit rows at their own small size (SIM_LOWBIT_SIZE) add some 20 s.
QUICK_COST = "a few minutes and 3 GB of host RAM on the simulator (2 CPU cores)"
FULL_COST = "about 10 minutes and 13 GB of host RAM on the simulator (2 CPU cores)"
QUICK = dict(sim_sizes=[0.1], times=[16, 64], slots=[3], reference_times=[16])
FULL = dict(sim_sizes=[0.1, 0.5], times=[8, 16, 32, 64], slots=[2, 3], reference_times=[16, 64])
SIM_NOTE = (
    "Simulated: every time is the timeline model's (a copy = latency + bytes / link rate, with H2D and D2H "
    "at once sharing the preset's total cap; a kernel = max(bytes touched / HBM rate, FLOPs / peak); "
    "launch_us of host time per op), so once copies dwarf launches a step's time is linear in its bytes "
    "and larger models scale these rows; state tensors are real host memory, which bounds the sizes run here."
)

LOWBIT_NOTE = (
    "The 8-bit rows step torchao's AdamW8bit (its own update, not torch's fused AdamW: Note [low-bit rows] in "
    "swapopt/bench/strategies.py); their x bound is over the fp32 states' bound of the size, and each swapped one's "
    "note gives it over its own (its bytes over the link, or resident-8bit's step). On the simulator torchao runs "
    "eagerly (torch.compile cannot run there), launching each op of its quantization where a GPU runs compiled "
    "kernels, so the simulated 8-bit steps pay far more launches than a GPU's."
)


def _floats(text: str) -> list[float]:
    if text.strip().lower() == "none":  # e.g. a run of layouts only
        return []
    return [float(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x and x != "none"]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swapopt-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true",
                    help=f"the whole sweep ({', '.join(f'{k} {v}' for k, v in FULL.items())}, end to end on "
                    f"an engine config) instead of the quick run ({', '.join(f'{k} {v}' for k, v in QUICK.items())}); "
                    f"full: {FULL_COST}; quick: {QUICK_COST}")
    ap.add_argument("--sim", metavar="PRESET", help="run on the simulator with this preset (h100, 910b, or the "
                    "path of a preset file, such as the calibrated one python -m swapopt.verify writes); "
                    f"without a GPU/NPU the simulator's {FALLBACK_PRESET} preset is used anyway")
    ap.add_argument("--sizes", type=_floats, help="model sizes in billions of params (default on the simulator: "
                    f"{QUICK['sim_sizes']}, --full {FULL['sim_sizes']}; on a device the largest up to 1B that fits, "
                    "--full 0.1 up to the largest that fits; 'none' for no sizes)")
    ap.add_argument("--impl", choices=["fused", "foreach"], default="fused", help="AdamW kernel of every strategy")
    ap.add_argument("--times", type=_ints, help="swapopt swap_optimizer_times sweep")
    ap.add_argument("--slots", type=_ints, help="swapopt slots sweep")
    ap.add_argument("--reference-times", type=_ints, help="one-in-flight chunkings")
    ap.add_argument("--strategies", default=None,
                    help=f"comma-separated subset of: {', '.join(STRATEGY_DOCS)} (default: all of them; on the "
                    f"simulator {', '.join(LOWBIT_STRATEGIES)} run only at {SIM_LOWBIT_SIZE:g}B, a size of their own "
                    "beside a resident row, when --sizes is not given, as their eager quantization takes minutes "
                    "there at 0.1B; named here, every strategy runs at the sizes asked)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2; 1 simulated)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps, median reported (default 5; 1 simulated: modeled time is deterministic)")
    ap.add_argument("--master-weights", action="store_true",
                    help="bf16 params stepped through fp32 masters swapped with the states (resident, swapopt, serial, "
                         "one-in-flight, resident-8bit, swapopt-8bit); the bound counts 12 bytes a param each way")
    ap.add_argument("--sanitize", action="store_true",
                    help="keep the simulator's stream sanitizer on (the tests do; off here it runs about 2x faster)")
    ap.add_argument("--layouts", type=_names, default=[],
                    help=f"real model layouts to run, comma-separated ({', '.join(LAYOUTS)}): fused AdamW resident "
                    "against swapopt, with kernel launches, copies each way and host CPU time per step (default: none)")
    ap.add_argument("--layout-times", type=_ints, default=list(LAYOUT_TIMES),
                    help=f"swap_optimizer_times of the layout runs (default {','.join(map(str, LAYOUT_TIMES))})")
    ap.add_argument("--layout-flat", action="store_true",
                    help="each layout chunk count also with the flat chunk update on (swapopt.flat.ENABLED), in "
                    "rows labelled swapopt-flat")
    ap.add_argument("--layout-graph", action="store_true",
                    help="each layout chunk count also with step_graph on (the steady step replayed as a device "
                    "graph), in rows labelled swapopt-graph")
    ap.add_argument("--layout-max-params", type=int, default=None,
                    help=f"layouts with more params are scaled down (every dim divided alike; tensor counts kept); "
                    f"default {SIM_MAX_NUMEL:,} on the simulator, what fits on a device")
    ap.add_argument("--e2e", default=None, help="engine configs for the train-step comparison (resident, swapped, "
                    "swapped with overlap_forward), comma-separated; each a config name or path, optionally with "
                    "config options after colons, e.g. 'llm_1b:model.n_layers=2:train.batch=1' (default: none; "
                    "with --full tiny on the simulator, llm_1b on a device); 'none' to skip")
    ap.add_argument("--e2e-steps", type=int, default=5, help="timed train steps per end-to-end variant, one "
                    "synchronized window (default and least 5)")
    ap.add_argument("--e2e-warmup", type=int, default=2, help="untimed train steps before them (default 2)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default bench/results); "
                    "existing results are never overwritten (a -2, -3... suffix is added)")
    ap.add_argument("--tag", default="", help="suffix of the output file names (DEVICE-DATE-TAG.json ...)")
    ap.add_argument("--render", type=Path, metavar="JSON", help="only rebuild the markdown and chart of a results JSON")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap.parse_args(argv)


def _progress(disabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("eta"), TimeRemainingColumn(), disable=disabled, transient=False,
    )


def run_strategies(args: argparse.Namespace, simulated: bool) -> tuple[list[str], list[float]]:
    """The strategies to run at the run's sizes, and the sizes at which the 8-bit rows run apart, beside a resident
    row for their bound. Unless --strategies names some: on a device every strategy; on the simulator the 8-bit
    rows only at SIM_LOWBIT_SIZE (Note [low-bit rows] in swapopt/bench/strategies.py), and not at all when --sizes
    asks for sizes."""
    if args.strategies is not None:
        return [s for s in args.strategies.split(",") if s], []
    if not simulated:
        return list(ALL_STRATEGIES), []
    apart = args.sizes is None and lowbit_class() is not None
    return list(DEFAULT_STRATEGIES), [SIM_LOWBIT_SIZE] if apart else []


def _run(args: argparse.Namespace) -> tuple[Report, list[Path]]:
    simulated = device.is_simulated()
    sweep = FULL if args.full else QUICK
    if args.sizes is not None:
        sizes = args.sizes
    elif simulated:
        sizes = sweep["sim_sizes"]
    else:
        fitting = auto_sizes()
        sizes = fitting if args.full else [max([b for b in fitting if b <= 1.0] or fitting[:1])]
    strategies, lowbit_sizes = run_strategies(args, simulated)
    cfg = BenchConfig(
        sizes=sizes, impl=args.impl, times=args.times or sweep["times"], slots=args.slots or sweep["slots"],
        reference_times=args.reference_times or sweep["reference_times"],
        strategies=strategies,
        warmup=args.warmup if args.warmup is not None else (1 if simulated else 2),
        repeats=args.repeats if args.repeats is not None else (1 if simulated else 5),
        master_weights=args.master_weights,
    )
    default_e2e = ("tiny" if simulated else "llm_1b") if args.full else "none"
    e2e_configs = _names(args.e2e or default_e2e)
    mod = device.get_torch_device_module()
    label = device_label()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = unique_stem(args.out, f"{label}-{datetime.now(timezone.utc):%Y-%m-%d}" + (f"-{args.tag}" if args.tag else ""))
    logger.info("benchmark on {} (torch {}), sizes {} B params", label, torch.__version__, sizes)

    from swapopt.bench.plots import timeline_chart
    from swapopt.bench.timeline import capture_step

    timeline_png: list[Path] = []

    def capture(strategy) -> None:
        if timeline_png:
            return
        spans = capture_step(strategy)
        if spans:
            path = args.out / f"{stem}-timeline.png"
            # Title from what is drawn: the planner may make fewer chunks than swap_optimizer_times asks for.
            chunks = len({s.chunk for s in spans if s.chunk is not None})
            title = (f"one swapopt step: {chunks} chunks, {strategy.slots} slots "
                     f"(swap_optimizer_times={strategy.times}), {label}" + (" (modeled)" if simulated else ""))
            timeline_png.append(timeline_chart(spans, path, title))

    lowbit_cfg = cfg.model_copy(update={"strategies": ["resident", *LOWBIT_STRATEGIES]})
    results = []
    with _progress(args.no_progress) as progress:
        total = plan_length(cfg) * len(sizes) + plan_length(lowbit_cfg) * len(lowbit_sizes)
        task = progress.add_task("strategies", total=total)
        for size in lowbit_sizes:  # first: the tables give peaks at the last (largest) size
            progress.update(task, description=f"{size:g}B (8-bit rows)")
            results.append(run_size(size, lowbit_cfg, on_done=lambda _: progress.advance(task)))
        for size in sizes:
            progress.update(task, description=f"{size:g}B")
            results.append(run_size(size, cfg, on_done=lambda _: progress.advance(task), timeline_hook=capture))
        layouts = []
        if args.layouts:
            max_numel = args.layout_max_params or default_max_numel()
            per_layout = 1 + len(args.layout_times) * (1 + args.layout_flat + args.layout_graph)
            layout_task = progress.add_task("layouts", total=len(args.layouts) * per_layout)
            for name in args.layouts:
                progress.update(layout_task, description=name)
                layouts.append(run_layout(
                    name, times=args.layout_times, max_numel=max_numel, impl=cfg.impl, warmup=cfg.warmup,
                    repeats=cfg.repeats, on_done=lambda _: progress.advance(layout_task), flat=args.layout_flat,
                    graph=args.layout_graph,
                ))
        e2e = []
        e2e_picture = None
        if e2e_configs:
            from swapopt.bench.e2e import VARIANTS, run_e2e

            e2e_task = progress.add_task("end to end", total=len(VARIANTS) * len(e2e_configs))
            for spec in e2e_configs:
                progress.update(e2e_task, description=spec.split(":")[0])
                row, (spans, marks) = run_e2e(spec, steps=args.e2e_steps, warmup=args.e2e_warmup,
                                              on_done=lambda: progress.advance(e2e_task),
                                              capture=e2e_picture is None)
                e2e.append(row)
                if spans and e2e_picture is None:
                    only_e2e = not results and not layouts
                    path = args.out / (f"{stem}.png" if only_e2e else f"{stem}-e2e-timeline.png")
                    title = (f"two consecutive train steps of {spec} with overlap_forward, {label}"
                             + (" (modeled)" if simulated else "") + "; dashed: step starts")
                    e2e_picture = timeline_chart(spans, path, title, marks)

    preset = dataclasses.asdict(mod.preset) if simulated else None
    lowbit = any(r.kind in LOWBIT_STRATEGIES for s in results for r in s.rows)
    name = label if simulated else f"{label} ({device.get_device()})"
    report = Report(
        device="sim" if simulated else device.get_device(), device_name=name, torch=torch.__version__,
        date=f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}", preset=preset, impl=cfg.impl,
        sizes=results, targets=[targets_for(s) for s in results], e2e=e2e, layouts=layouts,
        notes=([SIM_NOTE] if simulated else []) + ([LOWBIT_NOTE] if lowbit else []), command=args.command,
    )
    return report, _write_outputs(report, args.out, stem, timeline_png[0] if timeline_png else None, e2e_picture)


def _write_outputs(report: Report, out: Path, stem: str, timeline: Path | None,
                   e2e_timeline: Path | None = None) -> list[Path]:
    """JSON, markdown (linking the step timelines when there are some) and bar chart."""
    from swapopt.bench.plots import bar_chart

    modeled = " (modeled)" if report.device == "sim" else ""
    chart = None
    if report.sizes:  # a run of layouts only has no size rows to chart
        chart = bar_chart(report.sizes, out / f"{stem}-chart.png", f"AdamW step / bound, {report.device_name}{modeled}")
    json_path, md_path = write(report, out, stem, chart.name if chart else None, timeline.name if timeline else None,
                               e2e_timeline.name if e2e_timeline else None)
    return [json_path, md_path] + [p for p in (chart, timeline, e2e_timeline) if p]


def _render(path: Path) -> tuple[Report, list[Path]]:
    """Rebuild the markdown table and chart of an earlier run from its JSON."""
    report = Report.model_validate_json(path.read_text())
    report.targets = [targets_for(s) for s in report.sizes]
    report.layouts = [derive(r) for r in report.layouts]
    timeline = path.parent / f"{path.stem}-timeline.png"
    e2e_timeline = next((p for p in (path.parent / f"{path.stem}-e2e-timeline.png", path.with_suffix(".png"))
                         if report.e2e and p.exists()), None)
    return report, _write_outputs(report, path.parent, path.stem, timeline if timeline.exists() else None, e2e_timeline)


def _error(text: str) -> int:
    print(f"error: {text}")
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # recorded in the report, so that a results file says how to make it again
    args.command = shlex.join(["python", "-m", "swapopt.bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return _error("the benchmark draws its charts with matplotlib, which is not installed: "
                      "pip install 'swapopt[bench]'")
    if (os.environ.get("SWAPOPT_DEVICE") or "").strip().lower() == "cpu" and not args.render:
        return _error("SWAPOPT_DEVICE=cpu: the benchmark compares device-side strategies and needs a GPU/NPU or "
                      "the simulator; unset SWAPOPT_DEVICE (without an accelerator the simulator is used)")
    try:
        kind = "sim" if args.sim or args.render else device.get_device()
        if args.sim:
            from device import sim
            from device.sim.preset_file import load_preset, looks_like_path

            if looks_like_path(args.sim):
                args.sim = load_preset(args.sim)  # a missing or malformed file fails here, before anything runs
            elif args.sim.lower() not in sim.PRESETS:
                raise ValueError(f"unknown simulator preset {args.sim!r}; choose one of: {', '.join(sim.PRESETS)}, "
                                 "or the path of a preset file")
        for name in args.layouts:
            get_layout(name)  # an unknown name fails here, before anything runs
    except (ValueError, RuntimeError) as err:
        return _error(" ".join(str(err).split()))
    logger.remove()
    logger.add(sys.stderr, level="DEBUG" if args.verbose else "INFO")
    logger.enable("swapopt")
    logger.enable("device")
    preset = args.sim
    if not args.render and kind == "cpu":
        preset = FALLBACK_PRESET
        print(f"no accelerator found: running on the simulated {preset} device (times are modeled; "
              "--sim PRESET picks another preset)")
    mode = "full sweep" if args.full else "quick run (--full for the whole sweep)"
    if args.render:
        report, paths = _render(args.render)
    elif preset:
        from device import sim

        print(f"{mode}: {FULL_COST if args.full else QUICK_COST}")
        # Simulated tensors are real host memory; the preset's capacity stands for the device's.
        with sim.activate(preset, sanitize=args.sanitize):
            report, paths = _run(args)
    else:
        print(mode)
        report, paths = _run(args)
    if report.sizes:
        print(summary_table(report))
    if report.layouts:
        print(layouts_summary(report.layouts))
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
