"""``python -m swapopt.verify`` / ``swapopt-verify``: prove swapopt on this machine's GPU or NPU in one command.

Examples::

    swapopt-verify                                  # on a GPU/NPU: everything, within 30 minutes on one device
    swapopt-verify --quick                          # a short slot: within 8 minutes on one H100, start-up included
    swapopt-verify --model bench/results/REPORT.json  # later, on any CPU machine: add the modeled side
    swapopt-verify --dry-run --out /tmp/verify      # the same path on the simulator at small sizes, under a minute
    swapopt-verify --dry-run --sim 910b --skip-device-tests
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loguru import logger

import device
from swapopt.verify.plan import QUICK_BUDGET_S
from swapopt.verify.run import DEFAULT_OUT, VerifyOptions, model_report, verify


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swapopt-verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"the short plan: device tests, calibration, quick table, layouts, one end-to-end config, "
                    f"each phase stopped at its own time limit, within {QUICK_BUDGET_S // 60} minutes on one H100 "
                    "including start-up; no peers, no modeled side (--model adds it later)")
    ap.add_argument("--model", type=Path, metavar="REPORT.json",
                    help="add the modeled side (the simulator with the preset the report's calibration wrote) and the "
                    "comparison measured / modeled to a report written on a device; runs on any CPU machine and "
                    "rewrites the report's JSON and markdown")
    ap.add_argument("--preset", metavar="PRESET", help="with --model: model with this preset (a name or file) "
                    "instead of the report's own")
    ap.add_argument("--dry-run", action="store_true",
                    help="run on the simulator at small sizes (the default without a GPU/NPU): 'measured' figures "
                    "are then the simulator's own; under a minute on 2 CPU cores")
    ap.add_argument("--sim", metavar="PRESET", help="the dry run's simulator preset: h100 (default), 910b, or the "
                    "path of a preset file")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output folder (default bench/results); earlier results are never overwritten")
    ap.add_argument("--skip-device-tests", action="store_true", help="do not run (dry run: collect) -m cuda / -m npu")
    ap.add_argument("--skip-bench", action="store_true", help="calibration only: no quick table, layouts, end to end")
    ap.add_argument("--skip-peers", action="store_true", help="no peer comparison")
    e2e = ap.add_mutually_exclusive_group()
    e2e.add_argument("--model-e2e", dest="model_e2e", action="store_true", default=None,
                     help="also model the end-to-end configs on the simulator (on a device: minutes of CPU per step)")
    e2e.add_argument("--no-model-e2e", dest="model_e2e", action="store_false")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap.parse_args(argv)


def _error(text: str) -> int:
    print(f"error: {text}")
    return 2


def _model(args: argparse.Namespace) -> int:
    if not args.model.is_file():
        return _error(f"--model: {args.model} is not a file")
    logger.remove()
    logger.add(sys.stderr, level="DEBUG" if args.verbose else "INFO")
    try:
        report, paths, ok = model_report(args.model, preset=args.preset, model_e2e=args.model_e2e)
    except ValueError as err:
        return _error(" ".join(str(err).split()))
    for p in paths:
        print(p)
    rows = [r for r in report.comparisons() if r.ratio is not None]
    print(f"measured / modeled: {len(rows)} figures compared")
    if not ok:
        print(f"FAILED modeled side: {report.phases[-1].status.removeprefix('failed: ')}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is not None:
        return _model(args)
    if args.preset:
        return _error("--preset goes with --model")
    if (os.environ.get("SWAPOPT_DEVICE") or "").strip().lower() == "cpu":
        return _error("SWAPOPT_DEVICE=cpu: verify measures a GPU/NPU or, without one, runs on the simulator; unset "
                      "SWAPOPT_DEVICE")
    try:
        if args.sim:
            from device.sim.presets import resolve_preset

            resolve_preset(args.sim)  # an unknown name or a bad file fails here, before anything runs
        kind = device.get_device()
    except (ValueError, RuntimeError) as err:
        return _error(" ".join(str(err).split()))
    dry_run = args.dry_run or device.is_simulated() or kind not in ("cuda", "npu")
    if args.sim and not dry_run:
        return _error("--sim picks the dry run's preset; on a device add --dry-run to use it")
    logger.remove()
    logger.add(sys.stderr, level="DEBUG" if args.verbose else "INFO")
    logger.enable("swapopt")
    logger.enable("device")
    if dry_run and not args.dry_run:
        print("no accelerator found: dry run on the simulator (small sizes; figures are modeled)")
    options = VerifyOptions(dry_run=dry_run, sim=args.sim, out=args.out, device_tests=not args.skip_device_tests,
                            bench=not args.skip_bench, peers=not args.skip_peers, model_e2e=args.model_e2e,
                            progress=not args.no_progress, quick=args.quick)
    report, paths, ok = verify(options)
    for p in paths:
        print(p)
    if report.preset_path:
        print(f"calibrated preset: {report.preset_path}")
    failed = [p for p in report.phases if p.status.startswith("failed")]
    for p in failed:
        print(f"FAILED {p.name}: {p.status.removeprefix('failed: ')}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
