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

Every element-wise optimizer the container builds (Adam, AdamW) is wrapped in a ``SwapOptimizer``; the others
(``DistMuon``) stay as they are, with a warning. torchtitan's flat FQN-keyed state dicts,
``init_optim_state`` (one zero-lr step that creates the states, here in host memory), its DCP
``CheckpointManager`` and async staging (the trainer calls ``maybe_wait_for_staging`` before ``step``, so the
step never rewrites host states that are still being staged) work unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from swapopt.config import SwapConfig
from swapopt.hoststate import ELEMENTWISE

try:
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError as err:  # pragma: no cover - exercised only where torchtitan is absent
    raise ImportError(
        "swapopt.integrations.torchtitan needs torchtitan: pip install 'swapopt[integrations]' (or torchtitan)"
    ) from err

__all__ = ["SwapOptimizersContainer"]


class SwapOptimizersContainer(OptimizersContainer):
    """``OptimizersContainer`` whose Adam/AdamW optimizers keep their states in pinned host memory."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        swap_optimizer: bool = True
        """Keep optimizer states in pinned host memory and stream them through the device in step()."""

        swap_optimizer_times: int = 16
        """Chunks the swapped states are split into per step."""

        chunk_mb: float | None = None
        """Fixed chunk budget in MiB; overrides swap_optimizer_times."""

        slots: int = 3
        """Device staging buffers (one filling, one computing, one draining)."""

        resident_mb: float = 0.0
        """States that fit this budget (MiB) stay on the device and are stepped first."""

        def __post_init__(self) -> None:
            self.swap_config()  # validate the knobs when the config is made, not when it is built

        def swap_config(self) -> SwapConfig:
            return SwapConfig(
                swap_optimizer=self.swap_optimizer,
                swap_optimizer_times=self.swap_optimizer_times,
                chunk_mb=self.chunk_mb,
                slots=self.slots,
                resident_mb=self.resident_mb,
            )

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        self._swap = config.swap_config()
        if self._swap.swap_optimizer and config.implementation == "fused_opt_states_bf16":
            raise ValueError(
                "implementation='fused_opt_states_bf16' creates bf16 states on the device in a step pre-hook, "
                "which swapping cannot host; use implementation='fused' or 'foreach' with swap_optimizer=True"
            )
        super().__init__(config, model_parts=model_parts)

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
