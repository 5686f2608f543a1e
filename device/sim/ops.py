"""What an aten op does to memory, read from its schema: which tensor arguments it reads, writes in place,
writes as out=, or only looks at; whether it creates tensors; which ops copy, allocate or make the host wait."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch


def _packets(*names: str) -> frozenset:
    """The aten op packets of these names that this torch version has."""
    return frozenset(p for p in (getattr(torch.ops.aten, n, None) for n in names) if p is not None)


_COPY = _packets("copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "copy", "_foreach_copy_", "_foreach_copy")
# Allocation without a kernel: no launch, no data access.
_ALLOC_ONLY = _packets("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")
# Schema says "writes self" but only metadata changes.
_METADATA = _packets(
    "set_", "resize_", "resize_as_", "as_strided_", "detach_", "squeeze_", "unsqueeze_", "t_", "transpose_",
    "swapdims_", "_resize_output_", "record_stream",
)  # fmt: skip
# Output size depends on data: the host waits for the result.
_SYNC = _packets(
    "nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "_local_scalar_dense"
)
# Factories that read only the shape and dtype of their tensor argument.
_LIKE = _packets(
    "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones",
    "new_full",
) | _ALLOC_ONLY  # fmt: skip
_LOCAL_SCALAR = _packets("_local_scalar_dense")
_RESIZE = _packets("resize_")


@dataclass(frozen=True)
class OpInfo:
    name: str
    # (position, name, role) of tensor-like arguments; role: "r" read, "w" read-modify-write (in place),
    # "o" write only (out=), "v" no data access (view source, shape template, metadata change)
    roles: tuple[tuple[int, str, str], ...]
    new_outputs: bool  # returns a tensor that aliases no input
    value_return: bool  # returns a Python value computed from data (.item(), equal): the host waits
    copy: bool
    alloc_only: bool
    sync: bool
    local_scalar: bool
    resize: bool


@functools.cache
def op_info(func: Any) -> OpInfo:
    schema = func._schema
    packet = func.overloadpacket
    metadata = packet in _METADATA or packet in _LIKE
    # Collectives' schemas carry no alias annotations, yet they write their tensors in place (every rank
    # but the source receives data) and return those same tensors.
    collective = schema.name.startswith("c10d::")
    roles = []
    for i, arg in enumerate(schema.arguments):
        if "Tensor" not in str(arg.type):
            continue
        alias = arg.alias_info
        if collective:
            role = "w"
        elif metadata or (alias is not None and not alias.is_write):
            role = "v"
        elif alias is not None:
            role = "o" if arg.kwarg_only else "w"
        else:
            role = "r"
        roles.append((i, arg.name, role))
    returns = schema.returns
    return OpInfo(
        name=str(func),
        roles=tuple(roles),
        new_outputs=not collective and any(r.alias_info is None and "Tensor" in str(r.type) for r in returns),
        value_return=not collective and any("Tensor" not in str(r.type) for r in returns),  # Work: no wait
        copy=packet in _COPY,
        alloc_only=packet in _ALLOC_ONLY,
        sync=packet in _SYNC,
        local_scalar=packet in _LOCAL_SCALAR,
        resize=packet in _RESIZE,
    )


def tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _span(t: torch.Tensor) -> int:
    """Elements from a non-empty view's first element to its last, inclusive."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """Bytes of its storage a view can touch: [first element, last element + 1)."""
    numel = t.numel()
    if numel == 0:
        return None
    itemsize = t.element_size()
    offset = t.storage_offset()
    # A contiguous view spans exactly its elements (the common case: no walk over sizes and strides).
    span = numel if t.is_contiguous() else _span(t)
    return offset * itemsize, (offset + span) * itemsize


def strided_layout(t: torch.Tensor) -> tuple | None:
    """(sizes, strides, storage offset, itemsize) when t's elements leave gaps in its byte span, else None."""
    if t.is_contiguous() or t.numel() <= 1:
        return None
    if _span(t) == t.numel():
        return None  # a permutation of a dense block touches every byte of its span
    return tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.element_size()


# id(op) -> (the op, its argument names). Keyed by id: functools.cache would hash the op in Python (torch/_ops.py)
# on every call; the op is kept so that its id stays its own.
_ARG_NAMES: dict[int, tuple[Any, tuple[str, ...]]] = {}


def _arg_names(func: Any) -> tuple[str, ...]:
    known = _ARG_NAMES.get(id(func))
    if known is None:
        known = _ARG_NAMES[id(func)] = (func, tuple(a.name for a in func._schema.arguments))
    return known[1]


def arg_value(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The value passed for argument `name`, positionally or by keyword."""
    names = _arg_names(func)
    if name in names:
        position = names.index(name)
        if position < len(args):
            return args[position]
    return kwargs.get(name, default)


@functools.cache
def fresh_returns(func: Any) -> tuple[bool, ...]:
    """Per return of `func`'s schema: whether it aliases no input (read once per op: a schema is rebuilt on
    every access)."""
    return tuple(ret.alias_info is None for ret in func._schema.returns)


def new_outputs(func: Any, out: Any) -> list[torch.Tensor]:
    """Returned tensors that alias no input (dense CPU tensors only)."""
    return fresh_outputs(fresh_returns(func), out)


def fresh_outputs(fresh: tuple[bool, ...], out: Any) -> list[torch.Tensor]:
    """new_outputs, given which returns alias no input (see fresh_returns)."""
    if type(out) is torch.Tensor and fresh[:1] == (True,):  # the common case: one new tensor
        return [out] if out.is_cpu and out.layout is torch.strided else []
    values = out if isinstance(out, (tuple, list)) and len(fresh) > 1 else (out,)
    found = []
    for new, value in zip(fresh, values):
        if new:
            found.extend(t for t in tensors(value) if t.is_cpu and t.layout is torch.strided)
    return found


def factory_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes a factory (empty, zeros, full, empty_strided...) will allocate; 0 when the size is not given."""
    size = arg_value(func, args, kwargs, "size")
    if not isinstance(size, (list, tuple)) or not all(isinstance(s, int) for s in size):
        return 0
    dtype = arg_value(func, args, kwargs, "dtype") or torch.get_default_dtype()
    stride = arg_value(func, args, kwargs, "stride")
    if isinstance(stride, (list, tuple)) and len(stride) == len(size):
        numel = 0 if 0 in size else 1 + sum((s - 1) * st for s, st in zip(size, stride))
    else:
        numel = math.prod(size)
    return numel * dtype.itemsize
