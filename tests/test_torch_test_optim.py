"""torch's own optimizer tests (test/test_optim.py) pass on the simulated device wherever they pass on the CPU.

tests/torch_test_optim_run.py runs the file, as torch instantiates it for a device type, in three modes: the CPU
(the baseline), the simulated device (its PrivateUse1 type, instantiated as for cuda), and the simulated device with
every optimizer wrapped in SwapOptimizer. Every test that passes on the CPU must pass on the simulated device, and
wrapped too except where SwapOptimizer refuses what docs/optimizer.md says it refuses (sparse gradients, LBFGS,
SparseAdam, differentiable=True) and where a test reads states through a reference held across a step without
the `wait_for_swap_out()` docs/optimizer.md asks for (the sanitizer reports that race, which hardware has too;
fetching `opt.state` after the step waits by itself).

torch's wheel does not ship test_optim.py: the live checks need SWAPOPT_TORCH_TEST_OPTIM (a PyTorch checkout's
test/test_optim.py) and skip without it. They run a fixed sample (SAMPLE) to stay quick; the whole file's outcomes,
per mode, are in tests/data/torch-test-optim.json (`python tests/torch_test_optim_run.py MODE --json ...`, see
that file's "how"), which test_recorded_full_run checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch_test_optim_run as runner

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "torch-test-optim.json"

# The sample: Adam (the fused kernels of a CUDA-like device, host tensor lrs) and Adagrad (fused, sparse), on tests
# that take well under a second each on the simulator, among them the ones the simulator and SwapOptimizer once
# failed (meta params with fused=True, host states loaded into a fused device optimizer).
SAMPLE_OPTIMS = ("Adam", "Adagrad")
SAMPLE = (
    "test_fused_error_on_params_on_meta", "test_cpu_load_state_dict", "test_fused_does_not_step_if_foundinf",
    "test_step_all_hooks", "test_state_dict_pre_post_hook", "test_load_state_dict_pre_post_hook",
    "test_non_empty_state", "test_grads_are_never_inplaced_into", "test_load_nontensor_step",
    "test_deepcopy_copies_all_public_attrs", "test_errors", "test_optim_infos_do_not_specify_global_cliquey_kwargs",
)  # fmt: skip

FILE = runner.test_file()
needs_file = pytest.mark.skipif(
    FILE is None, reason=f"torch's test/test_optim.py is not shipped with torch: set {runner.ENV} to run it"
)


def _run(mode: str, tmp_path: Path) -> dict[str, list[str]]:
    out = tmp_path / f"{mode}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop("SWAPOPT_DEVICE", None)
    args = [sys.executable, str(ROOT / "tests" / "torch_test_optim_run.py"), mode, "--file", str(FILE),
            "--optims", ",".join(SAMPLE_OPTIMS), "--tests", ",".join(SAMPLE), "--json", str(out)]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["tests"]


@pytest.fixture(scope="module")
def cpu_baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return _run("cpu", tmp_path_factory.mktemp("cpu"))


@needs_file
@pytest.mark.parametrize("mode", ["sim", "wrapped"])
def test_sample_passes_where_the_cpu_passes(mode, cpu_baseline, tmp_path):
    other = _run(mode, tmp_path)
    passes = [k for k, (outcome, _) in cpu_baseline.items() if outcome == "pass"]
    assert len(passes) >= 15, cpu_baseline  # the sample is real: most of it runs on the CPU
    result = runner.compare(cpu_baseline, other, wrapped=mode == "wrapped")
    assert not result["violations"], result["violations"]
    assert result["compared"] + result["cpu_only"] == len(passes)
    if mode == "sim":
        assert not result["refusals"]


def test_compare_flags_what_it_must():
    """The comparison itself: a CPU pass that fails is a violation, a documented refusal only when wrapped, an
    @onlyCPU skip never."""
    cpu = {"a": ["pass", ""], "b": ["pass", ""], "c": ["pass", ""], "d": ["fail", "x"]}
    other = {
        "a": ["error", "ValueError: SwapOptimizer does not support sparse gradients (param_groups[0]..."],
        "b": ["skip", "Only runs on cpu"],
        "c": ["pass", ""],
        "d": ["pass", ""],
    }
    assert runner.compare(cpu, other, wrapped=True) == {
        "violations": {}, "refusals": {"sparse gradients": 1}, "compared": 2, "cpu_only": 1
    }  # fmt: skip
    assert list(runner.compare(cpu, other, wrapped=False)["violations"]) == ["a"]
    other["c"] = ["fail", "AssertionError: Tensor-likes are not equal!"]
    assert list(runner.compare(cpu, other, wrapped=True)["violations"]) == ["c"]


def test_recorded_full_run():
    """The recorded run of the whole file: every CPU pass passes on the simulated device, and wrapped, every one
    but documented refusals, for every optimizer the record covers."""
    record = json.loads(RECORD.read_text())
    cpu = record["modes"]["cpu"]
    assert record["torch"].startswith("2.13")
    for mode in ("sim", "wrapped"):
        covered = record["modes"][mode]
        assert covered, mode
        result = runner.compare(cpu, covered, wrapped=mode == "wrapped")
        assert not result["violations"], (mode, result["violations"])
        assert result == record["summary"][mode]["comparison"], mode  # the summary says what the outcomes say
        if mode == "sim":
            assert not result["refusals"]
        else:
            assert set(result["refusals"]) <= set(runner.DOCUMENTED)


def test_state_dict_passes_entries_that_are_not_a_params_states(sim):
    """torch's test_state_dict_pre_hook: a state-dict pre-hook sets `opt.state["test"] = 1`; torch's state_dict
    passes such an entry through, and so does SwapOptimizer's (it once took every entry for a param's dict)."""
    import torch

    from swapopt import SwapOptimizer

    param = torch.rand(2, 3, device=sim.torch_device(), requires_grad=True)
    opt = SwapOptimizer(torch.optim.Adagrad([param]))
    param.grad = torch.rand_like(param)
    opt.step()
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
    state = opt.state_dict()["state"]
    assert state["test"] == 1
    assert set(state[0]) == {"step", "sum"} and not sim.is_host(param) and state[0]["sum"].device.type == "cpu"
