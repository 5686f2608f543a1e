"""TrainEngine: model and data determinism, config validation, swap parity and bitwise DCP resume."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import device
from swapopt import SwapOptimizer
from swapopt.engine.config import ConfigError, EngineConfig, LRConfig, ModelConfig, load_config, parse_cfg_options
from swapopt.engine.data import CORPUS, ByteBatches, load_tokens
from swapopt.engine.model import TinyLM, build_model
from swapopt.engine.schedule import lr_at
from swapopt.engine.trainer import TrainEngine

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16", "train.batch=2",
         "train.seq_len=16", "train.steps=4", "train.compare_resident=0", "lr.warmup_steps=1"]


def small_cfg(*options: str) -> EngineConfig:
    return load_config(CONFIGS / "tiny.py", [*SMALL, *options])


def run_steps(engine: TrainEngine, n: int) -> list[float]:
    return [engine.train_step()["loss"] for _ in range(n)]


def test_model_init_is_a_function_of_the_seed():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=16)
    torch.manual_seed(123)  # the global RNG must not matter
    a = TinyLM(cfg, seed=7)
    torch.randn(1000)
    b = TinyLM(cfg, seed=7)
    c = TinyLM(cfg, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_tied_embeddings_share_one_parameter():
    model = TinyLM(ModelConfig(dim=32, n_layers=1, n_heads=2, tie_embeddings=True))
    assert model.head.weight is model.embed.weight
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256)


def test_hf_model_without_transformers_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs the `transformers` package"):
        build_model(ModelConfig(hf_path="/models/some-llm"))


def test_shipped_corpus_and_batches_are_deterministic_and_sharded():
    tokens = load_tokens()
    assert CORPUS.stat().st_size < 2**20 and tokens.numel() == CORPUS.stat().st_size
    assert bytes(tokens[:14].tolist()) == b"First Citizen:"
    whole = ByteBatches(tokens, batch=4, seq_len=16, seed=3)
    x, y = whole.get(5)
    assert x.shape == (4, 16) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(whole.get(5)[0], x) and not torch.equal(whole.get(6)[0], x)
    # Two ranks with 2 sequences each see exactly the 4 sequences of a one-rank batch of 4.
    ranks = [ByteBatches(tokens, batch=2, seq_len=16, seed=3, rank=r, world_size=2).get(5)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(ranks), x)


def test_lr_warmup_then_cosine_to_floor():
    cfg = LRConfig(warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_at(s, 20, 1.0, cfg) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lr_at(20, 20, 1.0, cfg) == pytest.approx(0.1)


def test_cfg_options_parse_python_and_yaml_literals():
    assert parse_cfg_options(["a.b=3", "c=3e-4", "d=true", "e=(0.9,0.99)", "f=null", "g=hello"]) == {
        "a.b": 3, "c": 3e-4, "d": True, "e": (0.9, 0.99), "f": None, "g": "hello"}


@pytest.mark.parametrize("option, key", [
    ("optim.swap_optimizr=true", "optim.swap_optimizr"),
    ("train.steps=abc", "train.steps"),
    ("optim.betas=0.9", "optim.betas"),
    ("optim.type=NoSuchOpt", "optim.type"),
    ("colour=blue", "colour"),
])
def test_bad_config_names_the_key(option, key):
    with pytest.raises(ConfigError, match="(?:^bad config: |; )" + re.escape(key) + ": ") as info:
        small_cfg(option)
    assert "\n" not in str(info.value)  # one line


def test_unknown_key_in_a_config_file_is_named(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"train\.stepz: unknown key \(did you mean train\.steps\?\)"):
        load_config(path)


def test_swap_with_an_unsupported_optimizer_is_refused_naming_the_key(sim):
    cfg = small_cfg("optim.type=LBFGS")
    with pytest.raises(ConfigError, match=r"optim\.type: swap_optimizer=True cannot wrap LBFGS"):
        cfg.optim.build([torch.nn.Parameter(torch.zeros(4))])


def test_swap_key_builds_a_swap_optimizer_with_the_knobs(sim):
    params = [torch.nn.Parameter(torch.zeros(4))]
    opt = small_cfg("optim.swap_optimizer_times=4", "optim.slots=2").optim.build(params)
    assert isinstance(opt, SwapOptimizer) and isinstance(opt.optimizer, torch.optim.AdamW)
    assert opt.optimizer.defaults["betas"] == (0.9, 0.95)
    plain = small_cfg("optim.swap_optimizer=false").optim.build(params)
    assert type(plain) is torch.optim.AdamW


def test_loss_curve_is_bitwise_identical_with_and_without_swap(sim):
    swapped = TrainEngine(small_cfg("optim.swap_optimizer=true"))
    resident = TrainEngine(small_cfg("optim.swap_optimizer=false"))
    assert swapped.swapping and not resident.swapping
    assert run_steps(swapped, 4) == run_steps(resident, 4)
    for a, b in zip(swapped.model.parameters(), resident.model.parameters()):
        assert torch.equal(a, b)
    for p in swapped.model.parameters():
        for key, value in swapped.optimizer.state[p].items():
            if key != "step":
                assert device.is_host_tensor(value), key


def test_train_step_reports_swap_traffic_and_device_memory(sim):
    engine = TrainEngine(small_cfg())
    m = engine.train_step()
    assert m["swap_bytes"] > 0 and m["mem_peak_bytes"] > 0 and m["tokens_per_s"] > 0
    assert set(m) >= {"loss", "lr", "grad_norm", "step_ms", "optim_ms", "h2d_gbps", "d2h_gbps"}


@pytest.mark.parametrize("swap", [True, False])
def test_dcp_resume_continues_bitwise(sim, tmp_path, swap):
    flag = f"optim.swap_optimizer={swap}"
    straight = TrainEngine(small_cfg(flag))
    expected = run_steps(straight, 4)

    first = TrainEngine(small_cfg(flag, f"train.checkpoint_dir={tmp_path}"))
    got = run_steps(first, 2)
    saved = first.save_checkpoint()
    assert saved.name == "step_00000002" and not list(tmp_path.glob(".*.tmp"))

    resumed = TrainEngine(small_cfg(flag, f"train.resume={tmp_path}"))
    assert resumed.step == 2
    if swap:
        for p in resumed.model.parameters():
            for key, value in resumed.optimizer.state[p].items():
                if key != "step":
                    assert device.is_host_tensor(value), key
    got += run_steps(resumed, 2)
    assert got == expected
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)


def test_rollout_offloads_and_onloads(sim, monkeypatch):
    engine = TrainEngine(small_cfg())
    run_steps(engine, 1)
    calls = []  # (method, device bytes allocated when it was called)

    def spy(name):
        method = getattr(engine, name)

        def called(*args, **kwargs):
            calls.append((name, sim.memory_allocated()))
            return method(*args, **kwargs)

        monkeypatch.setattr(engine, name, called)

    spy("offload_optimizer")
    spy("onload_optimizer")
    r = engine.rollout(buffer_mb=1.0)
    # The optimizer is offloaded before the buffer is taken and onloaded after it is released.
    assert [n for n, _ in calls] == ["offload_optimizer", "onload_optimizer"]
    assert calls[1][1] < r["rollout_mem_peak_bytes"]
    # The reported peak is the device's, not the buffer's size: the model that stays plus the buffer, and
    # nothing the optimizer would hold between steps.
    live = sim.memory_allocated()
    assert r["rollout_mem_peak_bytes"] == live + 2**20
    run_steps(engine, 1)
    for p in engine.model.parameters():
        for key, value in engine.optimizer.state[p].items():
            if key != "step":
                assert device.is_host_tensor(value), key


def test_gradient_checkpointing_keeps_the_loss_and_lowers_the_peak(sim):
    runs = {}
    for flag in (False, True):
        # 16 small chunks keep the step's staging below the activation peak that checkpointing lowers
        engine = TrainEngine(small_cfg(f"train.gradient_checkpointing={flag}", "model.n_layers=3",
                                       "optim.swap_optimizer_times=16"))
        metrics = [engine.train_step() for _ in range(2)]
        runs[flag] = ([m["loss"] for m in metrics], max(m["mem_peak_bytes"] for m in metrics))
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] < runs[False][1]


def test_device_masters_steps_fp32_masters_and_writes_the_bf16_params():
    # the recipe a master-weights job is compared with: grads upcast into fp32 masters, torch's AdamW steps the
    # masters, the params get the masters rounded; fp32 params are their own masters
    from swapopt.engine.device_masters import DeviceMasters

    gen = torch.Generator().manual_seed(0)
    bf16 = torch.nn.Parameter(torch.randn(8, 4, generator=gen).to(torch.bfloat16))
    fp32 = torch.nn.Parameter(torch.randn(5, generator=gen))
    opt = DeviceMasters([bf16, fp32], lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True))
    master = bf16.detach().float()
    ref = torch.optim.AdamW([master, ref_fp32 := fp32.detach().clone().requires_grad_()], lr=1e-2, foreach=True)
    for _ in range(3):
        g1, g2 = torch.randn(8, 4, generator=gen).to(torch.bfloat16), torch.randn(5, generator=gen)
        bf16.grad, fp32.grad = g1.clone(), g2.clone()
        master.grad, ref_fp32.grad = g1.float(), g2.clone()
        for group in opt.param_groups:  # the engine's LR schedule writes here
            group["lr"] = 5e-3
        for group in ref.param_groups:
            group["lr"] = 5e-3
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.step()
        assert torch.equal(bf16, master.to(torch.bfloat16)) and torch.equal(fp32, ref_fp32)
        assert bf16.grad is None and fp32.grad is None
    assert opt.masters[1] is fp32 and opt.masters[0].dtype == torch.float32
    assert torch.equal(opt.state[opt.masters[0]]["exp_avg"], ref.state[master]["exp_avg"])


def test_device_masters_builds_from_the_engine_config_and_refuses_swapping():
    from swapopt.engine.device_masters import DeviceMasters

    cfg = small_cfg("model.dtype=bfloat16", "optim.device_masters=true", "optim.swap_optimizer=false")
    params = list(build_model(cfg.model, 0).to(dtype=torch.bfloat16).parameters())
    opt = cfg.optim.build(params)
    assert isinstance(opt, DeviceMasters) and isinstance(opt.inner, torch.optim.AdamW)
    assert opt.param_groups[0]["weight_decay"] == cfg.optim.weight_decay
    with pytest.raises(ConfigError, match="device_masters"):
        small_cfg("optim.device_masters=true", "optim.swap_optimizer=true")
