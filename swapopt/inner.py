"""One call of the wrapped optimizer's own ``step`` over a subset of its params (a chunk, a piece, params
stepped in place), with copies of their param groups.

The pipeline (swapopt.pipeline) steps every chunk through here unless a direct step stands for it, and the
failure path (swapopt.recovery) re-steps a single piece through here.
"""

from __future__ import annotations

from typing import Any

import torch

from swapopt import internals
from swapopt.context import StepContext


def run_inner(ctx: StepContext, chunk_groups: dict[int, list[torch.Tensor]], chunk_state: Any, kwargs: dict) -> None:
    """One inner step over the given params and state; the shared groups and state are restored after.
    The step sees copies of the groups: a write to a group-level value would be lost, so it raises."""
    order = sorted(chunk_groups)
    hyper = ctx.hyper  # step-time copies of tensor hyperparameters (overlap_forward), else empty
    groups = [dict(ctx.param_groups[gi], params=chunk_groups[gi], **hyper.get(gi, {})) for gi in order]
    run_groups(ctx, order, groups, chunk_state, kwargs)


def run_groups(ctx: StepContext, order: list[int], groups: list[dict], chunk_state: Any, kwargs: dict) -> None:
    """run_inner over ready copies ``groups`` of the param groups ``order`` (current hyperparameters)."""
    inner = ctx.optimizer
    hyper = ctx.hyper
    with internals.stepping_subset(inner, groups, chunk_state):
        ctx.step_fn(inner, **kwargs)
    for gi, copy in zip(order, groups):
        orig = ctx.param_groups[gi]
        for key, value in copy.items():
            if key != "params" and (key not in orig or orig[key] is not value) and hyper.get(gi, {}).get(key) is not value:
                raise RuntimeError(
                    f"{type(inner).__name__}.step wrote param_groups[{gi}][{key!r}]: SwapOptimizer steps each "
                    "chunk of params with its own copy of the group, so group-level writes (a step counter, a "
                    "norm over all params) would be lost or wrong; such an optimizer is not per-param and "
                    "cannot be swapped"
                )
