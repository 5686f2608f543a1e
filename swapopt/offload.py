"""Hand the accelerator to another engine (an RL rollout) and take it back.

A SwapOptimizer keeps its swapped states in pinned host memory between steps, so offloading drains
in-flight copies, frees the staging buffers and moves the little that stays on the device (resident
states, device ``step`` scalars of fused or capturable groups) to the host; onloading moves the scalars
back, and the next step streams the states in and makes resident ones resident again. A plain optimizer
(``SwapConfig(swap_optimizer=False).wrap`` returns one) gets the classic treatment instead: its states
move to the CPU and back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from loguru import logger

from swapopt.eviction import device_call
from swapopt.optimizer import SwapOptimizer


def offload(opt: torch.optim.Optimizer, empty_cache: bool = True) -> None:
    """Free the device memory the optimizer holds between steps; ``empty_cache`` (default, as for
    :func:`offloaded`) also returns the allocator's cached blocks to the device, so the other phase can
    have them. Idempotent; safe before the first step and after a failed one."""
    if isinstance(opt, SwapOptimizer):
        opt.offload(empty_cache=empty_cache)
        return
    put_optimizer_to_device(opt, "cpu")
    if empty_cache:
        device_call("empty_cache")


def onload(opt: torch.optim.Optimizer) -> None:
    """Undo :func:`offload`. For a SwapOptimizer only the device scalars move back: swapped states stay on the
    host and the next step streams them in (and makes resident ones resident again). Idempotent; calling it
    without an offload is harmless."""
    if isinstance(opt, SwapOptimizer):
        opt.onload()
    else:
        _move_states(opt, lambda p: p.device)


@contextmanager
def offloaded(opt: torch.optim.Optimizer, empty_cache: bool = True) -> Iterator[None]:
    """``with offloaded(opt): rollout()``: offload on enter, onload on exit (also when the body raises)."""
    offload(opt, empty_cache=empty_cache)
    try:
        yield
    finally:
        onload(opt)


def put_optimizer_to_device(optimizer: torch.optim.Optimizer, device: str | torch.device) -> bool:
    """XTuner-style hook: ``"cpu"`` offloads a plain optimizer's states, the accelerator onloads them.

    Returns False for a SwapOptimizer, whose states already live on the host and must stay in their pinned
    tensors; True when the states of a plain optimizer were moved.
    """
    if isinstance(optimizer, SwapOptimizer):
        return False
    target = torch.device(device)
    _move_states(optimizer, lambda p: target)
    return True


def _move_states(opt: torch.optim.Optimizer, where: Callable[[torch.Tensor], torch.device]) -> None:
    moved = False
    for group in opt.param_groups:
        # torch keeps ``step`` as a CPU scalar unless the optimizer is capturable or fused.
        step_on_device = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            state = opt.state.get(p)
            for key, value in (state or {}).items():
                if not isinstance(value, torch.Tensor) or (key == "step" and not step_on_device):
                    continue
                target = where(p)
                if value.device != target:
                    state[key] = value.to(target, non_blocking=True)
                    moved = True
    if moved:
        # A non-blocking device-to-host copy may not have landed yet: reading it early gives garbage.
        device_call("synchronize")
        logger.debug("moved the states of {} to their target devices", type(opt).__name__)
