"""The unswapped mixed-precision recipe: bf16 params on the device with fp32 masters and the optimizer's states
on the device too (``optim.device_masters=true`` with ``swap_optimizer=false``).

It is what ``master_weights=True`` reproduces with the masters and states swapped (Note [master weights] in
swapopt.masters): each step upcasts the grads into the masters' ``.grad``, steps the masters with the torch
optimizer and writes them, rounded, into the params. So a master-weights job's summary compares against this
(memory and step period), not against an fp32 job that moves twice the activations and runs fp32 matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class DeviceMasters:
    """A torch optimizer over fp32 device masters of the low-precision params; fp32 params are their own
    masters. ``param_groups`` and ``state`` are the inner optimizer's (LR schedules work unchanged); grads are
    those of the model's params (clipping works unchanged)."""

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 build: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.params = list(params)
        self.masters = [p.detach().float() if p.dtype != torch.float32 else p for p in self.params]
        self.pairs = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        self.inner = build(self.masters)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in self.pairs:
            p.copy_(m)
            m.grad = None  # the upcast grads live only through the step

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
