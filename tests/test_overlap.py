"""overlap_forward: the updates stream under the next forward, with bitwise the same results, every access
ordered (sanitizer on), and the modeled timeline showing the next forward start before the update ends."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import device
from device.sim import StreamRaceError
from swapopt import SwapAdamW, SwapConfig, SwapOptimizer

STEPS = 4
CHUNKS = 4


def _mlp(seed: int = 0, width: int = 32, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def _inner(kind: str, params) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(params, lr=torch.tensor(1e-2), weight_decay=0.1, fused=True)
    if kind == "foreach":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    raise ValueError(kind)


def _train(kind: str, wrap: str, steps: int = STEPS, scaler: bool = False) -> tuple[list[torch.Tensor], list]:
    """Losses and final params of a short loop: zero_grad(set_to_none) -> forward -> backward -> clip ->
    (GradScaler-like attributes) -> step -> scheduler; ``wrap``: "none" | "off" | "on"."""
    model = _mlp()
    inner = _inner(kind, model.parameters())
    if wrap == "none":
        opt: torch.optim.Optimizer = inner
    else:
        opt = SwapOptimizer(inner, swap_optimizer_times=CHUNKS, overlap_forward=wrap == "on")
        opt.attach(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    torch.manual_seed(1)
    data = [(torch.randn(8, 32), torch.randn(8, 4)) for _ in range(steps)]
    scale = torch.tensor(4.0)
    losses = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.detach().clone())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if scaler:  # as GradScaler hands them to a fused optimizer, then changes the scale in place
            opt.grad_scale = scale
            opt.found_inf = torch.tensor(1.0 if i == 1 else 0.0)
        opt.step()
        if scaler:
            del opt.grad_scale, opt.found_inf
            scale.mul_(2.0)  # scaler.update(): in place on the compute stream, right after step()
        sched.step()
    if isinstance(opt, SwapOptimizer):
        opt.wait_for_update()
        opt.wait_for_swap_out()
    return [l.clone() for l in losses], [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "scaler"])
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_losses_and_params_bitwise_equal_on_and_off(sim, kind, scaler):
    if scaler and kind != "fused":
        pytest.skip("grad_scale / found_inf are handed to fused optimizers only")
    ref = _train(kind, "none", scaler=scaler)
    off = _train(kind, "off", scaler=scaler)
    on = _train(kind, "on", scaler=scaler)
    for run in (off, on):
        assert all(torch.equal(a, b) for a, b in zip(run[0], ref[0]))
        assert all(torch.equal(a, b) for a, b in zip(run[1], ref[1]))
    assert not torch.equal(ref[1][0], _mlp()[0].weight)  # the loop did train
