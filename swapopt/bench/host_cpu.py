"""``python -m swapopt.bench.host_cpu LAYOUT TIMES``: the host CPU of a swapped step of one layout, for A/B runs.

The layout bench (``swapopt-bench --layouts``) reports one counted step per row, and on a GPU host the thread's speed
moves by up to 2x from process to process (bench/results/cuda-h100-2026-11-27-host-2.md). Comparing two codes
takes runs of each, alternated, each of many steps. This prints one line per run: the layout, the chunks of its plan,
the median and least thread CPU of ``step()`` (the host work of issuing the step: its Python and its launches) over
``--steps`` uncounted steps, and the median step time by device events, as the bench times its rows. Run it once per
code (with ``PYTHONPATH`` naming each checkout), in turns. On the simulator the thread CPU also holds the simulator's own work,
so there it compares nothing; the layout bench's Python ms is the figure to use there.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import device
from swapopt.bench.counts import host_cpu_seconds
from swapopt.bench.layouts import LAYOUTS, get_layout, make_layout_params, scale_to_fit
from swapopt.bench.measure import time_steps
from swapopt.bench.strategies import AdamWSpec, make_strategy


def measure(layout: str, times: int, numel: int, steps: int, warmup: int = 5) -> dict[str, float]:
    """Thread CPU of step() (counts.host_cpu_seconds) and step time by device events (measure.time_steps, as the
    bench times a row) of swapopt over ``layout`` scaled to ``numel`` params, each over ``steps`` steps."""
    params = make_layout_params(scale_to_fit(get_layout(layout), numel))
    strategy = make_strategy("swapopt", params, AdamWSpec(impl="fused"), times=times, slots=3)
    timing = time_steps(strategy, warmup=warmup, repeats=steps)
    mod = device.get_torch_device_module()
    cpu = []
    for _ in range(steps):
        mod.synchronize()
        cpu.append(host_cpu_seconds(strategy.step))
        strategy.drain()
    plan = strategy.opt._layout.prepared.plan
    return {"chunks": len(plan.chunks), "cpu_med_ms": statistics.median(cpu) * 1e3, "cpu_min_ms": min(cpu) * 1e3,
            "step_med_ms": timing.step_ms}


def _count(text: str) -> int:
    value = int(float(text))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m swapopt.bench.host_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("layout", choices=sorted(LAYOUTS))
    ap.add_argument("times", type=_count, help="swap_optimizer_times")
    ap.add_argument("--numel", type=_count, default=100_000_000, help="params the layout is scaled to "
                    "(default 1e8)")
    ap.add_argument("--steps", type=_count, default=30, help="steps measured after 5 of warm-up (default 30)")
    ap.add_argument("--label", default="", help="a word printed with the line (the code's name, say)")
    args = ap.parse_args(argv)
    simulated = device.get_device() == "cpu"
    with device.sim.activate("h100", sanitize=False) if simulated else contextlib.nullcontext():
        got = measure(args.layout, args.times, args.numel, args.steps)
    where = "the simulator: thread CPU includes its own work" if simulated else device.get_device()
    print(f"{args.layout} t={args.times} chunks={got['chunks']} cpu_med={got['cpu_med_ms']:.2f} "
          f"cpu_min={got['cpu_min_ms']:.2f} step_med={got['step_med_ms']:.2f} ms {args.label} ({where})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
