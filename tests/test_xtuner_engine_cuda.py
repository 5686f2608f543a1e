"""XTuner v1's TrainEngine under the simulator's cuda flavour, unpatched: `import xtuner.v1` resolves cuda, and the
engine trains a tiny dense Qwen3 bitwise alike with plain AdamW, XTuner's SwapAdamW and swapopt
(tests/xtuner_engine_job.py, in a process of its own started with SWAPOPT_DEVICE=sim on the default preset); and
the device="cuda" factories XTuner's code calls make simulated tensors.

The engine check skips without a checkout on SWAPOPT_XTUNER_SRC, without ray, and without triton on
SWAPOPT_TRITON_PATH (and pkg_resources, importable or on SWAPOPT_PKG_RESOURCES_PATH): XTuner's cuda modules import
both (tests/xtuner_real.py). They go on that process's path only.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xtuner_real

import simdevice as simulator

ROOT = Path(__file__).resolve().parents[1]
PATHS = xtuner_real.cuda_paths()


def _found(name: str, extra: list[str]) -> bool:
    """Whether `name` is importable here or from one of `extra` (found, not imported: XTuner resolves its device
    at import, and this process is not the simulated one)."""
    found = importlib.util.find_spec(name) is not None
    return found or importlib.machinery.PathFinder.find_spec(name, extra) is not None


ENGINE_NEEDS = [
    pytest.mark.skipif(
        not (_found("xtuner", []) and _found("cyclopts", [])),
        reason="XTuner v1 is not importable (set SWAPOPT_XTUNER_SRC to a checkout of InternLM/xtuner; needs cyclopts)",
    ),
    pytest.mark.skipif(not _found("ray", []), reason="XTuner's model package imports ray (xtuner/v1/rl/utils)"),
    pytest.mark.skipif(
        importlib.machinery.PathFinder.find_spec("triton", PATHS) is None,
        reason="on cuda XTuner's TrainEngine imports triton (xtuner/v1/loss/liger_with_weights.py:5): set "
        "SWAPOPT_TRITON_PATH to a directory holding triton 3.4.0 (pip install --target DIR --no-deps triton==3.4.0)",
    ),
    pytest.mark.skipif(
        not _found("pkg_resources", PATHS),
        reason="on cuda XTuner's MHAConfig calls mmengine's is_installed, which imports pkg_resources: set "
        "SWAPOPT_PKG_RESOURCES_PATH to a directory holding setuptools 80.9.0",
    ),
]


def test_a_factory_given_cuda_makes_a_simulated_tensor(clean_device_env):
    """`torch.tensor(0, device="cuda")` (XTuner's model and engine make their scalars so) and other factories and
    `new_*` methods given a cuda device make simulated device tensors under the cuda flavour, as `.to("cuda")`
    does; other devices are left as given."""
    with simulator.activate("h100") as sim:
        here = sim.torch_device()
        made = [
            torch.tensor(0, device="cuda"),
            torch.zeros(2, device="cuda:0"),
            torch.arange(3, device=torch.device("cuda")),
            torch.empty(2, device="cpu").new_ones(3, device="cuda"),
            torch.full((2,), 1.5, device="cuda", dtype=torch.bfloat16),
        ]
        assert [t.device for t in made] == [here] * len(made)
        assert torch.equal(made[1].cpu(), torch.zeros(2, device="cpu")) and made[4].dtype == torch.bfloat16
        assert torch.zeros(2, device="cpu").device.type == "cpu"
        assert torch.zeros(2, device=here).device == here


def _needs_engine(test):
    for mark in ENGINE_NEEDS:
        test = mark(test)
    return test


def _job(mode: str, out: Path, env: dict[str, str], paths: list[str]) -> None:
    """Run tests/xtuner_engine_job.py MODE OUT in a process of its own with `paths` first on its path."""
    env = {**os.environ, **env}
    path = [*paths, str(ROOT), str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(path)
    done = subprocess.run(
        [sys.executable, "tests/xtuner_engine_job.py", mode, str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.split()[-2:] == ["ok", mode]


@_needs_engine
def test_xtuner_train_engine_trains_bitwise_with_swap_optimizer_on_cuda(tmp_path):
    """XTuner resolves cuda at import; its TrainEngine (FSDP2 over one gloo rank) trains three steps with plain
    AdamW, XTuner's SwapAdamW and swapopt (use_swapopt()) to the same losses and params, bit for bit, on the
    simulated device, with no Triton kernel launched. And the same job run on the CPU (XTuner resolving cpu, no
    simulator) gives those losses and params bit for bit: the simulated device computes what the CPU computes."""
    (tmp_path / "sim").mkdir()
    (tmp_path / "cpu").mkdir()
    _job("engine", tmp_path / "sim", {"SWAPOPT_DEVICE": "sim", "SWAPOPT_SIM_PRESET": "h100"}, PATHS)  # cuda flavour
    _job("plain", tmp_path / "cpu", {"SWAPOPT_DEVICE": "cpu"}, [])  # XTuner imports no triton on the CPU
    simulated = torch.load(tmp_path / "sim" / "plain-cuda.pt")
    on_cpu = torch.load(tmp_path / "cpu" / "plain-cpu.pt")
    assert simulated.keys() == on_cpu.keys() and len(simulated) > 3
    for key in on_cpu:
        assert torch.equal(simulated[key], on_cpu[key]), key
