"""copy.deepcopy and pickling of SwapOptimizer, as torch optimizers support them: the copy has its own
transfer engine and its own pinned host states, equal in value, steps bitwise like the original, and the
original is unaffected."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from dist_utils import assert_same_state, forward_backward, host_states, make_model, snapshot, swap, train

import device
from swapopt import SwapOptimizer

VARIANTS = {"host": {}, "resident": {"resident_mb": 0.001}}  # resident: small params keep device states


def to_device(model: torch.nn.Module) -> torch.nn.Module:
    """Unpickled tensors are host memory on the simulator; on an accelerator torch.load restores params on
    the device they were saved from. Re-home the param data (the Parameter objects, the optimizer's state
    keys, stay the same)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = torch.empty(p.shape, dtype=p.dtype, device=device.torch_device()).copy_(p.data)
    return model


def _pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def _torch_save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _copy_pair(how, model, opt):
    if how == "deepcopy":
        return copy.deepcopy((model, opt))
    loads = _pickle if how == "pickle" else _torch_save
    new_model, new_opt = loads((model, opt))  # one pickle: the optimizer's state keys are the new params
    return to_device(new_model), new_opt


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copy_has_its_own_engine_and_pinned_states_and_steps_bitwise(sim, how, variant):
    kw = VARIANTS[variant]
    ref_model = make_model()
    ref = swap(ref_model, **kw)
    train(ref_model, ref, 4)

    model = make_model()
    opt = swap(model, **kw)
    train(model, opt, 1)
    forward_backward(model, 1)
    opt.step()  # swap-outs still in flight: the copy must wait for them
    opt.zero_grad()
    new_model, new = _copy_pair(how, model, opt)

    assert type(new) is type(opt) and new.operate is not opt.operate
    assert (new.swap_optimizer_times, new.resident_mb, new.operate.slots) == (3, opt.resident_mb, opt.operate.slots)
    assert new.optimizer is not opt.optimizer and new.state is new.optimizer.state
    assert new.param_groups[0]["params"] == list(new_model.parameters())
    mine, theirs = host_states(opt), host_states(new)
    assert {t.data_ptr() for t in mine}.isdisjoint(t.data_ptr() for t in theirs)
    assert all(device.is_host_tensor(t) and t.is_pinned() for t in theirs)
    assert_same_state(snapshot(model, opt), snapshot(new_model, new))
    assert new.swap_stats().steps == opt.swap_stats().steps == 2

    train(model, opt, 2, start=2)
    train(new_model, new, 2, start=2)
    assert_same_state(snapshot(ref_model, ref), snapshot(model, opt))
    assert_same_state(snapshot(ref_model, ref), snapshot(new_model, new))


def test_deepcopy_of_the_optimizer_alone_copies_params_like_torch(sim):
    """copy.deepcopy(optimizer) copies its params too (torch's own optimizers do the same)."""
    model = make_model()
    opt = swap(model)
    train(model, opt, 2)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert copy.deepcopy(plain).param_groups[0]["params"][0] is not next(model.parameters())
    new = copy.deepcopy(opt)
    new_params = new.param_groups[0]["params"]
    assert all(q is not p and torch.equal(q, p) for q, p in zip(new_params, model.parameters()))
    assert set(new.state) == set(new_params)


def test_copy_of_an_offloaded_fused_optimizer_steps_bitwise(sim):
    """Offload moved fused AdamW's device ``step`` scalars to the host; a copy taken then puts its own back
    before its first step, like the original."""

    def build():
        model = make_model()
        return model, SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), swap_optimizer_times=3)

    ref_model, ref = build()
    train(ref_model, ref, 3)
    model, opt = build()
    train(model, opt, 2)
    opt.offload()
    new_model, new = copy.deepcopy((model, opt))
    train(new_model, new, 1, start=2)
    opt.onload()
    train(model, opt, 1, start=2)
    steps = [s["step"] for s in new.state.values()]
    assert steps and not any(device.is_host_tensor(t) for t in steps)
    assert_same_state(snapshot(ref_model, ref), snapshot(model, opt))
    assert_same_state(snapshot(ref_model, ref), snapshot(new_model, new))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_keeps_overlap_forward_and_prefetch(sim, how):
    model = torch.nn.Linear(4, 4)
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=True, prefetch=True)
    new = copy.deepcopy(opt) if how == "deepcopy" else _pickle(opt)
    assert new.overlap_forward and new.prefetch_enabled
    plain = copy.deepcopy(SwapOptimizer(torch.optim.AdamW(model.parameters())))
    assert not plain.overlap_forward and not plain.prefetch_enabled
