"""The device-dependent tests again, under the simulator's npu flavour (SWAPOPT_SIM_PRESET=910b: device
type npu, torch.npu, an importable torch_npu), in a pytest session of its own: torch names its PrivateUse1
backend once per process, so a process simulates one flavour (Note [simulated device type])."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import cli_zygote

TESTS = Path(__file__).parent
# The tests whose subject is the device: stepping and its failures, streams and races, memory, offload,
# checkpoints, the engine. The rest (CLI, integrations, benchmarks) do not depend on the flavour;
# test_npu_torch_npu.py runs itself under the npu flavour.
DEVICE_DEPENDENT = (
    "test_parity.py",
    "test_failure.py",
    "test_sim_corpus.py",
    "test_sim_sanitizer.py",
    "test_offload.py",
    "test_overlap.py",
    "test_checkpoint.py",
    "test_swap_memory.py",
    "test_engine.py",
    "test_master_weights.py",  # its optim_db matrix is a file of its own: the flavour changes no kernel it runs
    "test_graphed.py",  # torch_npu's CPU fallbacks (fused Adam with a tensor lr) cannot be captured
)


def run_under_npu(files: tuple[str, ...]) -> None:
    """``files`` pass in a pytest session of their own under the npu flavour."""
    env = {**os.environ, "SWAPOPT_SIM_PRESET": "910b"}
    env.pop("SWAPOPT_DEVICE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), env.get("PYTHONPATH")]))
    paths = [str(TESTS / name) for name in files]
    # forked from a process that imported torch once (tests/cli_zygote.py): the session names the backend itself
    run = cli_zygote.run(["-m", "pytest", "-v", "-n", "0", "-p", "no:cacheprovider", "-x", *paths], env=env,
                         timeout=900, cwd=TESTS.parent)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "simulated device: npu flavour" in run.stdout  # conftest's report header: the session's flavour
    assert " passed" in run.stdout


# The suite's workers take a file each (--dist loadfile): the second half runs from test_npu_flavour_second_half.py
# so that two workers share these minutes.
FIRST_HALF, SECOND_HALF = DEVICE_DEPENDENT[::2], DEVICE_DEPENDENT[1::2]


@pytest.mark.slow
def test_device_dependent_tests_pass_under_the_npu_flavour() -> None:
    run_under_npu(FIRST_HALF)
