"""mmengine: a Runner trains with SwapOptimWrapper, saves, resumes; swapped states stay on the host throughout."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("mmengine")

from mmengine.hooks import Hook  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.optim import build_optim_wrapper  # noqa: E402
from mmengine.runner import Runner  # noqa: E402
from dist_utils import assert_host_states  # noqa: E402

from swapopt import SwapOptimizer  # noqa: E402
from swapopt.integrations.mmengine import SwapAmpOptimWrapper, SwapOptimWrapper, swaps  # noqa: E402

SWAP_WRAPPER = dict(type="SwapOptimWrapper", optimizer=dict(type="AdamW", lr=1e-2), swap_optimizer_times=2)


class Regressor(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, inputs, targets, mode="tensor"):
        out = self.net(inputs)
        return {"loss": F.mse_loss(out, targets)} if mode == "loss" else out


class Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 8, generator=gen)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"inputs": self.x[i], "targets": self.y[i]}


class HostStates(Hook):
    """Asserts before and after every iteration that each swapped state is a host tensor."""

    def __init__(self) -> None:
        self.checked = 0

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        self._check(runner)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self._check(runner)

    def _check(self, runner) -> None:
        opt = runner.optim_wrapper.optimizer
        assert isinstance(opt, SwapOptimizer)
        self.checked += assert_host_states(opt)


def make_runner(work_dir, name: str, max_iters: int, hook: Hook, resume: bool = False) -> Runner:
    return Runner(
        model=Regressor(),
        work_dir=str(work_dir),
        experiment_name=name,
        train_dataloader=dict(dataset=Pairs(), sampler=dict(type="DefaultSampler", shuffle=False),
                              batch_size=8, collate_fn=dict(type="default_collate")),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        optim_wrapper=SWAP_WRAPPER,
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=2, by_epoch=False)),
        custom_hooks=[hook],
        resume=resume,
        randomness=dict(seed=0),
    )


def test_runner_trains_saves_resumes_with_states_on_host(sim, tmp_path, monkeypatch):
    # mmengine 0.10 calls torch.load without weights_only; torch >= 2.6 then refuses its own checkpoints
    # (open-mmlab/mmengine#1655). These are checkpoints this test just wrote.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    # On an accelerator Runner.resume would load with map_location=get_device(): make that "cuda" here and
    # record the map_location the checkpoint is really loaded with (loading itself goes to the CPU).
    import mmengine.runner.runner as runner_module

    locations = []
    load_checkpoint = Runner.load_checkpoint

    def spy(self, filename, map_location="cpu", *args, **kwargs):
        locations.append(map_location)
        return load_checkpoint(self, filename, "cpu", *args, **kwargs)

    monkeypatch.setattr(Runner, "load_checkpoint", spy)
    straight_hook, first_hook, resumed_hook = HostStates(), HostStates(), HostStates()
    straight = make_runner(tmp_path / "straight", "straight", 4, straight_hook)
    straight.train()

    first = make_runner(tmp_path / "split", "first", 2, first_hook)
    first.train()
    assert isinstance(first.optim_wrapper, SwapOptimWrapper)
    assert (tmp_path / "split" / "iter_2.pth").is_file()

    resumed = make_runner(tmp_path / "split", "resumed", 4, resumed_hook, resume=True)
    monkeypatch.setattr(runner_module, "get_device", lambda: "cuda")  # after the model was placed
    resumed.train()
    assert resumed.iter == 4
    assert locations == ["cpu"]  # resume=True, as users set it, kept the swapped states off the device
    assert first_hook.checked and resumed_hook.checked  # states existed and were checked after resume
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)


def test_resume_map_location_only_changes_for_swapping_runners(sim, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    first = make_runner(tmp_path, "first", 2, HostStates())
    first.train()
    seen = []
    ckpt = str(tmp_path / "iter_2.pth")
    cases = [
        (SWAP_WRAPPER, {}, "cpu"),  # a config dict, before train() builds it
        (dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-2)), {}, "npu"),
        (dict(gen=SWAP_WRAPPER, constructor="MultiOptimWrapperConstructor"), {}, "cpu"),
        (SWAP_WRAPPER, {"map_location": "npu:1"}, "npu:1"),  # an explicit choice is honoured
    ]
    runners = [make_runner(tmp_path, f"probe{i}", 2, HostStates()) for i in range(len(cases))]
    # Patched after the runners placed their models: mmengine's get_device now answers "npu".
    monkeypatch.setattr(Runner, "load_checkpoint",
                        lambda self, filename, map_location="cpu", **kw: seen.append(map_location) or {})
    monkeypatch.setattr("mmengine.runner.runner.get_device", lambda: "npu")
    for runner, (optim_wrapper, explicit, expected) in zip(runners, cases):
        runner.optim_wrapper = optim_wrapper
        with pytest.raises((KeyError, TypeError)):  # the fake checkpoint is empty: resume stops after loading
            runner.resume(ckpt, **explicit)
        assert seen.pop() == expected
    assert isinstance(first.optim_wrapper, SwapOptimWrapper) and swaps(first.optim_wrapper)


def test_forced_amp_on_npu_keeps_swapping_with_the_swap_constructor(sim, monkeypatch):
    # mmengine replaces the wrapper type by AmpOptimWrapper on NPUs without full-precision support.
    import mmengine.optim.optimizer.amp_optimizer_wrapper as amp_module
    import mmengine.optim.optimizer.builder as builder

    monkeypatch.setattr(builder, "is_npu_available", lambda: True)
    monkeypatch.setattr(builder, "is_npu_support_full_precision", lambda: False)
    monkeypatch.setattr(amp_module, "is_npu_available", lambda: True)
    with pytest.raises(TypeError, match="swap_optimizer_times"):
        build_optim_wrapper(Regressor(), dict(SWAP_WRAPPER))
    wrapper = build_optim_wrapper(Regressor(), dict(SWAP_WRAPPER, constructor="SwapOptimWrapperConstructor"))
    assert isinstance(wrapper, SwapAmpOptimWrapper) and isinstance(wrapper.optimizer, SwapOptimizer)


def test_import_without_mmengine_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mmengine.optim", None)
    monkeypatch.delitem(sys.modules, "swapopt.integrations.mmengine")
    with pytest.raises(ImportError, match=r"needs mmengine: pip install 'swapopt\[mmengine\]'"):
        importlib.import_module("swapopt.integrations.mmengine")


def test_every_swap_knob_reaches_the_optimizer_and_bad_ones_are_named(sim):
    cfg = dict(SWAP_WRAPPER, master_weights=True, slots=2, prefetch=True, clip_grad=dict(max_norm=1.0))
    wrapper = build_optim_wrapper(Regressor(), cfg)
    settings = wrapper.optimizer.settings
    assert (settings.master_weights, settings.slots, settings.prefetch) == (True, 2, True)
    assert wrapper.clip_grad_kwargs == dict(max_norm=1.0)  # the rest goes to mmengine's wrapper
    with pytest.raises(ValueError, match="slots"):
        build_optim_wrapper(Regressor(), dict(SWAP_WRAPPER, slots=0))
