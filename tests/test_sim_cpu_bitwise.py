"""A training job on the simulated device computes and draws what the same job computes and draws on the CPU.

The job has what makes a job drift when a device's random numbers or kernels differ from the CPU's: dropout
(nn.Dropout and attention dropout in scaled_dot_product_attention), activation checkpointing (the recompute must
draw the forward's masks again), random data drawn on the device, and a save / restore of the device's generator
state mid-job (as a checkpoint's resume does). The simulated device draws from the CPU default generator
(docs/devices.md), so every loss is bitwise the CPU job's, with and without SwapOptimizer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch import nn

import simdevice as simulator
from swapopt import SwapOptimizer

STEPS = 5


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids[:, :-1])
        for block in self.blocks:
            h = ckpt.checkpoint(block, h, use_reentrant=False)  # the recompute draws the forward's masks again
        return F.cross_entropy(self.head(h).flatten(0, 1), ids[:, 1:].flatten())


def job(device: torch.device, swap: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    if swap:
        opt = SwapOptimizer(opt, swap_optimizer_times=3)
    module = torch.get_device_module(device)  # torch.cpu, or the simulated device's module (torch.sim / torch.npu)
    losses = []
    for step in range(STEPS):
        if step == 2:
            saved = module.get_rng_state() if device.type != "cpu" else torch.get_rng_state()
        if step == 3:  # draw something, then restore the state saved a step ago, as a resume would
            torch.rand(7, device=device)
            if device.type != "cpu":
                module.set_rng_state(saved)
            else:
                torch.set_rng_state(saved)
        ids = torch.randint(0, 50, (4, 9), device=device)
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().cpu())
    return losses


@pytest.mark.parametrize("swap", [False, True], ids=["plain", "swapopt"])
def test_job_losses_are_bitwise_the_cpu_jobs(swap, clean_device_env):
    with simulator.host_default():
        expected = job(torch.device("cpu"))
    with simulator.activate() as sim:
        got = job(sim.torch_device(), swap=swap)
        sim.synchronize()
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"step {step}: cpu {a.item()!r} != simulated {b.item()!r}"
    assert len({loss.item() for loss in got}) == STEPS  # the job trains: a constant loss would compare trivially


def test_the_device_generator_is_the_cpu_generator(clean_device_env):
    """Seeding, saving and restoring through the device's module act on the CPU default generator, as docs/devices.md
    says; under the cuda flavour torch.cuda's functions do the same."""
    with simulator.activate() as sim:
        module = torch.get_device_module(sim.torch_device())
        names = [module] + ([torch.cuda] if sim.flavour == "cuda" else [])
        for mod in names:
            mod.manual_seed(123)
            assert mod.initial_seed() == torch.initial_seed() == 123
            state = mod.get_rng_state()
            assert torch.equal(state, torch.get_rng_state())
            first = torch.rand(4, device=sim.torch_device()).cpu()
            mod.set_rng_state(state)
            assert torch.equal(torch.rand(4).cpu(), first)  # the host draws what the device drew from that state
            states = mod.get_rng_state_all()
            assert len(states) == mod.device_count() and all(torch.equal(s, states[0]) for s in states)
