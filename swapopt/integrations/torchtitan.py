"""torchtitan integration: ``SwapOptimizersContainer``, an ``OptimizersContainer`` whose optimizers swap.

In a torchtitan config, build the optimizers from this container's ``Config``: the usual fields
(``param_groups``, ``implementation``, ...) plus the swap knobs::

    from swapopt.integrations.torchtitan import SwapOptimizersContainer
    from torchtitan.components.optimizer import ParamGroupConfig

    optimizer = SwapOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 3e-4, "weight_decay": 0.1})],
        swap_optimizer=True, swap_optimizer_times=16,
    )
    optimizers = optimizer.build(model_parts=model_parts)

The knobs are SwapSettings' (``swap_optimizer_times``, ``chunk_mb``, ``slots``, ``resident_mb``,
``master_weights``, ``prefetch``, ...); ``prefetch`` attaches each model part's forward hook, and
``overlap_forward`` is refused (torchtitan reads params outside a forward without waiting for the update).
Every element-wise optimizer the container builds (Adam, AdamW) is wrapped in a ``SwapOptimizer``; the others
(``DistMuon``) stay as they are, with a warning. torchtitan's flat FQN-keyed state dicts,
``init_optim_state`` (one zero-lr step that creates the states, here in host memory), its DCP
``CheckpointManager`` and async staging (the trainer calls ``maybe_wait_for_staging`` before ``step``, so the
step never rewrites host states that are still being staged) work unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import field, make_dataclass
from typing import Any

import torch

from swapopt.config import KNOBS, SwapSettings, settings_from
from swapopt.switch import SwapConfig
from swapopt.hoststate import ELEMENTWISE
from swapopt.optimizer import SwapOptimizer

try:
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError as err:  # pragma: no cover - exercised only where torchtitan is absent
    raise ImportError(
        "swapopt.integrations.torchtitan needs torchtitan: pip install 'swapopt[integrations]' (or torchtitan)"
    ) from err

__all__ = ["SwapOptimizersContainer"]


def _swap_fields() -> list[tuple[str, Any, Any]]:
    """The dataclass fields of the container's config: ``swap_optimizer`` (on by default: choosing this
    container is choosing to swap) and every SwapSettings knob with its type, default and docstring."""
    specs = [("swap_optimizer", bool, field(default=True, metadata={"doc": SwapConfig.model_fields[
        "swap_optimizer"].description}))]
    for name in KNOBS:
        info = SwapSettings.model_fields[name]
        specs.append((name, info.annotation, field(default=info.default, metadata={"doc": info.description})))
    return specs


def _swap_config(self: Any) -> SwapConfig:
    """The SwapConfig these fields make (validated by pydantic, errors naming the knob)."""
    return SwapConfig(swap_optimizer=self.swap_optimizer, **settings_from({k: getattr(self, k) for k in KNOBS}).model_dump())


def _validate(self: Any) -> None:
    self.swap_config()  # validate the knobs when the config is made, not when it is built


class SwapOptimizersContainer(OptimizersContainer):
    """``OptimizersContainer`` whose Adam/AdamW optimizers keep their states in pinned host memory.

    ``Config`` is torchtitan's optimizer config plus ``swap_optimizer`` and every knob of
    ``swapopt.SwapSettings`` (``swap_optimizer_times``, ``chunk_mb``, ``slots``, ``resident_mb``,
    ``master_weights``, ...), read from there so the two never disagree; each field's docstring is in its
    ``metadata["doc"]``."""

    Config = make_dataclass(
        "Config",
        _swap_fields(),
        bases=(OptimizersContainer.Config,),
        namespace={"swap_config": _swap_config, "__post_init__": _validate,
                   "__qualname__": "SwapOptimizersContainer.Config", "__module__": __name__},
        kw_only=True,
        slots=True,
    )

    def __init__(self, config: Any, *, model_parts: list[torch.nn.Module]) -> None:
        self._swap = config.swap_config()
        if self._swap.swap_optimizer and config.implementation == "fused_opt_states_bf16":
            raise ValueError(
                "implementation='fused_opt_states_bf16' creates bf16 states on the device in a step pre-hook, "
                "which swapping cannot host; use implementation='fused' or 'foreach' with swap_optimizer=True"
            )
        if self._swap.swap_optimizer and self._swap.overlap_forward:
            # torchtitan reads params outside a forward (its checkpoint's model state dict, float8 scale
            # updates) without calling wait_for_update(), so an update still running would be read half done.
            raise ValueError(
                "overlap_forward=True is not supported by SwapOptimizersContainer: torchtitan reads params outside "
                "a forward (checkpoints) without waiting for the update; use prefetch=True to hide the first swap-in"
            )
        super().__init__(config, model_parts=model_parts)
        if self._swap.swap_optimizer and self._swap.prefetch:
            for optimizer in self.optimizers:
                if isinstance(optimizer, SwapOptimizer):
                    for part in model_parts:  # each part's forward hook prefetches after that part's forward
                        optimizer.attach(part)

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., torch.optim.Optimizer]:  # type: ignore[override]
        factory = OptimizersContainer._resolve_optimizer_factory(name)
        swap = self._swap

        def build(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:
            optimizer = factory(*args, **kwargs)
            if not swap.swap_optimizer:
                return optimizer
            if type(optimizer) not in ELEMENTWISE:
                warnings.warn(
                    f"swapopt: {type(optimizer).__name__} is not a per-parameter element-wise optimizer; its "
                    "states stay where it puts them",
                    stacklevel=2,
                )
                return optimizer
            return swap.wrap(optimizer)

        return build
