"""``SwapConfig``: the swap knobs plus the one switch, ``swap_optimizer``, for engine configs.

It sits above swapopt.optimizer (its ``wrap`` builds a SwapOptimizer), while the knobs it carries are
declared once below everything, in swapopt.config.
"""

from __future__ import annotations

import warnings

import torch
from pydantic import ConfigDict

from swapopt.config import KNOBS, SwapSettings
from swapopt.optimizer import SwapOptimizer


class SwapConfig(SwapSettings):
    """Optimizer-state swapping for engine configs: ``swap_optimizer`` switches it on, the other fields are
    SwapSettings' knobs. ``overlap_forward``, ``prefetch`` and ``master_weights`` need
    ``swap_optimizer=True``; without it wrap() warns that they are ignored."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True, use_attribute_docstrings=True)

    swap_optimizer: bool = False
    """Keep the optimizer's states in pinned host memory and stream them through the device in step()."""

    def settings(self) -> SwapSettings:
        """The knobs of the SwapOptimizer this config builds."""
        return SwapSettings(**self.model_dump(include=set(KNOBS)))

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return ``optimizer`` wrapped in a SwapOptimizer, or unchanged when swapping is off."""
        if not self.swap_optimizer:
            ignored = [k for k in ("overlap_forward", "prefetch", "master_weights") if getattr(self, k)]
            if ignored:
                # A warning, not an error: configs switch swap_optimizer off alone to get the resident baseline.
                warnings.warn(
                    f"swapopt: {' and '.join(f'{k}=True' for k in ignored)} has no effect with swap_optimizer=False; "
                    f"the optimizer is returned unwrapped",
                    stacklevel=2,
                )
            return optimizer
        if isinstance(optimizer, SwapOptimizer):
            return optimizer
        return SwapOptimizer(optimizer, **self.settings().model_dump())
