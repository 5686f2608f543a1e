"""step_graph on a real CUDA device (Note [graphed step] in swapopt.graphed): steps captured and replayed with CUDA
graphs, bitwise torch's own: `python -m pytest -m cuda tests/cuda`."""

from __future__ import annotations

import pytest
import torch

from swapopt import SwapOptimizer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Whole params, a transposed one, and one that 16 chunks cut across chunk boundaries.
SIZES = ((4096, 1024), (513, 7), (64,), (2048, 512))


@pytest.fixture(autouse=True)
def _cuda_env(monkeypatch):
    monkeypatch.setenv("SWAPOPT_DEVICE", "cuda")
    torch.cuda.synchronize()


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    made = [torch.randn(s, generator=gen) for s in SIZES]
    made[1] = made[1].t().contiguous().t()
    return [torch.nn.Parameter(t.cuda()) for t in made]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True, capturable=True),
        lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2, device="cuda"), fused=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    ],
    ids=["adamw-fused", "adamw-capturable", "adam-tensor-lr", "sgd-momentum"],
)
@pytest.mark.parametrize("times", [4, 16])
def test_replayed_steps_are_bitwise_on_cuda(make, times):
    ps, rs = _params(0), _params(0)
    opt = SwapOptimizer(make(ps), swap_optimizer_times=times, step_graph=True)
    ref = make(rs)
    replays = 0
    for s in range(6):
        gen = torch.Generator().manual_seed(100 + s)
        for p, r in zip(ps, rs):
            g = torch.randn(p.shape, generator=gen).cuda()
            r.grad = torch.empty_like(r).copy_(g)
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(g)  # in place: the addresses a graph reads stay
        before = opt._graphed
        opt.step()
        ref.step()
        replays += before is not None and opt._graphed is before
    opt.wait_for_swap_out()
    torch.cuda.synchronize()
    assert replays == 2, (replays, opt._graph_off)
    for p, r in zip(ps, rs):
        assert torch.equal(p, r)
        for key, want in ref.state[r].items():
            assert torch.equal(opt.state[p][key].cuda(), want), key
