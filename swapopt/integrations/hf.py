"""Hugging Face ``Trainer``: the optimizer the Trainer would build from its ``TrainingArguments``, swapped.

``Trainer(optimizer_cls_and_kwargs=(cls, kwargs))`` replaces the Trainer's choice of optimizer class and
arguments (``args.optim``, ``adamw_torch_fused`` by default, with ``adam_beta1/2``, ``adam_epsilon``) while
the Trainer still builds the param groups (weight decay off for biases and norms). Passing
``(SwapAdamW, {"lr": ...})`` by hand therefore drops whatever the Trainer would have set: the fused
kernel, the betas, the epsilon, and the run is no longer bitwise the plain one. This module asks the
Trainer for its own choice and wraps that class instead.
"""

from __future__ import annotations

from typing import Any

from swapopt.classes import swap_class
from swapopt.config import settings_from


def swap_optimizer_cls_and_kwargs(args: Any, model: Any = None, **knobs: Any) -> tuple[type, dict[str, Any]]:
    """``(class, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``: the optimizer ``args.optim`` names,
    with the Trainer's own arguments for it, as a swapping class; ``knobs`` are swapopt's keywords
    (``swap_optimizer_times=16``, ``resident_mb``, ...). Optimizers swapopt cannot swap are refused when the
    Trainer builds them, with the reason."""
    settings_from(knobs)  # the knobs' names and values are checked here, not when the Trainer builds it
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    # swap_class refuses what is no torch.optim.Optimizer; SwapOptimizer refuses, at construction, optimizers
    # not known to be per-param (Adafactor, 8-bit ones) unless per_param=True vouches for them.
    return swap_class(cls), {**kwargs, **knobs}
