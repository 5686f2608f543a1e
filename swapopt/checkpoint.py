"""state_dict / load_state_dict for SwapOptimizer: host tensors out, host tensors in, no device memory.

``torch.optim.Optimizer.load_state_dict`` casts every state to ``param.device``: for swapped states that
would allocate all of them on the accelerator at once (the resume-time OOM this module exists to avoid).
Here loaded values are copied straight into the pinned host tensors the swap engine streams from.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

import device
from swapopt import hoststate
from swapopt.hoststate import ELEMENTWISE, is_dtensor

def state_dict(opt) -> dict[str, Any]:
    """The inner optimizer's state dict, its swapped states being the host tensors themselves.

    For DTensor params the states are DTensors over the host shards (the param's mesh, placements, global
    shape and stride), which DCP saves and loads in place.
    """
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    # In-flight D2H copies still write these tensors; reading before they land gives a mix of two steps.
    opt.wait_for_swap_out()
    # Between steps the swapped states are the pinned host tensors (DTensors over host shards for DTensor
    # params), so the inner optimizer's own state_dict already has the right format and copies nothing.
    sd = opt.optimizer.state_dict()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        result = hook(opt, sd)
        if result is not None:
            sd = result
    return sd


@dataclass
class _Copy:
    """One state to fill in place: ``src`` (this rank's piece) goes into ``dst`` (a host tensor for swapped
    states; the existing tensor for small ones)."""

    param: torch.Tensor
    key: Any
    src: torch.Tensor
    dst: torch.Tensor | None  # None: allocate a host tensor of ``dtype``
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None  # of that new host tensor; None: like the param (and its layout)


def load_state_dict(opt, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` into ``opt`` without moving states to ``param.device``.

    Everything is validated before anything changes: on error the optimizer is left as it was.
    """
    state_dict = state_dict.copy()
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result

    groups = opt.param_groups
    saved_groups = deepcopy(state_dict["param_groups"])
    _check_groups(groups, saved_groups)
    params = list(chain.from_iterable(g["params"] for g in groups))
    id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups), params))
    index_of = {id(p): i for i, p in enumerate(params)}
    saved_state = state_dict["state"]
    unknown = [k for k in saved_state if k not in id_map]
    if unknown:
        raise ValueError(f"optimizer state dict has state for ids {unknown!r} that no param group lists")

    # torch keeps ``step`` on the device only for fused or capturable groups.
    step_on_device = {id(p): bool(g.get("fused") or g.get("capturable")) for g in groups for p in g["params"]}
    # Validate and plan every copy before touching the optimizer.
    plans: dict[torch.Tensor, tuple[list[_Copy], dict[Any, Any]]] = {}
    for saved_id, values in saved_state.items():
        p = id_map[saved_id]
        if not isinstance(values, dict):
            raise ValueError(f"param {index_of[id(p)]} ({saved_id!r}): state must be a dict, got {type(values)}")
        plans[p] = _plan_param(opt, p, index_of[id(p)], values, step_on_device[id(p)])

    # New host tensors are allocated before anything is written, so a failed allocation changes nothing.
    for copies, _ in plans.values():
        for c in copies:
            if c.dst is None:
                c.dst = hoststate.new_host_like(c.param, c.dtype) if c.shape is None \
                    else device.pinned_empty(c.shape, dtype=c.dtype)
    opt.wait_for_swap_out()

    for p in params:
        if p not in plans and p in opt.state:
            del opt.state[p]
    for p, (copies, others) in plans.items():
        new_state: dict[Any, Any] = {}
        for c in copies:
            hoststate.local(c.dst).copy_(c.src)
            new_state[c.key] = c.dst
        new_state.update(others)
        # The dict itself is kept: the engine and DCP may hold references to it.
        st = opt.state[p]
        st.clear()
        st.update(new_state)

    for group, saved in zip(groups, saved_groups):
        saved["params"] = group["params"]
        if "param_names" in group and "param_names" not in saved:
            saved["param_names"] = group["param_names"]
        # Updated in place: SwapOptimizer and its inner optimizer share these dicts.
        group.clear()
        group.update(saved)

    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)


def _check_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer has {len(groups)}"
        )
    for i, (g, s) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(s["params"]):
            raise ValueError(
                f"parameter group {i}: loaded state dict lists {len(s['params'])} params, "
                f"the optimizer has {len(g['params'])}"
            )


def _plan_param(opt, p: torch.Tensor, index: int, values: dict[Any, Any],
                step_on_device: bool) -> tuple[list[_Copy], dict[Any, Any]]:
    current = opt.state.get(p, {})
    copies: list[_Copy] = []
    others: dict[Any, Any] = {}
    for key, value in values.items():
        where = f"param {index}, state {key!r}"
        if isinstance(value, torch.Tensor) and hoststate.is_swapped_state(p, key, value):
            existing = current.get(key)
            if not (isinstance(existing, torch.Tensor) and device.is_host_tensor(existing)):
                existing = None
            copies.append(_plan_swapped(opt, p, key, value, existing, where))
        elif isinstance(value, torch.Tensor):
            existing = current.get(key)
            if isinstance(existing, torch.Tensor) and existing.shape == value.shape and not is_dtensor(value):
                # Written in place: keeps the tensor (and its device) that the optimizer already uses.
                if not torch.can_cast(value.dtype, existing.dtype):
                    raise ValueError(f"{where}: dtype {value.dtype} cannot be cast to {existing.dtype}")
                copies.append(_Copy(param=p, key=key, src=value, dst=existing, dtype=existing.dtype))
            else:
                others[key] = _small_tensor(p, key, value, step_on_device)
        else:
            others[key] = deepcopy(value)
    return copies, others


def _plan_swapped(opt, p: torch.Tensor, key: Any, value: torch.Tensor, existing: torch.Tensor | None,
                  where: str) -> _Copy:
    # The layout the value must have: the host tensor it goes into, else the param's.
    ref: torch.Tensor | None = existing if existing is not None else p
    if tuple(value.shape) != tuple(ref.shape):
        # Only a non-element-wise optimizer (Adafactor's factored states) has states shaped unlike the param.
        if existing is not None or is_dtensor(p) or isinstance(opt.optimizer, ELEMENTWISE):
            raise ValueError(f"{where}: shape {tuple(value.shape)} does not match {tuple(ref.shape)}")
        ref = None
    if existing is not None:
        dtype = existing.dtype
    else:
        dtype = p.dtype if p.is_floating_point() else value.dtype
    if not torch.can_cast(value.dtype, dtype):
        raise ValueError(f"{where}: dtype {value.dtype} cannot be cast to {dtype}")
    if ref is None:
        if is_dtensor(value):
            raise ValueError(f"{where}: value is a DTensor but the param is not")
        return _Copy(param=p, key=key, src=value, dst=None, dtype=dtype, shape=tuple(value.shape))
    return _Copy(param=p, key=key, src=_local_piece(ref, value, where), dst=existing, dtype=dtype)


def _local_piece(ref: torch.Tensor, value: torch.Tensor, where: str) -> torch.Tensor:
    """This rank's part of ``value`` (global shape checked) laid out like ``ref``: the local shard of a
    DTensor, the slice of a full tensor that this rank owns, or the value itself."""
    if is_dtensor(value):
        if not is_dtensor(ref):
            raise ValueError(f"{where}: value is a DTensor but the param is not")
        if value.device_mesh != ref.device_mesh or tuple(value.placements) != tuple(ref.placements):
            raise ValueError(
                f"{where}: DTensor layout {value.placements} on {value.device_mesh} differs from "
                f"{ref.placements} on {ref.device_mesh}; load through torch.distributed.checkpoint to reshard"
            )
        return hoststate.local(value)
    if is_dtensor(ref):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(value.shape, ref.device_mesh, ref.placements)
        piece = value
        for dim, (size, start) in enumerate(zip(shape, offset)):
            piece = piece.narrow(dim, start, size)
        return piece
    return value


def _small_tensor(p: torch.Tensor, key: Any, value: torch.Tensor, step_on_device: bool) -> torch.Tensor:
    """A new unswapped tensor state (``step`` and other scalars), placed as torch places it."""
    target = hoststate.local(p)
    if key == "step":
        if step_on_device:
            return value.to(dtype=torch.float32, device=target.device)
        if value.dim() == 0:
            # A fresh CPU scalar, as the optimizers create it, not an alias of the caller's tensor.
            return torch.tensor(value.item(), dtype=value.dtype)
        return value.clone()
    dtype = target.dtype if target.is_floating_point() else value.dtype
    return value.to(dtype=dtype, device=target.device)
