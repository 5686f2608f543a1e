"""Class form of SwapOptimizer, for frameworks that build their optimizer from params and keyword arguments.

Hugging Face ``Trainer(optimizer_cls_and_kwargs=...)``, Lightning's ``configure_optimizers``, torchtitan's
container and XTuner-style configs all call ``optimizer_cls(params, lr=..., ...)``. ``SwapOptimizer`` takes a
built optimizer instead, so those routes cannot reach it. ``swap_class(torch.optim.X)`` returns a subclass of
``SwapOptimizer`` whose constructor takes ``X``'s own arguments plus the swap knobs, builds ``X`` and wraps it:
``SwapAdamW(params, lr=1e-3, swap_optimizer_times=16)`` is ``SwapOptimizer(torch.optim.AdamW(params,
lr=1e-3), swap_optimizer_times=16)``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from swapopt.config import KNOBS, SwapSettings
from swapopt.optimizer import SwapOptimizer

__all__ = ["SwapAdam", "SwapAdamW", "swap_class"]


# One class per optimizer class, so two calls for the same optimizer give the same class (isinstance holds).
_CLASSES: dict[type, type[SwapOptimizer]] = {}


def swap_class(optimizer_cls: type[torch.optim.Optimizer]) -> type[SwapOptimizer]:
    """A ``SwapOptimizer`` subclass built like ``optimizer_cls``: ``(params, *args, **kwargs)`` with
    ``optimizer_cls``'s own arguments, plus the swap knobs of swapopt.SwapSettings as keyword-only
    arguments (a positional argument can never land in a knob by accident).

    Unsupported optimizers (LBFGS, SparseAdam, flat-buffer fused ones) are refused here, by class, when
    the class alone decides it, and otherwise at construction, as ``SwapOptimizer`` refuses them.
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"swap_class takes a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    if issubclass(optimizer_cls, SwapOptimizer):
        raise ValueError(f"{optimizer_cls.__name__} already swaps its states; use it as it is")
    if issubclass(optimizer_cls, (torch.optim.LBFGS, torch.optim.SparseAdam)):
        raise ValueError(
            f"{optimizer_cls.__name__} cannot be swapped (its state cannot be split into per-param chunks); "
            "use it unwrapped"
        )
    cls = _CLASSES.get(optimizer_cls)
    if cls is None:
        cls = _make_class(optimizer_cls)
        _CLASSES[optimizer_cls] = cls
    return cls


def _make_class(optimizer_cls: type[torch.optim.Optimizer]) -> type[SwapOptimizer]:
    def __init__(self: SwapOptimizer, params: Any, *args: Any, **kwargs: Any) -> None:
        knobs = {k: kwargs.pop(k) for k in KNOBS if k in kwargs}
        SwapOptimizer.__init__(self, optimizer_cls(params, *args, **kwargs), **knobs)

    name = f"Swap{optimizer_cls.__name__}"
    __init__.__qualname__ = f"{name}.__init__"
    __init__.__doc__ = (
        f"Build ``{optimizer_cls.__module__}.{optimizer_cls.__name__}(params, *args, **kwargs)`` and keep its "
        "states in pinned host memory between steps (see swapopt.SwapOptimizer for the swap knobs)."
    )
    # Frameworks inspect the signature to decide which keyword arguments to pass (Lightning CLI, jsonargparse):
    # show the inner optimizer's parameters followed by the swap knobs.
    inner = inspect.signature(optimizer_cls.__init__)
    inner_params = [p for p in inner.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    knobs = [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.annotation)
        for k, f in SwapSettings.model_fields.items()
    ]
    positional = [p for p in inner_params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword_only = [p for p in inner_params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in positional):
        signature = None  # an unusual constructor: leave the generic (params, *args, ..., **kwargs) one
    else:
        signature = inner.replace(parameters=positional + keyword_only + knobs)
    namespace: dict[str, Any] = {
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": (
            f"``{optimizer_cls.__name__}`` whose states live in pinned host memory and stream through the "
            "accelerator in chunks during step(); bitwise the same updates. Keyword-only swap knobs: "
            f"{', '.join(KNOBS)} (swapopt.SwapSettings)."
        ),
        "inner_class": optimizer_cls,
    }
    cls = type(name, (SwapOptimizer,), namespace)
    if signature is not None:
        cls.__init__.__signature__ = signature  # type: ignore[attr-defined]
    return cls


SwapAdamW = swap_class(torch.optim.AdamW)
SwapAdam = swap_class(torch.optim.Adam)


def __getattr__(name: str) -> type[SwapOptimizer]:
    """``swapopt.classes.SwapSGD`` and friends for every torch.optim class: pickle finds a class by module and
    name, so a copy of a ``swap_class(torch.optim.X)`` instance can be loaded in a fresh process."""
    inner = getattr(torch.optim, name[len("Swap") :], None) if name.startswith("Swap") else None
    if isinstance(inner, type) and issubclass(inner, torch.optim.Optimizer) and not issubclass(inner, SwapOptimizer):
        return swap_class(inner)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
