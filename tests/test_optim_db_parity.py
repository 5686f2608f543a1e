"""Parity driven by torch's own optimizer matrix (optim_db), on the simulator.

For every optimizer torch tests, every OptimizerInput it lists is run wrapped and unwrapped on the
same params and grads, with params in every layout at once (contiguous, transposed, channels_last,
0-dim, zero-size), under an implementation (for-loop, foreach, fused where torch supports it on this
device), a dtype (fp32, bf16, fp16 where torch is deterministic, complex64 where supported) and a
chunking (swap_optimizer_times 1, 3, 64, or a chunk budget so small that params are split across
chunks). After 3 steps, params and the complete state_dict() must be bitwise equal; then the state
dict goes through torch.save/torch.load (weights_only=True) or deepcopy into a fresh wrapper, which
must keep stepping bitwise like a fresh unwrapped optimizer loaded the same way. Layouts torch itself
refuses for an optimizer (Muon takes matrices only, Adafactor no zero-size params) are left out.

The full product is too large for CI, so each optimizer runs a deterministic sample that covers every
input with every implementation, every implementation with every dtype, and every chunking.
"""

from __future__ import annotations

import copy
import io
import itertools
import random
from typing import Any

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal imports it
_frozen = torch.backends.flags_frozen()
from torch.testing._internal.common_optimizers import optim_db  # noqa: E402

# Importing torch's test utilities freezes torch.backends flags for the whole process (their test suite
# wants that); other tests in this process (Lightning sets cudnn.benchmark) must still be able to set them.
if not _frozen and torch.backends.flags_frozen():
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
assert torch.backends.flags_frozen() == _frozen

import simdevice as simulator  # noqa: E402
from swapopt import SwapOptimizer  # noqa: E402
from swapopt.hoststate import is_swapped_state  # noqa: E402
from stepping import assert_same  # noqa: E402

STEPS = 3
LAYOUTS = ("contiguous", "transposed", "channels_last", "0-dim", "zero-size")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
# (swap_optimizer_times, chunk_mb): 1, 3 and 64 chunks, and a ~2 KiB budget that splits params
CHUNKINGS = ((1, None), (3, None), (64, None), (16, 2 / 1024))
TORCH_REFUSES = {"Muon": {"channels_last", "0-dim"}, "Adafactor": {"zero-size"}}
# refused at construction by SwapOptimizer (and tested as such in test_optimizer_api)
REFUSED = {
    "LBFGS": "one flat history over all params and closure re-evaluation: refused",
    "SparseAdam": "sparse gradients only: refused",
}


def _infos() -> list[Any]:
    return list(optim_db)


def _impls(info: Any) -> list[str]:
    impls = ["for-loop"]
    if "foreach" in info.supported_impls:
        impls.append("foreach")
    if "fused" in info.supported_impls and "cpu" in info.supports_fused_on:
        impls.append("fused")
    return impls


def _dtypes(info: Any) -> list[torch.dtype]:
    return [d for d in DTYPES if d is not torch.complex64 or info.supports_complex]


def _inputs(info: Any) -> list[Any]:
    """OptimizerInputs that run on this device: differentiable ones are refused by SwapOptimizer (their
    states carry autograd history), capturable ones need CUDA graphs."""
    out = []
    for inp in info.optim_inputs_func(device="cpu", dtype=torch.float32):
        if inp.kwargs.get("differentiable") or inp.kwargs.get("capturable"):
            continue
        out.append(inp)
    return out


def _deterministic(info: Any, impl: str, dtype: torch.dtype) -> bool:
    """Whether torch's own result is a reference: its fused kernels take real dtypes only, and on CPU
    fused SGD with 16-bit dtypes reads part of a new momentum buffer before writing it (run it twice on
    a 1728-element param with different garbage in the allocator and the buffers differ)."""
    if impl != "fused":
        return True
    if dtype is torch.complex64 or dtype is torch.float16:
        return False
    return not (info.optim_cls.__name__ == "SGD" and dtype is torch.bfloat16)


def _sample(info: Any, seed: int) -> list[tuple[int, str, torch.dtype, tuple]]:
    """A deterministic covering sample of inputs x impls x dtypes x chunkings."""
    inputs = range(len(_inputs(info)))
    impls, dtypes = _impls(info), _dtypes(info)
    combos = [
        c for c in itertools.product(inputs, impls, dtypes, CHUNKINGS)
        if _deterministic(info, c[1], c[2])
    ]  # fmt: skip
    random.Random(seed).shuffle(combos)
    def keys(i: int, impl: str, dtype: torch.dtype, chunking: tuple) -> set:
        return {("in", i, impl), ("id", impl, dtype), ("c", chunking)}

    need: set = set().union(*(keys(*c) for c in combos))
    chosen = []
    for i, impl, dtype, chunking in combos:
        if keys(i, impl, dtype, chunking) & need:
            chosen.append((i, impl, dtype, chunking))
            need -= keys(i, impl, dtype, chunking)
    return chosen


def _make_params(layouts: tuple[str, ...], dtype: torch.dtype, gen: torch.Generator) -> list[torch.nn.Parameter]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32 if dtype.is_floating_point else dtype).to(dtype)

    made = {
        "contiguous": lambda: randn(24, 37),
        "transposed": lambda: randn(37, 24).t(),
        "channels_last": lambda: randn(2, 6, 8, 9).contiguous(memory_format=torch.channels_last),
        "0-dim": lambda: randn(),
        "zero-size": lambda: randn(0, 5),
    }
    return [torch.nn.Parameter(made[name]()) for name in layouts]


def _grads(params: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """Grads laid out like their params, as autograd makes them."""
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float32 if p.dtype.is_floating_point else p.dtype)
        out.append(torch.empty_like(p).copy_(g))
    return out


def _kwargs(inp: Any, impl: str) -> dict[str, Any]:
    kw = copy.deepcopy({k: v for k, v in inp.kwargs.items() if k not in ("foreach", "fused")})
    if impl == "foreach":
        kw["foreach"] = True
    elif impl == "fused":
        kw["fused"] = True
    else:
        kw["foreach"] = False
    return kw


def _build(info: Any, params: list[torch.Tensor], kw: dict[str, Any]) -> torch.optim.Optimizer:
    if "foreach" in kw and "foreach" not in info.supported_impls:
        kw = {k: v for k, v in kw.items() if k != "foreach"}
    return info.optim_cls(params, **copy.deepcopy(kw))


def _step_both(ps, opt, rs, ref, gen) -> None:
    for p, r, g in zip(ps, rs, _grads(ps, gen)):
        p.grad, r.grad = g.clone(), g.clone()
    opt.step()
    ref.step()


def _check(ps, opt, rs, ref, where: str) -> None:
    opt.wait_for_swap_out()
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert_same(p, r, f"{where}: param {i}")
    assert_same(opt.state_dict(), ref.state_dict(), f"{where}: state_dict")


def _round_trip(sd: dict, how: str) -> dict:
    if how == "deepcopy":
        return copy.deepcopy(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _assert_on_device(ref: torch.optim.Optimizer, where: str) -> None:
    """torch's load_state_dict casts states to param.device: the reference's states are back in device
    memory (the simulated device, as on CUDA), where the wrapper's are in host memory."""
    for p, st in ref.state.items():
        assert p.device.type != "cpu", where
        for k, v in st.items():
            if is_swapped_state(p, k, v):
                assert v.device == p.device, (where, k, v.device, p.device)


def _accepted(info: Any, layouts: tuple[str, ...], kw: dict, dtype: torch.dtype, seed: int) -> tuple[str, ...]:
    """The layouts torch itself steps for this input and dtype (each tried alone, on a throwaway copy):
    the others are torch's own errors, not ours to compare."""
    ok = []
    for name in layouts:
        gen = torch.Generator().manual_seed(seed)
        qs = _make_params((name,), dtype, gen)
        try:
            probe = _build(info, qs, kw)
            for q, g in zip(qs, _grads(qs, gen)):
                q.grad = g
            probe.step()
        except (RuntimeError, ValueError, TypeError, NotImplementedError, ArithmeticError):
            continue
        ok.append(name)
    return tuple(ok)


def _run_case(info: Any, inp: Any, impl: str, dtype: torch.dtype, chunking: tuple, n: int) -> tuple[str, ...]:
    """One case; returns the layouts it ran (those torch accepts for it)."""
    times, chunk_mb = chunking
    kw = _kwargs(inp, impl)
    where = f"{info.optim_cls.__name__} {inp.desc!r} {impl} {dtype} times={times} chunk_mb={chunk_mb}"
    layouts = _accepted(info, LAYOUTS, kw, dtype, n)
    if not layouts:
        return ()
    gen = torch.Generator().manual_seed(n)
    ps = _make_params(layouts, dtype, gen)
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    assert all(p.stride() == r.stride() for p, r in zip(ps, rs))
    assert all(p.device.type != "cpu" and r.device == p.device for p, r in zip(ps, rs)), where  # on the device
    ref = _build(info, rs, kw)
    opt = SwapOptimizer(_build(info, ps, kw), swap_optimizer_times=times, chunk_mb=chunk_mb)
    for _ in range(STEPS):
        _step_both(ps, opt, rs, ref, gen)
    _check(ps, opt, rs, ref, where)
    if chunk_mb is not None and opt._layout.elementwise and opt._layout.prepared.plan.total_bytes > 8192:
        assert any(pc.start > 0 for c in opt._layout.prepared.plan.chunks for pc in c.pieces), where  # really split
    # state dict -> (deepcopy | torch.save + torch.load(weights_only)) -> a fresh wrapper continues bitwise
    # like a fresh unwrapped optimizer given the reference's state dict the same way (torch's load casts
    # some states to the param's dtype, so the uninterrupted reference is not the right one to follow)
    how = "deepcopy" if n % 2 else "save-load"
    fresh_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = SwapOptimizer(_build(info, fresh_ps, kw), swap_optimizer_times=times, chunk_mb=chunk_mb)
    fresh.load_state_dict(_round_trip(opt.state_dict(), how))
    fresh_rs = [torch.nn.Parameter(r.detach().clone()) for r in rs]
    fresh_ref = _build(info, fresh_rs, kw)
    fresh_ref.load_state_dict(_round_trip(ref.state_dict(), how))
    _assert_on_device(fresh_ref, where + f" after {how}")
    _check(fresh_ps, fresh, fresh_rs, fresh_ref, where + f" after {how}")
    _step_both(fresh_ps, fresh, fresh_rs, fresh_ref, gen)
    _check(fresh_ps, fresh, fresh_rs, fresh_ref, where + f" stepping after {how}")
    return layouts


@pytest.mark.parametrize("info", _infos(), ids=lambda i: i.optim_cls.__name__)
def test_optim_db_parity(info):
    name = info.optim_cls.__name__
    if name in REFUSED:
        with simulator.activate(), pytest.raises(ValueError, match=name):
            SwapOptimizer(info.optim_cls([torch.nn.Parameter(torch.randn(4))]))
        pytest.skip(REFUSED[name])
    inputs = _inputs(info)
    assert inputs, name
    cases = _sample(info, seed=sum(map(ord, name)))
    seen: set[str] = set()
    ran = 0
    with simulator.activate():
        for n, (i, impl, dtype, chunking) in enumerate(cases):
            layouts = _run_case(info, inputs[i], impl, dtype, chunking, n)
            seen.update(layouts)
            ran += bool(layouts)
    assert ran >= len(cases) // 2, f"{name}: torch rejected {len(cases) - ran} of {len(cases)} sampled cases"
    # every layout was covered, except those torch itself refuses: Muon takes matrices only, Adafactor
    # divides by the param's size
    assert seen == set(LAYOUTS) - TORCH_REFUSES.get(name, set()), seen
