"""Pieces the step tests share: a small MLP, the AdamW variants they wrap, a failure injected into the
inner optimizer's n-th per-chunk call, and the reference a step that failed is compared with."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from swapopt import SwapOptimizer


def mlp(seed: int = 0, width: int = 32, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def adamw(kind: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW with decay: "fused" (with a tensor lr) or "foreach"."""
    if kind == "fused":
        return torch.optim.AdamW(params, lr=torch.full((), 1e-2), weight_decay=0.1, fused=True)
    if kind == "foreach":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    raise ValueError(kind)


def attached_pair(overlap_forward: bool) -> tuple[nn.ParameterList, list[nn.Parameter], SwapOptimizer, torch.optim.Optimizer]:
    """Six (4, 5) params under a foreach AdamW swapped in 3 chunks and attached to them, and an unwrapped
    AdamW over copies of them (the reference)."""
    torch.manual_seed(0)
    ps = nn.ParameterList(nn.Parameter(torch.randn(4, 5)) for _ in range(6))
    rs = [nn.Parameter(p.detach().clone()) for p in ps]
    opt = SwapOptimizer(
        torch.optim.AdamW(ps, lr=1e-2, foreach=True), swap_optimizer_times=3, overlap_forward=overlap_forward
    )
    opt.attach(ps)
    return ps, rs, opt, torch.optim.AdamW(rs, lr=1e-2, foreach=True)


def same_grads(ps: Iterable[torch.Tensor], rs: Iterable[torch.Tensor]) -> None:
    """Fresh random grads, the same for each param and its reference copy."""
    for p, r in zip(ps, rs):
        g = torch.randn_like(p)
        p.grad, r.grad = g.clone(), g.clone()


class Boom(RuntimeError):
    pass


def fail_on_call(opt: SwapOptimizer, n: int) -> Callable[[], None]:
    """Make the inner optimizer raise on its n-th per-chunk call (0-based) from now on; returns what
    puts the real step back."""
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


def step_reference_as_failed(opt: SwapOptimizer, ref: torch.optim.Optimizer, rs: list[torch.Tensor], chunks_done: int) -> None:
    """Step the unwrapped reference as the failed step left the swapped params: only those of the first
    ``chunks_done`` chunks of ``opt``'s plan stepped (the rest untouched: their grads dropped)."""
    done = {pc.index for c in opt._layout.prepared.plan.chunks[:chunks_done] for pc in c.pieces}
    for i, r in enumerate(rs):
        if i not in done:
            r.grad = None
    ref.step()


def assert_matches_reference(opt: SwapOptimizer, ps, ref: torch.optim.Optimizer, rs: list[torch.Tensor]) -> None:
    """Params and every state of ``opt`` bitwise those of the unwrapped reference, once its work is done."""
    opt.wait_for_update()
    opt.wait_for_swap_out()
    for p, r in zip(ps, rs):
        assert torch.equal(p.detach(), r.detach())
        # the swapped states are host tensors, the reference's device tensors: compare host copies
        assert all(torch.equal(opt.state[p][k].cpu(), v.cpu()) for k, v in ref.state[r].items())


def assert_params_and_states_equal(opt: SwapOptimizer, ps, ref: torch.optim.Optimizer, rs: list[torch.Tensor]) -> None:
    """Params, state keys and every state (tensors and plain numbers alike) of ``opt`` bitwise those of the
    reference; the caller has waited for ``opt``'s work."""
    for p, r in zip(ps, rs):
        assert torch.equal(p.detach().cpu(), r.detach().cpu())
    for p, r in zip(ps, rs):
        st, rt = opt.state[p], ref.state[r]
        assert set(st) == set(rt)
        for key in rt:
            assert torch.equal(torch.as_tensor(st[key]).cpu(), torch.as_tensor(rt[key]).cpu()), key


# Element-wise Adams in the kernels a chunk's update can take (fused, foreach, for-loop with amsgrad and maximize,
# a tensor lr): the cases both the direct and the flat chunk step are checked bitwise on.
ADAM_KERNELS = [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, amsgrad=True, maximize=True),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2), fused=True, weight_decay=0.05),
]
ADAM_KERNEL_IDS = ["adamw-fused", "adamw-foreach", "adam-forloop-amsgrad-maximize", "adam-fused-tensor-lr"]


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, so NaNs (fp16 Adam with eps=1e-8 makes some) compare too."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        t = t.view(_INT_OF_SIZE[t.element_size()])
    return t


def assert_same(got: Any, want: Any, where: str) -> None:
    """Bitwise: tensors with torch.equal on their bits (and equal dtype and shape), the rest with ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        # a wrapper keeps its states in host memory, torch's own on the device: compare both on the host
        assert torch.equal(bits(got).cpu(), bits(want).cpu()), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, set(got), set(want))
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)
