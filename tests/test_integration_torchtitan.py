"""torchtitan: SwapOptimizersContainer with its DCP CheckpointManager (sync and async with pinned staging):
save, load into a fresh container, continue bitwise like torchtitan's own OptimizersContainer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan")

from torchtitan.components.checkpointer.dcp import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import (  # noqa: E402
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)
from dist_utils import assert_host_states  # noqa: E402

import device  # noqa: E402

from swapopt import SwapOptimizer  # noqa: E402
from swapopt.integrations.torchtitan import SwapOptimizersContainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

GROUPS = [
    ParamGroupConfig(pattern=r"\.bias$", optimizer_name="AdamW",
                     optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.0, "betas": (0.9, 0.95)}),
    ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                     optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}),
]


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def container(m: nn.Module, swap: bool):
    cfg = (SwapOptimizersContainer.Config(param_groups=GROUPS, implementation="foreach", swap_optimizer_times=2)
           if swap else OptimizersContainer.Config(param_groups=GROUPS, implementation="foreach"))
    return cfg.build(model_parts=[m])


def run(seed: int, swap: bool):
    """A model, its optimizers container and torchtitan's LR schedulers over it (warmup 2 steps)."""
    m = model(seed)
    opts = container(m, swap)
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=10)
    return m, opts, scheds


def checkpointer(folder, m, opts, scheds, async_mode: str = "disabled") -> CheckpointManager:
    cfg = CheckpointManager.Config(enable=True, folder=str(folder), interval=1, async_mode=async_mode,
                                   keep_latest_k=0)
    return cfg.build(dataloader=None, model_parts=[m], optimizers=opts, lr_schedulers=scheds, states={},
                     sd_adapter=None)


def train(m, opts, scheds, start: int, steps: int, ckpt=None) -> None:
    for step in range(start, start + steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step), device="cpu").to(device.torch_device())
        m(x).pow(2).mean().backward()
        if ckpt is not None:
            ckpt.maybe_wait_for_staging()  # as torchtitan's trainer does before every step
        opts.step()
        scheds.step()
        opts.zero_grad()


def snapshot(m, opts) -> dict:
    out = {f"p.{n}": p.detach().clone() for n, p in m.named_parameters()}
    out.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opts.state_dict().items()})
    return out


def assert_same(a: dict, b: dict) -> None:
    """Bitwise, compared on the host (.cpu() on both sides, as on CUDA: swapped states live in host memory)."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def test_config_knobs_are_validated_and_wrap_each_optimizer(sim):
    with pytest.raises(ValueError, match="swap_optimizer_times"):
        SwapOptimizersContainer.Config(param_groups=GROUPS, swap_optimizer_times=0)
    with pytest.raises(ValueError, match="fused_opt_states_bf16"):
        SwapOptimizersContainer.Config(param_groups=GROUPS, implementation="fused_opt_states_bf16").build(
            model_parts=[model(0)])
    opts = container(model(0), swap=True)
    assert isinstance(opts, OptimizersContainer) and len(opts) == 1
    assert all(isinstance(o, SwapOptimizer) for o in opts)
    assert [g["weight_decay"] for g in opts.optimizers[0].param_groups] == [0.0, 0.1]
    plain = SwapOptimizersContainer.Config(param_groups=GROUPS, swap_optimizer=False).build(model_parts=[model(0)])
    assert not any(isinstance(o, SwapOptimizer) for o in plain)


def test_config_carries_every_swap_knob_with_its_default(sim):
    from swapopt.config import KNOBS, SwapSettings

    fields = {f.name: f for f in dataclasses.fields(SwapOptimizersContainer.Config)}
    for name in KNOBS:
        assert fields[name].default == SwapSettings.model_fields[name].default, name
        assert fields[name].metadata["doc"], name
    opts = SwapOptimizersContainer.Config(param_groups=GROUPS, master_weights=True, slots=2, chunk_mb=1.0,
                                          prefetch=True).build(model_parts=[m := model(0)])
    settings = opts.optimizers[0].settings
    assert (settings.master_weights, settings.slots, settings.chunk_mb, settings.prefetch) == (True, 2, 1.0, True)
    assert m._forward_hooks, "prefetch attaches the model part's forward hook"
    with pytest.raises(ValueError, match="overlap_forward"):
        SwapOptimizersContainer.Config(param_groups=GROUPS, overlap_forward=True).build(model_parts=[model(0)])


# "async_with_pinned_mem" stages with non-blocking copies, which need a real accelerator.
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_checkpoint_manager_save_load_continue_bitwise(pg, tmp_path, async_mode):
    ref_m, ref, ref_s = run(0, swap=False)
    train(ref_m, ref, ref_s, 0, 4)

    m, opts, scheds = run(0, swap=True)
    ckpt = checkpointer(tmp_path / "ckpt", m, opts, scheds, async_mode)
    train(m, opts, scheds, 0, 2)
    assert ckpt.save(curr_step=2)
    train(m, opts, scheds, 2, 2, ckpt)  # with async staging, the first of these steps waits for the staging
    ckpt.maybe_wait_for_saving()
    assert opts.optimizers[0].swap_stats().h2d_bytes > 0
    assert_same(snapshot(m, opts), snapshot(ref_m, ref))
    ckpt.close()

    m2, opts2, scheds2 = run(5, swap=True)  # another init: everything must come from the checkpoint
    ckpt2 = checkpointer(tmp_path / "ckpt", m2, opts2, scheds2)
    assert ckpt2.load(step=2)
    assert_host_states(opts2.optimizers[0])
    train(m2, opts2, scheds2, 2, 2)
    assert_same(snapshot(m2, opts2), snapshot(ref_m, ref))
    ckpt2.close()
