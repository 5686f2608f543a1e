"""Hand the accelerator to another engine (an RL rollout) and take it back.

A SwapOptimizer keeps every swapped state in pinned host memory between steps, so offloading only has to
drain in-flight copies and free the staging buffers, and onloading has nothing to move: the next step
streams the states in as usual. A plain optimizer (``SwapConfig(swap_optimizer=False).wrap`` returns one)
gets the classic treatment instead: its states move to the CPU and back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from loguru import logger

import device
from swapopt.optimizer import SwapOptimizer


def offload(opt: torch.optim.Optimizer, empty_cache: bool = False) -> None:
    """Free the device memory the optimizer holds between steps; ``empty_cache`` also returns the
    allocator's cached blocks to the device. Idempotent; safe before the first step and after a failed one."""
    if isinstance(opt, SwapOptimizer):
        opt.wait_for_swap_out()  # in-flight D2H copies still read the staging buffers
        opt.release_staging()
    else:
        put_optimizer_to_device(opt, "cpu")
    if empty_cache:
        _device_call("empty_cache")


def onload(opt: torch.optim.Optimizer) -> None:
    """Undo :func:`offload`. For a SwapOptimizer there is nothing to move: states stay on the host and the
    next step streams them in. Idempotent; calling it without an offload is harmless."""
    if not isinstance(opt, SwapOptimizer):
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
        _device_call("synchronize")
        logger.debug("moved the states of {} to their target devices", type(opt).__name__)


def _device_call(name: str) -> None:
    # torch.cpu (no accelerator) has synchronize but no empty_cache.
    fn = getattr(device.get_torch_device_module(), name, None)
    if fn is not None:
        fn()
