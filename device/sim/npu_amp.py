"""``torch_npu.npu.amp`` of the simulated torch_npu: its GradScaler steps optimizers as torch_npu's does.

torch_npu/npu/amp/grad_scaler.py (the same in v2.6.0, v2.7.1 and master), ``step()`` :375-382: an
optimizer with a true ``_step_supports_amp_scaling`` is stepped as
``optimizer.step(*args, **dict(kwargs, grad_scaler=self))``, always (upstream torch passes the kwarg only
when ``step``'s signature names it, torch/amp/grad_scaler.py), and with no unscale and no inf check of its
own: the optimizer must do both. Any other optimizer goes the usual way (unscale, skip on inf). The rest
(scale, unscale_, update) is upstream's, which computes the same numbers here.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.amp.grad_scaler import OptState


class GradScaler(torch.amp.GradScaler):
    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        super().__init__("npu", init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            retval = optimizer.step(*args, **dict(kwargs, grad_scaler=self))
            state["stage"] = OptState.STEPPED
            return retval
        return super().step(optimizer, *args, **kwargs)


def module() -> types.ModuleType:
    """The ``torch_npu.npu.amp`` module (torch.npu.amp is the same object, as torch_npu registers it)."""
    amp = types.ModuleType("torch_npu.npu.amp")
    amp.GradScaler = GradScaler
    return amp
