"""Chunks that hold whole params and pieces of a cut one (Note [mixed chunks] in swapopt.pipeline).

The whole params keep their state dicts from step to step and take the direct step; the cut pieces take a call
of the inner step of their own. Results stay bitwise those of the unwrapped optimizer, and a failure in either
call keeps every param stepped or untouched but the failing chunk's, which the ERROR log names.
"""

from __future__ import annotations

import gc

import pytest
import torch
from dist_utils import adopt, assert_steps_match, matches_snapshot, snapshot_params
from loguru import logger

import simdevice as simulator
from swapopt import SwapOptimizer, direct, inner

O = torch.optim
MAKERS = {
    "adamw_fused": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_amsgrad": lambda ps: O.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "sgd_momentum": lambda ps: O.SGD(ps, lr=1e-2, momentum=0.9),
}
CHUNK_MB = 24 / 1024  # 24 KiB of states a chunk: the 8192-element params are cut, the small ones stay whole


# Whole params on both sides of each cut one, so chunks mix the two (tests/cuda/test_cuda_parity.py takes them too).
SHAPES = ((64,), (8, 16), (8192,), (96,), (7, 9), (64, 128), (33,), (128,), (5,))


def _params() -> list[torch.nn.Parameter]:
    # SHAPES, odd ones and a transposed layout among the whole params
    made = [torch.randn(s) for s in SHAPES]
    made[4] = made[4].t().contiguous().t()  # a transposed layout among the whole params
    return [torch.nn.Parameter(t) for t in made]


def _grads(ps, rs) -> None:
    for p, r in zip(ps, rs):
        g = torch.empty_like(p).copy_(torch.randn(p.shape))
        p.grad, r.grad = g.clone(), g.clone()


def _plan(opt: SwapOptimizer):
    """The plan the next step runs."""
    params, groups, _ = opt._layout.active()
    return opt._layout.prepare(params, groups).plan


def _mixed(opt: SwapOptimizer) -> list[int]:
    """The chunks that hold whole params and cut pieces, from the step's plan."""
    plan = _plan(opt)
    numel = [p.numel() for p in opt._layout.active()[0]]
    out = []
    for k, c in enumerate(plan.chunks):
        whole = sum(pc.start == 0 and pc.stop == numel[pc.index] for pc in c.pieces)
        if whole >= 2 and whole < len(c.pieces):
            out.append(k)
    return out


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_mixed_chunks_take_the_direct_step_and_stay_bitwise(name, monkeypatch):
    calls: list[tuple[str, int]] = []
    real_run, real_groups = direct.DirectStep.run, inner.run_groups

    def counting_direct(self, *a, **k):
        ok = real_run(self, *a, **k)
        calls.append(("direct" if ok else "direct-declined", sum(len(g.params) for g in self.groups)))
        return ok

    def counting_inner(ctx, order, groups, chunk_state, kwargs):
        calls.append(("inner", sum(len(g["params"]) for g in groups)))
        return real_groups(ctx, order, groups, chunk_state, kwargs)

    monkeypatch.setattr(direct.DirectStep, "run", counting_direct)
    monkeypatch.setattr(inner, "run_groups", counting_inner)
    with simulator.activate():
        torch.manual_seed(0)
        ps = _params()
        rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt, ref = SwapOptimizer(MAKERS[name](ps), chunk_mb=CHUNK_MB), MAKERS[name](rs)
        for step in range(5):
            _grads(ps, rs)
            calls.clear()
            opt.step()
            ref.step()
        mixed = _mixed(opt)
        assert len(mixed) >= 2, "the plan has no chunk of whole params and cut pieces"
        chunks = _plan(opt).chunks
        cut = [pc for c in chunks for pc in c.pieces if not (pc.start == 0 and pc.stop == ps[pc.index].numel())]
        whole = len(ps) - len({pc.index for pc in cut})
        # the last step: the cut pieces went through calls of their own
        inner_tensors = sum(n for kind, n in calls if kind == "inner")
        direct_calls = [n for kind, n in calls if kind == "direct"]
        if name != "sgd_momentum":  # torch's Adam has a direct step (Note [direct step]): every tensor takes it
            assert sum(direct_calls) == whole + len(cut) and inner_tensors == 0
            assert len(direct_calls) == len(chunks) + len(_mixed(opt))  # a second call in each mixed chunk
        else:  # SGD has none, but the whole params keep their dicts: inner calls over them, others over the cut pieces
            assert not any(kind.startswith("direct") for kind, _ in calls) and inner_tensors == whole + len(cut)
        opt.wait_for_swap_out()
        for p, r in zip(ps, rs):
            assert torch.equal(p.detach(), r.detach())
            for key, value in ref.state[r].items():
                assert torch.equal(torch.as_tensor(opt.state[p][key]).cpu(), torch.as_tensor(value).cpu()), key


@pytest.mark.parametrize("which", ["whole", "cut"])
def test_a_fault_in_either_call_of_a_mixed_chunk(which, monkeypatch):
    messages: list[str] = []
    handle = logger.add(lambda m: messages.append(str(m)), level="ERROR")
    logger.enable("swapopt")
    make = MAKERS["adamw_foreach"]
    try:
        with simulator.activate() as dev:
            torch.manual_seed(0)
            ps = _params()
            rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            opt, ref = SwapOptimizer(make(ps), chunk_mb=CHUNK_MB), make(rs)
            for _ in range(2):
                _grads(ps, rs)
                opt.step()
                ref.step()
            opt.wait_for_swap_out()
            k = _mixed(opt)[0]
            plan = _plan(opt)
            _grads(ps, rs)
            old = snapshot_params(rs, ref.state)
            fired: list[str] = []
            real_run = direct.DirectStep.run
            numel = [p.numel() for p in ps]
            whole_k = {id(ps[pc.index]) for pc in plan.chunks[k].pieces if pc.start == 0 and pc.stop == numel[pc.index]}
            reached = []  # chunk k's whole params were stepped: the next call over cut pieces is chunk k's

            def direct_run(self, *a, **kw):
                if any(id(t) in whole_k for g in self.groups for t in g.params):
                    if which == "whole" and not fired:
                        fired.append(which)
                        raise RuntimeError("boom in the whole call")
                    reached.append(True)
                elif any(not isinstance(t, torch.nn.Parameter) for g in self.groups for t in g.params):
                    if reached and which == "cut" and not fired:  # chunk k's call over its cut pieces
                        fired.append(which)
                        raise RuntimeError("boom in the cut call")
                return real_run(self, *a, **kw)

            monkeypatch.setattr(direct.DirectStep, "run", direct_run)
            gc.collect()
            base = dev.memory_allocated()
            with pytest.raises(RuntimeError, match="boom"):
                opt.step()
            monkeypatch.undo()
            assert fired == [which]
            gc.collect()
            assert dev.memory_allocated() == base
            assert opt.swap_stats().failed
            ref.step()
            stepped = snapshot_params(rs, ref.state)
            opt.wait_for_swap_out()
            named = {i for i, p in enumerate(ps) if any(f"of shape {tuple(p.shape)}" in m for m in messages)}
            failing = {pc.index for pc in plan.chunks[k].pieces}
            for i, (p, r) in enumerate(zip(ps, rs)):
                st = opt.state.get(p, {})
                if matches_snapshot(p, st, stepped[i]):
                    continue
                if matches_snapshot(p, st, old[i]):
                    adopt(r, ref.state, *old[i])
                    continue
                assert i in named and i in failing, f"param {i} is neither stepped nor untouched"
                adopt(r, ref.state, p.detach(), st)
            assert_steps_match(opt, ref, ps, rs, _grads, steps=2)  # usable, and bitwise the reference from there
    finally:
        logger.remove(handle)
        logger.disable("swapopt")


@pytest.mark.parametrize(
    "knobs", [{"overlap_forward": True}, {"prefetch": True}, {"slots": 2}, {"groups": True}, {"reload": True}], ids=str
)
def test_mixed_chunks_under_the_pipeline_knobs(knobs):
    """The kept dicts and the cut pieces' dicts made each step, under the engine's knobs: the next forward's waits
    (overlap_forward), chunks swapped in ahead (prefetch), two slots, two groups whose lr a schedule changes between
    steps (each chunk's two calls hold copies of both), and a state_dict round trip in the middle of training."""
    knobs = dict(knobs)
    groups, reload = knobs.pop("groups", False), knobs.pop("reload", False)

    def make(ps):
        if groups:
            return O.AdamW([{"params": ps[::2]}, {"params": ps[1::2], "lr": 3e-3}], lr=1e-2, fused=True)
        return O.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)

    with simulator.activate():
        torch.manual_seed(0)
        ps = _params()
        rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt, ref = SwapOptimizer(make(ps), chunk_mb=CHUNK_MB, **knobs), make(rs)
        if knobs.get("overlap_forward") or knobs.get("prefetch"):
            opt.attach(torch.nn.ParameterList(ps))
        for step in range(6):
            _grads(ps, rs)
            if groups and step == 3:  # a scheduler writes one group's lr between steps
                for o in (opt, ref):
                    o.param_groups[1]["lr"] = 1e-3
            if reload and step == 3:
                saved = opt.state_dict()
                opt = SwapOptimizer(make(ps), chunk_mb=CHUNK_MB)
                opt.load_state_dict(saved)
            if knobs.get("prefetch"):
                opt.prefetch()
            opt.step()
            ref.step()
            if step == 2:
                assert _mixed(opt), "no chunk of whole params and cut pieces"
        opt.wait_for_swap_out()
        opt.wait_for_update()
        for p, r in zip(ps, rs):
            assert torch.equal(p.detach(), r.detach())
            for key, value in ref.state[r].items():
                assert torch.equal(torch.as_tensor(opt.state[p][key]).cpu(), torch.as_tensor(value).cpu()), key


@pytest.mark.parametrize("name", ["adamw_fused", "adam_amsgrad", "sgd_momentum"])
def test_cut_pieces_dicts_come_from_the_plan(name, monkeypatch):
    """Note [cut pieces]: once the states exist, a steady step makes the cut pieces' dicts from the plan's entries
    (no piece_input), stepped directly where the optimizer has a direct step; a key added to a cut param's dict
    sends its pieces back through piece_input for that step (the entries declined, or the plan made anew), the
    next step makes them from the new entries, and the key is kept. Bitwise throughout."""
    from swapopt import cut_pieces, pipeline

    made: list[str] = []
    real_input, real_inputs = pipeline.StepRun.piece_input, cut_pieces.CutPieces.inputs

    def counting_input(self, *a, **k):
        made.append("piece_input")
        return real_input(self, *a, **k)

    def counting_inputs(self, state):
        out = real_inputs(self, state)
        made.append("plan" if out is not None else "declined")
        return out

    monkeypatch.setattr(pipeline.StepRun, "piece_input", counting_input)
    monkeypatch.setattr(cut_pieces.CutPieces, "inputs", counting_inputs)
    with simulator.activate():
        torch.manual_seed(0)
        ps = _params()
        rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt, ref = SwapOptimizer(MAKERS[name](ps), chunk_mb=CHUNK_MB), MAKERS[name](rs)
        cut_param = next(i for i, p in enumerate(ps) if p.numel() == 8192)
        for step in range(6):
            _grads(ps, rs)
            if step == 4:  # a key of the user's own in the cut param's state
                opt.state[ps[cut_param]]["note"] = 7
                ref.state[rs[cut_param]]["note"] = 7
            made.clear()
            opt.step()
            ref.step()
            if step in (2, 3, 5):  # steady: every cut piece's dict made from the plan
                assert made and set(made) == {"plan"}, (step, made)
            if step == 4:  # the dict changed: read afresh (declined, or a new plan), never made from the old entries
                pieces = sum(pc.index == cut_param for c in _plan(opt).chunks for pc in c.pieces)
                assert made.count("declined") in (0, pieces) and made.count("piece_input") >= pieces, made
        assert len(_mixed(opt)) >= 2
        assert opt.state[ps[cut_param]]["note"] == 7
        # the entries stand only for dicts of the very keys they were made for
        params, groups, _ = opt._layout.active()
        cuts = [ci.cut_pieces for ci in opt._layout.prepare(params, groups).inputs if ci is not None and ci.cut_pieces]
        assert cuts
        del opt.state[ps[cut_param]]["note"]
        assert any(c.inputs(opt.state) is None for c in cuts)
        opt.state[ps[cut_param]]["note"] = 7
        assert all(c.inputs(opt.state) is not None for c in cuts)
        for piece in (piece for c in cuts for piece in c.pieces):  # the grads those calls bound
            piece.target.grad = None
        opt.wait_for_swap_out()
        for p, r in zip(ps, rs):
            assert torch.equal(p.detach(), r.detach())
            for key, value in ref.state[r].items():
                assert torch.equal(torch.as_tensor(opt.state[p][key]).cpu(), torch.as_tensor(value).cpu()), key
