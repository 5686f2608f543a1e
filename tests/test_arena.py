"""States in chunk-ordered pinned arenas: one H2D and one D2H copy per chunk, no re-planning or pinned
allocation once the states exist, exact updates, and checkpoints of each state's own size."""

from __future__ import annotations

import collections
import copy
import io

import pytest
import torch

import device
import swapopt.layout as swap_layout
import simdevice as simulator
from swapopt import SwapOptimizer

N, NUMEL, K = 48, 128, 4


def _make(fused: bool = True):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(N)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = {"fused": True} if fused else {"foreach": True}
    return params, ref, torch.optim.AdamW(params, lr=1e-2, **kw), torch.optim.AdamW(ref, lr=1e-2, **kw)


def _grads(params, ref, step):
    g = torch.Generator().manual_seed(step)
    for p, q in zip(params, ref):
        p.grad = torch.randn(NUMEL, generator=g)
        q.grad = p.grad.clone()


@pytest.mark.parametrize("fused", [True, False])
def test_one_copy_per_chunk_each_way_and_exact(fused, monkeypatch):
    plans = collections.Counter()
    real_plan = swap_layout.make_plan

    def counted(*args, **kwargs):
        plans["n"] += 1
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(swap_layout, "make_plan", counted)
    with simulator.activate() as dev:
        params, ref, inner, ref_opt = _make(fused)
        opt = SwapOptimizer(inner, swap_optimizer_times=K)
        pinned = []
        real_pinned = device.pinned_empty
        monkeypatch.setattr(device, "pinned_empty", lambda *a, **k: pinned.append(a) or real_pinned(*a, **k))
        for step in range(4):
            _grads(params, ref, step)
            if step == 1:
                plans_before, pinned_before = plans["n"], len(pinned)
            dev.reset_timeline()
            opt.step()
            ref_opt.step()
            lanes = collections.Counter(op.lane for op in dev.timeline)
            chunks = opt.swap_stats().chunks
            assert chunks == K
            if step >= 1:  # the states exist: each chunk moves in one copy per direction
                assert lanes["h2d"] == chunks, lanes
                assert lanes["d2h"] == chunks, lanes
        # the exact plan of step 2 is kept; nothing is pinned once the first step created the states
        assert plans["n"] - plans_before <= 1
        assert len(pinned) == pinned_before
        opt.wait_for_swap_out()
        for p, q in zip(params, ref):
            assert torch.equal(p, q)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key].cpu(), ref_opt.state[q][key].cpu())  # host vs device
                assert device.is_host_tensor(opt.state[p][key])


def test_replan_after_steady_state_is_not_repeated(monkeypatch):
    plans = collections.Counter()
    real_plan = swap_layout.make_plan
    monkeypatch.setattr(swap_layout, "make_plan", lambda *a, **k: plans.update(["n"]) or real_plan(*a, **k))
    with simulator.activate():
        params, ref, inner, _ = _make()
        opt = SwapOptimizer(inner, swap_optimizer_times=K)
        for step in range(2):
            _grads(params, ref, step)
            opt.step()
        settled = plans["n"]
        for step in range(2, 5):
            _grads(params, ref, step)
            opt.step()
        assert plans["n"] == settled


def test_states_are_views_of_one_arena_per_chunk_and_save_at_their_own_size(tmp_path):
    with simulator.activate():
        params, ref, inner, _ = _make()
        opt = SwapOptimizer(inner, swap_optimizer_times=K)
        for step in range(2):
            _grads(params, ref, step)
            opt.step()
        storages = {opt.state[p][key].untyped_storage().data_ptr() for p in params for key in ("exp_avg", "exp_avg_sq")}
        assert len(storages) <= K  # shared storages: the arenas
        sd = opt.state_dict()
        state_bytes = sum(
            v.numel() * v.element_size() for st in sd["state"].values() for k, v in st.items() if k != "step"
        )
        # each saved state has a storage of its own bytes (torch.save, DCP and async staging copy storages)
        assert all(
            v.untyped_storage().nbytes() == v.numel() * v.element_size()
            for st in sd["state"].values() for k, v in st.items() if k != "step"
        )  # fmt: skip
        buf = io.BytesIO()
        torch.save(sd, buf)
        assert state_bytes <= buf.tell() < state_bytes * 1.1 + 64 * 1024
        # DCP writes each tensor by itself: a view must not drag its whole arena along
        import torch.distributed.checkpoint as dcp

        dcp.save({"optim": {str(i): st["exp_avg"] for i, st in sd["state"].items()}}, checkpoint_id=tmp_path)
        written = sum(f.stat().st_size for f in tmp_path.glob("*.distcp"))
        half = state_bytes // 2
        assert half <= written < half * 1.5 + 64 * 1024
        # a loaded copy has the same values
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        for i, st in sd["state"].items():
            assert torch.equal(loaded["state"][i]["exp_avg"], st["exp_avg"])
        assert copy.deepcopy(sd)["state"].keys() == sd["state"].keys()


def test_copies_and_launches_per_chunk_are_fixed_whatever_the_tensor_count():
    """Counted on the simulator (deterministic): a chunk of whole params moves in one H2D and one D2H copy and
    takes a fixed number of launches and event calls, whatever its number of tensors; a chunk holding a piece of a
    param cut across chunks moves in one copy per state key each way (its states lie key by key in the arena those
    chunks share, each key's pieces one run), never one per (param, state)."""
    from swapopt.bench.counts import count_call

    def counts(shapes, times):
        with simulator.activate():
            dev = device.torch_device()
            torch.manual_seed(0)
            ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in shapes]
            opt = SwapOptimizer(torch.optim.AdamW(ps, lr=1e-2, fused=True), swap_optimizer_times=times)
            for _ in range(3):
                for p in ps:
                    p.grad = torch.randn(p.shape, device=dev)
                opt.step()
            opt.wait_for_swap_out()
            c = count_call(opt.step)
            opt.wait_for_swap_out()
            return opt.swap_stats().chunks, c

    chunks, few = counts([(NUMEL,)] * 8, 4)
    chunks_many, many = counts([(NUMEL,)] * 64, 4)
    assert chunks == chunks_many == 4
    for c in (few, many):
        assert (c.h2d_copies, c.d2h_copies) == (chunks, chunks)
    assert few.launches == many.launches  # 8 or 64 tensors: the same launches per chunk
    # and the same event records and stream waits: three of each a chunk (swapopt.costs.EVENT_CALLS_PER_CHUNK)
    # and a few a step
    assert few.runtime_calls == many.runtime_calls
    assert 6 * chunks <= many.runtime_calls <= 6 * chunks + 8

    chunks, split = counts([(512, 256)], 8)  # one param cut into pieces: exp_avg and exp_avg_sq a run each
    assert chunks > 1
    assert (split.h2d_copies, split.d2h_copies) == (2 * chunks, 2 * chunks)
