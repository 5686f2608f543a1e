"""What a SwapOptimizer keeps on the device between steps, moved to the host for another engine's phase.

Swapped states already live in pinned host memory; between steps the device holds only the staging buffers
(released by the transfer engine), resident states (``resident_mb``) and device ``step`` scalars of fused
or capturable groups. ``evict`` moves the last two into pinned host memory and remembers which scalars
came from the device; ``restore_scalars`` (onload, or at the latest a step pre-hook) moves those back.
Resident states are not moved back: the next step plans them resident again. swapopt.offload drives this
for a SwapOptimizer and gives a plain optimizer the classic treatment.
"""

from __future__ import annotations

from typing import Any

import torch
from loguru import logger

import device
from swapopt.hoststate import is_swapped_state, local, pinned_copy, wrap_like

# Kept in the optimizer's __dict__ (so copies and pickles see them only through swapopt.copying):
_SCALARS = "_offloaded_scalars"  # (param, key) -> device the scalar came from
_HOOK = "_restore_hook"  # the step pre-hook that restores them if onload is never called


def evict(opt: Any) -> None:
    """Move resident states and device scalars of ``opt`` (a SwapOptimizer) to pinned host memory."""
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


def offloaded_scalars(opt: Any) -> dict[tuple[torch.Tensor, str], torch.device]:
    """(param, key) -> device of the device scalars that evict moved to host memory."""
    return dict(opt.__dict__.get(_SCALARS, {}))


def remember_offloaded(opt: Any, scalars: dict[tuple[torch.Tensor, str], torch.device]) -> None:
    """Record device scalars that are in host memory for now; onload, or the next step, moves them back."""
    if not scalars:
        return
    opt.__dict__.setdefault(_SCALARS, {}).update(scalars)
    if opt.__dict__.get(_HOOK) is None:
        opt.__dict__[_HOOK] = opt.register_step_pre_hook(lambda o, args, kwargs: restore_scalars(o))


def restore_scalars(opt: Any) -> None:
    """Put the device scalars that evict moved to the host back where the optimizer keeps them."""
    hook = opt.__dict__.pop(_HOOK, None)
    if hook is not None:
        hook.remove()
    scalars = opt.__dict__.pop(_SCALARS, {})
    for (p, key), where in scalars.items():
        # The inner's dict: this runs as a step pre-hook, where the public `state` would wait (Note [reading states]).
        st = opt.optimizer.state.get(p)
        value = None if st is None else st.get(key)
        if isinstance(value, torch.Tensor) and device.is_host_tensor(value):
            dst = torch.empty(local(value).shape, dtype=value.dtype, device=where)
            dst.copy_(local(value))
            st[key] = wrap_like(value, dst)


def device_call(name: str) -> None:
    """Call the device module's ``name`` where it has one (torch.cpu, no accelerator, has synchronize but no
    empty_cache)."""
    fn = getattr(device.get_torch_device_module(), name, None)
    if fn is not None:
        fn()
