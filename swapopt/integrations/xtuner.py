"""XTuner v1 integration: an ``AdamWConfig`` whose ``build(model)`` returns a swapping AdamW.

In an XTuner v1 config, change the import and keep the rest::

    from swapopt.integrations.xtuner import AdamWConfig      # was: from xtuner.v1.config import AdamWConfig
    optim_cfg = AdamWConfig(lr=6e-5, swap_optimizer=True, swap_optimizer_times=16)

When ``xtuner.v1`` is importable the class subclasses ``xtuner.v1.config.AdamWConfig``, so every XTuner field,
validator and CLI help stays; without XTuner it is a pydantic model with the same fields. The extra knobs
``swap_optimizer_times``, ``chunk_mb``, ``slots`` and ``resident_mb`` are validated like ``swapopt.SwapConfig``.

How it meets XTuner's ``TrainEngine``:

- ``build_optimizer(optim_cfg)`` calls ``optim_cfg.build(model)``: one param group of the trainable params, as
  XTuner builds it, returned as ``swapopt.SwapAdamW`` (``torch.optim.AdamW`` when ``swap_optimizer`` is off).
- ``clip_grad_norm`` reads ``group.get("clip_grad", True)`` from ``optimizer.param_groups``: the wrapper's
  param groups are the inner AdamW's own dicts, so keys added there are seen by both.
- ``save_dcp`` / ``async_save_dcp`` / ``load_dcp`` go through ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict``: the states are the pinned host tensors (DTensors over host shards under
  FSDP2), loading writes into them, never onto the device. Checkpoints written by XTuner's own ``SwapAdamW``
  (with ``max_exp_avg_sq: None`` entries) load and continue bitwise.
- ``put_optimizer_to_device`` returns False because ``swap_optimizer`` is truthy, so the RL worker's
  ``offload_optimizer`` / ``onload_optimizer`` and ``offload_optimizer_first_step`` leave the states where
  they are: in pinned host memory, streamed through the device only inside ``step()``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from loguru import logger
from pydantic import BaseModel, ConfigDict, Field

from swapopt.classes import SwapAdamW

try:
    from xtuner.v1.config import AdamWConfig as _XTunerAdamWConfig
except ImportError:  # XTuner v1 is not on the package registry; most installs take this path
    _XTunerAdamWConfig = None

XTUNER_AVAILABLE = _XTunerAdamWConfig is not None

__all__ = ["XTUNER_AVAILABLE", "AdamWConfig"]


class _AdamWFields(BaseModel):
    """XTuner v1's ``OptimConfig`` + ``AdamWConfig`` fields and defaults, for installs without XTuner."""

    model_config = ConfigDict(extra="forbid")

    lr: float = 1e-5
    max_grad_norm: float = 1.0
    skip_grad_norm_threshold: Optional[float] = None
    weight_decay: float = 0.01
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    foreach: Optional[bool] = None


_Base: Any = _XTunerAdamWConfig if XTUNER_AVAILABLE else _AdamWFields


class AdamWConfig(_Base):
    """XTuner's ``AdamWConfig`` with swapping on by default and swapopt's knobs.

    ``swap_optimizer``: keep AdamW's states in pinned host memory and stream them during ``step()``;
    ``swap_optimizer_times``: chunks per step; ``chunk_mb``: fixed chunk budget (MiB), overrides it;
    ``slots``: device staging buffers; ``resident_mb``: states that fit stay on the device.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    swap_optimizer: bool = True
    swap_optimizer_times: int = Field(default=16, ge=1)
    chunk_mb: Optional[float] = Field(default=None, gt=0)
    slots: int = Field(default=3, ge=1)
    resident_mb: float = Field(default=0.0, ge=0)

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer XTuner's ``TrainEngine.build_optimizer`` installs: AdamW over the trainable params
        (one group, XTuner's layout), swapping when ``swap_optimizer`` is on."""
        params = [p for p in model.parameters() if p.requires_grad]
        total = sum(p.numel() for p in model.parameters())
        logger.info(
            "AdamW over {:.2f}M trainable of {:.2f}M params, swap_optimizer={}",
            sum(p.numel() for p in params) / 1e6, total / 1e6, self.swap_optimizer,
        )
        kwargs = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, foreach=self.foreach)
        if not self.swap_optimizer:
            return torch.optim.AdamW(params, **kwargs)
        return SwapAdamW(
            params,
            **kwargs,
            swap_optimizer_times=self.swap_optimizer_times,
            chunk_mb=self.chunk_mb,
            slots=self.slots,
            resident_mb=self.resident_mb,
        )
