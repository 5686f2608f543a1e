"""prefetch: the next step's first chunks are swapped in after the forward, under the backward. Results stay
bitwise those of the unwrapped optimizer, the step issues no swap-in for the prefetched chunks and its first
update waits for nothing but them, a plan that changed in between drops the prefetch without leaking its
staging, and every access is ordered (the simulator's sanitizer is on in every test)."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from stepping import (
    Boom,
    adamw,
    assert_matches_reference,
    attached_pair,
    fail_on_call,
    mlp,
    same_grads,
    step_reference_as_failed,
)
from torch import nn

import device
from swapopt import SwapAdamW, SwapConfig, SwapOptimizer
from swapopt.engine.config import AdamWConfig

CHUNKS = 4
STEPS = 4


class _Spy:
    """Counts, per step, the chunks swapped in by step() and those prefetched ahead of it."""

    def __init__(self, opt: SwapOptimizer) -> None:
        op = opt.operate
        self.swapped: list[int] = []
        self.prefetched: list[int] = []
        self.prefetch_events: dict[int, object] = {}
        real_in, real_pf = op.swap_in, op.prefetch_in

        def swap_in(k, copies):
            self.swapped.append(k)
            return real_in(k, copies)

        def prefetch_in(k, copies):
            self.prefetched.append(k)
            real_pf(k, copies)
            self.prefetch_events[k] = op.prefetched.h2d_events[k]

        op.swap_in, op.prefetch_in = swap_in, prefetch_in

    def reset(self) -> None:
        self.swapped.clear()
        self.prefetched.clear()
        self.prefetch_events.clear()


def _train(kind: str, mode: str, overlap: bool = False, steps: int = STEPS):
    """Params, state dict and optimizer of a short loop. ``mode``: "none" (unwrapped), "off" (no prefetch),
    "auto" (the knob and attach), "manual" (opt.prefetch() after the forward, knob off)."""
    model = mlp()
    inner = adamw(kind, model.parameters())
    opt: torch.optim.Optimizer = inner
    used = 0
    if mode != "none":
        opt = SwapOptimizer(inner, swap_optimizer_times=CHUNKS, overlap_forward=overlap, prefetch=mode == "auto")
        opt.attach(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    torch.manual_seed(1)
    data = [(torch.randn(8, 32), torch.randn(8, 4)) for _ in range(steps)]
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        if mode == "manual":
            opt.prefetch()
            assert not opt.prefetch()  # idempotent until the step
        if isinstance(opt, SwapOptimizer):
            used += opt.operate.prefetched is not None
        loss.backward()
        opt.step()
        sched.step()
        if isinstance(opt, SwapOptimizer):
            assert opt.operate.prefetched is None  # adopted by the step
    if isinstance(opt, SwapOptimizer):
        opt.wait_for_update()
        opt.wait_for_swap_out()
    sd = opt.state_dict()
    return [p.detach().clone() for p in model.parameters()], sd, used


def _same_state_dict(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for key, v in a["state"][k].items():
            w = b["state"][k][key]
            assert torch.equal(torch.as_tensor(v).cpu(), torch.as_tensor(w).cpu()), (k, key)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_bitwise_equal_with_prefetch_on_off_and_unwrapped(sim, kind, overlap):
    ref_params, ref_sd, _ = _train(kind, "none")
    for mode in ("off", "auto", "manual"):
        params, sd, used = _train(kind, mode, overlap)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), mode
        _same_state_dict(sd, ref_sd)
        # no plan before step 1, a stale one after it (step 1 created the states): steps 3 and 4 prefetch
        assert used == (0 if mode == "off" else STEPS - 2), (mode, used)
    assert not torch.equal(ref_params[0], mlp()[0].weight)  # the loop did train


def _stepped(width: int = 64, chunks: int = CHUNKS, overlap: bool = False, prefetch: bool = True, **kw):
    model = mlp(width=width)
    opt = SwapOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
        swap_optimizer_times=chunks, overlap_forward=overlap, prefetch=prefetch, **kw,
    )  # fmt: skip
    opt.attach(model)
    x = torch.randn(8, width)
    for _ in range(2):  # after step 2 the plan holds: the next forward prefetches
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    return model, opt, x


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_step_issues_no_swap_in_for_prefetched_chunks(sim, overlap):
    model, opt, x = _stepped(overlap=overlap)
    h2d_without = opt.swap_stats().h2d_bytes
    spy = _Spy(opt)
    for _ in range(2):
        spy.reset()
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        ahead = opt.operate.slots - 1
        assert spy.prefetched == list(range(ahead)) and not spy.swapped  # issued by the forward hook
        loss.backward()
        opt.step()
        n = opt.swap_stats().chunks
        assert n > ahead
        assert spy.swapped == list(range(ahead, n)), spy.swapped
        assert spy.prefetched == list(range(ahead))  # nothing issued twice
        # the prefetched chunks' updates wait for the prefetched copies
        assert all(opt.operate.h2d_events[k] is spy.prefetch_events[k] for k in range(ahead))
        assert opt.swap_stats().h2d_bytes == h2d_without  # each chunk counted once per step
    opt.wait_for_update()
    opt.wait_for_swap_out()


def test_no_prefetch_before_the_first_step_without_attach_or_without_grad(sim):
    model = mlp()
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters()), swap_optimizer_times=CHUNKS, prefetch=True)
    assert not opt.prefetch()  # no plan yet
    x = torch.randn(8, 32)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()
        assert opt.operate.prefetched is None  # knob on but never attached: nothing automatic
    opt.attach(model)
    with torch.no_grad():
        model(x)  # an evaluation forward: no backward and step follow
    assert opt.operate.prefetched is None
    model(x)
    assert opt.operate.prefetched is not None
    opt.offload()
    assert opt.operate.prefetched is None


def _entry_to_first_update_us(sim, prefetch: bool) -> float:
    model, opt, x = _stepped(width=512, prefetch=prefetch)
    sim.synchronize()
    sim.reset_timeline()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    with torch.profiler.record_function("test.entry"):
        torch.zeros(1).add_(1)  # on the compute stream, after the backward: the step's entry
    opt.step()
    sim.synchronize()
    ops = [op for op in sim.timeline if op.lane != "host"]  # device work only
    entry = max(op.end_us for op in ops if op.label == "test.entry")
    first = min(op.start_us for op in ops if op.label == "swapopt.update[0]")
    ahead = [op.end_us for op in ops if op.label == "swapopt.prefetch[0]"]
    assert bool(ahead) == prefetch
    if prefetch:  # waits for the entry and chunk 0's prefetched copy, nothing else
        assert first == pytest.approx(max(entry, *ahead)), (first, entry, ahead)
    return first - entry


def test_first_update_starts_sooner_after_the_entry(sim_no_launch):
    with_prefetch = _entry_to_first_update_us(sim_no_launch, True)
    without = _entry_to_first_update_us(sim_no_launch, False)
    assert with_prefetch < without, (with_prefetch, without)


def _reference_pair(width: int = 32):
    model = mlp(width=width)
    twin = mlp(width=width)
    opt = SwapOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), swap_optimizer_times=CHUNKS, prefetch=True
    )
    opt.attach(model)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=True)
    return model, opt, twin, ref


def _step_both(model, opt, twin, ref, x, between=None) -> None:
    for m, o in ((model, opt), (twin, ref)):
        o.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        if between is not None:
            between(m, o)
        o.step()


def _assert_bitwise(model, opt, twin, ref) -> None:
    opt.wait_for_swap_out()
    for p, r in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.detach(), r.detach())
        assert all(torch.equal(torch.as_tensor(opt.state[p][k]).cpu(), torch.as_tensor(v).cpu()) for k, v in ref.state[r].items())


@pytest.mark.parametrize("action", ["load_state_dict", "offload", "invalidate", "grad_lost", "add_param_group"])
def test_plan_changes_after_the_prefetch_drop_it_without_a_leak(sim, action):
    model, opt, twin, ref = _reference_pair()
    torch.manual_seed(1)
    xs = [torch.randn(8, 32) for _ in range(5)]
    for x in xs[:2]:
        _step_both(model, opt, twin, ref, x)
    saved = opt.state_dict()
    extra, twin_extra = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))  # made before the baseline

    def act(m, o):
        if o is ref:
            if action == "grad_lost":
                m[0].weight.grad = None
            elif action == "add_param_group":
                o.add_param_group({"params": [twin_extra]})
            return
        assert o.operate.prefetched is not None  # the forward prefetched
        if action == "load_state_dict":
            o.load_state_dict(saved)
        elif action == "offload":
            o.offload()
        elif action == "invalidate":
            o.invalidate()
        elif action == "grad_lost":
            m[0].weight.grad = None  # the plan changes: the prefetch is dropped at the step
        elif action == "add_param_group":
            o.add_param_group({"params": [extra]})
        if action != "grad_lost":
            assert o.operate.prefetched is None

    opt.zero_grad(set_to_none=True)
    opt.wait_for_swap_out()
    sim.synchronize()
    gc.collect()
    base = sim.memory_allocated()
    _step_both(model, opt, twin, ref, xs[2], act)
    assert opt.operate.prefetched is None
    _assert_bitwise(model, opt, twin, ref)
    opt.zero_grad(set_to_none=True)
    sim.synchronize()
    gc.collect()
    assert sim.memory_allocated() <= base, "the dropped prefetch's staging outlived the step"
    for x in xs[3:]:  # later steps prefetch again and stay bitwise
        _step_both(model, opt, twin, ref, x)
    _assert_bitwise(model, opt, twin, ref)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("fail_chunk", [0, 1])
def test_failing_step_after_a_prefetch_keeps_params_stepped_or_untouched(sim, overlap, fail_chunk):
    ps, rs, opt, ref = attached_pair(overlap_forward=overlap)
    for step in range(5):
        same_grads(ps, rs)
        prefetched = opt.prefetch()
        assert prefetched == (step >= 2)  # manual: no plan before step 1, a stale one after it
        if step != 2:
            opt.step()
            ref.step()
            continue
        opt.wait_for_swap_out()
        sim.synchronize()
        gc.collect()
        base = sim.memory_allocated()
        restore = fail_on_call(opt, fail_chunk)
        with pytest.raises(Boom):
            opt.step()
        restore()
        assert opt.operate.prefetched is None and not opt.operate.pending
        gc.collect()
        assert sim.memory_allocated() <= base, "staging outlived the failed step"
        step_reference_as_failed(opt, ref, rs, chunks_done=fail_chunk)
    assert_matches_reference(opt, ps, ref, rs)


def test_knob_plumbing_and_the_ignored_knob_warning(sim):
    model = mlp()
    opt = SwapConfig(swap_optimizer=True, prefetch=True).wrap(torch.optim.AdamW(model.parameters()))
    assert isinstance(opt, SwapOptimizer) and opt.prefetch_enabled and not opt.overlap_forward
    assert not SwapConfig().prefetch
    assert SwapAdamW(model.parameters(), prefetch=True).prefetch_enabled
    built = AdamWConfig(swap_optimizer=True, prefetch=True, overlap_forward=True).build(model.parameters())
    assert built.prefetch_enabled and built.overlap_forward
    for knob in ("overlap_forward", "prefetch"):
        with pytest.warns(UserWarning, match=f"{knob}=True has no effect with swap_optimizer=False"):
            plain = SwapConfig(**{knob: True}).wrap(torch.optim.AdamW(model.parameters()))
        assert not isinstance(plain, SwapOptimizer)
        with pytest.warns(UserWarning, match=knob):
            AdamWConfig(**{knob: True}).build(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SwapConfig().wrap(torch.optim.AdamW(model.parameters()))  # nothing to warn about


def test_engine_prefetches_bitwise_and_never_makes_the_host_wait(sim, monkeypatch):
    from test_engine_overlap import HostWaits, engine, losses

    off = losses(engine(), 4)
    e = engine("optim.prefetch=true")  # prefetch alone: the engine attaches the optimizer for it too
    opt = e.optimizer
    issued = []
    real = opt.prefetch
    opt.prefetch = lambda: issued.append(real()) or issued[-1]  # the forward hook looks it up on the instance
    on = losses(e, 2)
    waits = HostWaits(sim, monkeypatch)
    pending = [e.train_step() for _ in range(2)]
    assert waits.count == 0  # a prefetch the step adopts never makes the host wait
    on += [m["loss"] for m in pending]
    assert on == off
    assert sum(issued) >= 2, issued  # the later steps ran on prefetched chunks


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_fsdp2_one_rank_prefetch_bitwise(pg, overlap):
    from dist_utils import sharded_mlp

    def run(prefetch: bool):
        model = sharded_mlp((12, 16, 9, 3), 1, mesh_device=device.torch_device().type)  # params on the device
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        opt = SwapOptimizer(inner, swap_optimizer_times=3, overlap_forward=overlap, prefetch=prefetch)
        opt.attach(model)  # after fully_shard; the prefetch hook runs after FSDP's post-forward
        used = 0
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 12, generator=g, device="cpu").to(device.torch_device())  # a CPU generator draws on the host
            loss = model(x).pow(2).mean()
            used += opt.operate.prefetched is not None
            loss.backward()
            opt.step()
            # FSDP2 allocates the sharded grads on its reduce-scatter stream and the step reads them on the
            # current one; freeing them (zero_grad(set_to_none=True)) needs record_stream by CUDA's rules,
            # which FSDP2 leaves out (its later reduce-scatters are ordered after the step anyway).
            for p in model.parameters():
                device.record_stream(p.grad, device.get_torch_device_module().current_stream())
        opt.wait_for_update()
        full = [p.full_tensor().clone() for p in model.parameters()]
        opt.wait_for_swap_out()
        return full, used

    on, used = run(True)
    off, _ = run(False)
    assert used == STEPS - 2
    assert all(torch.equal(a, b) for a, b in zip(on, off))


@pytest.mark.parametrize("knobs", [{"resident_mb": 0.02}, {"chunk_mb": 3 / 1024}], ids=["resident", "split"])
def test_resident_and_split_params_bitwise(sim, knobs):
    model, twin = mlp(), mlp()
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), prefetch=True, **knobs)
    opt.attach(model)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(1)
    used = 0
    for _ in range(STEPS):
        x = torch.randn(8, 32)

        def count(m, o):
            nonlocal used
            used += o is opt and o.operate.prefetched is not None

        _step_both(model, opt, twin, ref, x, count)
    prep = opt._layout.prepared
    if "resident_mb" in knobs:
        assert prep.resident, "some params stay resident"
    else:
        assert any(pc.start > 0 for c in prep.plan.chunks for pc in c.pieces), "no param is split"
    assert used == STEPS - 2
    _assert_bitwise(model, opt, twin, ref)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_prefetch_budget_is_the_staging_and_the_step_keeps_its_cap(sim, overlap):
    # The prefetch allocates the step's staging (slots x slot bytes) and nothing else; from there to the end
    # of the step the extra device memory stays within (slots + 1) x chunk, as without prefetch.
    slots = 3
    model, opt, x = _stepped(width=128, chunks=8, overlap=overlap, slots=slots)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()  # the forward hook prefetched: drop it to measure one by hand
        assert opt.operate.discard_prefetch()
        before = sim.memory_allocated()
        assert opt.prefetch()
        staging = sim.memory_allocated() - before
        assert staging == slots * opt._layout.prepared.slot_bytes
        loss.backward()
        base = sim.memory_allocated() - staging  # what the step would start from without the prefetch
        sim.reset_peak_memory_stats()
        opt.step()
        chunk = opt._layout.prepared.plan.max_chunk_bytes
        extra = sim.max_memory_allocated() - base
        assert staging <= extra <= (slots + 1) * chunk, f"{extra} > {slots + 1} x {chunk}"
    opt.wait_for_update()
    opt.wait_for_swap_out()
