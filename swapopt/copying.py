"""copy.deepcopy and pickling of SwapOptimizer.

torch optimizers pickle as their defaults, state and param groups (``Optimizer.__getstate__``); hooks are
not part of the copy. A SwapOptimizer pickles as its inner optimizer plus its settings: streams, events
and staging belong to one process and one transfer engine, so the copy builds its own
(SwapOptimizerOperate) and moves the states it received into pinned host memory of its own. deepcopy
goes through the same two functions, with the deepcopy memo applied to the inner optimizer, so params
are copied or shared exactly as for a plain torch optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import device
from swapopt.config import KNOBS
from swapopt.eviction import offloaded_scalars, remember_offloaded
from swapopt.hoststate import is_swapped_state, local, pinned_copy
from swapopt.masters import MASTER


def getstate(opt: Any) -> dict[str, Any]:
    """What a copy needs: the inner optimizer, the settings and the step counters. In-flight swap-outs are
    waited for first, so the copy reads each state after the last step's write."""
    opt.wait_for_swap_out()
    return {
        "optimizer": opt.optimizer,
        # With overlap_forward the copy needs its own attach(model), as the original did.
        "settings": opt.settings.model_dump(),
        "masters": _masters_of(opt),
        "stats": opt._stats.model_dump(),
        # Device scalars an offload moved to the host: the copy moves its own back at onload or its next step.
        "offloaded": [(p, key, str(dev)) for (p, key), dev in offloaded_scalars(opt).items()],
    }


def setstate(opt: Any, state: dict[str, Any], init: Callable[..., None]) -> None:
    """Rebuild ``opt`` (created without __init__ by pickle or deepcopy) around the copied inner optimizer;
    ``init`` is SwapOptimizer's own __init__, not type(opt)'s: class forms built from params take other
    arguments."""
    inner = state["optimizer"]
    _pin_states(inner)
    knobs = state.get("settings")
    if knobs is None:  # a copy made before the knobs were kept as one settings object
        knobs = {k: state[k] for k in KNOBS if k in state}
    init(opt, inner, **knobs)
    masters = opt._ctx.masters
    for p, master, ready in state.get("masters", ()):
        masters.set(p, master if device.get_device() == "cpu" else pinned_copy(master))
        if ready:
            masters.ready.add(p)
    opt._stats = type(opt._stats).model_validate(state["stats"])
    remember_offloaded(opt, {(p, key): torch.device(dev) for p, key, dev in state.get("offloaded", ())})


def _masters_of(opt: Any) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(param, master, holds a value) per master (Note [master weights]): the params are the inner
    optimizer's, so a copy pairs its copied params with copied masters."""
    masters = opt._ctx.masters
    return [(p, holder[MASTER], p in masters.ready) for p, holder in masters.host.items()]


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
