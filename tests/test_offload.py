"""RL phases on the simulator: offload/onload around a rollout that needs the device memory, idempotence,
safety before the first step and after a failed step, re-homing of states moved behind the optimizer's
back, and put_optimizer_to_device."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from dist_utils import (
    adamw,
    assert_same_state,
    forward_backward,
    host_states,
    live_device_bytes,
    make_model,
    snapshot,
    swap,
    train,
)
from loguru import logger

import device
import simdevice as simulator
from swapopt import SwapOptimizer, offload, offloaded, onload, put_optimizer_to_device


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def device_state_bytes(opt) -> int:
    opt.wait_for_swap_out()
    return sum(nbytes(v) for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and not device.is_host_tensor(v))


def _reference_run(steps: int) -> tuple[dict, int]:
    """Uninterrupted swap training; returns its final snapshot and the peak device memory it needed."""
    with simulator.activate("h100", sanitize=True) as mod:
        model = make_model()
        opt = swap(model)
        mod.reset_peak_memory_stats()
        train(model, opt, steps)
        return snapshot(model, opt), mod.max_memory_allocated()


def test_rl_phase_frees_the_device_for_a_kv_cache_and_training_continues_bitwise():
    expected, train_peak = _reference_run(5)
    with simulator.activate("h100", capacity_bytes=train_peak, sanitize=True) as mod:
        model = make_model()
        opt = swap(model)
        param_bytes = sum(nbytes(p) for p in model.parameters())
        train(model, opt, 2)
        forward_backward(model, 2)
        opt.step()

        offload(opt, empty_cache=True)
        grad_bytes = sum(nbytes(p.grad) for p in model.parameters())
        assert mod.memory_allocated() == param_bytes + grad_bytes + device_state_bytes(opt)
        opt.zero_grad()

        # The rollout takes every byte training does not hold; resident AdamW states (2x params) could
        # not have stayed beside it.
        kv_bytes = train_peak - mod.memory_allocated()
        assert sum(nbytes(t) for t in host_states(opt)) == 2 * param_bytes
        assert param_bytes + 2 * param_bytes + kv_bytes > train_peak
        kv_cache = torch.empty(kv_bytes, dtype=torch.uint8)
        kv_cache.fill_(7)
        del kv_cache

        onload(opt)
        train(model, opt, 2, start=3)
        assert_same_state(expected, snapshot(model, opt))


def test_offloaded_context_onloads_on_exception_and_training_continues(monkeypatch):
    expected, _ = _reference_run(4)
    calls = []
    # The module, not the function of the same name that the swapopt package exports.
    module = importlib.import_module("swapopt.offload")
    real_onload = module.onload
    monkeypatch.setattr(module, "onload", lambda o: (calls.append(o), real_onload(o)))
    with simulator.activate("h100", sanitize=True):
        model = make_model()
        opt = swap(model)
        train(model, opt, 2)
        with pytest.raises(RuntimeError, match="rollout failed"):
            with offloaded(opt):
                raise RuntimeError("rollout failed")
        assert calls == [opt]
        train(model, opt, 2, start=2)
        assert_same_state(expected, snapshot(model, opt))


def test_offload_onload_are_idempotent_before_the_first_step(sim):
    model = make_model()
    opt = swap(model)
    params = [p.detach().clone() for p in model.parameters()]
    before = live_device_bytes(sim)
    offload(opt)
    offload(opt, empty_cache=True)
    onload(opt)
    onload(opt)
    opt.onload()  # onload with no offload
    opt.offload()
    opt.onload()
    assert not opt.state
    assert sim.memory_allocated() == before
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_offload_onload_change_no_state(sim):
    model = make_model()
    opt = swap(model)
    train(model, opt, 2)
    before = snapshot(model, opt)
    ptrs = [t.data_ptr() for t in host_states(opt)]
    onload(opt)
    offload(opt)
    offload(opt)
    onload(opt)
    onload(opt)
    assert_same_state(before, snapshot(model, opt))
    assert [t.data_ptr() for t in host_states(opt)] == ptrs
    assert all(device.is_host_tensor(t) for t in host_states(opt))


def test_offload_after_a_failed_step_frees_staging():
    with simulator.activate("h100", capacity_bytes=1 << 20, sanitize=True) as mod:
        model = make_model()
        opt = swap(model)
        train(model, opt, 1)
        forward_backward(model, 1)
        # Leave no room for staging: the step fails on its first device allocation.
        blocker = torch.empty(mod.mem_get_info()[0], dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError):
            opt.step()
        del blocker
        offload(opt, empty_cache=True)
        offload(opt)
        expected = sum(nbytes(p) + nbytes(p.grad) for p in model.parameters()) + device_state_bytes(opt)
        assert mod.memory_allocated() == expected
        onload(opt)
        opt.step()
        opt.zero_grad()
        assert all(device.is_host_tensor(t) for t in host_states(opt))


def test_state_moved_to_device_is_rehomed_at_next_step_with_warning():
    expected, _ = _reference_run(3)
    messages: list[str] = []
    logger.enable("swapopt")
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    try:
        with simulator.activate("h100", sanitize=True), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = make_model()
            opt = swap(model)
            train(model, opt, 2)
            opt.wait_for_swap_out()
            p = next(iter(model.parameters()))
            host = opt.state[p]["exp_avg"]
            # What ``state[k] = state[k].to(dev)`` does on an accelerator: a device copy replaces the host one.
            opt.state[p]["exp_avg"] = torch.empty(host.shape, device=device.torch_device()).copy_(host)
            assert not device.is_host_tensor(opt.state[p]["exp_avg"])
            train(model, opt, 1, start=2)
            opt.wait_for_swap_out()
            # Back in the very pinned tensor it came from (no new host allocation), values intact.
            assert opt.state[p]["exp_avg"].data_ptr() == host.data_ptr()
            assert device.is_host_tensor(opt.state[p]["exp_avg"])
            assert_same_state(expected, snapshot(model, opt))
    finally:
        logger.remove(sink)
        logger.disable("swapopt")
    # That one warning, naming the state; not just any warning (or log line) the run happened to give.
    rehomed = [w for w in caught if "optimizer state 'exp_avg' was found in device memory" in str(w.message)]
    assert len(rehomed) == 1, [str(w.message) for w in caught] + messages


def test_put_optimizer_to_device_is_false_for_swap_optimizer(sim):
    model = make_model()
    opt = swap(model)
    train(model, opt, 1)
    before = snapshot(model, opt)
    ptrs = [t.data_ptr() for t in host_states(opt)]
    assert put_optimizer_to_device(opt, "cpu") is False
    assert put_optimizer_to_device(opt, device.torch_device()) is False
    assert [t.data_ptr() for t in host_states(opt)] == ptrs
    assert_same_state(before, snapshot(model, opt))


@pytest.mark.parametrize("capturable", [False, True])
def test_put_optimizer_to_device_moves_a_plain_optimizer(capturable):
    model = make_model()
    opt = adamw(model)
    train(model, opt, 1)
    opt.param_groups[0]["capturable"] = capturable
    assert put_optimizer_to_device(opt, "meta") is True
    for s in opt.state.values():
        assert s["exp_avg"].is_meta and s["exp_avg_sq"].is_meta
        # The CPU scalar step stays put unless the optimizer keeps it on the device (capturable/fused).
        assert s["step"].is_meta == capturable


def test_offload_onload_of_a_plain_optimizer_round_trip():
    # SwapConfig(swap_optimizer=False).wrap returns the plain optimizer: the same RL code must still work.
    model = make_model()
    opt = adamw(model)
    train(model, opt, 2)
    before = snapshot(model, opt)
    with offloaded(opt):
        assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    onload(opt)
    assert_same_state(before, snapshot(model, opt))
    assert all(s["exp_avg"].device == p.device for p, s in opt.state.items())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_offload_leaves_no_optimizer_byte_on_the_device_and_the_next_step_restores_residency(sim, fused):
    """Resident states (resident_mb) and the device ``step`` scalars of fused AdamW go to host memory while
    offloaded; afterwards training continues bitwise like a run that never offloaded."""

    def build():
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=not fused, fused=fused)
        return model, SwapOptimizer(inner, swap_optimizer_times=3, resident_mb=0.001)

    ref_model, ref = build()
    train(ref_model, ref, 4)
    model = make_model()
    no_optimizer = live_device_bytes(sim)
    del model
    model, opt = build()
    train(model, opt, 2)
    on_device = device_state_bytes(opt)
    assert on_device > 0  # resident states (and fused steps) live on the device between steps
    with offloaded(opt):
        assert device_state_bytes(opt) == 0
        assert live_device_bytes(sim) == no_optimizer
    train(model, opt, 2, start=2)
    assert device_state_bytes(opt) == on_device
    assert_same_state(snapshot(ref_model, ref), snapshot(model, opt))
    # Stepping without onload works too: the next step puts the device scalars back first.
    offload(opt)
    train(model, opt, 1, start=4)
    train(ref_model, ref, 1, start=4)
    assert_same_state(snapshot(ref_model, ref), snapshot(model, opt))


def test_offload_empty_cache_returns_the_cached_segments_to_the_device():
    """With PyTorch's caching allocator, freed optimizer blocks stay reserved until empty_cache: offload's
    empty_cache=True must hand them back (what a rollout engine outside torch's allocator can use), and
    empty_cache=False must leave the cache alone. States of 16 MiB each take segments of their own, so
    emptying the cache has something to release; the exact allocator would show no difference."""
    with simulator.activate("h100", allocator="caching", sanitize=True) as mod:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4096, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 8))
        # chunks of 16 MiB, as the docstring has it (with swap_optimizer_times the planner may take smaller ones)
        opt = swap(model, chunk_mb=16)
        for _ in range(2):
            model(torch.randn(4, 4096)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        live = mod.memory_allocated()
        reserved_after_step = mod.memory_reserved()

        offload(opt, empty_cache=False)
        freed = live - mod.memory_allocated()
        assert freed >= 2 * 4096 * 1024 * 4, "offload frees at least the two AdamW states of the big weight"
        assert mod.memory_reserved() == reserved_after_step, "empty_cache=False keeps the cache"

        onload(opt)
        offload(opt, empty_cache=True)
        emptied = mod.memory_reserved()
        assert emptied <= reserved_after_step - freed
        mod.empty_cache()
        assert mod.memory_reserved() == emptied, "offload already released every segment it could"
