"""The direct step (Note [direct step] in swapopt.direct): a chunk of the Adam family is stepped by one call of
torch's functional over lists kept per plan, bitwise the inner step; other optimizers, subclasses that
override how states are gathered, and steps that torch would refuse keep the inner step."""

from __future__ import annotations

import pytest
import torch

import device
import simdevice as simulator
from stepping import ADAM_KERNEL_IDS, ADAM_KERNELS, assert_params_and_states_equal
from swapopt import SwapOptimizer, direct

STEPS = 4
SIZES = ((1500,), (7, 33), (64, 16), (5,), (300,))


def _run(make, *, steps=STEPS, grad_scale=None, **swap_kw):
    """Step a SwapOptimizer and the same optimizer unwrapped on identical params and grads; count the chunks
    the direct step took."""
    torch.manual_seed(0)
    taken = []
    real_run = direct.DirectStep.run

    def counting_run(self, *args, **kwargs):
        ok = real_run(self, *args, **kwargs)
        taken.append(ok)
        return ok

    direct.DirectStep.run = counting_run
    try:
        with simulator.activate():
            dev = device.torch_device()
            ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in SIZES]
            rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            opt = SwapOptimizer(make(ps), **swap_kw)
            ref = make(rs)
            for _ in range(steps):
                for p, r in zip(ps, rs):
                    g = torch.randn(p.shape, device=dev)
                    p.grad, r.grad = g.clone(), g.clone()
                if grad_scale is not None:  # as GradScaler lends them to a fused optimizer
                    for o in (opt, ref):
                        o.grad_scale = torch.tensor(grad_scale, device=dev)
                        o.found_inf = torch.zeros((), device=dev)
                opt.step()
                ref.step()
            opt.wait_for_swap_out()
            assert_params_and_states_equal(opt, ps, ref, rs)
    finally:
        direct.DirectStep.run = real_run
    return taken


# One chunk; two chunks of whole params; and a fixed budget of 10 KiB, which cuts the 1,500-element param in two
# (1,024 + 476 elements) and keeps the others whole: chunks of whole params beside chunks with a cut piece, which
# take the inner step. (swap_optimizer_times=3 made that plan before the planner weighed the link's costs; it now
# cuts both larger params into three chunks, none of whole params: Note [chunk count from costs].)
KNOBS = [{"swap_optimizer_times": 1}, {"swap_optimizer_times": 2}, {"chunk_mb": 10_000 / 2**20}]


@pytest.mark.parametrize(
    "make",
    [
        *ADAM_KERNELS,
        lambda ps: torch.optim.Adam([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "betas": (0.8, 0.9)}]),
    ],
    ids=[*ADAM_KERNEL_IDS, "adam-groups"],
)
@pytest.mark.parametrize("knobs", KNOBS, ids=["times1", "times2", "mixed"])
def test_direct_step_is_bitwise_and_taken(make, knobs):
    taken = _run(make, **knobs)
    assert taken and all(taken)  # every chunk of whole params after the first step went the direct way


def test_direct_step_passes_grad_scaler_attributes():
    taken = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), grad_scale=4.0, swap_optimizer_times=2)
    assert taken and all(taken)


def test_non_elementwise_optimizer_keeps_the_inner_step():
    """Adafactor's states are not param-shaped (row and column factors): no direct step, still bitwise."""
    assert not direct.supported(torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(2, 2))]),
                                torch.optim.Adafactor.step)
    taken = _run(lambda ps: torch.optim.Adafactor(ps, lr=1e-2), swap_optimizer_times=2)
    assert taken == []


def test_subclass_with_its_own_init_group_keeps_the_inner_step():
    class Clipped(torch.optim.AdamW):
        def _init_group(self, group, params, grads, *rest):
            has_complex = super()._init_group(group, params, grads, *rest)
            for g in grads:
                g.clamp_(-0.5, 0.5)
            return has_complex

    taken = _run(lambda ps: Clipped(ps, lr=1e-2), swap_optimizer_times=2, per_param=True)
    assert taken == []


def test_foreach_with_tensor_lr_raises_as_torch_does():
    """torch refuses a tensor lr with foreach and not capturable: the direct step leaves that to the inner step."""
    with simulator.activate():
        dev = device.torch_device()
        p = torch.nn.Parameter(torch.randn(8, device=dev))
        inner = torch.optim.Adam([p], lr=1e-2, foreach=True)
        opt = SwapOptimizer(inner)
        for _ in range(2):
            p.grad = torch.ones_like(p)
            opt.step()
        opt.param_groups[0]["lr"] = torch.tensor(1e-2)
        p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError, match="lr as a Tensor is not supported"):
            opt.step()


def test_direct_step_survives_a_wrapped_init_group(monkeypatch):
    # Importing torch._dynamo wraps every torch optimizer's _init_group (a dynamo-disable wrapper that keeps
    # the function as __wrapped__): the direct step must still be taken, as it was before the wrapping.
    import functools

    original = torch.optim.Adam._init_group

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "_init_group", wrapped)
    taken = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True), swap_optimizer_times=2)
    assert taken and all(taken)


# Note [fused kernel call] in swapopt.internals: a fused group of one device and dtype calls torch's fused ops
# without the functional's grouping pass; anything the functional would convert (grad_scale/found_inf, a tensor lr)
# or split (params of two dtypes) goes through the functional.
FUSED = [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True, amsgrad=True, maximize=True, weight_decay=0.05),
    lambda ps: torch.optim.Adam(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "betas": (0.8, 0.9), "amsgrad": True}], fused=True
    ),
]


def _counting_fused_calls(monkeypatch) -> list[int]:
    from swapopt import internals

    calls = []
    real = internals.adam_fused_call

    def counting(params, *args, **kwargs):
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(internals, "adam_fused_call", counting)
    return calls


@pytest.mark.parametrize("make", FUSED, ids=["adamw", "adam-amsgrad-maximize", "adam-groups"])
@pytest.mark.parametrize("knobs", KNOBS, ids=["times1", "times2", "mixed"])
def test_fused_groups_call_the_kernel_without_grouping(monkeypatch, make, knobs):
    calls = _counting_fused_calls(monkeypatch)
    taken = _run(make, **knobs)
    assert taken and all(taken)
    assert len(calls) >= len(taken) and all(calls)  # each direct step: one call a group copy, none empty


@pytest.mark.parametrize(
    "case",
    [
        dict(make=lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), grad_scale=4.0),
        dict(make=lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2), fused=True)),
        dict(make=lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
    ],
    ids=["grad-scaler", "tensor-lr", "foreach"],
)
def test_what_the_functional_converts_goes_through_it(monkeypatch, case):
    calls = _counting_fused_calls(monkeypatch)
    taken = _run(case["make"], grad_scale=case.get("grad_scale"), swap_optimizer_times=2)
    assert taken and all(taken)  # the direct step, through the functional
    assert calls == []


def test_params_of_two_dtypes_in_one_group_go_through_the_functional(monkeypatch):
    """The functional groups fp32 and bf16 params apart (one kernel call each): the direct step leaves that to it."""
    calls = _counting_fused_calls(monkeypatch)
    torch.manual_seed(0)
    with simulator.activate():
        dev = device.torch_device()
        ps = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=dt))
              for s, dt in zip(SIZES, (torch.float32, torch.bfloat16) * 3)]  # fmt: skip
        rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt = SwapOptimizer(torch.optim.AdamW(ps, lr=1e-2, fused=True), swap_optimizer_times=1)
        ref = torch.optim.AdamW(rs, lr=1e-2, fused=True)
        for _ in range(STEPS):
            for p, r in zip(ps, rs):
                g = torch.randn(p.shape, device=dev, dtype=p.dtype)
                p.grad, r.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        opt.wait_for_swap_out()
        assert_params_and_states_equal(opt, ps, ref, rs)
    assert calls == []
