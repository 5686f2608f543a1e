"""Mistakes a new user makes, each met by a clear refusal or a warning that names the fix, and the import
cost a training script pays for `import swapopt`."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

import cli_zygote
from swapopt import SwapConfig, SwapOptimizer

ROOT = Path(__file__).resolve().parents[1]


def _params(n: int = 3, numel: int = 64) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]


def _grads(params) -> None:
    for p in params:
        p.grad = torch.randn_like(p)


def test_a_second_wrapper_of_one_optimizer_is_refused_naming_the_first(sim):
    inner = torch.optim.AdamW(_params())
    first = SwapOptimizer(inner)
    with pytest.raises(ValueError, match=f"already wrapped by another SwapOptimizer \\(id {id(first):#x}\\)"):
        SwapOptimizer(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        SwapConfig(swap_optimizer=True).wrap(inner)
    # Dropping the first frees the optimizer for a new wrapper; copies of a wrapper wrap their own copy.
    copy = __import__("copy").deepcopy(first)
    assert copy.optimizer is not inner
    del first
    again = SwapOptimizer(inner)
    _grads(again.optimizer.param_groups[0]["params"])
    again.step()


def test_params_left_in_host_memory_warn_once_that_nothing_swaps(sim):
    params = [torch.nn.Parameter(torch.randn(64, device="cpu")) for _ in range(2)]
    opt = SwapOptimizer(torch.optim.AdamW(params))
    _grads(params)
    with pytest.warns(UserWarning, match=r"2 param\(s\) are in host memory.*model.to\(device.torch_device\(\)\)") as seen:
        opt.step()
    assert seen[0].filename == __file__  # points at the step() call
    assert opt.swap_stats().steps == 0
    _grads(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once


@pytest.mark.parametrize("knob", ["swap_optimizer_times", "slots"])
def test_a_bool_for_a_count_is_refused(sim, knob):
    with pytest.raises(ValueError, match=f"{knob} must be an int >= 1, got True"):
        SwapOptimizer(torch.optim.AdamW(_params()), **{knob: True})
    with pytest.raises(ValueError, match="a count, not a switch"):
        SwapConfig(swap_optimizer=True, **{knob: True})
    assert getattr(SwapConfig(swap_optimizer=True, **{knob: 2}), knob) == 2


def test_offload_defaults_agree():
    import inspect

    import swapopt

    defaults = {f.__qualname__: inspect.signature(f).parameters["empty_cache"].default
                for f in (swapopt.offload, swapopt.offloaded, SwapOptimizer.offload)}
    assert set(defaults.values()) == {True}, defaults


def test_a_group_added_under_overlap_forward_without_its_module_warns(sim):
    model, extra = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=True)
    opt.attach(model)
    with pytest.warns(UserWarning, match=r"2 param\(s\) of the new group belong to no model passed to attach"):
        opt.add_param_group({"params": list(extra.parameters())})
    again = torch.nn.Linear(4, 4)
    opt.attach(again)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.add_param_group({"params": list(again.parameters())})  # attached first: no warning


def _prefetch_warnings(times: int, steps: int = 4) -> list[str]:
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters()), swap_optimizer_times=times, prefetch=True)
    opt.attach(model)
    x = torch.randn(2, 64)
    prefetched = 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(steps):
            model(x).sum().backward()
            prefetched += opt.operate.prefetched is not None
            opt.step()
            opt.zero_grad()
    assert prefetched >= 2  # the warning below is about prefetches that happened
    return [str(w.message) for w in seen if "prefetch holds" in str(w.message)]


def test_prefetch_holding_most_of_the_states_warns_once(sim):
    said = _prefetch_warnings(times=4)
    assert len(said) == 1 and "raise swap_optimizer_times" in said[0], said
    assert _prefetch_warnings(times=16) == []  # two chunks ahead of 16: a small share, nothing to say


def test_import_swapopt_leaves_torch_distributed_tensor_unimported():
    # torch.distributed.tensor costs most of a second to import; a script that never makes a DTensor
    # should not pay it for swapopt.
    code = "import sys, swapopt; print('torch.distributed.tensor' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("SWAPOPT_DEVICE", None)
    run = cli_zygote.run(["-c", code], cwd=os.getcwd(), env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_a_model_left_on_the_host_fails_at_its_first_op_with_device_data(sim):
    # As on CUDA: the forward's first op mixing host weights and device inputs raises torch's own error; the
    # optimizer is never reached with a half-built step.
    model = torch.nn.Linear(8, 8, device="cpu")
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters()))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        model(torch.randn(4, 8, device=sim.torch_device()))
    assert opt.swap_stats().steps == 0 and not opt.state
