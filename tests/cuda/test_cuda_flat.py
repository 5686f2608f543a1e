"""The flat chunk update on a real CUDA device (Note [flat chunk update] in swapopt.flat): taken for any sizes,
bitwise torch's own step: `python -m pytest -m cuda tests/cuda`."""

from __future__ import annotations

import pytest
import torch

from swapopt import SwapOptimizer, flat

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Tails of every length (no CPU rule holds here), and no param over a chunk at swap_optimizer_times=2: the flat
# update steps chunks of whole params, and a chunk holding a piece of a split param takes the direct step.
SIZES = ((3000,), (7, 33), (1,), (51, 57), (5,), (2047,), (33, 31), (1500,))


@pytest.fixture(autouse=True)
def _cuda_env(monkeypatch):
    monkeypatch.setenv("SWAPOPT_DEVICE", "cuda")
    monkeypatch.setattr(flat, "ENABLED", True)  # off by default (swapopt.flat.ENABLED)
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True, capturable=True),
    ],
    ids=["adamw-fused", "adamw-foreach", "adam-forloop-amsgrad", "adamw-fused-capturable"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_update_on_cuda_is_bitwise_and_taken(make, dtype, monkeypatch):
    taken = []
    real = flat.FlatStep.run

    def counting(self, *a, **k):
        ok = real(self, *a, **k)
        taken.append(ok)
        return ok

    monkeypatch.setattr(flat.FlatStep, "run", counting)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ps = [torch.nn.Parameter(torch.randn(s, device=dev).to(dtype)) for s in SIZES]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = SwapOptimizer(make(ps), swap_optimizer_times=2), make(rs)
    for _ in range(5):
        for p, r in zip(ps, rs):
            g = torch.randn(p.shape, device=dev).to(dtype)
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    opt.wait_for_swap_out()
    torch.cuda.synchronize()
    assert taken and all(taken)
    for p, r in zip(ps, rs):
        assert torch.equal(p.detach(), r.detach())
        for key, value in ref.state[r].items():
            assert torch.equal(torch.as_tensor(opt.state[p][key]).cpu(), torch.as_tensor(value).cpu()), key
