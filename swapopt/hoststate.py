"""Host-side optimizer state: which states swap, DTensor wrapping, pinned allocation, layout probing."""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any

import torch

import device
from swapopt import internals, perparam, subclass_state
from swapopt.internals import raw_step  # noqa: F401 - re-exported: statespec and probes step raw
from swapopt.perparam import TORCH_ELEMENTWISE

# torch's optimizers whose every non-scalar state has the param's shape and whose update of an element
# reads only that element: one param may be split across chunks and stepped as flat pieces (the list
# lives in swapopt.perparam, with the registry for third-party ones).
ELEMENTWISE: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in TORCH_ELEMENTWISE if hasattr(torch.optim, name)
)

# Per-param scalar bookkeeping that torch optimizers keep as 0-dim tensors next to the big states:
# Adam-family "step", NAdam "mu_product", ASGD "eta" and "mu". They are read on the host every step
# (non-capturable paths call .item() on them), tiny, and cloned per piece, so they never swap.
SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def is_dtensor(t: Any) -> bool:
    # No DTensor exists before torch.distributed.tensor is imported, and importing it costs most of a
    # second (its op registrations): look it up instead of importing it with swapopt.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor; plain tensors unchanged."""
    if is_dtensor(t):
        return internals.dtensor_local(t)
    return t


def wrap_like(ref: torch.Tensor, host_local: torch.Tensor) -> torch.Tensor:
    """A DTensor over ``host_local`` with ``ref``'s mesh, placements, global shape and stride
    (``ref`` is the param, or a state with its own layout); plain tensors are returned unchanged."""
    if not is_dtensor(ref):
        return host_local
    # Not DTensor.from_local: it moves a local tensor of another device type onto the mesh's device (a host
    # shard under a cuda mesh would be copied back to the device).
    return internals.dtensor_over(host_local, ref)


def is_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one storage range without gaps or overlaps (any dim order)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda x: x[1]):
        if size == 0:
            return True
        if stride != expected:
            return False
        expected *= size
    return True


def layout_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides torch gives ``empty_like(t)`` (preserve_format): t's own when dense, else contiguous.
    Fused kernels pair param, grad and state elements by memory position, so states keep this layout."""
    if is_dense(t):
        return tuple(t.stride())
    strides, acc = [], 1
    for size in reversed(t.shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, both dense, same memory order: flat memory-order ranges of both pair element by element."""
    if a.shape != b.shape or not (is_dense(a) and is_dense(b)):
        return False
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor in memory (storage) order, not logical order."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def pinned_like(
    shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype, pin: bool = True
) -> torch.Tensor:
    """Pinned host memory with the given shape and dense strides, taking its size in host RAM (device.host_empty:
    not the power of two of the caching host allocator, Note [host memory at its true size] in device).
    ``pin=False``: pinned later by device.pin_host (a master the first step moves into an arena, say)."""
    numel = math.prod(shape)
    return device.host_empty(numel * dtype.itemsize, pin=pin).view(dtype).as_strided(shape, strides)


def gather_range(dst: torch.Tensor, src: torch.Tensor, start: int, stop: int) -> None:
    """Copy elements [start, stop) of ``src`` in row-major order into the 1-D ``dst``, without
    materializing ``src`` whole: a few strided copies of whole sub-blocks plus the ragged ends."""
    if stop <= start:
        return
    if src.dim() == 0:
        dst.copy_(src.reshape(1))
        return
    inner = math.prod(src.shape[1:])
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)
    if i0 == i1:
        gather_range(dst, src[i0], r0, r1)
        return
    pos = 0
    if r0:
        pos = inner - r0
        gather_range(dst[:pos], src[i0], r0, inner)
        i0 += 1
    if i1 > i0:
        n = (i1 - i0) * inner
        dst[pos : pos + n].view((i1 - i0, *src.shape[1:])).copy_(src[i0:i1])
        pos += n
    if r1:
        gather_range(dst[pos:], src[i1], 0, r1)


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """Dim permutation that makes dense ``t`` contiguous (outermost dim first)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))


def pinned_empty_like(value: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pinned host memory shaped, typed (``dtype`` if given) and laid out (layout_strides) like ``value``'s
    local tensor, wrapped like ``value`` (a DTensor over the host shard for DTensors). A tensor-subclass state
    gets the same subclass over pinned parts, a DTensor one a DTensor of its layout over that (Note [subclass
    states] in swapopt.subclass_state)."""
    if subclass_state.is_subclass_state(value):
        if dtype is not None and dtype != value.dtype:
            raise TypeError(f"a {type(value).__name__} state cannot be made {dtype}: its parts are quantized")
        return subclass_state.map_parts(value, pinned_empty_like)
    src = local(value)
    return wrap_like(value, pinned_like(tuple(src.shape), layout_strides(src), dtype or src.dtype))


def pinned_copy(value: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``value`` with its dense layout (a DTensor over the host shard for DTensors)."""
    # src's own strides when dense (channels_last stays channels_last), else contiguous.
    if subclass_state.is_subclass_state(value):  # part by part: a copy into a plain tensor would dequantize
        return subclass_state.map_parts(value, pinned_copy)
    dst = pinned_empty_like(value)
    local(dst).copy_(local(value))
    return dst


def new_host_like(param: torch.Tensor, dtype: torch.dtype | None = None, pin: bool = True) -> torch.Tensor:
    """Pinned host memory for one param-shaped state of ``param`` with the param's dense layout, wrapped
    like the param (a DTensor over the host shard for DTensor params); ``pin``: see pinned_like."""
    loc = local(param)
    return wrap_like(param, pinned_like(tuple(loc.shape), layout_strides(loc), dtype or loc.dtype, pin))


def is_swapped_state(param: torch.Tensor, key: str, value: Any) -> bool:
    """Tensor states other than the scalar step-like ones live on the host between steps."""
    if not isinstance(value, torch.Tensor) or key in SCALAR_KEYS:
        return False
    return value.dim() > 0 or param.dim() == 0


def state_nbytes(value: torch.Tensor) -> int:
    if subclass_state.is_subclass_state(value):  # its parts' bytes, not numel x its appearance dtype
        return subclass_state.nbytes(value)
    loc = local(value)
    return loc.numel() * loc.element_size()


def constructor_kwargs(cls: type, defaults: dict) -> dict:
    """The defaults the constructor accepts (AdamW keeps ``decoupled_weight_decay`` in defaults, say)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def probe_states(
    optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor, step_fn, dtype: torch.dtype | None = None
) -> tuple[int, tuple[tuple[str, torch.dtype, bool], ...]] | None:
    """Swapped state bytes per param element and the swapped states' (key, dtype, shaped like the
    param), found by stepping a throwaway optimizer of the same class and hyperparameters once over a
    tiny param of the same dtype (``dtype`` when the optimizer steps another tensor for it: an fp32 master),
    ndim and device.

    Returns None when the probe cannot run (a constructor with required arguments, say); the caller
    then estimates. ``step_fn`` is the class's step without the Optimizer hook wrapper, so global step
    hooks do not see the probe.
    """
    loc = local(param)
    tiny = torch.zeros((4,) * loc.dim(), dtype=dtype or loc.dtype, device=loc.device)
    tiny.grad = torch.full_like(tiny, 1e-3)
    try:
        probe = type(optimizer)([tiny], **constructor_kwargs(type(optimizer), optimizer.defaults))
        probe.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        probe.param_groups[0]["params"] = [tiny]
        step_fn(probe)
    except Exception:  # noqa: BLE001 - any failure only means "unknown"
        return None
    swapped = [(k, v) for k, v in probe.state[tiny].items() if is_swapped_state(tiny, k, v)]
    nbytes = sum(state_nbytes(v) for _, v in swapped)
    spec = tuple((k, v.dtype, tuple(v.shape) == tuple(tiny.shape)) for k, v in swapped)
    return -(-nbytes // tiny.numel()), spec


def sized_probe(
    optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor, step_fn, dtype: torch.dtype | None = None
) -> tuple[int, int] | None:
    """(bytes, count) of the swapped states the first step creates for ``param``, counting each part of a subclass
    state (Note [subclass states] in swapopt.subclass_state), when their kind depends on the param's size; None
    when it does not (probe_states' bytes per element hold), or when this probe cannot tell.

    An optimizer outside torch.optim may choose its states by the param's size: torchao's low-bit ones quantize
    a state only for params of at least 4096 elements, a multiple of the block size, so probe_states' tiny
    param sees fp32 states. This probe steps a throwaway optimizer once over a meta param of the real local
    shape (meta tensors take no memory and run no kernel), under torch.compiler's force_eager stance (a probe
    never compiles anything: torchao compiles its update per shape otherwise). torch's own optimizers, and any
    registered element-wise (its states shaped like the param by contract), keep the same kinds at every size and
    are not probed again.
    """
    cls = type(optimizer)
    if cls.__module__.split(".")[:2] == ["torch", "optim"] or perparam.is_elementwise(cls):
        return None
    loc = local(param)
    # factories without a device (torchao's ``step``) make host scalars, which mix with meta tensors
    with torch.device("cpu"):
        meta = torch.zeros(tuple(loc.shape), dtype=dtype or loc.dtype, device="meta")
        meta.grad = torch.zeros_like(meta)
        settings = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}
        try:
            with torch.compiler.set_stance("force_eager"):
                probe = cls([meta], **constructor_kwargs(cls, optimizer.defaults))
                probe.param_groups[0].update(settings)
                probe.param_groups[0]["params"] = [meta]
                step_fn(probe)
        except Exception:  # noqa: BLE001 - any failure only means "unknown"
            return None
    swapped = [v for k, v in probe.state[meta].items() if is_swapped_state(meta, k, v)]
    if not any(subclass_state.is_subclass_state(v) for v in swapped):
        return None
    count = sum(len(subclass_state.parts(v)) if subclass_state.is_subclass_state(v) else 1 for v in swapped)
    return sum(state_nbytes(v) for v in swapped), count
