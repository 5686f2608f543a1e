"""Host-side optimizer state: which states swap, DTensor wrapping, pinned allocation, layout probing."""

from __future__ import annotations

import inspect
from typing import Any

import torch

import device

try:  # torch.distributed may be absent on some builds
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover - builds without distributed
    DTensor = None  # type: ignore[assignment,misc]

# Optimizers whose every non-scalar state has the param's shape and whose update of an element reads
# only that element: one param may be split across chunks and stepped as flat pieces.
ELEMENTWISE: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adadelta")
    if hasattr(torch.optim, name)
)

# Per-param scalar bookkeeping that torch optimizers keep as 0-dim tensors next to the big states:
# Adam-family "step", NAdam "mu_product", ASGD "eta" and "mu". They are read on the host every step
# (non-capturable paths call .item() on them), tiny, and cloned per piece, so they never swap.
SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor; plain tensors unchanged."""
    if is_dtensor(t):
        return t._local_tensor  # no autograd edge, unlike to_local() on a param
    return t


def wrap_like(ref: torch.Tensor, host_local: torch.Tensor) -> torch.Tensor:
    """A DTensor over ``host_local`` with ``ref``'s mesh, placements, global shape and stride
    (``ref`` is the param, or a state with its own layout); plain tensors are returned unchanged."""
    if not is_dtensor(ref):
        return host_local
    return DTensor.from_local(
        host_local,
        ref.device_mesh,
        ref.placements,
        run_check=False,
        shape=ref.shape,
        stride=ref.stride(),
    )


def new_host_like(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pinned host memory for one param-shaped state of ``param``, wrapped like the param (a DTensor
    over the host shard for DTensor params)."""
    loc = local(param)
    return wrap_like(param, device.pinned_empty(tuple(loc.shape), dtype=dtype or loc.dtype))


def is_swapped_state(param: torch.Tensor, key: str, value: Any) -> bool:
    """Tensor states other than the scalar step-like ones live on the host between steps."""
    if not isinstance(value, torch.Tensor) or key in SCALAR_KEYS:
        return False
    return value.dim() > 0 or param.dim() == 0


def state_nbytes(value: torch.Tensor) -> int:
    loc = local(value)
    return loc.numel() * loc.element_size()


def _constructor_kwargs(cls: type, defaults: dict) -> dict:
    """The defaults the constructor accepts (AdamW keeps ``decoupled_weight_decay`` in defaults, say)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def probe_elem_bytes(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor, step_fn) -> int | None:
    """Swapped state bytes per param element, found by stepping a throwaway optimizer of the same class
    and hyperparameters once over a tiny param of the same dtype, ndim and device.

    Returns None when the probe cannot run (a constructor with required arguments, say); the caller
    then estimates. ``step_fn`` is the class's step without the Optimizer hook wrapper, so global step
    hooks do not see the probe.
    """
    loc = local(param)
    tiny = torch.zeros((4,) * loc.dim(), dtype=loc.dtype, device=loc.device)
    tiny.grad = torch.full_like(tiny, 1e-3)
    try:
        probe = type(optimizer)([tiny], **_constructor_kwargs(type(optimizer), optimizer.defaults))
        probe.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        probe.param_groups[0]["params"] = [tiny]
        step_fn(probe)
    except Exception:  # noqa: BLE001 - any failure only means "unknown"
        return None
    nbytes = sum(state_nbytes(v) for k, v in probe.state[tiny].items() if is_swapped_state(tiny, k, v))
    return -(-nbytes // tiny.numel())
