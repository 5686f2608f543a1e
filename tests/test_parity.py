"""Bitwise parity with the unwrapped optimizer, on the simulator with the stream sanitizer on."""

from __future__ import annotations

import warnings

import pytest
import torch

import simdevice as simulator
from swapopt import SwapOptimizer

STEPS = 5


def _params(dtype=torch.float32, sizes=((1500,), (7, 33), ())):
    return [torch.nn.Parameter(torch.randn(s, dtype=torch.float32).to(dtype)) for s in sizes]


def _groups(params, split_groups, group_kw):
    if not split_groups:
        return params
    half = max(1, len(params) // 2)
    return [{"params": params[:half]}, {"params": params[half:], **group_kw}]


def run_pair(
    make,
    *,
    dtype=torch.float32,
    sizes=((1500,), (7, 33), ()),
    split_groups=False,
    group_kw=None,
    steps=STEPS,
    skip_grad=None,
    before_step=None,
    **swap_kw,
):
    """Step a SwapOptimizer and the same optimizer unwrapped on identical params and grads.
    Returns (swapped params, swapped opt, reference params, reference opt)."""
    group_kw = group_kw or {"lr": 3e-3, "weight_decay": 0.1}
    torch.manual_seed(0)
    with simulator.activate():
        ps = _params(dtype, sizes)
        rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt = SwapOptimizer(make(_groups(ps, split_groups, group_kw)), **swap_kw)
        ref = make(_groups(rs, split_groups, group_kw))
        for step in range(steps):
            for i, (p, r) in enumerate(zip(ps, rs)):
                if skip_grad is not None and skip_grad(step, i):
                    p.grad = r.grad = None
                    continue
                g = torch.randn(p.shape).to(dtype)
                p.grad, r.grad = g.clone(), g.clone()
            if before_step is not None:
                before_step(opt, ref)
            opt.step()
            ref.step()
        opt.wait_for_swap_out()
    return ps, opt, rs, ref


def assert_parity(ps, opt, rs, ref):
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert torch.equal(p.detach(), r.detach()), f"param {i} differs"
        rst = ref.state.get(r, {})
        sst = opt.state.get(p, {})
        assert set(rst) == set(sst), f"param {i}: state keys {set(sst)} != {set(rst)}"
        for key, value in rst.items():
            if isinstance(value, torch.Tensor):
                got = sst[key]
                assert got.shape == value.shape and got.dtype == value.dtype, (i, key)
                # swapped states live on the host, the reference's on the device: compare host copies
                assert torch.equal(got.cpu(), value.cpu()), f"param {i} state {key!r} differs"
            else:
                assert sst[key] == value, (i, key)


O = torch.optim
CASES = {
    "adam": lambda g: O.Adam(g, lr=1e-2),
    "adam_foreach_amsgrad": lambda g: O.Adam(g, lr=1e-2, foreach=True, amsgrad=True),
    "adam_fused": lambda g: O.Adam(g, lr=1e-2, fused=True),
    "adam_fused_amsgrad_maximize": lambda g: O.Adam(g, lr=1e-2, fused=True, amsgrad=True, maximize=True),
    "adam_maximize_wd": lambda g: O.Adam(g, lr=1e-2, maximize=True, weight_decay=0.01, foreach=False),
    "adamw": lambda g: O.AdamW(g, lr=1e-2),
    "adamw_foreach": lambda g: O.AdamW(g, lr=1e-2, foreach=True, amsgrad=True),
    "adamw_fused": lambda g: O.AdamW(g, lr=1e-2, fused=True),
    "sgd_momentum": lambda g: O.SGD(g, lr=1e-2, momentum=0.9, foreach=False),
    "sgd_nesterov_foreach": lambda g: O.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
    "sgd_fused": lambda g: O.SGD(g, lr=1e-2, momentum=0.9, fused=True),
    "sgd_plain": lambda g: O.SGD(g, lr=1e-2),
    "adagrad": lambda g: O.Adagrad(g, lr=1e-2, initial_accumulator_value=0.1),
    "adagrad_foreach": lambda g: O.Adagrad(g, lr=1e-2, foreach=True, lr_decay=0.01),
    "adagrad_fused": lambda g: O.Adagrad(g, lr=1e-2, fused=True),
    "rmsprop_centered_momentum": lambda g: O.RMSprop(g, lr=1e-2, centered=True, momentum=0.9),
    "rmsprop_foreach": lambda g: O.RMSprop(g, lr=1e-2, centered=True, momentum=0.5, foreach=True),
    "adamax": lambda g: O.Adamax(g, lr=1e-2),
    "adamax_foreach": lambda g: O.Adamax(g, lr=1e-2, foreach=True, maximize=True),
    "nadam": lambda g: O.NAdam(g, lr=1e-2),
    "nadam_foreach_decoupled": lambda g: O.NAdam(g, lr=1e-2, foreach=True, decoupled_weight_decay=True),
    "radam": lambda g: O.RAdam(g, lr=1e-2),
    "radam_foreach": lambda g: O.RAdam(g, lr=1e-2, foreach=True, decoupled_weight_decay=True),
    "asgd": lambda g: O.ASGD(g, lr=1e-2, t0=2),
    "asgd_foreach": lambda g: O.ASGD(g, lr=1e-2, t0=2, foreach=True),
    "rprop": lambda g: O.Rprop(g, lr=1e-2),
    "rprop_foreach": lambda g: O.Rprop(g, lr=1e-2, foreach=True, maximize=True),
    "adadelta": lambda g: O.Adadelta(g, lr=1.0),
    "adadelta_foreach": lambda g: O.Adadelta(g, lr=1.0, foreach=True),
    "adafactor": lambda g: O.Adafactor(g, lr=1e-2),
    "adafactor_foreach": lambda g: O.Adafactor(g, lr=1e-2, foreach=True, weight_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parity_optimizers(name):
    # two groups with different hyperparameters; chunk budget small enough to split the 1500-element param
    assert_parity(*run_pair(CASES[name], split_groups=True, swap_optimizer_times=3))


@pytest.mark.parametrize("times", [1, 3, 16, 100])
def test_parity_swap_times(times):
    sizes = ((600,), (3, 4), (), (10,), (2, 2, 2))
    assert_parity(*run_pair(lambda g: O.AdamW(g, lr=1e-2, foreach=True), sizes=sizes, swap_optimizer_times=times))


@pytest.mark.parametrize("name", ["adamw", "adam_fused", "sgd_nesterov_foreach", "rmsprop_centered_momentum", "adafactor"])
def test_parity_bf16(name):
    assert_parity(*run_pair(CASES[name], dtype=torch.bfloat16, swap_optimizer_times=4))


@pytest.mark.parametrize("name", ["adamw_fused", "adam_foreach_amsgrad", "rprop_foreach", "asgd"])
def test_parity_param_larger_than_chunk(name):
    # 8 KiB chunks hold 1024 Adam elements: the 4096-element param is split in several pieces
    ps, opt, rs, ref = run_pair(CASES[name], sizes=((4096,), (3, 700)), chunk_mb=8 / 1024)
    assert_parity(ps, opt, rs, ref)
    assert opt.swap_stats().chunks >= 4


def test_parity_params_without_grads_some_steps():
    skip = lambda step, i: (step + i) % 3 == 0  # noqa: E731
    sizes = ((600,), (3, 4), (), (10,))
    for name in ("adamw", "sgd_momentum", "adafactor", "adagrad"):
        assert_parity(*run_pair(CASES[name], sizes=sizes, skip_grad=skip, swap_optimizer_times=3))


def test_parity_resident():
    sizes = ((600,), (3, 4), (), (10,))
    ps, opt, rs, ref = run_pair(CASES["adamw"], sizes=sizes, swap_optimizer_times=2, resident_mb=200 / 2**20)
    assert_parity(ps, opt, rs, ref)
    # 200 bytes hold the AdamW states of the three small params (96 + 8 + 80 bytes), not the big one's: those
    # stay in device memory, the big one's are swapped to the host. Parity alone would also hold if nothing
    # stayed resident.
    where = [{opt.state[p][k].device.type for k in ("exp_avg", "exp_avg_sq")} for p in ps]
    assert where == [{"cpu"}, {ps[0].device.type}, {ps[0].device.type}, {ps[0].device.type}]
    assert ps[0].device.type != "cpu"


def test_parity_muon():
    if not hasattr(O, "Muon"):
        pytest.skip("torch.optim.Muon not available")
    assert_parity(*run_pair(lambda g: O.Muon(g, lr=1e-2), sizes=((16, 8), (4, 12), (8, 8)), swap_optimizer_times=2))


def test_parity_tied_params_stepped_once():
    torch.manual_seed(0)
    with simulator.activate():
        w, b = torch.nn.Parameter(torch.randn(40, 8)), torch.nn.Parameter(torch.randn(8))
        rw, rb = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(b.detach().clone())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about the duplicate
            opt = SwapOptimizer(O.AdamW([w, b, w], lr=1e-2), swap_optimizer_times=16)
        ref = O.AdamW([rw, rb], lr=1e-2)
        for _ in range(STEPS):
            for p, r in ((w, rw), (b, rb)):
                g = torch.randn(p.shape)
                p.grad, r.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        opt.wait_for_swap_out()
    assert_parity([w, b], opt, [rw, rb], ref)


def _amp_attrs(found_inf_at):
    def before(opt, ref):
        step = getattr(before, "n", 0)
        before.n = step + 1
        for o in (opt, ref):
            o.grad_scale = torch.tensor(4.0)
            o.found_inf = torch.tensor(1.0 if step == found_inf_at else 0.0)

    return before


@pytest.mark.parametrize("name", ["adam_fused", "adamw_fused", "sgd_fused", "adagrad_fused"])
def test_parity_grad_scaler_attributes(name):
    # GradScaler sets grad_scale / found_inf on the optimizer it steps; fused inners unscale in-kernel
    ps, opt, rs, ref = run_pair(CASES[name], before_step=_amp_attrs(found_inf_at=2), swap_optimizer_times=3)
    assert opt._step_supports_amp_scaling
    assert not hasattr(opt.optimizer, "grad_scale")
    assert_parity(ps, opt, rs, ref)


def test_parity_scheduler_clipping_closure_zero_grad():
    torch.manual_seed(0)
    with simulator.activate():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        refm = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        refm.load_state_dict(model.state_dict())
        opt = SwapOptimizer(O.AdamW(model.parameters(), lr=1e-2), swap_optimizer_times=3)
        ref = O.AdamW(refm.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        rsched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        for step in range(6):
            for m, o in ((model, opt), (refm, ref)):

                def closure(m=m, o=o):
                    o.zero_grad(set_to_none=step % 2 == 0)
                    loss = torch.nn.functional.mse_loss(m(x), y)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                    return loss

                loss = o.step(closure)
                assert loss is not None
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
                sched.step()
                rsched.step()
        opt.wait_for_swap_out()
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-2 * 0.5**3
    assert_parity(list(model.parameters()), opt, list(refm.parameters()), ref)


def _layout_param(layout: str) -> torch.Tensor:
    if layout == "channels_last":
        return torch.randn(4, 6, 9, 8).contiguous(memory_format=torch.channels_last)
    return torch.randn(40, 33).t()  # transposed


FUSED = {
    "adam_fused": lambda ps: O.Adam(ps, lr=1e-2, fused=True),
    "adamw_fused": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd_momentum_fused": lambda ps: O.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad_fused": lambda ps: O.Adagrad(ps, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("chunk_mb", [None, 2 / 1024], ids=["whole", "split"])
@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_on_non_contiguous_params(name, layout, chunk_mb):
    # Fused kernels pair param, grad and state elements by memory position: host states keep the param's
    # dense layout, split pieces follow memory order.
    torch.manual_seed(0)
    with simulator.activate():
        p = torch.nn.Parameter(_layout_param(layout))
        r = torch.nn.Parameter(p.detach().clone())
        assert r.stride() == p.stride() and not p.is_contiguous()
        opt = SwapOptimizer(FUSED[name]([p]), chunk_mb=chunk_mb)
        ref = FUSED[name]([r])
        for _ in range(4):
            g = torch.empty_like(p).copy_(torch.randn(p.shape))  # autograd's layout: the param's
            p.grad, r.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        opt.wait_for_swap_out()
        if chunk_mb is not None:
            assert len(opt._layout.prepared.plan.chunks) > 1
        assert torch.equal(p, r)
        for key, value in ref.state[r].items():
            assert opt.state[p][key].stride() == value.stride(), key
            assert torch.equal(opt.state[p][key].cpu(), value.cpu()), key


def test_zero_element_params_only():
    # every param with a grad has zero elements: steps 1, 2, 3 run and count as torch counts them
    ps, opt, rs, ref = run_pair(lambda g: O.AdamW(g, lr=1e-2), sizes=((0,), (3, 0)), steps=3)
    assert_parity(ps, opt, rs, ref)
    assert all(opt.state[p]["step"] == 3 for p in ps)


def test_no_state_entries_torch_would_not_make():
    # SGD without momentum keeps no state: no empty per-param entries either
    ps, opt, rs, ref = run_pair(lambda g: O.SGD(g, lr=1e-2), steps=2, chunk_mb=2 / 1024)
    assert_parity(ps, opt, rs, ref)
    assert ref.state_dict()["state"] == {}
    assert opt.state_dict()["state"] == {} and len(opt.state) == 0
