"""An exception inside step() leaves every param either fully stepped or untouched, and the optimizer usable;
a param split across chunks whose update began before the failing chunk is rolled forward (completed)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import adopt, matches_snapshot, snapshot_params
from loguru import logger
from stepping import Boom, fail_on_call

import device
import simdevice as simulator
from swapopt import SwapOptimizer
from swapopt.hoststate import is_swapped_state

O = torch.optim


def _compare(ps, opt, rs, ref):
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert torch.equal(p.detach(), r.detach()), f"param {i}"
        assert set(opt.state.get(p, {})) == set(ref.state.get(r, {})), f"param {i} keys"
        for k, v in ref.state.get(r, {}).items():
            if isinstance(v, torch.Tensor):
                # swapped states live on the host, the reference's on the device: compare host copies
                assert torch.equal(opt.state[p][k].cpu(), v.cpu()), f"param {i} state {k}"


def _scalar_bytes(dev, opt, ps):
    return sum(v.nbytes for p in ps for v in opt.state.get(p, {}).values() if not dev.is_host(v))


MAKERS = {
    "adamw": lambda ps: O.AdamW(ps, lr=1e-2, foreach=True),
    "adam_fused": lambda ps: O.Adam(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: O.SGD(ps, lr=1e-2, momentum=0.9),
    "adafactor": lambda ps: O.Adafactor(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("fail_step", [0, 2])  # 0: while states are being created; 2: steady state
@pytest.mark.parametrize("fail_chunk", [0, 1, 2])
def test_failure_in_chunk_k(name, fail_step, fail_chunk):
    make = MAKERS[name]
    torch.manual_seed(0)
    with simulator.activate() as dev:
        ps = [torch.nn.Parameter(torch.randn(4, 5)) for _ in range(6)]
        rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt = SwapOptimizer(make(ps), swap_optimizer_times=3)  # 3 chunks of 2 whole params
        ref = make(rs)
        for step in range(5):
            grads = [torch.randn(4, 5) for _ in ps]
            for p, r, g in zip(ps, rs, grads):
                p.grad, r.grad = g.clone(), g.clone()
            if step != fail_step:
                opt.step()
                ref.step()
                continue
            base = dev.memory_allocated() - _scalar_bytes(dev, opt, ps)
            restore = fail_on_call(opt, fail_chunk)
            with pytest.raises(Boom):
                opt.step()
            restore()
            # only the scalar step states of the completed params were added
            assert dev.memory_allocated() == base + _scalar_bytes(dev, opt, ps), "staging not released"
            assert opt.optimizer.param_groups is opt.param_groups and opt.optimizer.state is opt.state
            # the reference steps exactly the params of the chunks that completed
            done = {p.index for c in opt._layout.prepared.plan.chunks[:fail_chunk] for p in c.pieces}
            assert len(done) == 2 * fail_chunk
            for i, r in enumerate(rs):
                if i not in done:
                    r.grad = None
            ref.step()
            opt.wait_for_swap_out()
            _compare(ps, opt, rs, ref)
        opt.wait_for_swap_out()
    _compare(ps, opt, rs, ref)


# 8 KiB chunks: 1024 AdamW elements or 2048 SGD-momentum/Adagrad elements, so the 3000- and 2500-element
# params are split across chunks (several pieces each) and the small ones share chunks with their pieces.
SPLIT_SIZES = ((3000,), (5, 60), (2500,), (7,), (4, 700))
SPLIT_CHUNK_MB = 8 / 1024
SPLIT_MAKERS = {
    "adamw_foreach": lambda ps: O.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: O.AdamW(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: O.SGD(ps, lr=1e-2, momentum=0.9),
    "adagrad": lambda ps: O.Adagrad(ps, lr=1e-2),
}


def _split_pair(make, **swap_kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in SPLIT_SIZES]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    return ps, SwapOptimizer(make(ps), chunk_mb=SPLIT_CHUNK_MB, **swap_kw), rs, make(rs)


def _set_grads(ps, rs):
    for p, r in zip(ps, rs):
        g = torch.randn(p.shape)
        p.grad, r.grad = g.clone(), g.clone()


def _split_indices(opt):
    chunks = opt._layout.prepared.plan.chunks
    return {i for i in range(len(SPLIT_SIZES)) if sum(pc.index == i for c in chunks for pc in c.pieces) > 1}


def _begun(plan, k):
    """Params with a piece in a chunk before k."""
    return {pc.index for c in plan.chunks[:k] for pc in c.pieces}


class _Injector:
    """Raise ``Boom`` once, when chunk ``k``'s update is about to begin (before the inner optimizer runs);
    with ``keep``, every inner optimizer call from then on raises ``RecoveryBoom`` until ``stop()``."""

    def __init__(self, opt, k, keep=False):
        self.opt, self.k, self.keep, self.fired = opt, k, keep, False
        real_begin, real_step = opt.operate.begin_update, opt._step_fn

        def begin_update(j):
            if j == self.k and not self.fired:
                self.fired = True
                raise Boom(f"injected failure before the update of chunk {j}")
            return real_begin(j)

        def step_fn(o, *args, **kwargs):
            if self.keep and self.fired:
                raise RecoveryBoom("injected failure in the recovery")
            return real_step(o, *args, **kwargs)

        opt.operate.begin_update, opt._step_fn = begin_update, step_fn
        self._real = real_step

    def stop(self):
        del self.opt.operate.begin_update  # the instance attribute shadowed the method
        self.opt._step_fn = self._real


class RecoveryBoom(RuntimeError):
    pass


@pytest.mark.parametrize("name", sorted(SPLIT_MAKERS))
@pytest.mark.parametrize("fail_step", [0, 2])  # 0: states being created; 2: steady state
def test_roll_forward_at_every_chunk(name, fail_step):
    make = SPLIT_MAKERS[name]
    n_chunks, k, rolled = None, 0, 0
    while n_chunks is None or k < n_chunks:
        with simulator.activate() as dev:
            ps, opt, rs, ref = _split_pair(make)
            for step in range(fail_step + 2):
                _set_grads(ps, rs)
                if step != fail_step:
                    opt.step()
                    ref.step()
                    continue
                opt.wait_for_swap_out()
                old = snapshot_params(rs, ref.state)
                base = dev.memory_allocated() - _scalar_bytes(dev, opt, ps)
                inject = _Injector(opt, k)
                with pytest.raises(Boom):
                    opt.step()
                inject.stop()
                plan = opt._layout.prepared.plan
                n_chunks = len(plan.chunks)
                assert len(_split_indices(opt)) >= 2 and n_chunks >= 4
                begun = _begun(plan, k)
                rolled += any(plan.last_chunk[i] >= k for i in begun)
                # staging and recovery buffers released; only device-resident scalar states (fused step) added
                assert dev.memory_allocated() == base + _scalar_bytes(dev, opt, ps), "staging not released"
                ref.step()
                stepped = snapshot_params(rs, ref.state)
                opt.wait_for_swap_out()
                for i, p in enumerate(ps):  # begun before chunk k: stepped (rolled forward if split); else old
                    expect = stepped[i] if i in begun else old[i]
                    assert matches_snapshot(p, opt.state.get(p, {}), expect), f"chunk {k}: param {i}"
                for i, r in enumerate(rs):  # the reference takes the same outcome
                    if i not in begun:
                        r.data.copy_(old[i][0])
                        ref.state.pop(r, None)
                        if old[i][1]:
                            ref.state[r] = dict(old[i][1])
            opt.wait_for_swap_out()
            _compare(ps, opt, rs, ref)  # later steps work and match
        k += 1
    assert rolled >= 2  # the failure hit split params mid-way more than once


def _first_boundary_chunk(opt):
    """The first chunk that starts with a later piece of a param begun in the chunk before."""
    return next(k for k, c in enumerate(opt._layout.prepared.plan.chunks) if k and c.pieces[0].start > 0)


def _adopt(ps, opt, rs, ref):
    """Give the reference the optimizer's params and states."""
    for p, r in zip(ps, rs):
        adopt(r, ref.state, p.detach(), opt.state.get(p))


@pytest.mark.parametrize("name", ["adamw_foreach", "sgd_momentum"])
@pytest.mark.parametrize("mode", ["inside_update", "recovery_fails"])
@pytest.mark.parametrize("fail_step", [0, 2])
def test_straddling_param_left_partial_is_reported(name, mode, fail_step):
    # The failure leaves the param split across chunk k partially stepped when it comes from inside the
    # update of chunk k (no redo: the update may have begun writing in place) or when completing it fails.
    messages = []
    handle = logger.add(lambda m: messages.append(str(m)), level="ERROR")
    logger.enable("swapopt")
    try:
        with simulator.activate() as dev:
            ps, opt, rs, ref = _split_pair(SPLIT_MAKERS[name])
            for step in range(fail_step + 3):
                _set_grads(ps, rs)
                if step != fail_step:
                    opt.step()
                    ref.step()
                    continue
                opt.wait_for_swap_out()
                if step == 0:
                    opt._layout.prepare(*opt._layout.active()[:2])  # plan ahead to pick the chunk
                k = _first_boundary_chunk(opt)
                plan = opt._layout.prepared.plan
                i = plan.chunks[k].pieces[0].index
                cut = plan.chunks[k].pieces[0].start
                old = snapshot_params(rs, ref.state)
                base = dev.memory_allocated() - _scalar_bytes(dev, opt, ps)
                if mode == "inside_update":
                    restore = fail_on_call(opt, k)
                    with pytest.raises(Boom):
                        opt.step()
                    restore()
                else:
                    inject = _Injector(opt, k, keep=True)
                    with pytest.raises(Boom):  # the original exception, not the recovery's
                        opt.step()
                    inject.stop()
                assert dev.memory_allocated() == base + _scalar_bytes(dev, opt, ps), "staging not released"
                ref.step()
                stepped = snapshot_params(rs, ref.state)
                opt.wait_for_swap_out()
                begun = _begun(plan, k)
                for j, p in enumerate(ps):
                    if j != i:
                        assert matches_snapshot(p, opt.state.get(p, {}), stepped[j] if j in begun - {i} else old[j]), j
                # the straddling param: elements before the cut stepped, the rest old, per element with states
                p, st = ps[i].detach(), opt.state.get(ps[i], {})
                assert torch.equal(p[:cut], stepped[i][0][:cut]) and torch.equal(p[cut:], old[i][0][cut:])
                if fail_step == 0:
                    assert not st  # the states being created were dropped
                else:
                    assert set(st) == set(old[i][1])
                    for key, v in old[i][1].items():
                        if is_swapped_state(ps[i], key, v):
                            assert torch.equal(st[key][:cut].cpu(), stepped[i][1][key][:cut].cpu()), key
                            assert torch.equal(st[key][cut:].cpu(), v[cut:].cpu()), key
                        else:
                            assert torch.equal(st[key].cpu(), v.cpu()), key  # step count old
                _adopt(ps, opt, rs, ref)
            opt.wait_for_swap_out()
            _compare(ps, opt, rs, ref)  # the optimizer keeps working after the injection stops
    finally:
        logger.remove(handle)
        logger.disable("swapopt")
    errors = [m for m in messages if "ERROR" in m]
    # one ERROR for the split param (what was stepped), and, for a failure inside the update, one that
    # names every param of the failed chunk as possibly partly updated
    split = [m for m in errors if f"[0, {cut})" in m]
    assert len(split) == 1 and f"of shape {tuple(ps[i].shape)}" in split[0], messages
    assert ("completing" in split[0]) == (mode == "recovery_fails")
    if mode == "inside_update":
        chunk = [m for m in errors if "may be partly updated" in m]
        assert len(chunk) == 1 and f"of shape {tuple(ps[i].shape)}" in chunk[0], messages


def test_roll_forward_with_one_slot():
    # slots=1: no lookahead; the failure comes before the update of a chunk that continues a split param
    with simulator.activate():
        ps, opt, rs, ref = _split_pair(SPLIT_MAKERS["adamw_foreach"], slots=1)
        for step in range(4):
            _set_grads(ps, rs)
            if step == 2:
                k = _first_boundary_chunk(opt)
                opt.wait_for_swap_out()
                before = snapshot_params(ps, opt.state)
                inject = _Injector(opt, k)
                with pytest.raises(Boom):
                    opt.step()
                inject.stop()
                opt.wait_for_swap_out()
                begun = _begun(opt._layout.prepared.plan, k)
                untouched = [i for i in range(len(ps)) if i not in begun]
                assert untouched and all(matches_snapshot(ps[i], opt.state[ps[i]], before[i]) for i in untouched)
                for i in untouched:  # the reference steps the others only
                    rs[i].grad = None
                ref.step()
                continue
            opt.step()
            ref.step()
        opt.wait_for_swap_out()
    _compare(ps, opt, rs, ref)


@pytest.mark.parametrize("name", sorted(SPLIT_MAKERS))
def test_split_parity_stats_and_host_memory(name, monkeypatch):
    with simulator.activate() as dev:
        ps, opt, rs, ref = _split_pair(SPLIT_MAKERS[name])
        calls = []
        real = device.pinned_empty
        monkeypatch.setattr(device, "pinned_empty", lambda *a, **k: calls.append(a) or real(*a, **k))
        buffers: dict = {}
        for step in range(4):
            _set_grads(ps, rs)
            opt.step()
            ref.step()
            if step == 0:
                allocated = len(calls)
            opt.wait_for_swap_out()
            for p in ps:
                for k, v in opt.state[p].items():
                    if is_swapped_state(p, k, v):
                        buffers.setdefault((id(p), k), set()).add(v.data_ptr())
        assert len(_split_indices(opt)) >= 2
        assert len(calls) == allocated  # the first step allocates every host state; nothing after
        assert all(len(ptrs) == 1 for ptrs in buffers.values())  # host states are never reallocated
        state_bytes = sum(v.nbytes for p in ps for k, v in opt.state[p].items() if is_swapped_state(p, k, v))
        # no spares, no backups: pinned host memory is the states, and each byte moves once each way
        stats = opt.swap_stats()
        assert stats.pinned_requested_bytes == state_bytes
        assert dev.host_memory_allocated() == stats.pinned_bytes  # as the host allocator takes it (npu: rounded)
        assert (stats.h2d_bytes, stats.d2h_bytes) == (state_bytes, state_bytes)
    _compare(ps, opt, rs, ref)  # bitwise parity with splitting


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("fail_chunk", [0, 2])
def test_failure_after_the_inner_update_puts_that_chunks_step_counts_back(impl, fail_chunk):
    # The inner optimizer of chunk k finished (step counts advanced in place, params updated), then the
    # step raised: chunk k's params keep their old step counts (Note [failure semantics]); the chunks
    # before it are stepped, the chunks after it untouched.
    torch.manual_seed(0)
    with simulator.activate():
        ps = [torch.nn.Parameter(torch.randn(4, 5)) for _ in range(6)]
        opt = SwapOptimizer(torch.optim.AdamW(ps, lr=1e-2, **{impl: True}), swap_optimizer_times=3)
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn(4, 5)
            opt.step()
        chunks = opt._layout.prepared.plan.chunks
        assert len(chunks) == 3 and all(len(c.pieces) == 2 for c in chunks)
        real, calls = opt._step_fn, []

        def step_then_raise(o, *args, **kwargs):
            out = real(o, *args, **kwargs)
            if o is opt.optimizer:
                calls.append(1)
                if len(calls) == fail_chunk + 1:
                    raise Boom("after the update")
            return out

        opt._step_fn = step_then_raise
        with pytest.raises(Boom):
            opt.step()
        opt._step_fn = real
        opt.wait_for_swap_out()
        for k, chunk in enumerate(chunks):
            for piece in chunk.pieces:
                assert float(opt.state[ps[piece.index]]["step"]) == (3.0 if k < fail_chunk else 2.0), (k, piece)
