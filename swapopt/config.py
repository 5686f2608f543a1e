"""SwapConfig: the knobs of SwapOptimizer as a pydantic model, usable from engine configs."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SwapConfig(BaseModel):
    """Optimizer-state swapping switches.

    ``swap_optimizer_times``: about how many chunks the swapped states are split into per step (to avoid
    cutting params the planner may use chunks up to 25% larger or up to 1.5x as many, and from 8 chunks on
    it adds up to 3 smaller first ones unless ``prefetch`` is on; swapopt.plan).
    ``chunk_mb``: byte budget per chunk (MiB); overrides ``swap_optimizer_times`` when set.
    ``slots``: staging buffers on the device (3: one filling, one computing, one draining).
    ``resident_mb``: states that fit this budget (MiB) stay on the device and are stepped first.
    ``per_param``: vouch that an optimizer from outside torch.optim keeps per-param state and reads no
    other param in its update (see swapopt.register_per_param); torch's own optimizers need no vouching.
    ``overlap_forward``: run the updates on their own stream and let the next forward start under them,
    each module waiting only for its own params (SwapOptimizer.attach(model) must be called; user code
    reading params or states outside a forward calls SwapOptimizer.wait_for_update() first).
    ``prefetch``: swap in the first ``slots - 1`` chunks of the next step right after the forward, so they
    stream in under the backward and the first update starts at once; the forward hook comes with
    SwapOptimizer.attach(model) (without it nothing is prefetched). Holds the staging (slots x slot bytes)
    from the forward to the end of step: a prefetch budget on top of the step's (slots + 1) x chunk.
    ``overlap_forward`` and ``prefetch`` need ``swap_optimizer=True``; without it wrap() warns that they
    are ignored.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    swap_optimizer: bool = False
    swap_optimizer_times: int = Field(default=16, ge=1)
    chunk_mb: Optional[float] = Field(default=None, gt=0)
    slots: int = Field(default=3, ge=1)
    resident_mb: float = Field(default=0.0, ge=0)
    per_param: bool = False
    overlap_forward: bool = False
    prefetch: bool = False

    @field_validator("swap_optimizer_times", "slots", mode="before")
    @classmethod
    def _no_bool_counts(cls, value: object) -> object:
        # pydantic turns True into 1: `swap_optimizer_times: true` (meant as the switch) would mean one chunk.
        if isinstance(value, bool):
            raise ValueError("a count, not a switch: give an int >= 1 (swap_optimizer is the on/off switch)")
        return value

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return ``optimizer`` wrapped in a SwapOptimizer, or unchanged when swapping is off."""
        if not self.swap_optimizer:
            ignored = [k for k in ("overlap_forward", "prefetch") if getattr(self, k)]
            if ignored:
                # A warning, not an error: configs switch swap_optimizer off alone to get the resident baseline.
                warnings.warn(
                    f"swapopt: {' and '.join(f'{k}=True' for k in ignored)} has no effect with swap_optimizer=False; "
                    f"the optimizer is returned unwrapped",
                    stacklevel=2,
                )
            return optimizer
        from swapopt.optimizer import SwapOptimizer

        if isinstance(optimizer, SwapOptimizer):
            return optimizer
        return SwapOptimizer(
            optimizer,
            swap_optimizer_times=self.swap_optimizer_times,
            chunk_mb=self.chunk_mb,
            slots=self.slots,
            resident_mb=self.resident_mb,
            per_param=self.per_param,
            overlap_forward=self.overlap_forward,
            prefetch=self.prefetch,
        )
