"""What per-param state an optimizer needs, learned from the optimizer itself.

A throwaway optimizer of the same class and hyperparameters steps a tiny host param once; the state it
creates gives the keys and their shapes relative to the param's. Stepping it again with one key removed
(or set to None) tells whether the step can do without that key. ``load_state_dict`` checks a state dict
against this, so a checkpoint the optimizer cannot step with is refused at load, naming param and key,
instead of failing half-way through a later step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger

import device
from swapopt.hoststate import constructor_kwargs as _ctor_kwargs, local
from swapopt.hoststate import raw_step as _raw_step

# Probe dims: distinct and never 1, so each dim of a state maps back to the param dim it came from
# (Adafactor's row and column factors, say). Beyond four dims the product grows too fast: then only
# states shaped exactly like the probe param are mapped.
_DIMS = (2, 3, 5, 7)

# Group flags that pick a kernel (or the device a value lives on), not which states exist: the probe runs
# the plain for-loop path on the host, so checking a state dict never allocates device memory.
_HOST_PATH = {"foreach": False, "fused": False, "capturable": False, "differentiable": False}


@dataclass(frozen=True)
class KeySpec:
    """One state key. ``dims``: the expected shape, each entry a size (>= 0) or ``-1 - i`` for the param's
    dim i; None when the shape is not known. ``required``: a step fails without the key. ``none_ok``: a step
    accepts None for it (SGD's momentum buffer)."""

    dims: tuple[int, ...] | None
    required: bool
    none_ok: bool

    def shape_for(self, param_shape: tuple[int, ...]) -> tuple[int, ...] | None:
        if self.dims is None:
            return None
        return tuple(param_shape[-1 - d] if d < 0 else d for d in self.dims)


def _dims(value: torch.Tensor, tiny: torch.Tensor) -> tuple[int, ...] | None:
    shape = tuple(local(value).shape)
    if shape == tuple(tiny.shape):
        return tuple(-1 - i for i in range(tiny.dim()))
    if tiny.dim() > len(_DIMS):
        return shape if not shape else None
    where = {size: i for i, size in enumerate(tiny.shape)}
    out = []
    for size in shape:
        if size == 1:
            out.append(1)
        elif size in where:
            out.append(-1 - where[size])
        else:
            return None
    return tuple(out)


def probe(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> dict[str, KeySpec] | None:
    """The state ``optimizer`` keeps for a param like ``param`` (dtype, ndim) in a group with ``group``'s
    hyperparameters; None when the probe cannot run (a constructor with required arguments, say)."""
    loc = local(param)
    if not (loc.is_floating_point() or loc.is_complex()):
        return None
    shape = _DIMS[: loc.dim()] if loc.dim() <= len(_DIMS) else (2,) * loc.dim()
    # Pinned host memory: on the simulator that is host memory too, so every probe op runs on the host.
    tiny = device.pinned_empty(shape, dtype=loc.dtype).zero_()
    tiny.grad = device.pinned_empty(shape, dtype=loc.dtype).fill_(1e-3)
    cls = type(optimizer)
    step = _raw_step(optimizer)
    try:
        kwargs = _ctor_kwargs(cls, optimizer.defaults)
        kwargs.update({k: v for k, v in _HOST_PATH.items() if k in kwargs})
        opt = cls([tiny], **kwargs)
        pg = opt.param_groups[0]
        pg.update({k: v for k, v in group.items() if k not in ("params", "param_names")})
        pg.update({k: v for k, v in _HOST_PATH.items() if k in pg})
        step(opt)
        base = dict(opt.state[tiny])
    except Exception as exc:  # noqa: BLE001 - the probe only informs the check
        logger.debug("swapopt: cannot probe the state of {}: {!r}", cls.__name__, exc)
        return None

    def steps_with(key: str, drop: bool) -> bool:
        st = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in base.items() if k != key or not drop}
        if not drop:
            st[key] = None
        opt.state[tiny] = st
        try:
            step(opt)
        except Exception:  # noqa: BLE001 - failing is the answer
            return False
        return True

    return {
        key: KeySpec(
            dims=_dims(value, tiny) if isinstance(value, torch.Tensor) else None,
            required=not steps_with(key, drop=True),
            none_ok=steps_with(key, drop=False),
        )
        for key, value in base.items()
    }


def check_keys(spec: dict[str, KeySpec], index: int, values: dict[Any, Any], name: str) -> None:
    """Raise ValueError when a non-empty saved state lacks a key the step needs or holds None for it."""
    if not values:
        return  # no state yet: the optimizer creates it at the next step
    for key, ks in spec.items():
        if key not in values:
            if ks.required:
                raise ValueError(
                    f"param {index}, state {key!r}: missing; {name} needs it in every non-empty param state "
                    f"(the state dict has {sorted(map(str, values))})"
                )
        elif values[key] is None and not ks.none_ok:
            raise ValueError(f"param {index}, state {key!r}: None, but {name} needs a value to step")


def check_shapes(spec: dict[str, KeySpec], index: int, param: torch.Tensor, values: dict[Any, Any], name: str) -> None:
    """Raise ValueError when a tensor state's shape differs from the one the optimizer creates for ``param``
    (global shapes for DTensors), or when a state the optimizer keeps as a tensor is something else."""
    for key, ks in spec.items():
        value = values.get(key)
        if value is None:
            continue
        expected = ks.shape_for(tuple(param.shape))
        if expected is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"param {index}, state {key!r}: {type(value).__name__}, but {name} keeps a tensor here")
        if tuple(value.shape) != expected:
            raise ValueError(
                f"param {index}, state {key!r}: shape {tuple(value.shape)}, but {name} keeps shape {expected} "
                f"for a param of shape {tuple(param.shape)}"
            )
