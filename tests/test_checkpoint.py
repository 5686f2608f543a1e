"""SwapOptimizer.state_dict / load_state_dict on the simulator: format parity with torch, host-only loads,
validation that leaves the optimizer unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import (
    adamw,
    assert_same_state,
    copy_model,
    forward_backward,
    host_states,
    live_device_bytes,
    make_model,
    snapshot,
    swap,
    train,
)
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import device
import simdevice as simulator
from swapopt import SwapOptimizer


def on_device(sd):
    """``sd`` with its non-scalar tensors copied to the device. On an accelerator, torch's load_state_dict
    does this itself (``.to(param.device)``); on the simulator the device is the CPU, so it would not."""
    dev = device.torch_device()
    state = {
        i: {k: torch.empty(v.shape, dtype=v.dtype, device=dev).copy_(v) if v.dim() else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


INNERS = {
    "adamw": (adamw, {}),
    "adamw-resident": (adamw, {"resident_mb": 0.001}),  # the small params keep their states on the device
    # Factored states shaped unlike their params; whole params per chunk.
    "adafactor": (lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2, foreach=False), {}),
}


@pytest.mark.parametrize("inner", list(INNERS))
def test_plain_checkpoint_loads_into_swap_optimizer_and_trains_on(sim, inner):
    make_inner, swap_kw = INNERS[inner]
    ref = make_model()
    plain = make_inner(ref)
    train(ref, plain, 3)
    plain_sd = copy.deepcopy(plain.state_dict())

    model = copy_model(ref)
    opt = SwapOptimizer(make_inner(model), swap_optimizer_times=3, **swap_kw)
    before = live_device_bytes(sim)
    opt.load_state_dict(plain_sd)
    assert sim.memory_allocated() <= before
    assert all(device.is_host_tensor(t) for t in host_states(opt))
    # Same format as the plain optimizer: keys, shapes, dtypes, values, param groups.
    assert_same_state(snapshot(ref, plain), snapshot(model, opt))

    train(ref, plain, 2, start=3)
    train(model, opt, 2, start=3)
    assert_same_state(snapshot(ref, plain), snapshot(model, opt))


def test_swap_checkpoint_loads_into_plain_optimizer(sim):
    model = make_model()
    opt = swap(model)
    train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())

    ref = copy_model(model)
    plain = adamw(ref)
    plain.load_state_dict(on_device(sd))
    assert_same_state(snapshot(model, opt), snapshot(ref, plain))
    train(model, opt, 2, start=3)
    train(ref, plain, 2, start=3)
    assert_same_state(snapshot(model, opt), snapshot(ref, plain))


def test_state_dict_returns_the_host_tensors_and_allocates_nothing(sim):
    model = make_model()
    opt = swap(model)
    train(model, opt, 2)
    before = live_device_bytes(sim)
    sim.reset_peak_memory_stats()
    sd = opt.state_dict()
    assert sim.max_memory_allocated() == before
    hosts = {t.data_ptr() for t in host_states(opt)}
    returned = [v for s in sd["state"].values() for k, v in s.items() if k != "step"]
    assert returned and all(t.data_ptr() in hosts and device.is_host_tensor(t) for t in returned)


def _checkpoint_from_plain_run():
    """A plain AdamW checkpoint made before the simulator starts: its tensors are ordinary host memory."""
    ref = make_model()
    plain = adamw(ref)
    train(ref, plain, 3)
    return ref, plain.state_dict()


@pytest.mark.parametrize("fresh", [True, False], ids=["no-state", "with-state"])
def test_load_allocates_no_device_memory(fresh):
    ref, sd = _checkpoint_from_plain_run()
    with simulator.activate("h100", sanitize=True) as mod:
        model = copy_model(ref)
        opt = swap(model)
        if not fresh:
            train(model, opt, 1)
        before = live_device_bytes(mod)
        mod.reset_peak_memory_stats()
        opt.load_state_dict(sd)
        assert mod.max_memory_allocated() == before
        assert mod.memory_allocated() == before
        assert all(device.is_host_tensor(t) for t in host_states(opt))
        for i, s in opt.state_dict()["state"].items():
            for k, v in s.items():
                assert torch.equal(v, sd["state"][i][k]), (i, k)


def test_set_optimizer_state_dict_fake_step_and_load_stay_on_host():
    ref, sd = _checkpoint_from_plain_run()
    fqn_sd = get_optimizer_state_dict(ref, adamw_loaded(ref, sd))
    with simulator.activate("h100", sanitize=True) as mod:
        model = copy_model(ref)
        params_before = [p.detach().clone() for p in model.parameters()]
        opt = swap(model)
        first_step_extra = _first_step_extra_memory(mod, copy_model(ref))
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        before = live_device_bytes(mod)
        mod.reset_peak_memory_stats()
        # Empty state: DCP runs a step with zero grads and lr=0 to create it.
        osd = get_optimizer_state_dict(model, opt)
        assert mod.memory_allocated() == before
        # Zero grads plus what any first step needs (staging, kernel temporaries); no resident states.
        assert mod.max_memory_allocated() <= before + param_bytes + first_step_extra
        for p, p0 in zip(model.parameters(), params_before):
            assert torch.equal(p, p0)
            assert p.grad is None
        hosts = host_states(opt)
        assert hosts and all(device.is_host_tensor(t) and not t.any() for t in hosts)
        assert all(v.data_ptr() in {t.data_ptr() for t in hosts}
                   for s in osd["state"].values() for k, v in s.items() if k != "step")

        # Loading copies into those same host tensors, with no device allocation.
        ptrs = [t.data_ptr() for t in hosts]
        mod.reset_peak_memory_stats()
        set_optimizer_state_dict(model, opt, fqn_sd)
        assert mod.max_memory_allocated() == before
        assert [t.data_ptr() for t in host_states(opt)] == ptrs
        got = get_optimizer_state_dict(model, opt)
        for name, s in fqn_sd["state"].items():
            for k, v in s.items():
                assert torch.equal(got["state"][name][k], v), (name, k)


def _first_step_extra_memory(mod, model) -> int:
    """Device memory a first SwapOptimizer step takes on top of params and grads."""
    opt = swap(model)
    forward_backward(model, 0)
    base = mod.memory_allocated()
    mod.reset_peak_memory_stats()
    opt.step()
    extra = mod.max_memory_allocated() - base
    opt.zero_grad()
    del opt
    return extra


def adamw_loaded(model, sd):
    opt = adamw(model)
    opt.load_state_dict(sd)
    return opt


def _corrupt(sd, what):
    sd = copy.deepcopy(sd)
    if what == "group-count":
        sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))
    elif what == "group-size":
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    elif what == "unknown-id":
        sd["state"][99] = sd["state"][0]
    elif what == "shape":
        sd["state"][2]["exp_avg_sq"] = torch.zeros(3, 5)
    elif what == "dtype":
        sd["state"][3]["exp_avg"] = torch.zeros_like(sd["state"][3]["exp_avg"], dtype=torch.complex64)
    elif what == "not-a-dict":
        sd["state"][1] = [1, 2]
    return sd


ERRORS = {
    "group-count": "2 parameter groups",
    "group-size": "parameter group 0",
    "unknown-id": "99",
    "shape": r"param 2, state 'exp_avg_sq': shape \(3, 5\)",
    "dtype": "param 3, state 'exp_avg': dtype torch.complex64",
    "not-a-dict": "param 1",
}


@pytest.mark.parametrize("what", list(ERRORS))
def test_bad_state_dict_raises_and_changes_nothing(sim, what):
    model = make_model()
    opt = swap(model)
    train(model, opt, 2)
    good = copy.deepcopy(opt.state_dict())
    # Valid entries come before the bad one and the groups carry a new lr: none of it may land.
    good["param_groups"][0]["lr"] = 0.5
    bad = _corrupt(good, what)
    before = snapshot(model, opt)
    ptrs = [t.data_ptr() for t in host_states(opt)]
    with pytest.raises(ValueError, match=ERRORS[what]):
        opt.load_state_dict(bad)
    assert_same_state(before, snapshot(model, opt))
    assert [t.data_ptr() for t in host_states(opt)] == ptrs
    assert opt.param_groups[0]["lr"] == 1e-2


def test_param_groups_loaded_in_place_like_torch(sim):
    model = make_model()
    opt = swap(model)
    train(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.25
    sd["param_groups"][0]["betas"] = (0.8, 0.9)
    group, params = opt.param_groups[0], opt.param_groups[0]["params"]
    opt.load_state_dict(sd)
    # Same dict object shared with the inner optimizer; params kept, hyperparameters loaded.
    assert opt.param_groups[0] is group and opt.optimizer.param_groups[0] is group
    assert group["params"] is params
    assert group["lr"] == 0.25 and group["betas"] == (0.8, 0.9)
