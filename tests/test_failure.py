"""An exception inside step() leaves every param either fully stepped or untouched, and the optimizer usable,
params split across chunks included (atomic_split)."""

from __future__ import annotations

import pytest
import pydantic
import torch
from loguru import logger

import device
from device import sim as simulator
from swapopt import SwapConfig, SwapOptimizer
from swapopt.hoststate import is_swapped_state

O = torch.optim


class Boom(RuntimeError):
    pass


def _fail_on_call(opt: SwapOptimizer, n: int):
    """Make the inner optimizer raise on its n-th per-chunk call (0-based) of the next step."""
    real = opt._step_fn
    calls = []

    def step_fn(o, *args, **kwargs):
        if o is opt.optimizer:
            calls.append(1)
            if len(calls) == n + 1:
                raise Boom(f"injected failure in chunk {n}")
        return real(o, *args, **kwargs)

    opt._step_fn = step_fn
    return lambda: setattr(opt, "_step_fn", real)


def _compare(ps, opt, rs, ref):
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert torch.equal(p.detach(), r.detach()), f"param {i}"
        assert set(opt.state.get(p, {})) == set(ref.state.get(r, {})), f"param {i} keys"
        for k, v in ref.state.get(r, {}).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(opt.state[p][k], v), f"param {i} state {k}"


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
            restore = _fail_on_call(opt, fail_chunk)
            with pytest.raises(Boom):
                opt.step()
            restore()
            # only the scalar step states of the completed params were added
            assert dev.memory_allocated() == base + _scalar_bytes(dev, opt, ps), "staging not released"
            assert opt.optimizer.param_groups is opt.param_groups and opt.optimizer.state is opt.state
            # the reference steps exactly the params of the chunks that completed
            done = {p.index for c in opt._prepared.plan.chunks[:fail_chunk] for p in c.pieces}
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


def _snapshot(params, state):
    """Each param's value and state, cloned."""
    return [
        (p.detach().clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.get(p, {}).items()})
        for p in params
    ]


def _matches(p, st, snap) -> bool:
    value, states = snap
    if not torch.equal(p.detach(), value) or set(st) != set(states):
        return False
    return all(torch.equal(st[k], v) if isinstance(v, torch.Tensor) else st[k] == v for k, v in states.items())


def _split_indices(opt):
    chunks = opt._prepared.plan.chunks
    return {i for i in range(len(SPLIT_SIZES)) if sum(pc.index == i for c in chunks for pc in c.pieces) > 1}


@pytest.mark.parametrize("name", sorted(SPLIT_MAKERS))
@pytest.mark.parametrize("fail_step", [0, 2, 3])  # 0: states being created; 2 and 3: either host buffer current
def test_failure_in_every_chunk_with_split_params(name, fail_step):
    make = SPLIT_MAKERS[name]
    n_chunks = None
    k = 0
    while n_chunks is None or k < n_chunks:
        with simulator.activate() as dev:
            ps, opt, rs, ref = _split_pair(make)
            for step in range(fail_step + 3):
                _set_grads(ps, rs)
                if step != fail_step:
                    opt.step()
                    ref.step()
                    continue
                opt.wait_for_swap_out()
                old = _snapshot(rs, ref.state)
                base = dev.memory_allocated() - _scalar_bytes(dev, opt, ps)
                restore = _fail_on_call(opt, k)
                with pytest.raises(Boom):
                    opt.step()
                restore()
                plan = opt._prepared.plan
                n_chunks = len(plan.chunks)
                assert len(_split_indices(opt)) >= 2 and n_chunks >= 4
                # staging released; only device-resident scalar states (fused step) of stepped params added
                assert dev.memory_allocated() == base + _scalar_bytes(dev, opt, ps), "staging not released"
                ref.step()
                stepped_ref = _snapshot(rs, ref.state)
                opt.wait_for_swap_out()
                stepped = set()
                for i, p in enumerate(ps):
                    st = opt.state.get(p, {})
                    is_new, is_old = _matches(p, st, stepped_ref[i]), _matches(p, st, old[i])
                    assert is_new != is_old, f"chunk {k}: param {i} is neither stepped nor untouched"
                    if is_new:
                        stepped.add(i)
                # exactly the params whose last piece was in a chunk before the failed one
                assert stepped == {i for i, last in plan.last_chunk.items() if last < k}, f"chunk {k}"
                for i, r in enumerate(rs):  # the reference takes the same outcome
                    if i not in stepped:
                        r.data.copy_(old[i][0])
                        ref.state.pop(r, None)
                        if old[i][1]:
                            ref.state[r] = dict(old[i][1])
            opt.wait_for_swap_out()
            _compare(ps, opt, rs, ref)  # later steps work and match
        k += 1


def test_split_failure_with_one_slot():
    # slots=1: no lookahead, each backup is queued right before its update
    with simulator.activate():
        ps, opt, rs, ref = _split_pair(SPLIT_MAKERS["adamw_foreach"], slots=1)
        for step in range(4):
            _set_grads(ps, rs)
            if step == 2:
                opt.wait_for_swap_out()
                before = _snapshot(ps, opt.state)
                restore = _fail_on_call(opt, 3)
                with pytest.raises(Boom):
                    opt.step()
                restore()
                opt.wait_for_swap_out()
                last = opt._prepared.plan.last_chunk
                untouched = [i for i in range(len(ps)) if last[i] >= 3]
                assert untouched and all(_matches(ps[i], opt.state[ps[i]], before[i]) for i in untouched)
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
        for step in range(5):
            _set_grads(ps, rs)
            opt.step()
            ref.step()
            if step == 1:
                allocated = len(calls)
            opt.wait_for_swap_out()
            for p in ps:
                for k, v in opt.state[p].items():
                    if is_swapped_state(p, k, v):
                        buffers.setdefault((id(p), k), set()).add(v.data_ptr())
        split = _split_indices(opt)
        assert len(split) >= 2
        # spares exist from the second step on (the first creates the states), then nothing is allocated
        assert len(calls) == allocated
        # a split param's state alternates between two pinned tensors, any other param's stays put
        for (pid, k), ptrs in buffers.items():
            i = next(i for i, p in enumerate(ps) if id(p) == pid)
            assert len(ptrs) == (2 if i in split else 1), (i, k)
        state_bytes = sum(v.nbytes for p in ps for k, v in opt.state[p].items() if is_swapped_state(p, k, v))
        split_state = sum(v.nbytes for i in split for k, v in opt.state[ps[i]].items() if is_swapped_state(ps[i], k, v))
        split_param = sum(ps[i].nbytes for i in split)
        # Pinned host memory is the states plus, for split params only, a spare copy of their states and a
        # backup of the param; the stats count the backups' D2H (the spare takes the swap-out, no extra).
        assert dev.host_memory_allocated() == state_bytes + split_state + split_param
        stats = opt.swap_stats()
        assert (stats.h2d_bytes, stats.d2h_bytes) == (state_bytes, state_bytes + split_param)
    _compare(ps, opt, rs, ref)  # bitwise parity with splitting


def test_non_atomic_split_keeps_pieces_and_reports():
    messages = []
    handle = logger.add(lambda m: messages.append(str(m)), level="ERROR")
    logger.enable("swapopt")
    try:
        with simulator.activate() as dev:
            p = torch.nn.Parameter(torch.randn(4096))
            opt = SwapOptimizer(O.AdamW([p], lr=1e-2), chunk_mb=8 / 1024, atomic_split=False)  # 4 pieces
            p.grad = torch.randn(4096)
            opt.step()
            base_host = dev.host_memory_allocated()
            assert base_host == 2 * p.nbytes  # exp_avg, exp_avg_sq: no spare, no backup
            opt.wait_for_swap_out()
            before = p.detach().clone()
            exp_avg = opt.state[p]["exp_avg"].clone()
            step = opt.state[p]["step"].clone()
            p.grad = torch.randn(4096)
            restore = _fail_on_call(opt, 2)
            with pytest.raises(Boom):
                opt.step()
            restore()
            opt.wait_for_swap_out()
            changed = (p.detach() != before).nonzero().flatten()
            assert changed.min() >= 0 and changed.max() < 2048  # pieces 0 and 1 ran, 2 and 3 did not
            assert torch.equal(opt.state[p]["exp_avg"][2048:], exp_avg[2048:])
            assert not torch.equal(opt.state[p]["exp_avg"][:2048], exp_avg[:2048])
            assert torch.equal(opt.state[p]["step"], step)
            p.grad = torch.randn(4096)
            base = dev.memory_allocated()
            opt.step()  # keeps working
            assert dev.memory_allocated() == base
            assert dev.host_memory_allocated() == base_host
    finally:
        logger.remove(handle)
        logger.disable("swapopt")
    assert any("split across it" in m for m in messages)


def test_atomic_split_is_validated_and_configurable():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="atomic_split"):
        SwapOptimizer(O.AdamW([p]), atomic_split="yes")
    with pytest.raises(pydantic.ValidationError):
        SwapConfig(swap_optimizer=True, atomic_split="yes")
    assert SwapOptimizer(O.AdamW([p])).atomic_split is True
    assert SwapConfig(swap_optimizer=True, atomic_split=False).wrap(O.AdamW([p])).atomic_split is False
