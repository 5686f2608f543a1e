"""The modeled side of a verify run: the same probes and benchmark parts on the simulator, with the preset file
calibrated in the run, in a process of its own.

A process of its own, because the simulator registers torch's PrivateUse1 backend, which a real torch_npu
already holds, and because its modeled figures must not depend on what the device run left behind. It loads
the preset from the file just written, as any later simulator run will. `python -m swapopt.verify.modeled
PRESET.json REQUEST.json RESULT.json` is that process; `run_modeled` starts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loguru import logger
from pydantic import BaseModel

from swapopt.verify.bench_runs import BenchParts
from swapopt.verify.calibrate import Calibration
from swapopt.verify.plan import VerifyPlan


class ModeledRequest(BaseModel):
    plan: VerifyPlan
    label: str
    sizes: list[float]  # quick-table sizes to model (the measured ones, capped)
    layout_caps: dict[str, int]  # layout -> params to model it at (the measured numel, capped)
    e2e: bool
    bench: bool


class ModeledResult(BaseModel):
    calibration: Calibration
    parts: BenchParts | None = None


def run_modeled(preset: Path, request: ModeledRequest, workdir: Path, timeout_s: int) -> ModeledResult:
    """Start the modeled process and read its result (RuntimeError with its exit code when it fails)."""
    request_path, result_path = workdir / "modeled-request.json", workdir / "modeled-result.json"
    request_path.write_text(request.model_dump_json())
    result_path.unlink(missing_ok=True)
    env = dict(os.environ)
    # No real device in that process: torch must not load torch_npu (it would take the PrivateUse1 backend), and
    # device detection must not pick the GPU; the simulator is activated explicitly below.
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env.pop("SWAPOPT_DEVICE", None)
    env.pop("SWAPOPT_SIM_PRESET", None)
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "swapopt.verify.modeled", str(preset), str(request_path), str(result_path)]
    done = subprocess.run(command, env=env, timeout=timeout_s)
    if done.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"the modeled run ({' '.join(command[1:])}) exited with {done.returncode}")
    return ModeledResult.model_validate_json(result_path.read_text())


def _model(preset: Path, request: ModeledRequest) -> ModeledResult:
    from device import sim
    from swapopt.verify.bench_runs import run_parts
    from swapopt.verify.calibrate import measure

    plan = request.plan
    # The sanitizer checks stream ordering, which the tests cover; off, the simulator runs about 2x faster.
    with sim.activate(preset, sanitize=False):
        calibration = measure(plan.calibration, request.label, max_copy_bytes=plan.model_copy_max_bytes,
                              max_adamw_numel=plan.model_adamw_max_numel, matmul_n=plan.model_matmul_n)
        parts = None
        if request.bench:
            # Host time is a figure of the device's host, not of the model: measured only.
            parts = run_parts(plan, request.sizes, layout_caps=request.layout_caps, e2e=request.e2e, host_time=False)
    return ModeledResult(calibration=calibration, parts=parts)


def main(argv: list[str] | None = None) -> int:
    preset, request_path, result_path = (argv if argv is not None else sys.argv[1:])[:3]
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    request = ModeledRequest.model_validate_json(Path(request_path).read_text())
    result = _model(Path(preset), request)
    Path(result_path).write_text(result.model_dump_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
