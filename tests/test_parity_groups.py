"""Chunks that hold params of several param groups (each with its own lr, weight_decay, momentum or betas)
step bitwise like the unwrapped optimizer: the inner optimizer is handed each group's share of the chunk with
that group's hyperparameters. The plans here are checked to mix groups in one chunk, whole params and a
param split across chunks both; parity is torch.equal on params and states after several steps."""

from __future__ import annotations

import pytest
import torch

from swapopt import SwapOptimizer

O = torch.optim
STEPS = 5

# Three groups. In the "split" layout each chunk holds states of 1024 elements: the 1300-element param of
# group 0 is cut after its first 512 elements and its tail shares a chunk with the first param of group 1.
SIZES = (((5, 7), (1300,)), ((9,), (600,), ()), ((2, 3, 4), (300,)))
SPLIT, TAIL_WITH = 1, 2  # index of the split param, and of the other group's param in its tail's chunk
HYPER = ({}, {"lr": 3e-3, "weight_decay": 0.2}, {"lr": 2e-2, "weight_decay": 0.0})
# name: (optimizer over the groups, what the last group also changes, swapped fp32 states per element)
CASES = {
    "adamw_foreach": (lambda g: O.AdamW(g, lr=1e-2, weight_decay=0.05, foreach=True), {"betas": (0.8, 0.95)}, 2),
    "adamw_forloop": (lambda g: O.AdamW(g, lr=1e-2, weight_decay=0.05, foreach=False), {"betas": (0.8, 0.95)}, 2),
    "adamw_fused": (lambda g: O.AdamW(g, lr=1e-2, weight_decay=0.05, fused=True), {"betas": (0.8, 0.95)}, 2),
    "adam_foreach_amsgrad": (lambda g: O.Adam(g, lr=1e-2, foreach=True, amsgrad=True), {"betas": (0.5, 0.9)}, 3),
    "sgd_momentum": (lambda g: O.SGD(g, lr=1e-2, momentum=0.9, foreach=False), {"momentum": 0.5}, 1),
    "sgd_momentum_foreach": (
        lambda g: O.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, foreach=True), {"momentum": 0.7}, 1
    ),
    "adagrad": (lambda g: O.Adagrad(g, lr=1e-2), {"lr_decay": 0.01}, 1),
}
LAYOUTS = ("one_chunk", "split")


def _knobs(layout: str, states: int) -> dict:
    if layout == "one_chunk":
        return {"swap_optimizer_times": 1}
    return {"chunk_mb": 1024 * 4 * states / 2**20}


def _groups(params: list[list[torch.nn.Parameter]], extra: dict) -> list[dict]:
    # the last group also differs in an optimizer-specific value (betas, momentum, lr_decay)
    return [{"params": ps, **hyper, **(extra if g == len(params) - 1 else {})} for g, (ps, hyper) in
            enumerate(zip(params, HYPER))]


def _mixed_chunks(opt: SwapOptimizer) -> list[set[int]]:
    """The groups of each chunk of the plan the last step ran, for chunks holding more than one."""
    prep = opt._layout.prepared
    chunks = [{prep.groups[pc.index] for pc in c.pieces} for c in prep.plan.chunks]
    return [g for g in chunks if len(g) > 1]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_chunk_of_several_groups_is_bitwise(sim, name, layout):
    make, extra, states = CASES[name]
    torch.manual_seed(0)
    ps = [[torch.nn.Parameter(torch.randn(s)) for s in sizes] for sizes in SIZES]
    rs = [[torch.nn.Parameter(p.detach().clone()) for p in group] for group in ps]
    opt = SwapOptimizer(make(_groups(ps, extra)), **_knobs(layout, states))
    ref = make(_groups(rs, extra))
    flat_ps = [p for group in ps for p in group]
    flat_rs = [r for group in rs for r in group]
    for _ in range(STEPS):
        for p, r in zip(flat_ps, flat_rs):
            g = torch.randn(p.shape)
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    opt.wait_for_swap_out()

    mixed = _mixed_chunks(opt)
    assert mixed, "no chunk holds params of two groups: the test would prove nothing"
    plan = opt._layout.prepared.plan
    if layout == "one_chunk":
        assert len(plan.chunks) == 1 and mixed == [{0, 1, 2}]
    else:
        # the split param's tail shares its chunk with a param of group 1
        pieces = [(k, pc) for k, c in enumerate(plan.chunks) for pc in c.pieces if pc.index == SPLIT]
        assert [(pc.start, pc.stop) for _, pc in pieces] == [(0, 512), (512, 1300)], pieces
        assert TAIL_WITH in {pc.index for pc in plan.chunks[pieces[-1][0]].pieces}
        assert len(mixed) >= 2
    # the states are swapped: they live in host memory, the params on the device
    assert all(v.device.type == "cpu" for p in flat_ps for v in opt.state[p].values() if v.shape == p.shape and p.dim())
    assert flat_ps[0].device.type != "cpu"

    for i, (p, r) in enumerate(zip(flat_ps, flat_rs)):
        assert torch.equal(p.detach(), r.detach()), f"param {i}"
        assert set(opt.state[p]) == set(ref.state[r]), f"param {i} state keys"
        for key, value in ref.state[r].items():
            got = opt.state[p][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and got.shape == value.shape, (i, key)
                assert torch.equal(got.cpu(), value.cpu()), f"param {i} state {key!r}"
            else:
                assert got == value, (i, key)
