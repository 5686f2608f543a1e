"""prefetch through the optimizer, in the cases the other prefetch tests leave out: a plan large enough for
the smaller first chunks of Note [ramp] (swapopt.plan) has none with prefetch and has them without it, and
gradient accumulation (several forwards before one step) prefetches once, at the first forward, and the step
adopts that prefetch. Results are bitwise those of the unwrapped optimizer, or of the same run without prefetch
(torch.equal)."""

from __future__ import annotations

import pytest
import torch
from stepping import adamw, mlp
from torch import nn

from swapopt import SwapOptimizer
from swapopt.plan import RAMP_MIN_CHUNKS, ramp_budgets

STEPS = 4


def _bitwise(model, opt, twin, ref) -> None:
    opt.wait_for_update()
    opt.wait_for_swap_out()
    for i, (p, r) in enumerate(zip(model.parameters(), twin.parameters())):
        assert torch.equal(p.detach(), r.detach()), f"param {i}"
        assert set(opt.state[p]) == set(ref.state[r]), f"param {i} state keys"
        for key, value in ref.state[r].items():
            assert torch.equal(torch.as_tensor(opt.state[p][key]).cpu(), torch.as_tensor(value).cpu()), (i, key)


# ----- Note [ramp]: no smaller first chunks with prefetch -------------------------------------------------
# mlp(width=512, depth=5): 1.3M params, 10.5 MB of AdamW states: about 1.3 MB chunks at 8 chunks, or 1 MiB ones
# with chunk_mb=1, so the last ramp budget (half a chunk) is at least RAMP_MIN_BYTES: one smaller first chunk.
WIDTH, DEPTH, RAMP_STEPS = 512, 5, 3
KNOBS = {"times": {"swap_optimizer_times": RAMP_MIN_CHUNKS}, "chunk_mb": {"chunk_mb": 1}}


def _ramp_run(prefetch: bool, knobs: dict):
    model = mlp(width=WIDTH, depth=DEPTH)
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), prefetch=prefetch, **knobs)
    opt.attach(model)
    torch.manual_seed(1)
    used = []
    for _ in range(RAMP_STEPS):
        x = torch.randn(8, WIDTH)
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        used.append(opt.operate.prefetched is not None)
        loss.backward()
        opt.step()
    opt.wait_for_update()
    opt.wait_for_swap_out()
    return model, opt, used


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_prefetch_plans_no_ramp_where_one_forms_without_it(sim, knob, monkeypatch):
    # the ramp rule itself: the link's costs would leave out ramp chunks this small (Note [chunk count from costs])
    monkeypatch.setattr("swapopt.layout.link_costs", lambda device_type, replayed=False: None)
    model, plain, used_plain = _ramp_run(False, KNOBS[knob])
    ramped = plain._layout.prepared.plan
    ramp = ramp_budgets(ramped.budget)
    assert ramp, "the plan is too small for a ramp: the test would prove nothing"
    # Without prefetch: the first chunks are cut to the ramp budgets, each smaller than the next.
    first = [c.nbytes for c in ramped.chunks[: len(ramp) + 1]]
    assert all(n <= b for n, b in zip(first, ramp)), (first, ramp)
    assert first == sorted(first) and first[0] <= ramped.budget >> 1, first
    assert plain.swap_stats().chunks == len(ramped.chunks) and not any(used_plain)

    twin, fetched, used = _ramp_run(True, KNOBS[knob])
    flat = fetched._layout.prepared.plan
    assert flat.budget == ramped.budget  # the same sizes and knobs: only the ramp differs
    # With prefetch: every chunk but the last is cut to the full budget, the first included.
    assert all(c.nbytes > flat.budget >> 1 for c in flat.chunks[:-1]), [c.nbytes for c in flat.chunks]
    assert flat.chunks[0].nbytes > max(ramp)
    assert fetched.swap_stats().chunks == len(flat.chunks)
    # no plan before step 1, a stale one after it: the last step ran on prefetched chunks
    assert used == [False] * 2 + [True] * (RAMP_STEPS - 2), used
    # the two plans give bitwise the same params and states (tests/test_parity.py compares the plain run's
    # kind with the unwrapped optimizer)
    _bitwise(twin, fetched, model, plain)


# ----- gradient accumulation -----------------------------------------------------------------------------
MICRO = 3
CHUNKS = 8  # the prefetch holds 2 of them: a small share, below the warning's


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_gradient_accumulation_prefetches_at_the_first_forward_and_the_step_adopts_it(sim, kind, overlap):
    model, twin = mlp(), mlp()
    inner = adamw(kind, model.parameters())
    opt = SwapOptimizer(inner, swap_optimizer_times=CHUNKS, overlap_forward=overlap, prefetch=True)
    opt.attach(model)
    ref = adamw(kind, twin.parameters())
    op = opt.operate
    issued: list[bool] = []
    real_prefetch = opt.prefetch
    opt.prefetch = lambda: issued.append(real_prefetch()) or issued[-1]  # the forward hook looks it up here
    swapped: list[int] = []
    real_swap_in = op.swap_in
    op.swap_in = lambda k, copies: swapped.append(k) or real_swap_in(k, copies)
    torch.manual_seed(1)
    batches = [[(torch.randn(8, 32), torch.randn(8, 4)) for _ in range(MICRO)] for _ in range(STEPS + 1)]
    losses: dict[str, list[torch.Tensor]] = {"swap": [], "ref": []}
    for step, micro in enumerate(batches):
        issued.clear()
        swapped.clear()
        held = None
        for m, o, name in ((model, opt, "swap"), (twin, ref, "ref")):
            o.zero_grad(set_to_none=True)
            for j, (x, y) in enumerate(micro):
                loss = nn.functional.mse_loss(m(x), y) / MICRO
                if o is opt and step >= 2:  # a plan that holds: the first forward prefetched
                    if j == 0:
                        held = op.prefetched
                        assert held is not None
                    assert op.prefetched is held  # later forwards neither drop nor redo it
                loss.backward()
                losses[name].append(loss.detach())
            o.step()
        if step < 2:  # no plan before step 1, a stale one after it: nothing to prefetch for
            assert not any(issued) and op.prefetched is None
            continue
        assert issued == [True] + [False] * (MICRO - 1), issued  # one forward hook call per micro-batch
        assert op.prefetched is None  # adopted by the step
        ahead = len(held.h2d_events)
        assert ahead >= 1 and swapped == list(range(ahead, opt.swap_stats().chunks)), (ahead, swapped)
        # the prefetched chunks' updates waited for the prefetch's copies, not for copies of their own
        assert all(op.h2d_events[k] is held.h2d_events[k] for k in range(ahead))
    _bitwise(model, opt, twin, ref)
    assert all(torch.equal(a, b) for a, b in zip(losses["swap"], losses["ref"]))
    assert not torch.equal(next(model.parameters()), next(mlp().parameters()))  # the loop did train
