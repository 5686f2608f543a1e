"""Pinned copy rates measured in a process of its own, under allocator settings read only at start-up.

On an Ascend NPU the copies are measured a second time with `PYTORCH_NPU_ALLOC_CONF=expandable_segments:True`:
torch_npu reads its allocator settings once, when it initializes, so they cannot be switched inside the run.
`python -m swapopt.verify.copy_sweep RESULT.json SIZE[,SIZE...] TARGET_BYTES` is that process; `run_copy_sweep`
starts it with the settings given and reads its points back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pydantic import TypeAdapter

from swapopt.verify.calibrate import CopyPoint

EXPANDABLE_NPU = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}


def with_setting(current: str | None, setting: str) -> str:
    """`setting` added to a comma-separated allocator config, replacing the same key."""
    key = setting.split(":", 1)[0]
    kept = [part for part in (current or "").split(",") if part and part.split(":", 1)[0] != key]
    return ",".join([*kept, setting])


def run_copy_sweep(sizes: list[int], target_bytes: int, env_settings: dict[str, str], result: Path,
                   timeout_s: int = 600) -> list[CopyPoint]:
    env = dict(os.environ)
    for name, setting in env_settings.items():
        env[name] = with_setting(env.get(name), setting)
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "swapopt.verify.copy_sweep", str(result), ",".join(map(str, sizes)),
               str(target_bytes)]
    done = subprocess.run(command, env=env, timeout=timeout_s, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"copy sweep exited with {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return TypeAdapter(list[CopyPoint]).validate_json(result.read_text())


def main(argv: list[str] | None = None) -> int:
    from swapopt.verify.calibrate import measure_copies

    result, sizes, target = (argv if argv is not None else sys.argv[1:])[:3]
    points = measure_copies([int(s) for s in sizes.split(",")], int(target))
    Path(result).write_text(json.dumps([p.model_dump(mode="json") for p in points]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
