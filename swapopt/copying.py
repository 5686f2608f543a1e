"""copy.deepcopy and pickling of SwapOptimizer.

torch optimizers pickle as their defaults, state and param groups (``Optimizer.__getstate__``); hooks are
not part of the copy. A SwapOptimizer pickles as its inner optimizer plus its settings: streams, events
and staging belong to one process and one transfer engine, so the copy builds its own
(SwapOptimizerOperate) and moves the states it received into pinned host memory of its own. deepcopy
goes through the same two functions, with the deepcopy memo applied to the inner optimizer, so params
are copied or shared exactly as for a plain torch optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

import device
from swapopt.hoststate import is_swapped_state, local, pinned_empty_like


def getstate(opt: Any) -> dict[str, Any]:
    """What a copy needs: the inner optimizer, the settings and the step counters. In-flight swap-outs are
    waited for first, so the copy reads each state after the last step's write."""
    from swapopt.offload import offloaded_scalars  # offload imports the optimizer, which imports this module

    opt.wait_for_swap_out()
    return {
        "optimizer": opt.optimizer,
        "swap_optimizer_times": opt.swap_optimizer_times,
        "chunk_mb": opt.chunk_mb,
        "slots": opt.operate.slots,
        "resident_mb": opt.resident_mb,
        "per_param": opt.per_param,
        "overlap_forward": opt.overlap_forward,  # the copy needs its own attach(model), as the original did
        "prefetch": opt.prefetch_enabled,
        "stats": opt._stats.model_dump(),
        # Device scalars an offload moved to the host: the copy moves its own back at onload or its next step.
        "offloaded": [(p, key, str(dev)) for (p, key), dev in offloaded_scalars(opt).items()],
    }


def setstate(opt: Any, state: dict[str, Any]) -> None:
    """Rebuild ``opt`` (created without __init__ by pickle or deepcopy) around the copied inner optimizer."""
    # Imported here: the optimizer module imports this one, and offload imports the optimizer.
    from swapopt.offload import remember_offloaded
    from swapopt.optimizer import SwapOptimizer

    inner = state["optimizer"]
    _pin_states(inner)
    # SwapOptimizer's own __init__, not type(opt)'s: class forms built from params take other arguments.
    SwapOptimizer.__init__(
        opt,
        inner,
        swap_optimizer_times=state["swap_optimizer_times"],
        chunk_mb=state["chunk_mb"],
        slots=state["slots"],
        resident_mb=state["resident_mb"],
        per_param=state.get("per_param", False),
        overlap_forward=state.get("overlap_forward", False),  # absent in copies made before these knobs
        prefetch=state.get("prefetch", False),
    )
    opt._stats = type(opt._stats).model_validate(state["stats"])
    remember_offloaded(opt, {(p, key): torch.device(dev) for p, key, dev in state.get("offloaded", ())})


def pinned_copy(value: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``value`` with its dense layout (a DTensor over the host shard for DTensors)."""
    # src's own strides when dense (channels_last stays channels_last), else contiguous.
    dst = pinned_empty_like(value)
    local(dst).copy_(local(value))
    return dst


def _pin_states(inner: torch.optim.Optimizer) -> None:
    """Unpickled or deep-copied host tensors are ordinary pageable memory, and a copied resident state sits
    in device memory: move every swapped state into pinned host memory (the next step makes resident ones
    resident again)."""
    if device.get_device() == "cpu":
        return  # no accelerator: states stay where the optimizer keeps them
    for p, st in inner.state.items():
        if not isinstance(p, torch.Tensor):
            continue
        for key, value in list(st.items()):
            if not is_swapped_state(p, key, value):
                continue
            if device.is_host_tensor(value) and local(value).is_pinned():
                continue
            st[key] = pinned_copy(value)
