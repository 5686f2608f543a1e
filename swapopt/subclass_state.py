"""Tensor-subclass optimizer states (torchao's low-bit ``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``):
how one is taken apart into the plain tensors that hold its data and put back together over other tensors.

Note [subclass states]
A low-bit optimizer keeps each moment as a tensor subclass: codes (uint8, or float8) plus a scale per block
(fp32) and, for the 8- and 4-bit kinds, a 256- or 16-entry lookup table (qmap). The subclass reports the
param's shape and an "appearance" dtype (fp32), so read as a tensor it is 4 bytes an element, and a copy into
a plain tensor dequantizes it. swapopt never does either: through the subclass's ``__tensor_flatten__`` a state
becomes its parts, each a plain tensor with its own key (``part_key``), and each part is swapped as any plain
state is (its own arena range, slot region and copies), so a step moves exactly the parts' bytes. The step
sees the subclass rebuilt (``__tensor_unflatten__``, same class and metadata) over the parts' slot views, and
the optimizer's own kernels update those in place; between steps opt.state holds the subclass rebuilt over
the parts' pinned host tensors, which is also what state_dict, torch.save and DCP see.

A DTensor (FSDP2) param's state is a DTensor whose local tensor is the subclass over the local shard (torchao
builds it so). Such a state counts as a subclass state too: its parts are its local subclass's parts, and it is
rebuilt as a DTensor with the same mesh, placements, global shape and stride over the rebuilt local subclass
(swapopt.internals.dtensor_over: no copy onto the mesh's device), so every path above (swap, state_dict, DCP,
offload) sees a DTensor of the same layout over host or slot parts, as torchao's resident one is over device parts.

Every state has parts of its own (torchao makes a fresh qmap per state, never one tensor shared by params);
``parts`` still lists a tensor once per state, and swapping it once per state is correct even if two states
shared one qmap, because the step only reads it: each copy holds the same values.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from swapopt import internals

SEP = "\0"  # part keys are "<state key>\0<attr>": no state key holds a NUL, so none collides with a part key


def _dtensor_type() -> type | None:
    # DTensor is looked up, not imported (importing torch.distributed.tensor costs most of a second; none
    # exists before it is imported): swapopt.hoststate's is_dtensor, which imports this module
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _local(value: Any) -> Any:
    """The local tensor of a DTensor, else ``value`` (swapopt.internals.dtensor_local: no autograd view)."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return internals.dtensor_local(value)
    return value


def is_subclass_state(value: Any) -> bool:
    """A state that is a tensor subclass holding its data in inner plain tensors (torchao's low-bit states), or a
    DTensor whose local tensor is one (an FSDP2 param's low-bit state).

    A DTensor over a plain tensor is left out (swapopt handles it through its local shard), and so is a device's
    own tensor type that wraps memory of another device (the simulator's tensors wrap host memory): the inner
    tensors of a subclass state live on the device the state reports."""
    if not isinstance(value, torch.Tensor) or type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
        return False
    loc = _local(value)
    if loc is not value:
        return is_subclass_state(loc)
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is None:
        return False
    attrs, _ = value.__tensor_flatten__()
    inner = [getattr(value, a) for a in attrs]
    return bool(inner) and all(isinstance(t, torch.Tensor) and t.device == value.device for t in inner)


def parts(value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(attr, plain tensor) of every tensor holding ``value``'s data, in flatten order; a subclass inside a
    subclass is taken apart too (its attrs joined by '.'); a DTensor's are its local subclass's."""
    value = _local(value)
    out: list[tuple[str, torch.Tensor]] = []
    attrs, _ = value.__tensor_flatten__()
    for a in attrs:
        inner = getattr(value, a)
        if is_subclass_state(inner):
            out += [(f"{a}.{b}", t) for b, t in parts(inner)]
        else:
            out.append((a, inner))
    return out


def rebuild(value: torch.Tensor, new: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A subclass of ``value``'s class and metadata over the tensors ``new`` (attr -> tensor, as ``parts``
    names them); attrs missing from ``new`` keep ``value``'s own tensors. A DTensor gives a DTensor of its
    layout over the rebuilt local subclass."""
    loc = _local(value)
    if loc is not value:
        return internals.dtensor_over(rebuild(loc, new), value)
    attrs, meta = value.__tensor_flatten__()
    inner: dict[str, torch.Tensor] = {}
    for a in attrs:
        child = getattr(value, a)
        if is_subclass_state(child):
            prefix = a + "."
            inner[a] = rebuild(child, {k[len(prefix):]: t for k, t in new.items() if k.startswith(prefix)})
        else:
            inner[a] = new.get(a, child)
    return type(value).__tensor_unflatten__(inner, meta, value.size(), value.stride())


def map_parts(value: torch.Tensor, fn: Any) -> torch.Tensor:
    """``value`` rebuilt over ``fn(part)`` of each of its parts."""
    return rebuild(value, {a: fn(t) for a, t in parts(value)})


def nbytes(value: torch.Tensor) -> int:
    """The bytes the subclass's data takes: the sum of its parts' (not numel x its appearance dtype)."""
    return sum(t.numel() * t.element_size() for _, t in parts(value))


def part_key(key: Any, attr: str) -> str:
    return f"{key}{SEP}{attr}"


def split_key(key: Any) -> tuple[str, str] | None:
    """(state key, attr) of a part key; None for any other key."""
    if not isinstance(key, str) or SEP not in key or key.startswith(SEP):
        return None
    state_key, attr = key.split(SEP, 1)
    return state_key, attr


def staged(key: Any, value: Any, views: Mapping[str, Any]) -> dict[str, Any] | None:
    """attr -> staged entry (what the pipeline keeps per key: value seen, slot view, host view) of every part
    of the subclass state ``value`` under ``key``, when all of them are staged in ``views``; else None."""
    if not is_subclass_state(value):
        return None
    out = {}
    for a, _ in parts(value):
        entry = views.get(part_key(key, a))
        if entry is None:
            return None
        out[a] = entry
    return out


def same_parts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same class and parts of the same attrs, shapes and dtypes: ``b``'s parts can be copied into ``a``'s."""
    if type(a) is not type(b) or tuple(a.shape) != tuple(b.shape) or type(_local(a)) is not type(_local(b)):
        return False
    pa, pb = parts(a), parts(b)
    return [(n, t.shape, t.dtype) for n, t in pa] == [(n, t.shape, t.dtype) for n, t in pb]
