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

import device
from swapopt.copying import pinned_copy
from swapopt.hoststate import is_swapped_state, local, wrap_like
from swapopt.optimizer import SwapOptimizer


def offload(opt: torch.optim.Optimizer, empty_cache: bool = True) -> None:
    """Free the device memory the optimizer holds between steps; ``empty_cache`` (default, as for
    :func:`offloaded`) also returns the allocator's cached blocks to the device, so the other phase can
    have them. Idempotent; safe before the first step and after a failed one."""
    if isinstance(opt, SwapOptimizer):
        opt.wait_for_update()  # the other phase reads the params (overlap_forward: an update may be pending)
        opt.wait_for_swap_out()  # in-flight D2H copies still read the staging buffers
        opt.release_staging()
        _evict(opt)
    else:
        put_optimizer_to_device(opt, "cpu")
    if empty_cache:
        _device_call("empty_cache")


def onload(opt: torch.optim.Optimizer) -> None:
    """Undo :func:`offload`. For a SwapOptimizer only the device scalars move back: swapped states stay on the
    host and the next step streams them in (and makes resident ones resident again). Idempotent; calling it
    without an offload is harmless."""
    if isinstance(opt, SwapOptimizer):
        _restore_scalars(opt)
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


def _evict(opt: SwapOptimizer) -> None:
    """Move what a SwapOptimizer keeps in device memory between steps to pinned host memory: resident states
    (``resident_mb``; the next step plans them resident again) and device scalars (``step`` of fused or
    capturable groups; moved back by onload or, at the latest, before the next step)."""
    if device.get_device() == "cpu":
        return
    resident = False
    scalars: dict[tuple[torch.Tensor, str], torch.device] = {}
    for p, st in opt.state.items():
        for key, value in list(st.items()):
            if not isinstance(value, torch.Tensor) or device.is_host_tensor(value):
                continue
            host = pinned_copy(value)
            if is_swapped_state(p, key, value):
                resident = True
            else:
                scalars[(p, key)] = local(value).device
            st[key] = host
    if resident:
        opt.invalidate()  # the cached plan says "resident": plan again, which moves them back
    remember_offloaded(opt, scalars)
    if resident or scalars:
        logger.debug("swapopt offload: moved {} device scalars and the resident states to host memory", len(scalars))


def offloaded_scalars(opt: SwapOptimizer) -> dict[tuple[torch.Tensor, str], torch.device]:
    """(param, key) -> device of the device scalars that offload moved to host memory and onload moves back."""
    return dict(opt.__dict__.get("_offloaded_scalars", {}))


def remember_offloaded(opt: SwapOptimizer, scalars: dict[tuple[torch.Tensor, str], torch.device]) -> None:
    """Record device scalars that are in host memory for now; onload, or the next step, moves them back."""
    if not scalars:
        return
    opt.__dict__.setdefault("_offloaded_scalars", {}).update(scalars)
    if opt.__dict__.get("_restore_hook") is None:
        opt.__dict__["_restore_hook"] = opt.register_step_pre_hook(lambda o, args, kwargs: _restore_scalars(o))


def _restore_scalars(opt: SwapOptimizer) -> None:
    """Put the device scalars that offload moved to the host back where the optimizer keeps them."""
    hook = opt.__dict__.pop("_restore_hook", None)
    if hook is not None:
        hook.remove()
    scalars = opt.__dict__.pop("_offloaded_scalars", {})
    for (p, key), where in scalars.items():
        st = opt.state.get(p)
        value = None if st is None else st.get(key)
        if isinstance(value, torch.Tensor) and device.is_host_tensor(value):
            dst = torch.empty(local(value).shape, dtype=value.dtype, device=where)
            dst.copy_(local(value))
            st[key] = wrap_like(value, dst)


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
