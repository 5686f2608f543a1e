"""Fault injection at every stage of a chunk, with params split across chunks.

After the failing step every param is either fully stepped (value, states, step count) or untouched,
except the params of a chunk whose inner update raised, which the ERROR log names; device memory is
back to what it was before the step (the exception's traceback keeps no staging alive); swap_stats()
says the step failed; and later steps are bitwise those of a reference that took the same outcome.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pytest
import torch
from dist_utils import adopt, assert_steps_match, matches_snapshot, snapshot_params
from loguru import logger

import device
import simdevice as simulator
from swapopt import SwapOptimizer, SwapOptimizerOperate
from swapopt.pipeline import StepRun

O = torch.optim
MAKERS = {
    "adamw_foreach": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "sgd_momentum": lambda ps: O.SGD(ps, lr=1e-2, momentum=0.9),
}
STAGES = ("before_swap_in", "inside_update", "after_update", "swap_out_interrupt", "pinned_alloc")


class Boom(RuntimeError):
    pass


def _params() -> list[torch.nn.Parameter]:
    made = [torch.randn(3000), torch.randn(60, 50).t(), torch.randn(700), torch.randn(())]
    return [torch.nn.Parameter(t) for t in made]


def _grads(ps, rs) -> None:
    for p, r in zip(ps, rs):
        g = torch.empty_like(p).copy_(torch.randn(p.shape))
        p.grad, r.grad = g.clone(), g.clone()


@contextlib.contextmanager
def _errors() -> Iterator[list[str]]:
    """The ERROR messages swapopt logs meanwhile."""
    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(str(m)), level="ERROR")
    logger.enable("swapopt")
    try:
        yield messages
    finally:
        logger.remove(handle)
        logger.disable("swapopt")


def _adopt_outcome(ps, rs, opt, ref, old, stepped, failed: set[int]) -> int:
    """After a failed step of ``opt`` and a successful one of ``ref`` (``old``/``stepped``: the reference before and
    after): every param outside ``failed`` is stepped, every one inside it untouched or written in place by the
    failed update; the reference adopts each outcome. Returns how many were written in place."""
    partial = 0
    for i, (p, r) in enumerate(zip(ps, rs)):
        st = opt.state.get(p, {})
        if matches_snapshot(p, st, stepped[i]):
            assert i not in failed, i
            continue
        assert i in failed, f"param {i} is not stepped"
        if matches_snapshot(p, st, old[i]):
            adopt(r, ref.state, *old[i])
        else:
            partial += 1
            adopt(r, ref.state, p.detach(), st)
    return partial


class _Injector:
    """Raise once at the given stage of chunk ``k`` of the next step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, opt: SwapOptimizer, stage: str, k: int) -> None:
        self.fired = False
        mp = monkeypatch

        def once(real, when):
            def wrapper(*args, **kwargs):
                if not self.fired and when(*args, **kwargs):
                    self.fired = True
                    return self._raise(real, *args, **kwargs)
                return real(*args, **kwargs)

            return wrapper

        if stage == "before_swap_in":
            mp.setattr(SwapOptimizerOperate, "swap_in", once(SwapOptimizerOperate.swap_in, lambda s, kk, c: kk == k))
        elif stage == "inside_update":
            calls = []

            def counting(o, *a, **kw):
                calls.append(1)
                return len(calls) == k + 1

            mp.setattr(opt, "_step_fn", once(opt._step_fn, counting))
        elif stage == "after_update":
            mp.setattr(StepRun, "outputs", once(StepRun.outputs, lambda s, kk, *a: kk == k))
        elif stage == "swap_out_interrupt":
            mp.setattr(SwapOptimizerOperate, "swap_out", once(SwapOptimizerOperate.swap_out, lambda s, kk, *a: kk == k))
        elif stage == "pinned_alloc":  # new states' pinned host memory, on the step that creates them
            # Small buffers come from the caching host allocator, arenas from host_empty's registered memory.
            mp.setattr(device, "pinned_empty", once(device.pinned_empty, lambda *a, **kw: True))
            mp.setattr(device, "host_empty", once(device.host_empty, lambda *a, **kw: True))
        self.stage = stage

    def _raise(self, real, *args, **kwargs):
        if self.stage == "swap_out_interrupt":  # half the copies are queued when the interrupt lands
            op, k, copies = args[0], args[1], list(args[2])
            op.d2h_stream.wait_event(op.update_events[k])  # as swap_out orders its copies
            with op.mod.stream(op.d2h_stream):
                for dst, src in copies[: len(copies) // 2]:
                    dst.copy_(src, non_blocking=True)
            raise KeyboardInterrupt
        raise Boom(self.stage)


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("fail_step", [0, 2])
@pytest.mark.parametrize("stage", STAGES)
def test_fault_at_every_stage(stage, fail_step, name, monkeypatch):
    if stage == "pinned_alloc" and fail_step:
        pytest.skip("pinned host memory is allocated on the step that creates the states")
    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(str(m)), level="ERROR")
    logger.enable("swapopt")
    try:
        with simulator.activate() as dev:
            torch.manual_seed(0)
            ps = _params()
            rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            opt = SwapOptimizer(MAKERS[name](ps), chunk_mb=6 / 1024)
            ref = MAKERS[name](rs)
            for step in range(fail_step + 3):
                _grads(ps, rs)
                if step != fail_step:
                    opt.step()
                    ref.step()
                    assert not opt.swap_stats().failed
                    continue
                opt.wait_for_swap_out()
                params, groups, _ = opt._layout.active()
                plan = opt._layout.prepare(params, groups).plan
                assert any(pc.start > 0 for c in plan.chunks for pc in c.pieces), "no param is split"
                # the first chunk that continues a param begun in the chunk before: the worst place to fail
                k = next(j for j, c in enumerate(plan.chunks) if j and c.pieces[0].start > 0)
                old = snapshot_params(rs, ref.state)
                gc.collect()
                base = dev.memory_allocated()
                injector = _Injector(monkeypatch, opt, stage, k)
                with pytest.raises((Boom, KeyboardInterrupt)):
                    opt.step()
                assert injector.fired
                monkeypatch.undo()
                gc.collect()
                assert dev.memory_allocated() == base, "staging or slot views outlived the failed step"
                stats = opt.swap_stats()
                assert stats.failed and stats.last_error
                ref.step()
                stepped = snapshot_params(rs, ref.state)
                opt.wait_for_swap_out()
                named = {i for i, p in enumerate(ps) if any(f"of shape {tuple(p.shape)}" in m for m in messages)}
                if stage == "inside_update":  # every param of the failed chunk is named in the ERROR log
                    assert {pc.index for pc in plan.chunks[k].pieces} <= named, messages
                else:
                    assert not messages, messages
                for i, (p, r) in enumerate(zip(ps, rs)):
                    st = opt.state.get(p, {})
                    if matches_snapshot(p, st, stepped[i]):
                        continue  # the reference keeps its step
                    if matches_snapshot(p, st, old[i]):
                        adopt(r, ref.state, *old[i])
                        continue
                    assert stage == "inside_update" and i in named, f"param {i} is neither stepped nor untouched"
                    adopt(r, ref.state, p.detach(), st)  # named partial: the reference adopts it
            opt.wait_for_swap_out()
            for i, (p, r) in enumerate(zip(ps, rs)):  # later steps match bitwise
                assert matches_snapshot(p, opt.state.get(p, {}), snapshot_params([r], ref.state)[0]), f"param {i}"
            assert not opt.swap_stats().failed
    finally:
        logger.remove(handle)
        logger.disable("swapopt")


def test_a_failed_update_in_a_later_snapshot_batch_gets_its_step_counts_back(monkeypatch):
    """700 params, so that the failure path's snapshot of the step counts is stacked in batches (Note [snapshot
    batches]): the last chunk's update runs (its step counts advance in place) and then raises, after the earlier
    batches' chunks were stepped. That chunk's step counts are put back from its batch's stack; every other param
    is stepped; the failed chunk's params are named; later steps match a reference that adopts the outcome."""
    with _errors() as messages, simulator.activate():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(64)) for _ in range(700)]
        rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        make = MAKERS["adamw_foreach"]
        opt, ref = SwapOptimizer(make(ps), swap_optimizer_times=8), make(rs)
        for _ in range(2):
            _grads(ps, rs)
            opt.step()
            ref.step()
        opt.wait_for_swap_out()
        watch = opt._layout.prepared.scalars
        assert len(watch.batches) >= 2, watch.batches
        plan = opt._layout.prepared.plan
        k = len(plan.chunks) - 1  # in the last batch: every earlier batch was stacked and its chunks stepped
        assert watch.batch_of[k] == len(watch.batches) - 1 > watch.batch_of[0]
        failed = {pc.index for pc in plan.chunks[k].pieces}
        calls = []
        real = opt._step_fn

        def step_then_raise(*args, **kwargs):
            calls.append(1)
            out = real(*args, **kwargs)
            if len(calls) == k + 1:
                raise Boom("after the inner step")
            return out

        monkeypatch.setattr(opt, "_step_fn", step_then_raise)
        _grads(ps, rs)
        old = snapshot_params(rs, ref.state)
        counts = {i: opt.state[p]["step"].item() for i, p in enumerate(ps)}
        with pytest.raises(Boom):
            opt.step()
        assert len(calls) == k + 1
        monkeypatch.undo()
        ref.step()
        stepped = snapshot_params(rs, ref.state)
        opt.wait_for_swap_out()
        for i, p in enumerate(ps):  # the failed chunk's counts put back, every other one advanced
            assert opt.state[p]["step"].item() == counts[i] + (i not in failed), i
        named = {i for i, p in enumerate(ps) if any(f"of shape {tuple(p.shape)}" in m for m in messages)}
        assert named or not failed
        _adopt_outcome(ps, rs, opt, ref, old, stepped, failed)
        assert_steps_match(opt, ref, ps, rs, _grads)


@pytest.mark.parametrize("where", ["kernel", "interrupt_after_add"])
@pytest.mark.parametrize("fail_call", [0, 1])
def test_a_failed_fused_update_takes_its_step_count_adds_back(fail_call, where, monkeypatch):
    """Fused AdamW steps each chunk by the direct fused calls, one a group, which take no copy of the step counts
    (Note [undone step counts] in swapopt.internals): no stack is issued for them. Three groups over two chunks, so
    that each chunk makes two calls; the kernel raises at chunk 1's first call (its own add is taken back) or at its
    second (the first call's add is taken back by the failure path; its params, written in place, are named); or a
    Ctrl-C lands as that call's step count add returns, where Python raises an interrupt that came during a C call. Chunk 1's
    step counts are then the old ones, chunk 0's advanced; every param is stepped, untouched or named; later steps
    match a reference that adopts the outcome."""
    with _errors() as messages, simulator.activate():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(64)) for _ in range(12)]
        rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]

        def make(q):
            return O.AdamW(
                [{"params": q[:4]}, {"params": q[4:8], "lr": 3e-3}, {"params": q[8:], "weight_decay": 0.0}],
                lr=1e-2, weight_decay=0.1, fused=True,
            )  # fmt: skip

        opt, ref = SwapOptimizer(make(ps), swap_optimizer_times=2), make(rs)
        stacks: list[int] = []
        real_stack = torch.stack

        def counting_stack(*a, **kw):
            stacks.append(1)
            return real_stack(*a, **kw)

        monkeypatch.setattr(torch, "stack", counting_stack)
        for _ in range(3):
            _grads(ps, rs)
            opt.step()
            ref.step()
        opt.wait_for_swap_out()
        prep = opt._layout.prepared
        chunks = prep.plan.chunks
        calls_in = [len({prep.groups[pc.index] for pc in c.pieces}) for c in chunks]
        assert calls_in == [2, 2], calls_in
        stacks.clear()
        _grads(ps, rs)
        opt.step()  # a steady step: every chunk stepped by the fused calls alone
        ref.step()
        assert not stacks, "a step count copy was stacked for chunks stepped by the direct fused calls"
        opt.wait_for_swap_out()
        counts = {i: float(opt.state[p]["step"]) for i, p in enumerate(ps)}
        failing = calls_in[0] + fail_call
        seen: list[int] = []
        if where == "kernel":
            real_kernel = torch._fused_adamw_

            def kernel(*a, **kw):
                seen.append(1)
                if len(seen) == failing + 1:
                    raise Boom("inside the fused kernel call")
                return real_kernel(*a, **kw)

            monkeypatch.setattr(torch, "_fused_adamw_", kernel)
        else:
            real_add = torch._foreach_add_

            def add(*a, **kw):
                out = real_add(*a, **kw)
                seen.append(1)
                if len(seen) == failing + 1:
                    raise KeyboardInterrupt  # as Python raises a Ctrl-C that came during the C call
                return out

            monkeypatch.setattr(torch, "_foreach_add_", add)
        _grads(ps, rs)
        old = snapshot_params(rs, ref.state)
        with pytest.raises((Boom, KeyboardInterrupt)):
            opt.step()
        assert len(seen) == failing + 1, seen
        monkeypatch.undo()
        ref.step()
        stepped = snapshot_params(rs, ref.state)
        opt.wait_for_swap_out()
        failed = {pc.index for pc in chunks[1].pieces}
        for i, p in enumerate(ps):  # chunk 1's counts old (the adds taken back), chunk 0's advanced
            assert float(opt.state[p]["step"]) == counts[i] + (i not in failed), i
        named = {i for i, p in enumerate(ps) if any(f"of shape {tuple(p.shape)}" in m for m in messages)}
        assert named, messages  # every param has one shape: the ERROR names chunk 1's
        partial = _adopt_outcome(ps, rs, opt, ref, old, stepped, failed)
        first = [pc for pc in chunks[1].pieces if prep.groups[pc.index] == prep.groups[chunks[1].pieces[0].index]]
        assert partial == (len(first) if fail_call else 0), partial  # what chunk 1's first call stepped
        assert_steps_match(opt, ref, ps, rs, _grads)
