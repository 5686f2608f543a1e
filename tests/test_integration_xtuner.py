"""XTuner v1: swapopt's AdamWConfig inside a stand-in of XTuner's TrainEngine (FSDP2, DCP, RL offload), bitwise
equal to the same engine running torch's AdamW. The stand-in makes the calls XTuner's engine makes (see
tests/xtuner_standin.py); XTuner v1 itself is not on the package registry."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from xtuner_standin import TrainEngine, TrainWorker, train

import device
from swapopt import SwapOptimizer
from swapopt.integrations.xtuner import XTUNER_AVAILABLE, AdamWConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CFG = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, foreach=True)


def swap_cfg(**kw) -> AdamWConfig:
    return AdamWConfig(**CFG, swap_optimizer=True, swap_optimizer_times=3, **kw)


def plain_cfg() -> AdamWConfig:
    return AdamWConfig(**CFG, swap_optimizer=False)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(engine: TrainEngine) -> dict:
    opt = engine.optimizer
    if isinstance(opt, SwapOptimizer):
        opt.wait_for_swap_out()
    out = {f"param.{n}": full(p).clone() for n, p in engine.model.named_parameters()}
    names = {p: n for n, p in engine.model.named_parameters()}
    for p, st in opt.state.items():
        for key, value in st.items():
            out[f"state.{names[p]}.{key}"] = full(value).clone() if isinstance(value, torch.Tensor) else value
    return out


def assert_same(a: dict, b: dict) -> None:
    """Bitwise, compared on the host (.cpu() on both sides, as on CUDA: swapped states live in host memory)."""
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key].cpu(), b[key].cpu()), key
        else:
            assert a[key] == b[key], key


def assert_states_on_host(engine: TrainEngine) -> int:
    checked = 0
    for st in engine.optimizer.state.values():
        for key, value in st.items():
            if key != "step" and isinstance(value, torch.Tensor):
                assert device.is_host_tensor(value), key
                checked += 1
    return checked


def test_config_fields_defaults_and_validation():
    cfg = AdamWConfig()
    # XTuner's default and type: swapping is off unless asked for, and None means off.
    assert cfg.swap_optimizer is False and cfg.swap_optimizer_times == 16 and cfg.slots == 3
    assert AdamWConfig(swap_optimizer=None).swap_optimizer is None
    assert (cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps, cfg.max_grad_norm) == (1e-5, 0.01, (0.9, 0.95), 1e-8, 1.0)
    assert {"skip_grad_norm_threshold", "foreach", "chunk_mb", "resident_mb"} <= set(AdamWConfig.model_fields)
    for bad in (dict(swap_optimizer_times=0), dict(slots=0), dict(chunk_mb=-1.0), dict(resident_mb=-1.0)):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            AdamWConfig(**bad)
    with pytest.raises(ValidationError, match="swap_optimizer_tims"):
        AdamWConfig(swap_optimizer_tims=4)
    with pytest.raises(ValidationError, match="slots"):
        cfg.slots = 0
    if XTUNER_AVAILABLE:
        from xtuner.v1.config import AdamWConfig as XTunerAdamWConfig

        assert issubclass(AdamWConfig, XTunerAdamWConfig)


def test_engine_trains_clips_and_checkpoints_bitwise_like_adamw(pg, tmp_path):
    plain = TrainEngine(plain_cfg())
    train(plain, 0, 4)

    engine = TrainEngine(swap_cfg())
    opt = engine.optimizer
    assert isinstance(opt, SwapOptimizer) and type(opt.optimizer) is torch.optim.AdamW
    assert [p for g in opt.param_groups for p in g["params"]] == [p for _, p in engine.model.trainable_parameters()]
    assert hasattr(next(engine.model.parameters()), "full_tensor")  # FSDP2 DTensor params
    # clip_grad_norm reads the group flag from optimizer.param_groups: the inner AdamW's own dicts.
    opt.param_groups[0]["clip_grad"] = True
    assert opt.optimizer.param_groups[0]["clip_grad"] is True
    train(engine, 0, 2)
    engine.save_dcp(tmp_path / "step2")
    train(engine, 2, 2)
    assert opt.swap_stats().h2d_bytes > 0
    assert_same(snapshot(engine), snapshot(plain))  # the same state keys too

    resumed = TrainEngine(swap_cfg(), seed=7)
    resumed.load_dcp(tmp_path / "step2")
    assert assert_states_on_host(resumed)
    train(resumed, 2, 2)
    assert_same(snapshot(resumed), snapshot(plain))


def test_async_save_with_a_step_during_the_save_keeps_the_pre_step_state(pg, tmp_path):
    engine = TrainEngine(swap_cfg())
    train(engine, 0, 2)
    expected = snapshot(engine)
    future = engine.async_save_dcp(tmp_path / "async")
    train(engine, 2, 1)  # the save is still pending while this step rewrites the host states
    future.result()
    loaded = TrainEngine(swap_cfg(), seed=3)
    loaded.load_dcp(tmp_path / "async")
    assert_same(snapshot(loaded), expected)


def test_rl_offload_onload_and_offload_first_step_leave_states_on_host(pg, tmp_path, monkeypatch):
    engine = TrainEngine(swap_cfg())
    plain = TrainEngine(plain_cfg())
    for e in (engine, plain):
        train(e, 0, 2)
    engine.save_dcp(tmp_path / "ckpt")

    worker = TrainWorker(engine)
    emptied = []
    mod = device.get_torch_device_module()
    monkeypatch.setattr(mod, "empty_cache", lambda *a: emptied.append(1))
    worker.offload_optimizer()
    assert assert_states_on_host(engine)
    worker.onload_optimizer()
    assert worker.skipped == ["offload", "onload"] and emptied  # nothing moved, the cache was still emptied
    assert engine.put_optimizer_to_device("cpu") is False

    resumed = TrainEngine(swap_cfg(), seed=5)
    resumed.load_dcp(tmp_path / "ckpt")
    train(resumed, 2, 2, offload_first_step=True)
    assert assert_states_on_host(resumed)
    train(plain, 2, 2)
    assert_same(snapshot(resumed), snapshot(plain))


def test_xtuner_format_state_dict_loads_and_continues_bitwise(pg):  # XTuner's build reads the rank
    # XTuner's own SwapAdamW stores ``max_exp_avg_sq: None`` for every param when amsgrad is off.
    source = TrainEngine(plain_cfg())
    train(source, 0, 2)
    xtuner_sd = source.optimizer.state_dict()
    for st in xtuner_sd["state"].values():
        st["max_exp_avg_sq"] = None

    swap, plain = TrainEngine(swap_cfg(), seed=1), TrainEngine(plain_cfg(), seed=1)
    for e in (swap, plain):
        e.model.load_state_dict(source.model.state_dict())
        e.optimizer.load_state_dict(xtuner_sd)
        train(e, 2, 2)
    assert_same(snapshot(swap), snapshot(plain))
    assert swap.optimizer.swap_stats().h2d_bytes > 0
