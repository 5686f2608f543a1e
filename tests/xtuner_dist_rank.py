"""One rank of the 2-rank XTuner checks (launched by tests/test_xtuner_dist.py, torchrun-style env, simulator).

Usage: xtuner_dist_rank.py MODE DIR
- ``dropin``: XTuner's AdamWConfig (XTuner's own when importable, else the stand-in copy) patched by
  use_swapopt(); the stand-in TrainEngine (FSDP2 over both ranks) trains with ``swap_optimizer=True`` and with
  the plain config, saves, resumes each way; every comparison is bitwise, made here, on full tensors.
- ``moe``: needs XTuner's MoE model (tests/xtuner_moe.py): XTuner's AdamWConfig patched by use_swapopt() trains
  it with swapopt bitwise like XTuner's plain AdamW, saves, and resumes bitwise against the uninterrupted run; the
  fused expert weights' local shards are cut across chunks.
- ``xtuner_swap_ckpt``: needs XTuner: its own SwapAdamW (use_swapopt() not called yet) trains and saves; then
  use_swapopt() and load_dcp must raise SwapoptCheckpointError.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import xtuner_real  # before swapopt.integrations.xtuner: it may put a checkout on sys.path
from dist_utils import end_rank
from test_integration_xtuner import assert_same, snapshot
from xtuner_standin import TrainEngine, XTunerAdamWConfig, train

import device
from swapopt import SwapOptimizer
from swapopt.integrations.xtuner import AdamWConfig as ExplicitAdamWConfig
from swapopt.integrations.xtuner import SwapoptCheckpointError, use_swapopt

CFG = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, foreach=True)


def config_cls():
    optim = xtuner_real.xtuner_module("xtuner.v1.config.optim")
    return optim.AdamWConfig if optim is not None else type("AdamWConfig", (XTunerAdamWConfig,), {})


def dropin(out: Path) -> None:
    cls, engine_cls = config_cls(), type("TrainEngine", (TrainEngine,), {})
    use_swapopt(cls, engine_cls=engine_cls)
    plain = engine_cls(cls(**CFG))
    train(plain, 0, 4)
    swap = engine_cls(cls(**CFG, swap_optimizer=True, swap_optimizer_times=3))
    assert isinstance(swap.optimizer, SwapOptimizer)
    train(swap, 0, 2)
    swap.save_dcp(out / "swap2")
    plain2 = engine_cls(cls(**CFG))
    train(plain2, 0, 2)
    plain2.save_dcp(out / "plain2")
    train(swap, 2, 2)
    assert swap.optimizer.swap_stats().h2d_bytes > 0
    expected = snapshot(plain)
    assert_same(snapshot(swap), expected)
    # swapopt -> plain, plain -> swapopt: both resume bitwise.
    for ckpt, cfg in (("swap2", cls(**CFG)), ("plain2", cls(**CFG, swap_optimizer=True, swap_optimizer_times=3))):
        resumed = engine_cls(cfg, seed=7)
        resumed.load_dcp(out / ckpt)
        train(resumed, 2, 2)
        assert_same(snapshot(resumed), expected)
    if dist.get_rank() == 0:
        (out / "dropin.ok").write_text(cls.__module__)


def xtuner_swap_ckpt(out: Path) -> None:
    optim = xtuner_real.xtuner_module("xtuner.v1.config.optim")
    assert optim is not None, "xtuner_swap_ckpt needs XTuner v1 importable"
    # XTuner moves its states with .to(DEVICE), DEVICE being the device type: on CUDA that is the rank's current
    # device; the simulator wants the index.
    sys.modules["xtuner.v1.optim.swap_adamw"].DEVICE = device.torch_device()
    cls = optim.AdamWConfig
    assert not cls.__dict__.get("__swapopt_patched__")
    xt = TrainEngine(cls(**CFG, swap_optimizer=True))
    assert type(xt.optimizer).__module__.startswith("xtuner."), type(xt.optimizer)
    train(xt, 0, 2)
    xt.save_dcp(out / "xtuner_swap")
    saved = snapshot(xt)
    planner = {"load_planner_cls": xtuner_real.xtuner_module("xtuner.v1.patch").InterleavedShardLoadPlanner}

    # Without use_swapopt()'s check, swapopt loads it as XTuner's engine would: no error, and no moment restored.
    unchecked = type("TrainEngine", (TrainEngine,), planner)(ExplicitAdamWConfig(**CFG, swap_optimizer=True), seed=3)
    unchecked.load_dcp(out / "xtuner_swap")
    loaded = snapshot(unchecked)
    # XTuner's states are each rank's local shard: the true full moment is their concatenation.
    moments = [k for k in saved if k.endswith((".exp_avg", ".exp_avg_sq")) and isinstance(saved[k], torch.Tensor)]
    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(shards, {k: saved[k].cpu() for k in moments})
    wrong = [k for k in moments if not torch.equal(loaded[k].cpu(), torch.cat([s[k] for s in shards]))]
    assert moments and wrong == moments, (len(wrong), len(moments))

    engine_cls = type("TrainEngine", (TrainEngine,), planner)
    use_swapopt(cls, engine_cls=engine_cls)
    engine = engine_cls(cls(**CFG, swap_optimizer=True))
    try:
        engine.load_dcp(out / "xtuner_swap")
    except SwapoptCheckpointError as e:
        if dist.get_rank() == 0:
            (out / "xtuner_swap.err").write_text(str(e))
    else:
        raise AssertionError("a 2-rank checkpoint of XTuner's SwapAdamW loaded without error")


def moe(out: Path) -> None:
    import xtuner_moe
    import xtuner_moe_ops

    optim = xtuner_real.xtuner_module("xtuner.v1.config.optim")
    assert optim is not None and xtuner_moe.QWEN3 is not None, "moe needs XTuner v1's MoE model importable"
    cls, engine_cls = optim.AdamWConfig, type("TrainEngine", (xtuner_moe.MoETrainEngine,), {})
    use_swapopt(cls, engine_cls=engine_cls)
    swap_cfg = dict(CFG, swap_optimizer=True, swap_optimizer_times=6)
    with xtuner_moe_ops.install():
        plain = engine_cls(cls(**CFG))
        train(plain, 0, 4)
        expected = snapshot(plain)
        swap = engine_cls(cls(**swap_cfg))
        assert isinstance(swap.optimizer, SwapOptimizer)
        train(swap, 0, 2)
        swap.save_dcp(out / "moe2")
        train(swap, 2, 2)
        assert swap.optimizer.swap_stats().h2d_bytes > 0
        assert_same(snapshot(swap), expected)
        held = xtuner_moe.expert_chunks(swap)
        assert len(held) == 4 and all(held.values()), held
        assert any(len(ks) > 1 for ks in held.values()) and len(set().union(*held.values())) > 1, held
        for cfg in (cls(**swap_cfg), cls(**CFG)):  # swapopt's 2-rank MoE checkpoint, into swapopt and plain AdamW
            resumed = engine_cls(cfg, seed=7)
            resumed.load_dcp(out / "moe2")
            train(resumed, 2, 2)
            assert_same(snapshot(resumed), expected)
    if dist.get_rank() == 0:
        from xtuner.v1.utils.device import get_device

        (out / "moe.ok").write_text(f"{cls.__module__} {get_device()}")  # the device XTuner resolved


def main() -> None:
    device.get_torch_device_module().set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"dropin": dropin, "moe": moe, "xtuner_swap_ckpt": xtuner_swap_ckpt}[mode](out)
    end_rank()


if __name__ == "__main__":
    main()
