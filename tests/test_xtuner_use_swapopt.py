"""use_swapopt(): XTuner's own AdamWConfig(swap_optimizer=True) builds swapopt, its defaults and types unchanged;
multi-rank checkpoints of XTuner's SwapAdamW are refused; RL offload moves resident states off the device.

Each test runs against the stand-in copy of XTuner's AdamWConfig (tests/xtuner_standin.py) and, when XTuner v1
is importable (see tests/xtuner_real.py), against XTuner's own class."""

from __future__ import annotations

import sys
import typing

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xtuner_real  # before swapopt.integrations.xtuner: it may put a checkout on sys.path
from pydantic import ValidationError
from test_integration_xtuner import assert_same, snapshot
from xtuner_standin import TrainEngine, TrainWorker, XTunerAdamWConfig, train

import device
from swapopt import SwapOptimizer
from swapopt.integrations.xtuner import SwapoptCheckpointError, check_optimizer_shards, use_swapopt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CFG = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, foreach=True)


@pytest.fixture(params=["standin", "xtuner"])
def config_cls(request):
    """A config class that use_swapopt() has not patched yet (a fresh subclass of the stand-in), or XTuner's
    own (patched once per process: use_swapopt() is permanent there)."""
    if request.param == "standin":
        return type("AdamWConfig", (XTunerAdamWConfig,), {})
    optim = xtuner_real.xtuner_module("xtuner.v1.config.optim")
    if optim is None:
        pytest.skip("XTuner v1 is not importable (set SWAPOPT_XTUNER_SRC to a checkout of InternLM/xtuner)")
    return optim.AdamWConfig


def engine_cls():
    # A subclass per test: use_swapopt() patches the class it is given, for the whole process.
    return type("TrainEngine", (TrainEngine,), {})


def test_knobs_added_defaults_and_types_kept(config_cls):
    unpatched = not config_cls.__dict__.get("__swapopt_patched__")
    if unpatched:
        with pytest.raises(ValidationError, match="swap_optimizer_times"):
            config_cls(swap_optimizer_times=4)
        made_before = config_cls(swap_optimizer=True)
    use_swapopt(config_cls)
    build = config_cls.build
    use_swapopt(config_cls)  # idempotent: no second wrapper
    assert config_cls.build is build and not hasattr(build.__swapopt_original__, "__swapopt_original__")

    cfg = config_cls()
    assert cfg.swap_optimizer is False  # XTuner's default, not swapopt's
    assert config_cls.model_fields["swap_optimizer"].annotation == typing.Optional[bool]
    assert config_cls(swap_optimizer=None).swap_optimizer is None
    assert (cfg.swap_optimizer_times, cfg.chunk_mb, cfg.slots, cfg.resident_mb) == (16, None, 3, 0.0)
    for bad in (dict(swap_optimizer_times=0), dict(slots=0), dict(chunk_mb=-1.0), dict(resident_mb=-1.0)):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            config_cls(**bad)
    with pytest.raises(ValidationError, match="swap_optimizer_tims"):
        config_cls(swap_optimizer_tims=4)
    if unpatched:
        assert made_before.swap_optimizer is True  # instances made earlier keep working (built below)


@pytest.mark.parametrize("flag", [False, None])
def test_flag_off_or_none_builds_plain_adamw(config_cls, flag, pg):
    use_swapopt(config_cls)
    opt = TrainEngine(config_cls(**CFG, swap_optimizer=flag)).optimizer
    assert type(opt) is torch.optim.AdamW


def test_drop_in_config_trains_bitwise_like_xtuner_plain_adamw(config_cls, pg, tmp_path):
    use_swapopt(config_cls, engine_cls=(Engine := engine_cls()))
    plain = Engine(config_cls(**CFG))
    train(plain, 0, 4)

    engine = Engine(config_cls(**CFG, swap_optimizer=True, swap_optimizer_times=3, chunk_mb=0.5))
    opt = engine.optimizer
    assert isinstance(opt, SwapOptimizer) and type(opt.optimizer) is torch.optim.AdamW
    assert opt.swap_optimizer_times == 3 and opt.chunk_mb == 0.5
    train(engine, 0, 2)
    engine.save_dcp(tmp_path / "step2")
    train(engine, 2, 2)
    assert opt.swap_stats().h2d_bytes > 0
    assert_same(snapshot(engine), snapshot(plain))

    # swapopt -> plain AdamW and back, both resuming bitwise.
    for cfg in (config_cls(**CFG), config_cls(**CFG, swap_optimizer=True, swap_optimizer_times=3)):
        resumed = Engine(cfg, seed=7)
        resumed.load_dcp(tmp_path / "step2")
        train(resumed, 2, 2)
        assert_same(snapshot(resumed), snapshot(plain))
        resumed.save_dcp(tmp_path / f"again{type(resumed.optimizer).__name__}")


def test_config_made_before_use_swapopt_builds_with_default_knobs(pg):
    cls = type("AdamWConfig", (XTunerAdamWConfig,), {})
    cfg = cls(**CFG, swap_optimizer=True)
    use_swapopt(cls)
    opt = TrainEngine(cfg).optimizer
    assert isinstance(opt, SwapOptimizer) and opt.swap_optimizer_times == 16 and opt.resident_mb == 0.0


def _xtuner_swap_style_checkpoint(path, local_rows: int) -> None:
    """What XTuner's SwapAdamW writes on 2 ranks: the model sharded correctly (global [16, 12]), each optimizer
    state saved as one rank's local shard with that shard's size as its global size."""
    torch.manual_seed(0)
    state = {
        "model": {"w": torch.randn(16, 12)},
        "optimizer": {
            "state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.randn(local_rows, 12),
                            "exp_avg_sq": torch.rand(local_rows, 12), "max_exp_avg_sq": None}},
            "param_groups": [{"lr": 1e-2, "params": ["w"]}],
        },
    }
    dcp.save(state, checkpoint_id=path)


def test_xtuner_swapadamw_multirank_checkpoint_is_refused(tmp_path, sim):
    _xtuner_swap_style_checkpoint(tmp_path / "bad", local_rows=8)
    with pytest.raises(SwapoptCheckpointError, match=r"2 of 2 optimizer states .*optimizer\.state\.w\.exp_avg "
                       r"\[8, 12\].*model\.w \[16, 12\].*XTuner's own SwapAdamW.*load_states=False"):
        check_optimizer_shards(tmp_path / "bad")
    _xtuner_swap_style_checkpoint(tmp_path / "one_rank", local_rows=16)  # one rank: the local shard is the whole
    check_optimizer_shards(tmp_path / "one_rank")


def test_engine_load_dcp_refuses_it_and_loads_plain_checkpoints(pg, tmp_path):
    use_swapopt(cls := type("AdamWConfig", (XTunerAdamWConfig,), {}), engine_cls=(Engine := engine_cls()))
    source = Engine(cls(**CFG))
    train(source, 0, 1)
    source.save_dcp(tmp_path / "plain")
    # Rewrite it as XTuner's SwapAdamW would on 2 ranks: every state of a matrix param cut to half its rows.
    sd = source._get_dcp_state_dict(cpu_offload=True)
    dcp.load(sd, checkpoint_id=tmp_path / "plain")
    for st in sd["optimizer"]["state"].values():
        for k, v in st.items():
            if k != "step" and v.dim() == 2:
                st[k] = v[: v.shape[0] // 2].clone()
    dcp.save(sd, checkpoint_id=tmp_path / "halved")

    engine = Engine(cls(**CFG, swap_optimizer=True))
    with pytest.raises(SwapoptCheckpointError, match="XTuner's own SwapAdamW"):
        engine.load_dcp(tmp_path / "halved")
    # Model only: no error (the stand-in reads with torch's size-checking planner, so no optimizer args either).
    engine.load_dcp(tmp_path / "halved", load_states=False, load_args=False)
    engine.load_dcp(tmp_path / "plain")
    assert len(engine.optimizer.state) == len(source.optimizer.state)


def test_rl_offload_with_resident_states_leaves_no_optimizer_byte_on_device(config_cls, pg):
    use_swapopt(config_cls, engine_cls=(Engine := engine_cls()))
    plain = Engine(config_cls(**CFG))
    train(plain, 0, 4)
    engine = Engine(config_cls(**CFG, swap_optimizer=True, swap_optimizer_times=3, resident_mb=64))
    train(engine, 0, 2)
    opt = engine.optimizer
    opt.wait_for_swap_out()

    def on_device() -> int:
        return sum(v.numel() for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and not device.is_host_tensor(v))

    assert on_device() > 0  # resident_mb kept states on the device
    mod = device.get_torch_device_module()
    before = mod.memory_allocated()
    worker = TrainWorker(engine)
    worker.offload_optimizer()
    assert on_device() == 0 and mod.memory_allocated() < before
    worker.onload_optimizer()
    train(engine, 2, 2)
    assert on_device() > 0
    assert_same(snapshot(engine), snapshot(plain))


def test_use_swapopt_without_xtuner_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "xtuner.v1.config.optim", None)  # None in sys.modules: ImportError
    with pytest.raises(ImportError, match=r"could not be imported.*SWAPOPT|PYTHONPATH.*integrations\.xtuner import"):
        use_swapopt()


def test_explicit_import_alone_leaves_resident_states_on_the_device_through_rl_offload(pg):
    # The explicit route builds swapopt but hooks nothing in XTuner's engine (docs/xtuner.md): XTuner's worker skips
    # its optimizer offload when swap_optimizer is set, so states kept by resident_mb stay where they are.
    from swapopt.integrations.xtuner import AdamWConfig

    engine = engine_cls()(AdamWConfig(**CFG, swap_optimizer=True, swap_optimizer_times=3, resident_mb=64))
    train(engine, 0, 2)
    opt = engine.optimizer
    assert isinstance(opt, SwapOptimizer)
    opt.wait_for_swap_out()
    resident = sum(v.numel() for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and not device.is_host_tensor(v))
    assert resident > 0
    TrainWorker(engine).offload_optimizer()
    assert sum(v.numel() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and not device.is_host_tensor(v)) == resident
