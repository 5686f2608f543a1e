"""Hugging Face Trainer: ``optimizer_cls_and_kwargs=(SwapAdamW, {...})`` trains a tiny local Llama, saves with
save_steps, resumes with resume_from_checkpoint, and ends bitwise where plain AdamW ends; with
``swap_optimizer_cls_and_kwargs(args)`` it ends bitwise where a plain Trainer (its default fused AdamW) ends."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the hub; read at import time
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from dist_utils import assert_host_states  # noqa: E402

import device  # noqa: E402
import simdevice  # noqa: E402
from swapopt import SwapAdamW, SwapOptimizer  # noqa: E402
from swapopt.integrations.hf import swap_optimizer_cls_and_kwargs  # noqa: E402

OPTIM_KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (16, 12), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class HostStates(TrainerCallback):
    """After every optimizer step: the optimizer is a SwapOptimizer and each swapped state is a host tensor."""

    def __init__(self) -> None:
        self.checked = 0

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps ours
        assert isinstance(opt, SwapOptimizer)
        opt.wait_for_swap_out()
        self.checked += assert_host_states(opt)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def trainer(out, optimizer_cls, callbacks=()) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=4, seed=0,
        report_to=[], logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )
    assert args.device == device.torch_device() and args.n_gpu == 1  # the simulated accelerator, one of it
    return Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=list(callbacks),
                   optimizer_cls_and_kwargs=(optimizer_cls, dict(OPTIM_KW, **(
                       {"swap_optimizer_times": 3} if optimizer_cls is SwapAdamW else {}))))


@pytest.fixture
def hf_on_sim(sim, monkeypatch):
    """The Trainer on the simulated accelerator: accelerate and transformers take a custom torch device from
    ACCELERATE_TORCH_DEVICE (they look for CUDA through torch.cuda.is_available(), False for the simulator).
    torch's default device is the host's, as in a training script (the Trainer places model and batches); a
    default device of the simulator's type would also make accelerate's sampler ask for a device Generator, which
    a Python-registered backend cannot provide (torch's PrivateUse1 hooks need getNewGenerator, from C++)."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", str(device.torch_device()))
    monkeypatch.setenv("SWAPOPT_SIM_DEVICES", "1")  # one device visible (CUDA_VISIBLE_DEVICES=0): no DataParallel
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with simdevice.host_default():
            yield sim
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_trainer_with_swap_adamw_saves_resumes_and_matches_adamw(hf_on_sim, tmp_path):
    plain = trainer(tmp_path / "plain", torch.optim.AdamW)
    plain.train()

    straight_hook = HostStates()
    straight = trainer(tmp_path / "swap", SwapAdamW, [straight_hook])
    straight.train()
    assert (tmp_path / "swap" / "checkpoint-2" / "optimizer.pt").is_file()

    resumed_hook = HostStates()
    resumed = trainer(tmp_path / "resumed", SwapAdamW, [resumed_hook])
    resumed.train(resume_from_checkpoint=str(tmp_path / "swap" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert straight_hook.checked and resumed_hook.checked
    assert resumed.optimizer.optimizer.swap_stats().h2d_bytes > 0  # swapping really happened

    ref = dict(plain.model.named_parameters())
    for run in (straight, resumed):
        for name, p in run.model.named_parameters():
            assert torch.equal(p, ref[name]), name
    # The optimizer states match too, key for key.
    swap_state = resumed.optimizer.state_dict()["state"]
    plain_state = plain.optimizer.state_dict()["state"]
    assert swap_state.keys() == plain_state.keys()
    for i in plain_state:
        for key, value in plain_state[i].items():
            assert torch.equal(swap_state[i][key].cpu(), value.cpu()), (i, key)  # host vs device states


def test_trainer_with_its_own_optimizer_choice_swapped_matches_a_plain_trainer(hf_on_sim, tmp_path):
    def build(out, swap: bool) -> Trainer:
        args = TrainingArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, seed=0,
                                 report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
                                 dataloader_num_workers=0, weight_decay=0.1, adam_beta2=0.95)
        extra = {"optimizer_cls_and_kwargs": swap_optimizer_cls_and_kwargs(args, swap_optimizer_times=3)} if swap else {}
        return Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), **extra)

    plain, swapped = build(tmp_path / "plain", False), build(tmp_path / "swap", True)
    plain.train()
    swapped.train()
    inner = swapped.optimizer.optimizer
    assert isinstance(inner, SwapOptimizer) and inner.swap_stats().steps == 3
    # The Trainer's own choice, carried over: the fused kernel, its betas, its decay groups.
    plain_groups, swap_groups = plain.optimizer.param_groups, inner.param_groups
    assert [g["fused"] for g in swap_groups] == [g["fused"] for g in plain_groups] == [True, True]
    assert [(g["betas"], g["weight_decay"]) for g in swap_groups] == [(g["betas"], g["weight_decay"]) for g in plain_groups]
    ref = dict(plain.model.named_parameters())
    for name, p in swapped.model.named_parameters():
        assert torch.equal(p, ref[name]), name


def test_knobs_are_checked_and_non_torch_optimizers_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match="unknown swapopt knob"):
        swap_optimizer_cls_and_kwargs(args, swap_times=4)
    cls, kwargs = swap_optimizer_cls_and_kwargs(args, resident_mb=8)
    assert issubclass(cls, SwapOptimizer) and kwargs["resident_mb"] == 8 and kwargs["fused"] is True
    args.optim = "adafactor"  # transformers' own optimizer: not known to be per-param, refused when built
    cls, kwargs = swap_optimizer_cls_and_kwargs(args)
    with pytest.raises(ValueError, match="not known to be a per-param optimizer"):
        cls(tiny_llama().parameters(), **kwargs)
