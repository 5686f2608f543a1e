"""master_weights=True under torch's optimizer matrix (optim_db): every optimizer's sampled inputs, implementations,
low-precision dtypes and chunkings bitwise the mixed-precision recipe (tests/test_master_weights.py's Recipe), before
and after a save and load. A file of its own: importing optim_db takes seconds, which the npu flavour's rerun of
test_master_weights.py (tests/test_npu_flavour.py) need not pay."""

from __future__ import annotations

import io
import random

import pytest
import torch
from torch import nn

import simdevice as simulator
from swapopt import SwapOptimizer
from test_master_weights import LOW, Recipe, _check, _same_grads
from test_optim_db_parity import (
    CHUNKINGS,
    REFUSED,
    _accepted,
    _build,
    _impls,
    _inputs,
    _kwargs,
    _make_params,
    optim_db,
)


def _sample(info, seed: int) -> list[tuple[int, str, torch.dtype, tuple]]:
    """Every input once, every implementation with both low-precision dtypes, every chunking."""
    combos = [(i, impl, dtype, c) for i in range(len(_inputs(info))) for impl in _impls(info) for dtype in LOW
              for c in CHUNKINGS]  # fmt: skip
    random.Random(seed).shuffle(combos)
    need = set().union(*({("in", i), ("id", impl, d), ("c", c)} for i, impl, d, c in combos))
    chosen = []
    for i, impl, d, c in combos:
        keys = {("in", i), ("id", impl, d), ("c", c)}
        if keys & need:
            chosen.append((i, impl, d, c))
            need -= keys
    return chosen


def _run_case(info, inp, impl, dtype, chunking, n) -> bool:
    times, chunk_mb = chunking
    kw = _kwargs(inp, impl)
    where = f"{info.optim_cls.__name__} {inp.desc!r} {impl} {dtype} times={times} chunk_mb={chunk_mb}"
    layouts = _accepted(info, ("contiguous", "transposed", "channels_last", "0-dim", "zero-size"), kw, torch.float32, n)
    if not layouts:
        return False
    gen = torch.Generator().manual_seed(n)
    # the low-precision params in every layout torch steps, and one fp32 param: its own master
    ps = _make_params(layouts, dtype, gen) + _make_params(("contiguous",), torch.float32, gen)
    rs = [nn.Parameter(p.detach().clone()) for p in ps]
    build = lambda params: _build(info, params, kw)  # noqa: E731
    recipe = Recipe(build, rs)
    opt = SwapOptimizer(build(ps), swap_optimizer_times=times, chunk_mb=chunk_mb, master_weights=True)
    for _ in range(3):
        _same_grads(ps, rs, gen)
        opt.step()
        recipe.step()
    _check(ps, opt, rs, recipe, where)
    # a save and load in the middle: a fresh wrapper continues like the recipe
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    fresh_ps = [nn.Parameter(p.detach().clone()) for p in ps]
    fresh = SwapOptimizer(build(fresh_ps), swap_optimizer_times=times, chunk_mb=chunk_mb, master_weights=True)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    _same_grads(fresh_ps, rs, gen)
    fresh.step()
    recipe.step()
    _check(fresh_ps, fresh, rs, recipe, where + " after a save and load")
    return True


@pytest.mark.parametrize("info", [i for i in optim_db if i.optim_cls.__name__ not in REFUSED],
                         ids=lambda i: i.optim_cls.__name__)  # fmt: skip
def test_optim_db_matches_the_recipe(info):
    name = info.optim_cls.__name__
    cases = _sample(info, seed=sum(map(ord, name)))
    with simulator.activate():
        ran = sum(_run_case(info, _inputs(info)[i], impl, dtype, chunking, n)
                  for n, (i, impl, dtype, chunking) in enumerate(cases))  # fmt: skip
    assert ran >= len(cases) // 2, f"{name}: torch rejected {len(cases) - ran} of {len(cases)} sampled cases"
