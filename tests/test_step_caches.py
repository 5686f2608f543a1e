"""Structural facts behind host work that grows with chunks: states that exist before the first swapped
step (loaded by load_state_dict, built by the optimizer's constructor) are laid out in chunk order, so
each chunk moves in one H2D and one D2H copy from that step on; the plan is made once; nothing is pinned
after the first step; loaded states saved by torch.save and DCP take their own bytes only."""

from __future__ import annotations

import collections
import copy
import io
import operator

import pytest
import torch

import device
import swapopt.layout as swap_layout
from swapopt import SwapOptimizer
from swapopt.bench.counts import count_call
from swapopt.hoststate import local
from swapopt.pipeline import StepRun

N, NUMEL, K = 40, 96, 4
KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "adagrad": ("sum",)}


def _build(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.Adagrad(params, lr=1e-2, initial_accumulator_value=0.1, foreach=True)


def _params(seed: int = 0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(N)]


def _grads(params, ref, step):
    g = torch.Generator().manual_seed(100 + step)
    for p, q in zip(params, ref):
        p.grad = torch.randn(NUMEL, generator=g)
        q.grad = p.grad.clone()


def _copies(sim) -> collections.Counter:
    """Timeline ops per lane; a read of a device scalar (.item(): torch's own reads of device step counts, as
    foreach Adagrad keeps them under a device default, as on CUDA) is counted apart, as "item"."""
    return collections.Counter(
        "item" if op.name == "aten._local_scalar_dense.default" else op.lane for op in sim.timeline
    )


def _loaded(kind: str):
    """A swapped optimizer resumed from a checkpoint of an unwrapped one stepped twice, and the unwrapped
    one (the reference)."""
    ref = _params()
    ref_opt = _build(kind, ref)
    for step in range(2):
        for q in ref:
            q.grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(step))
        ref_opt.step()
    sd = copy.deepcopy(ref_opt.state_dict())  # as read from a file: no tensor shared with ref_opt
    params = [torch.nn.Parameter(q.detach().clone()) for q in ref]
    opt = SwapOptimizer(_build(kind, params), swap_optimizer_times=K)
    opt.load_state_dict(sd)
    return params, opt, ref, ref_opt


@pytest.mark.parametrize("kind", ["adamw", "adagrad"])
def test_states_present_before_the_first_step_move_in_one_copy_per_chunk(sim, kind, monkeypatch):
    plans = collections.Counter()
    real_plan = swap_layout.make_plan
    monkeypatch.setattr(swap_layout, "make_plan", lambda *a, **k: plans.update(["n"]) or real_plan(*a, **k))
    if kind == "adamw":  # checkpoint-loaded states
        params, opt, ref, ref_opt = _loaded(kind)
    else:  # Adagrad builds its states in __init__: adopted at wrap time
        params = _params()
        ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = SwapOptimizer(_build(kind, params), swap_optimizer_times=K)
        ref_opt = _build(kind, ref)
    pinned = []
    real_pinned = device.pinned_empty
    monkeypatch.setattr(device, "pinned_empty", lambda *a, **k: pinned.append(a) or real_pinned(*a, **k))
    plan = None
    for step in range(4):
        _grads(params, ref, step)
        if step == 1:
            pinned_after_first = len(pinned)
        sim.reset_timeline()
        opt.step()
        lanes = _copies(sim)
        sim.reset_timeline()
        ref_opt.step()
        # step-count reads: the ones torch's own step makes, no more
        assert lanes["item"] == _copies(sim)["item"], (step, lanes)
        assert opt.swap_stats().chunks == K
        # from the very first swapped step: one copy per chunk each way
        assert lanes["h2d"] == K and lanes["d2h"] == K, (step, lanes)
        if plan is None:
            plan = opt._layout.prepared.plan
        assert opt._layout.prepared.plan is plan  # planned once, never again
    assert plans["n"] == 1
    assert len(pinned) == pinned_after_first  # nothing pinned after the first step
    opt.wait_for_swap_out()
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
        for key in KEYS[kind]:
            state = opt.state[p][key]
            assert torch.equal(state.cpu(), ref_opt.state[q][key].cpu())  # host state vs device state
            assert device.is_host_tensor(state) and opt._layout.arenas.locate(local(state)) is not None
            assert state.stride() == q.stride()
    # the arenas hold the states and nothing else: pinned bytes == state bytes
    arena_bytes = sum(base.numel() for base in opt._layout.arenas._bases.values())
    assert arena_bytes == sum(opt.state[p][k].nbytes for p in params for k in KEYS[kind])


def test_first_step_plan_is_the_steady_one_and_views_are_one_per_state(sim, monkeypatch):
    """A fresh AdamW: the probe's sizes are exact, so the states the first step creates do not re-plan;
    a steady step costs one view per state and a bounded number of ops per chunk."""
    plans = collections.Counter()
    real_plan = swap_layout.make_plan
    monkeypatch.setattr(swap_layout, "make_plan", lambda *a, **k: plans.update(["n"]) or real_plan(*a, **k))
    params = _params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = SwapOptimizer(_build("adamw", params), swap_optimizer_times=K)
    plan = None
    for step in range(3):
        _grads(params, ref, step)
        opt.step()
        plan = plan or opt._layout.prepared.plan
        assert opt._layout.prepared.plan is plan
    assert plans["n"] == 1
    _grads(params, ref, 3)
    counts = count_call(opt.step)
    assert counts.h2d_copies == K and counts.d2h_copies == K
    # per state one view of the slot; the rest (slot allocation, typed slot views, the fused kernel,
    # step-count snapshot, events) is per chunk
    states = 2 * N
    assert counts.aten_ops <= states + 12 * K, counts


def test_loaded_states_in_arenas_save_at_their_own_size(sim, tmp_path):
    params, opt, ref, ref_opt = _loaded("adamw")
    _grads(params, ref, 0)
    opt.step()
    opt.wait_for_swap_out()
    storages = {opt.state[p][k].untyped_storage().data_ptr() for p in params for k in KEYS["adamw"]}
    assert len(storages) <= K  # moved into the chunks' arenas
    sd = opt.state_dict()
    exp_avg = [st["exp_avg"] for st in sd["state"].values()]
    assert all(v.untyped_storage().nbytes() == v.nbytes for v in exp_avg)
    state_bytes = sum(v.nbytes for st in sd["state"].values() for k, v in st.items() if k in KEYS["adamw"])
    buf = io.BytesIO()
    torch.save(sd, buf)
    assert state_bytes <= buf.tell() < state_bytes * 1.1 + 64 * 1024
    import torch.distributed.checkpoint as dcp

    dcp.save({"optim": {str(i): v for i, v in enumerate(exp_avg)}}, checkpoint_id=tmp_path)
    written = sum(f.stat().st_size for f in tmp_path.glob("*.distcp"))
    half = state_bytes // 2
    assert half <= written < half * 1.5 + 64 * 1024


def test_wrapper_is_freed_without_a_garbage_collection(sim):
    """No reference cycle through the layout or the step: dropping the optimizer frees its states (and
    a model's device memory with it) at once, not at the next gc run."""
    import gc
    import weakref

    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    opt = SwapOptimizer(_build("adamw", params), swap_optimizer_times=K)
    opt.step()
    opt.wait_for_swap_out()
    gone = weakref.ref(opt)
    gc.disable()
    try:
        del opt
        assert gone() is None
    finally:
        gc.enable()


def _mixed(seed: int = 0):
    """Small params plus one big enough to be split across chunks (flat pieces)."""
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(N)] + [torch.nn.Parameter(torch.randn(4000))]


def _mixed_pair():
    """_mixed params under SwapOptimizer(fused AdamW) and a copy of them under the plain optimizer."""
    params = _mixed()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = SwapOptimizer(torch.optim.AdamW(params, lr=1e-2, fused=True), swap_optimizer_times=K)
    return params, ref, opt, torch.optim.AdamW(ref, lr=1e-2, fused=True)


def _mixed_grads(params, ref, step):
    g = torch.Generator().manual_seed(200 + step)
    for p, q in zip(params, ref):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()


def _check_parity(opt, params, ref, ref_opt):
    opt.wait_for_swap_out()
    for p, q in zip(params, ref):
        assert torch.equal(p.detach(), q.detach())
        if q in ref_opt.state:
            for key, value in ref_opt.state[q].items():
                assert torch.equal(opt.state[p][key].cpu(), value.cpu()), key  # host vs device: host copies


def test_cache_hit_reuses_plan_groups_and_targets_and_sees_lr_changes(sim):
    params, ref, opt, ref_opt = _mixed_pair()
    seen = None
    for step in range(4):
        _mixed_grads(params, ref, step)
        if step == 3:  # what a scheduler does between steps
            for g in (opt.param_groups[0], ref_opt.param_groups[0]):
                g["lr"] = 3e-3
        opt.step()
        ref_opt.step()
        prep = opt._layout.prepared
        inputs = [(ci.targets, ci.groups, [id(t) for t in ci.targets], [id(g) for g in ci.groups]) for ci in prep.inputs]
        if step >= 2:  # step 1 created the states (a new layout); from then on every step is a cache hit
            assert prep is seen[0]
            assert [i[2:] for i in inputs] == [i[2:] for i in seen[1]]
        seen = (prep, inputs)
        assert any(ci.bound for ci in prep.inputs)  # the big param is split: flat pieces are cached too
        # cached flat views hold no grad between steps (no grad or slot memory kept alive)
        assert all(ci.targets[pos].grad is None for ci in prep.inputs for pos, *_ in ci.bound)
        assert all(g["lr"] == opt.param_groups[0]["lr"] for ci in prep.inputs for g in ci.groups)
    _check_parity(opt, params, ref, ref_opt)


def test_grad_that_becomes_none_replans_and_is_not_stepped(sim):
    params, ref, opt, ref_opt = _mixed_pair()
    for step in range(4):
        _mixed_grads(params, ref, step)
        if step == 2:
            params[3].grad = ref[3].grad = None
        before = opt._layout.prepared
        opt.step()
        ref_opt.step()
        if step == 2:
            assert opt._layout.prepared is not before
            assert not any(p is params[3] for p in opt._layout.prepared.params)
        if step == 3:
            assert any(p is params[3] for p in opt._layout.prepared.params)
    _check_parity(opt, params, ref, ref_opt)


def test_state_replaced_by_hand_is_caught_on_a_cache_hit(sim):
    params, ref, opt, ref_opt = _mixed_pair()
    before = None
    for step in range(4):
        _mixed_grads(params, ref, step)
        if step == 3:
            opt.wait_for_swap_out()
            for key in ("exp_avg", "exp_avg_sq"):  # a new tensor with the same values, in place of the cached one
                opt.state[params[5]][key] = opt.state[params[5]][key].clone()
        opt.step()
        ref_opt.step()
        if step == 3:  # missed, the step would update the old cached host tensors and leave these stale
            assert opt._layout.prepared is not before
        before = opt._layout.prepared
    _check_parity(opt, params, ref, ref_opt)


def _steady_adamw(n: int) -> SwapOptimizer:
    """Fused AdamW over n params of NUMEL elements in K chunks, after three steps: the next step hits every cache."""
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(n)]
    opt = SwapOptimizer(_build("adamw", params), swap_optimizer_times=K)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(NUMEL)
        opt.step()
    return opt


@pytest.mark.parametrize("n", [N, 10 * N])
def test_steady_step_aten_ops_do_not_grow_with_tensors(sim, n):
    """1-D states get their slot views from one split per dtype and chunk: a cache-hit step dispatches
    the same number of aten ops for 40 tensors as for 400."""
    opt = _steady_adamw(n)
    counts = count_call(opt.step)
    assert counts.h2d_copies == K and counts.d2h_copies == K
    assert counts.aten_ops <= 12 * K, counts


def _python_calls(fn) -> int:
    """Python function calls (and builtins called from Python) made by ``fn``, outside the simulator's frames."""
    import gc
    import sys

    calls, inside = 0, 0

    def profile(frame, event, arg):
        nonlocal calls, inside
        sim_frame = "/device/sim/" in frame.f_code.co_filename
        if event == "call" and sim_frame:
            inside += 1
        elif event == "return" and sim_frame:
            inside -= 1
        elif inside == 0 and event in ("call", "c_call"):
            calls += 1

    # Garbage of earlier tests collected inside the call would run its finalizers there: collected before, and the
    # collector off meanwhile (as count_call does).
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return calls


def test_steady_step_makes_no_python_call_per_tensor(sim):
    """A cache-hit step of fused AdamW (the direct step, Note [fused kernel call] in swapopt.internals) makes as
    many Python calls for 400 tensors as for 40: no hashing of each param, no grouping pass, no per-param event
    bookkeeping, and no copy of the step counts for the failure path (Note [undone step counts] in
    swapopt.internals), which the other updates stack in batches that double (Note [snapshot batches])."""
    found, batches = [], []
    for n in (N, 10 * N):
        opt = _steady_adamw(n)
        found.append(_python_calls(opt.step))
        batches.append(len(opt._layout.prepared.scalars.batches))
    assert batches[0] == 1 and 1 <= batches[1] - batches[0] <= 2, batches  # batches there would have been
    assert found[1] == found[0], found


@pytest.mark.parametrize("loaded", [False, True])
def test_a_param_split_across_chunks_keeps_one_copy_per_state_and_chunk(sim, loaded):
    # Params A (whole), P (cut across two chunks), B (whole), two states each: P's states lie whole in the
    # arena the two chunks share, after A's and before B's, so chunk 0 moves [A's states, P.exp_avg[:m]] and
    # P.exp_avg_sq[:m], chunk 1 moves P.exp_avg[m:] and [P.exp_avg_sq[m:], B's states]: 2 copies a chunk
    # each way (one per state of the cut param), not a run plus one per piece and state.
    sizes = (1024, 4096, 1024)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    # 32 KiB chunks: A's 8 KiB and most of P's 32 KiB, then the rest of P and B
    opt = SwapOptimizer(torch.optim.AdamW(params, lr=1e-2, fused=True), chunk_mb=32 / 1024)
    if loaded:  # states that exist before the first swapped step are re-laid out the same way
        for q in ref:
            q.grad = torch.ones_like(q)
        ref_opt.step()
        with torch.no_grad():
            for p, q in zip(params, ref):
                p.copy_(q)
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        sim.reset_timeline()
        opt.step()
        ref_opt.step()
        plan = opt._layout.prepared.plan
        assert len(plan.chunks) == 2 and [pc.index for pc in plan.chunks[0].pieces] == [0, 1]
        lanes = _copies(sim)
        if loaded or step:  # (a first step creates the states on the device: a copy out per piece and state)
            assert lanes["h2d"] == 4 and lanes["d2h"] == 4, (step, lanes)
    opt.wait_for_swap_out()
    storages = {local(opt.state[p][k]).untyped_storage().data_ptr() for p in params for k in KEYS["adamw"]}
    assert len(storages) == 1  # one arena
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
        for key in KEYS["adamw"]:
            assert torch.equal(opt.state[p][key].cpu(), ref_opt.state[q][key].cpu())  # host vs device


def _layouts(n: int):
    """n params cycling through a plain 2-D, a transposed and a channels_last layout."""
    torch.manual_seed(1)
    makers = (
        lambda: torch.randn(8, 12),
        lambda: torch.randn(12, 8).t(),
        lambda: torch.randn(2, 3, 4, 2).to(memory_format=torch.channels_last),
    )
    return [torch.nn.Parameter(makers[i % 3]()) for i in range(n)]


@pytest.mark.parametrize("n", [N, 10 * N])
def test_steady_step_makes_no_slot_views_and_frees_its_staging(sim, n):
    """Slot views are made once per plan (Note [persistent slots] in swapopt.operate), for states of every
    layout: a cache-hit step dispatches as many aten ops for 40 tensors as for 400, and the staging's
    memory is back with the allocator when it returns."""
    params = _layouts(n)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = SwapOptimizer(_build("adamw", params), swap_optimizer_times=K)
    ref_opt = _build("adamw", ref)
    slots = None
    for step in range(4):
        for p, q in zip(params, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        before = sim.memory_allocated()
        if step == 3:
            counts = count_call(opt.step)
            assert counts.h2d_copies == K and counts.d2h_copies == K
            assert counts.aten_ops <= 12 * K, counts
        else:
            opt.step()
        ref_opt.step()
        if step >= 1:  # the states exist: the step allocates nothing that outlives it
            assert sim.memory_allocated() == before
            assert slots is None or all(map(operator.is_, opt.operate._slot_store, slots))
            slots = list(opt.operate._slot_store)
    _check_parity(opt, params, ref, ref_opt)


def test_state_dicts_are_built_once_and_rebuilt_for_a_state_replaced_by_hand(sim, monkeypatch):
    """A chunk of whole params hands the inner step the dicts of its last step while the params' own state
    dicts hold the very same values; a scalar state replaced by hand is seen at the next step."""
    params = _params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = SwapOptimizer(_build("adamw", params), swap_optimizer_times=K)
    ref_opt = _build("adamw", ref)
    built = collections.Counter()
    real = StepRun.piece_input
    monkeypatch.setattr(StepRun, "piece_input", lambda self, piece, *a: built.update([piece.index]) or real(self, piece, *a))
    for step in range(5):
        _grads(params, ref, step)
        if step == 3:
            for p, q in zip(params[:2], ref[:2]):
                opt.state[p]["step"] = torch.full((), 10.0)
                ref_opt.state[q]["step"] = torch.full((), 10.0)
        built.clear()
        opt.step()
        ref_opt.step()
        if step == 2:
            assert not built  # a steady step builds no state dict
        if step == 3:  # the replaced param's chunk is built afresh, the others are not
            chunk = next(c for c in opt._layout.prepared.plan.chunks if any(pc.index == 0 for pc in c.pieces))
            assert set(built) == {pc.index for pc in chunk.pieces}
    _check_parity(opt, params, ref, ref_opt)


def test_a_step_opens_profiler_ranges_only_while_a_profiler_records(sim):
    """Note [profiler ranges]: a range costs host time even with no profiler, so none is opened then (the
    simulator's timeline labels, which want them, are off in untagged())."""
    params = _params()
    opt = SwapOptimizer(_build("adamw", params), swap_optimizer_times=K)
    for step in range(3):
        _grads(params, params, step)
        opt.step()
    own = _params()
    resident = _build("adamw", own)
    for step in range(2):
        _grads(own, own, step)
        resident.step()
    with sim.untagged():
        counts = count_call(opt.step)
        plain = count_call(resident.step)
    # no op beyond aten ops but those of torch's own Optimizer.step range, which the unwrapped step opens too
    assert counts.dispatched - counts.aten_ops == plain.dispatched - plain.aten_ops, (counts, plain)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, sim.untagged():
        opt.step()
    names = {e.name for e in prof.events()}
    assert {f"swapopt.swap_in[{K - 1}]", "swapopt.update[0]", f"swapopt.swap_out[{K - 1}]"} <= names
