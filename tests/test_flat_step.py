"""The flat chunk update (Note [flat chunk update] in swapopt.flat): a chunk of the Adam family whose states lie
key by key in its slot is stepped as one flat tensor, bitwise the inner step; chunks that mix hyperparameters or
step counts, sizes whose elements would change kernel code on a CPU-backed device, and non-element-wise
optimizers keep the per-tensor path."""

from __future__ import annotations

import itertools

import pytest
import torch

import device
import simdevice as simulator
from stepping import ADAM_KERNEL_IDS, ADAM_KERNELS, assert_params_and_states_equal
from swapopt import SwapOptimizer, direct, flat

STEPS = 4
# whole multiples of flat.CPU_BLOCK elements: on the simulator's CPU kernels no element changes code flat
SAFE = ((64,), (8, 64), (128,), (16, 16), (2, 2, 32))
UNSAFE = ((1500,), (7, 33), (64,))


@pytest.fixture(autouse=True)
def _flat_on(monkeypatch):
    monkeypatch.setattr(flat, "ENABLED", True)  # off by default (swapopt.flat.ENABLED)


def _run(make, sizes=SAFE, *, steps=STEPS, grad_scale=None, skip_first=(), channels_last=False, **swap_kw):
    """Step a SwapOptimizer and the same optimizer unwrapped on identical params and grads, checking params and
    every state bitwise; returns what each chunk update took: "flat", "direct" or "inner", from the third step on
    (the first creates the states; the second steps directly over the dicts made for it, which it then keeps)."""
    torch.manual_seed(0)
    taken: list[str] = []
    real_flat, real_direct = flat.FlatStep.run, direct.DirectStep.run

    def flat_run(self, *a, **k):
        ok = real_flat(self, *a, **k)
        if ok:
            taken.append("flat")
        return ok

    def direct_run(self, *a, **k):
        ok = real_direct(self, *a, **k)
        taken.append("direct" if ok else "inner")
        return ok

    flat.FlatStep.run, direct.DirectStep.run = flat_run, direct_run
    try:
        with simulator.activate():
            dev = device.torch_device()
            ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in sizes]
            if channels_last:  # a 4-D param laid out unlike its shape's default order
                ps.append(torch.nn.Parameter(torch.randn(2, 8, 2, 2, device=dev).to(memory_format=torch.channels_last)))
            rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            opt = SwapOptimizer(make(ps), **swap_kw)
            if swap_kw.get("overlap_forward") or swap_kw.get("prefetch"):
                opt.attach(torch.nn.ParameterList(ps))
            ref = make(rs)
            for step in range(steps):
                if step == 2:
                    taken.clear()
                for i, (p, r) in enumerate(zip(ps, rs)):
                    if step == 0 and i in skip_first:  # a param that starts later: its step count lags
                        p.grad = r.grad = None
                        continue
                    g = torch.randn(p.shape, device=dev)
                    if p.dim() == 4 and channels_last:
                        g = g.to(memory_format=torch.channels_last)  # as autograd lays out a channels_last grad
                    p.grad, r.grad = g.clone(), g.clone()
                if grad_scale is not None:  # as GradScaler lends them to a fused optimizer
                    for o in (opt, ref):
                        o.grad_scale = torch.tensor(grad_scale, device=dev)
                        o.found_inf = torch.zeros((), device=dev)
                if swap_kw.get("prefetch"):
                    opt.prefetch()  # as after a forward: the first chunks swap in ahead of the step
                opt.step()
                ref.step()
            opt.wait_for_swap_out()
            opt.wait_for_update()
            assert_params_and_states_equal(opt, ps, ref, rs)
    finally:
        flat.FlatStep.run, direct.DirectStep.run = real_flat, real_direct
    return taken


@pytest.mark.parametrize(
    "make",
    [
        *ADAM_KERNELS,
        lambda ps: torch.optim.Adam([{"params": ps[:2]}, {"params": ps[2:]}], lr=3e-3),  # two groups, alike
    ],
    ids=[*ADAM_KERNEL_IDS, "adam-equal-groups"],
)
@pytest.mark.parametrize("times", [1, 3])
def test_flat_update_is_bitwise_and_taken(make, times):
    taken = _run(make, swap_optimizer_times=times)
    assert taken and set(taken) == {"flat"}  # every chunk went flat once its dicts were kept


def test_flat_update_with_grad_scaler_attributes_and_a_permuted_layout():
    taken = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), grad_scale=4.0, channels_last=True,
                 swap_optimizer_times=2)  # fmt: skip
    assert taken and set(taken) == {"flat"}


def test_groups_with_different_hyperparameters_keep_the_per_tensor_path():
    make = lambda ps: torch.optim.Adam([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "betas": (0.8, 0.9)}])
    taken = _run(make, swap_optimizer_times=1)  # one chunk holds both groups
    assert taken and "flat" not in taken


def test_a_chunk_of_unequal_step_counts_keeps_the_per_tensor_path():
    taken = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), skip_first=(1,), swap_optimizer_times=1)
    assert taken and "flat" not in taken


def test_sizes_that_change_cpu_kernel_code_keep_the_per_tensor_path():
    """On the simulator (CPU kernels) a param's scalar tail would take the vector code in the middle of the flat
    tensor: such chunks step per tensor, bitwise."""
    assert not flat.position_free(torch.device("cpu"), [1500, 231])
    assert flat.position_free(torch.device("cpu"), [64, 512])
    assert not flat.position_free(torch.device("cpu"), [flat.CPU_SERIAL, 64])
    taken = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), UNSAFE, swap_optimizer_times=1)
    assert taken and set(taken) == {"direct"}


def test_non_elementwise_optimizer_takes_the_per_tensor_path():
    """Adafactor's states are row and column factors, not param-shaped: neither flat nor direct, still bitwise."""
    built = []
    real_build = flat.FlatStep.build

    def counting_build(*a, **k):
        built.append(1)
        return real_build(*a, **k)

    flat.FlatStep.build = counting_build
    try:
        taken = _run(lambda ps: torch.optim.Adafactor(ps, lr=1e-2), swap_optimizer_times=2)
    finally:
        flat.FlatStep.build = real_build
    assert taken == [] and built == []


def test_states_lie_key_by_key_in_one_arena_run():
    """The layout the flat update reads: a chunk's exp_avg views back to back, then its exp_avg_sq views, in the
    host arena as in the slot, so the chunk moves in one copy each way."""
    with simulator.activate():
        dev = device.torch_device()
        ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in SAFE]
        opt = SwapOptimizer(torch.optim.AdamW(ps, lr=1e-2, fused=True), swap_optimizer_times=1)
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn(p.shape, device=dev)
            opt.step()
        opt.wait_for_swap_out()
        for key, nxt in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            for a, b in itertools.pairwise(ps):
                ea, eb = opt.state[a][key], opt.state[b][nxt]
                assert ea.data_ptr() + ea.numel() * ea.element_size() == eb.data_ptr()
        last, first = opt.state[ps[-1]]["exp_avg"], opt.state[ps[0]]["exp_avg_sq"]
        assert last.data_ptr() + last.numel() * last.element_size() == first.data_ptr()
        prep = opt._layout.prepared
        assert [len(rs) for rs in prep.runs] == [1] and prep.covered[0] == frozenset(range(len(prep.regions[0])))


@pytest.mark.parametrize("knobs", [{"overlap_forward": True}, {"prefetch": True}, {"slots": 2}], ids=str)
def test_flat_update_under_the_pipeline_knobs(knobs):
    """The scratch lives on the update's stream (its own with overlap_forward) and the slots' views are the
    flat tensors, prefetched or not."""
    taken = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), swap_optimizer_times=3, **knobs)
    assert taken and set(taken) == {"flat"}
