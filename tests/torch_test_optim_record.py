"""Merge runs of torch's test_optim.py (tests/torch_test_optim_run.py, one JSON per mode and optimizer) into the
record tests/test_torch_test_optim.py checks: outcomes per mode, the comparison with the CPU baseline, what ran.

    python tests/torch_test_optim_record.py RUNS_DIR --out tests/data/torch-test-optim.json \
        --source "pytorch/pytorch test/test_optim.py at <commit>"

RUNS_DIR holds `<mode>-<name>.json` files (the runner's --json); a test present in several files of a mode keeps
its last outcome. Only tests that ran in a mode are compared (the record says which optimizers each mode covers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch_test_optim_run as runner


def merge(runs: Path) -> dict[str, Any]:
    modes: dict[str, dict[str, list[str]]] = {mode: {} for mode in runner.MODES}
    seconds: dict[str, float] = {mode: 0.0 for mode in runner.MODES}
    files: dict[str, list[str]] = {mode: [] for mode in runner.MODES}
    torch_version = None
    for path in sorted(runs.glob("*.json")):
        mode = path.stem.split("-", 1)[0]
        if mode not in modes:
            continue
        run = json.loads(path.read_text())
        modes[mode].update(run["tests"])
        seconds[mode] += run["seconds"]
        files[mode].append(f"{path.stem.split('-', 1)[1]}: {len(run['tests'])} tests")  # a stopped run has fewer
        torch_version = run["torch"]
    summary: dict[str, Any] = {}
    for mode, tests in modes.items():
        counts: dict[str, int] = {}
        for outcome, _ in tests.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        entry: dict[str, Any] = {"counts": counts, "seconds": round(seconds[mode], 1), "runs": files[mode]}
        if mode != "cpu":
            entry["comparison"] = runner.compare(modes["cpu"], tests, wrapped=mode == "wrapped")
        summary[mode] = entry
    return {"torch": torch_version, "summary": summary, "modes": modes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", required=True, help="where the test file came from (repository, path, commit)")
    args = parser.parse_args(argv)
    record = merge(args.runs)
    record["source"] = args.source
    record["date"] = datetime.date.today().isoformat()
    record["how"] = (
        "python tests/torch_test_optim_run.py {cpu,sim,wrapped} --file test_optim.py --optims NAME --json "
        "RUNS/<mode>-NAME.json per optimizer, then python tests/torch_test_optim_record.py RUNS --out this file"
    )
    args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    for mode, entry in record["summary"].items():
        print(mode, json.dumps({k: v for k, v in entry.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
