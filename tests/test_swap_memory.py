"""Device and host memory of SwapOptimizer on the simulator (sanitizer on)."""

from __future__ import annotations

import pytest
import torch

import device
import simdevice as simulator
from swapopt import SwapOptimizer
from swapopt.hoststate import is_swapped_state

O = torch.optim
KiB, MiB = 1 << 10, 1 << 20


def _params(n=8, shape=(64, 64)):
    return [torch.nn.Parameter(torch.randn(shape)) for _ in range(n)]


def _grads(params):
    for p in params:
        p.grad = torch.randn(p.shape)


def _device_bytes_outside_step(opt, params):
    """What may stay on the device between steps: params, grads and scalar (unswapped) states."""
    total = sum(p.numel() * p.element_size() * (2 if p.grad is not None else 1) for p in params)
    for p in params:
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and not device.is_host_tensor(v):
                assert not is_swapped_state(p, k, v), f"swapped state {k!r} left on the device"
                total += v.untyped_storage().nbytes()
    return total


def _pinned(dev, t):
    info = dev._lookup(t.untyped_storage())  # the simulator's host registry
    return info is not None and info.kind == "host"


MAKERS = {
    "adamw_foreach": lambda ps: O.AdamW(ps, lr=1e-3, foreach=True),
    "adam_single_amsgrad_wd_max": lambda ps: O.Adam(ps, lr=1e-3, foreach=False, amsgrad=True, weight_decay=0.1, maximize=True),
    "adamw_fused": lambda ps: O.AdamW(ps, lr=1e-3, fused=True),
    "sgd_momentum": lambda ps: O.SGD(ps, lr=1e-3, momentum=0.9),
    "rmsprop_centered": lambda ps: O.RMSprop(ps, lr=1e-3, centered=True, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_peak_extra_memory_bounded(name, slots):
    with simulator.activate() as dev:
        params = _params()
        opt = SwapOptimizer(MAKERS[name](params), swap_optimizer_times=16, slots=slots)
        for step in range(3):  # the first step creates the states chunk by chunk
            _grads(params)
            base = dev.memory_allocated()
            dev.reset_peak_memory_stats()
            opt.step()
            chunk = opt._layout.prepared.plan.max_chunk_bytes
            extra = dev.max_memory_allocated() - base
            assert extra <= (slots + 1) * chunk, f"step {step}: {extra} > {(slots + 1)} x {chunk}"
            # nothing but params, grads and scalar step states remains on the device
            assert dev.memory_allocated() == _device_bytes_outside_step(opt, params)
        assert opt.swap_stats().chunks >= 8


def _working_bytes(make, shape):
    """Peak device memory one unwrapped step of one param needs beyond param, grad and states."""
    with simulator.activate() as dev:
        p = torch.nn.Parameter(torch.randn(shape))
        opt = make([p])
        for _ in range(2):
            p.grad = torch.randn(shape)
            base = dev.memory_allocated()
            dev.reset_peak_memory_stats()
            opt.step()
        return dev.max_memory_allocated() - base


def test_peak_memory_whole_param_optimizer():
    # Adafactor's factored states are tiny, but its update works on param-sized temporaries: the bound is
    # slots x chunk of staging plus the working memory the unwrapped optimizer needs for one param.
    make = lambda ps: O.Adafactor(ps, lr=1e-3)  # noqa: E731
    working = _working_bytes(make, (64, 64))
    with simulator.activate() as dev:
        params = _params()
        opt = SwapOptimizer(make(params), swap_optimizer_times=16, slots=3)
        for _ in range(3):
            _grads(params)
            base = dev.memory_allocated()
            dev.reset_peak_memory_stats()
            opt.step()
            chunk = opt._layout.prepared.plan.max_chunk_bytes
            assert dev.max_memory_allocated() - base <= 3 * chunk + working
            assert dev.memory_allocated() == _device_bytes_outside_step(opt, params)


def test_host_bytes_equal_state_bytes_allocated_once(monkeypatch):
    with simulator.activate() as dev:
        params = _params(n=5, shape=(33, 17)) + [torch.nn.Parameter(torch.randn(()))]
        opt = SwapOptimizer(O.AdamW(params, lr=1e-3, amsgrad=True), chunk_mb=6400 / 2**20)
        calls = []
        real = device.host_empty  # every pinned host buffer of swapopt: arenas and single states
        monkeypatch.setattr(device, "host_empty", lambda *a, **k: calls.append(a) or real(*a, **k))
        ptrs: dict = {}
        for step in range(6):
            _grads(params)
            opt.step()
            if step == 0:  # the first step creates the states
                allocated = len(calls)
            opt.wait_for_swap_out()
            for p in params:
                for k, v in opt.state[p].items():
                    if is_swapped_state(p, k, v):
                        ptrs.setdefault((id(p), k), set()).add(v.data_ptr())
        chunks = opt._layout.prepared.plan.chunks
        # chunks smaller than one param's states (6,732 bytes) cut the 561-element params
        assert any(sum(pc.index == i for c in chunks for pc in c.pieces) > 1 for i in range(len(params)))
        # exp_avg, exp_avg_sq, max_exp_avg_sq allocated in the first step (whole params of a chunk share
        # one buffer), split params included, and never again
        assert len(calls) == allocated and 0 < allocated <= 3 * len(params)
        state_bytes = 0
        for p in params:
            for k, v in opt.state[p].items():
                if is_swapped_state(p, k, v):
                    assert _pinned(dev, v), k
                    assert len(ptrs[(id(p), k)]) == 1, "host state reallocated"
                    state_bytes += v.numel() * v.element_size()
        expected = sum(3 * p.numel() * 4 for p in params)
        storages = {
            v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
            for p in params for k, v in opt.state[p].items() if _pinned(dev, v)
        }  # fmt: skip
        host_bytes = sum(storages.values())
        assert state_bytes == host_bytes == expected
        # all pinned memory is the states: a failing step rolls split params forward, it keeps no copies
        # (counted as the host takes it: whole pages for arenas swapopt registers, rounded up by the caching host
        # allocator below device.REGISTER_MIN and on the npu flavour, device.host_held_bytes)
        arenas = opt._layout.arenas
        held = {
            v.untyped_storage().data_ptr(): device.host_held_bytes(v.untyped_storage().nbytes(), exact=arenas.locate(v) is not None)
            for p in params for k, v in opt.state[p].items() if _pinned(dev, v)
        }  # fmt: skip
        assert dev.host_memory_allocated() == sum(held.values())
        assert opt.swap_stats().pinned_requested_bytes == expected


def test_resident_states_stay_on_device():
    with simulator.activate() as dev:
        params = [torch.nn.Parameter(torch.randn(100)) for _ in range(4)]
        opt = SwapOptimizer(O.AdamW(params, lr=1e-3), swap_optimizer_times=2, resident_mb=2 * 800 / MiB)
        for _ in range(3):
            _grads(params)
            opt.step()
        opt.wait_for_swap_out()
        on_device = [p for p in params if not device.is_host_tensor(opt.state[p]["exp_avg"])]
        assert on_device == params[:2]
        resident_bytes = sum(opt.state[p][k].nbytes for p in on_device for k in ("exp_avg", "exp_avg_sq"))
        assert resident_bytes <= 2 * 800
        assert dev.memory_allocated() == sum(p.nbytes * 2 for p in params) + resident_bytes
        # a checkpoint round trip puts every state on the host; the next step makes the same params resident
        opt.load_state_dict(opt.state_dict())
        _grads(params)
        opt.step()
        opt.wait_for_swap_out()
        assert [p for p in params if not device.is_host_tensor(opt.state[p]["exp_avg"])] == params[:2]


def _train(dev, model, opt, steps=3):
    x = torch.randn(4, 256)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_capped_device_trains_only_with_swap():
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(4)])

    # params 1 MiB + grads 1 MiB + Adam states 2 MiB do not fit in 3 MiB; swapped, states stream through
    cap = 3 * MiB
    with simulator.activate(capacity_bytes=cap) as dev:
        m = model()
        with pytest.raises(torch.OutOfMemoryError):
            _train(dev, m, O.AdamW(m.parameters(), lr=1e-3))
    with simulator.activate(capacity_bytes=cap) as dev:
        m = model()
        opt = SwapOptimizer(O.AdamW(m.parameters(), lr=1e-3), swap_optimizer_times=16)
        _train(dev, m, opt, steps=4)
        assert dev.max_memory_allocated() <= cap
        assert opt.swap_stats().steps == 4


@pytest.mark.parametrize("slots", [1, 3])
def test_cap_holds_for_a_grad_laid_out_unlike_its_param(slots):
    # A transposed grad on a contiguous param is gathered piece by piece into the slot, never copied
    # whole, so (slots + 1) x budget holds from the first step on; the result stays bitwise.
    budget_mb = 0.25
    with simulator.activate() as dev:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(512, 512))
        r = torch.nn.Parameter(p.detach().clone())
        opt = SwapOptimizer(O.AdamW([p], lr=1e-3, foreach=True), chunk_mb=budget_mb, slots=slots)
        ref = O.AdamW([r], lr=1e-3, foreach=True)
        for step in range(3):
            g = torch.randn(512, 512).t()  # not the param's layout
            assert not g.is_contiguous()
            p.grad, r.grad = g.clone(memory_format=torch.preserve_format), g.clone(memory_format=torch.preserve_format)
            base = dev.memory_allocated()
            dev.reset_peak_memory_stats()
            opt.step()
            extra = dev.max_memory_allocated() - base
            ref.step()
            cap = (slots + 1) * budget_mb * MiB
            assert extra <= cap, f"step {step}: {extra / MiB:.2f} MiB > {cap / MiB:.2f} MiB"
            assert opt._layout.prepared.plan.max_chunk_bytes <= budget_mb * MiB
        opt.wait_for_swap_out()
        assert torch.equal(p, r)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k].cpu(), ref.state[r][k].cpu()), k  # host state, device state


def test_cap_counts_region_alignment():
    # 400 params of 7 elements: each state region is padded to 64 bytes inside the chunk budget.
    budget = 8 * KiB
    with simulator.activate() as dev:
        params = [torch.nn.Parameter(torch.randn(7)) for _ in range(400)]
        opt = SwapOptimizer(O.AdamW(params, lr=1e-3, foreach=True), chunk_mb=budget / MiB, slots=3)
        for step in range(3):
            _grads(params)
            base = dev.memory_allocated()
            dev.reset_peak_memory_stats()
            opt.step()
            extra = dev.max_memory_allocated() - base
            assert extra <= 4 * budget, f"step {step}: {extra} > 4 x {budget}"
            slot = opt._layout.prepared.slot_bytes
            assert slot <= budget, (slot, budget)
