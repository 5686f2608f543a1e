"""``python -m swapopt.bench.simops [--out PATH]``: the simulator's host overhead per op.

On the simulator every aten op passes through its dispatch mode (storage classes, stream, sanitizer,
memory, timeline), so a step's host time there is mostly this bookkeeping, not the op. This measures it on
four fixed loops, each on plain CPU torch (no simulator) and under ``sim.activate()`` (default preset,
sanitizer on), so that a change to the simulator (e.g. how it tells device tensors apart) is judged by
ops/s on the same loop: (a) in-place ``add_`` on 16 elements; (b) out-of-place ``mul`` on 16 elements;
(c) forward + backward of 4 x Linear(64, 64) at batch 8; (d) ``AdamW(foreach=True).step()`` over 16
params of 64 x 64. Each figure is the median, over 5 repeats after a warm-up, of N iterations timed with
``time.perf_counter`` and closed by a device synchronize. Under the simulator the tensors are created inside
the activated block, on ``device.torch_device()`` when that is not cpu. Imports only torch and ``device``,
so it can be run by path against another checkout (``PYTHONPATH=<checkout> python simops.py``).

Wall time on a shared machine moves with its load, so ``--compare NAME=CHECKOUT ...`` also measures the same
loops under the simulator of each checkout (its ``device`` package) in host CPU time (``time.thread_time``, one
torch thread), each in a process of its own, ``--rounds`` rounds with the checkouts taken in turn (the order
reversed every other round); per round each figure is the least of ``CPU_REPEATS`` repeats after a warm-up, and
the report gives, per loop and checkout, the median over rounds and the least, per aten op.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import device
from device import sim

ITERS = {"add_": 2000, "mul": 2000, "mlp": 50, "adamw": 50}
WHAT = {"add_": "x.add_(1) on 16 elements", "mul": "torch.mul(x, y) on 16 elements",
        "mlp": "fwd+bwd, 4 x Linear(64,64), batch 8", "adamw": "AdamW(foreach=True).step(), 16 x (64,64)"}
REPEATS = 5
# --compare: iterations per repeat, repeats per round (host CPU time; the least of them is the round's figure).
CPU_ITERS = {"add_": 500, "mul": 500, "mlp": 10, "adamw": 10}
CPU_REPEATS = 15


def build(name: str, kw: dict[str, Any]) -> Callable[[], object]:
    """One iteration of loop ``name``, its tensors created now with ``kw`` (``{}`` or ``{"device": ...}``)."""
    torch.manual_seed(0)
    if name == "add_":
        x = torch.zeros(16, **kw)
        return lambda: x.add_(1.0)
    if name == "mul":
        x, y = torch.randn(16, **kw), torch.randn(16, **kw)
        return lambda: torch.mul(x, y)
    if name == "mlp":
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, **kw) for _ in range(4)])
        inp = torch.randn(8, 64, **kw)

        def fwd_bwd() -> None:
            model.zero_grad(set_to_none=True)
            model(inp).sum().backward()
        return fwd_bwd
    params = [torch.nn.Parameter(torch.randn(64, 64, **kw)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    return torch.optim.AdamW(params, lr=1e-3, foreach=True).step


class _Count(TorchDispatchMode):
    """Counts the aten ops run under it (on plain CPU torch: the ops per iteration of a loop)."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


def time_loop(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> list[float]:
    """Seconds per iteration of each repeat, after max(2, iters // 10) warm-up iterations."""
    for _ in range(max(2, iters // 10)):
        fn()
    sync()
    out = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / iters)
    return out


def run(iters: dict[str, int]) -> dict[str, Any]:
    if sim.active() is not None:
        raise RuntimeError("a simulator is already active (SWAPOPT_DEVICE=sim?): the plain rows would be simulated")
    rows = {n: {"loop": n, "what": WHAT[n], "iters": k} for n, k in iters.items()}
    for n, k in iters.items():
        fn = build(n, {})
        with _Count() as count:
            fn()
        rows[n]["aten_ops_per_iter"] = count.n
        rows[n]["plain_repeats_us"] = [s * 1e6 for s in time_loop(fn, k, torch.cpu.synchronize)]
    with sim.activate() as dev:
        tdev = device.torch_device()
        kw = {} if tdev.type == "cpu" else {"device": tdev}
        for n, k in iters.items():
            fn = build(n, kw)
            rows[n]["sim_repeats_us"] = [s * 1e6 for s in time_loop(fn, k, dev.synchronize)]
        preset = getattr(getattr(dev, "preset", None), "name", None)
    for r in rows.values():
        r["plain_us"], r["sim_us"] = (statistics.median(r[f"{k}_repeats_us"]) for k in ("plain", "sim"))
        r["plain_ops_s"], r["sim_ops_s"] = 1e6 / r["plain_us"], 1e6 / r["sim_us"]
        r["sim_us_per_aten_op"] = r["sim_us"] / r["aten_ops_per_iter"]
        r["overhead"] = r["sim_us"] / r["plain_us"]
    return {"sim_torch_device": str(tdev), "sim_preset": preset, "rows": list(rows.values())}


def cpu_us_per_op(iters: dict[str, int], repeats: int) -> dict[str, float]:
    """Under the simulator of the ``device`` package this process imports: per loop, host CPU microseconds per aten
    op (the least of ``repeats`` repeats of ``iters[loop]`` iterations, after a warm-up), with one torch thread."""
    torch.set_num_threads(1)
    ops = {}
    for n in iters:
        fn = build(n, {})
        with _Count() as count:
            fn()
        ops[n] = count.n
    out = {}
    with sim.activate() as dev:
        tdev = device.torch_device()
        kw = {} if tdev.type == "cpu" else {"device": tdev}
        for n, k in iters.items():
            fn = build(n, kw)
            for _ in range(3):
                fn()
            dev.synchronize()
            best = float("inf")
            for _ in range(repeats):
                t0 = time.thread_time()
                for _ in range(k):
                    fn()
                dev.synchronize()
                best = min(best, time.thread_time() - t0)
            out[n] = best / k / ops[n] * 1e6
    return out


def compare(checkouts: dict[str, Path], rounds: int) -> dict[str, Any]:
    """``cpu_us_per_op`` of each checkout's simulator, each in its own process, ``rounds`` rounds taken in turn (the
    order reversed every other round, so that neither side always runs first)."""
    names = list(checkouts)
    per_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    load = [_loadavg()]
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            env = {**os.environ, "PYTHONPATH": str(checkouts[name])}
            env.pop("SWAPOPT_DEVICE", None)
            done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--cpu-per-op"], env=env,
                                  capture_output=True, text=True, check=True)
            per_round[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        load.append(_loadavg())
    rows = []
    for loop in CPU_ITERS:
        row: dict[str, Any] = {"loop": loop}
        for name in names:
            values = [r[loop] for r in per_round[name]]
            row[name] = {"median": statistics.median(values), "least": min(values), "rounds": values}
        rows.append(row)
    return {"checkouts": {n: str(p) for n, p in checkouts.items()}, "rounds": rounds, "iters": CPU_ITERS,
            "repeats": CPU_REPEATS, "rows": rows, "load": load}


def _loadavg() -> float | None:
    """The machine's 1-minute load average (the others' work on a shared machine moves every figure)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def compare_table(cmp: dict[str, Any]) -> str:
    """Per loop: each checkout's median over rounds (least in brackets), CPU us per aten op, and each one's ratio to
    the first checkout's median."""
    names = list(cmp["checkouts"])
    head = "| loop | " + " | ".join(f"{n} (us/op)" for n in names) + " | " + " | ".join(
        f"{n} / {names[0]}" for n in names[1:]) + " |"
    lines = [head, "|---|" + "---:|" * (2 * len(names) - 1)]
    for row in cmp["rows"]:
        first = row[names[0]]["median"]
        cells = [f"{row[n]['median']:.1f} ({row[n]['least']:.1f})" for n in names]
        ratios = [f"{row[n]['median'] / first:.2f}" for n in names[1:]]
        lines.append(f"| {row['loop']} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def _machine() -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "unknown")
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": cpu, "torch_threads": torch.get_num_threads()}


def _commit(path: Path) -> str | None:
    """HEAD's short hash of the checkout holding ``path``, "+dirty" when ``path`` has uncommitted changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(path), *a], capture_output=True, text=True).stdout.strip()
    return (git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", ".") else "")) or None


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| loop | N | aten ops/iter | plain us/iter | sim us/iter | plain iter/s | sim iter/s | sim us/aten op"
             " | sim / plain |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['loop']}: {r['what']} | {r['iters']} | {r['aten_ops_per_iter']} | {r['plain_us']:.2f} | "
                     f"{r['sim_us']:.2f} | {r['plain_ops_s']:,.0f} | {r['sim_ops_s']:,.0f} | "
                     f"{r['sim_us_per_aten_op']:.2f} | {r['overhead']:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(f"bench/results/sim-overhead-{datetime.now(timezone.utc):%Y-%m-%d}"),
                    help="output stem: writes STEM.json and STEM.md")
    ap.add_argument("--iters", type=int, help="N for every loop (default: %s)" % ITERS)
    ap.add_argument("--label", default="", help="what this run measures, e.g. 'before: ... (commit abc1234)'")
    ap.add_argument("--compare", nargs="+", metavar="NAME=CHECKOUT", default=[],
                    help="also compare these checkouts' simulators in host CPU time (the first is the reference)")
    ap.add_argument("--rounds", type=int, default=5, help="--compare: rounds, checkouts taken in turn")
    ap.add_argument("--cpu-per-op", action="store_true", help=argparse.SUPPRESS)  # one --compare measurement
    args = ap.parse_args(argv)
    if args.cpu_per_op:
        print(json.dumps(cpu_us_per_op(CPU_ITERS, CPU_REPEATS)))
        return None  # type: ignore[return-value]
    checkouts = {n: Path(p).resolve() for n, _, p in (c.partition("=") for c in args.compare)}
    res = run({n: args.iters or k for n, k in ITERS.items()})
    cmp = compare(checkouts, args.rounds) if checkouts else None
    src = Path(device.__file__).resolve().parent
    report = {"device": "sim", "torch": torch.__version__, "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
              "label": args.label, "device_package": str(src), "commit": _commit(src), "machine": _machine(),
              "repeats": REPEATS, **res}
    if cmp is not None:
        report["compare"] = {**cmp, "commits": {n: _commit(p / "device") for n, p in checkouts.items()}}
    m = report["machine"]
    md = (f"# swapopt benchmark: simulator per-op host overhead\n\n{args.label or 'unlabeled run'}\n\n"
          f"torch {report['torch']}, {report['date']}, nproc {m['nproc']} ({m['cpu']}), torch threads "
          f"{m['torch_threads']}; simulator preset {res['sim_preset']}, sanitizer on, tensors on "
          f"`{res['sim_torch_device']}`; `device` from {src} (commit {report['commit'] or '-'}).\n\n"
          f"{table(res['rows'])}\n\n## Notes\n\n- Median over {REPEATS} repeats of N iterations (host wall "
          "time, `time.perf_counter`, closed by a synchronize), after a warm-up; plain = CPU torch, no simulator; "
          "aten ops/iter counted on plain. No timing is asserted; figures vary with the machine and its load.\n")
    if cmp is not None:
        md += (f"\n## Host CPU time per aten op, checkouts compared\n\n{compare_table(cmp)}\n\nSimulator of each "
               f"checkout's `device` ({', '.join(f'{n}: {p}' for n, p in cmp['checkouts'].items())}), each loop in "
               f"host CPU time (`time.thread_time`, one torch thread), per round the least of {cmp['repeats']} repeats "
               f"after a warm-up, {cmp['rounds']} rounds with the checkouts in turn; median over rounds (least in "
               "brackets). 1-minute load average before the first round and after each: "
               f"{', '.join('-' if v is None else f'{v:.1f}' for v in cmp['load'])}.\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = Path(f"{args.out}.json"), Path(f"{args.out}.md")
    json_path.write_text(json.dumps(report, indent=1))
    md_path.write_text(md)
    print(table(res["rows"]))
    if cmp is not None:
        print(compare_table(cmp))
    print(f"wrote {json_path} and {md_path}")
    return json_path, md_path


if __name__ == "__main__":
    main()
