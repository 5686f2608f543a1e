"""Lightning integration: strategies that keep swapped optimizer states in host memory on resume.

Lightning's ``Strategy.load_optimizer_state_dict`` loads each optimizer's state, then calls
``_optimizer_to_device(optimizer, root_device)``, which moves every state tensor to the accelerator. For a
swapping optimizer that would put the whole optimizer state in device memory from resume until the next
step (the out-of-memory-on-resume that swapping exists to avoid). ``Strategy.setup`` makes the same move for
states that exist before training starts. These strategies skip the move for swapping optimizers and leave
every other optimizer to Lightning::

    import lightning as L
    from swapopt import SwapAdamW
    from swapopt.integrations.lightning import SwapSingleDeviceStrategy

    class Module(L.LightningModule):
        def configure_optimizers(self):
            return SwapAdamW(self.parameters(), lr=3e-4, swap_optimizer_times=16)

    trainer = L.Trainer(strategy=SwapSingleDeviceStrategy(device="cuda:0"))   # or SwapDDPStrategy()
    trainer.fit(Module(), ckpt_path="last.ckpt")

For another strategy class, put :class:`SwapStatesOnHost` first in its bases:
``class MyStrategy(SwapStatesOnHost, DeepSpeedStrategy): ...``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from loguru import logger

import device
from swapopt.hoststate import pinned_copy
from swapopt.optimizer import SwapOptimizer

try:
    from lightning.fabric.utilities.optimizer import _optimizer_to_device
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as err:  # pragma: no cover - exercised only where lightning is absent
    raise ImportError(
        "swapopt.integrations.lightning needs Lightning: pip install 'swapopt[integrations]' (or lightning)"
    ) from err

__all__ = ["SwapDDPStrategy", "SwapSingleDeviceStrategy", "SwapStatesOnHost", "keep_states_on_host"]


def _swapping(optimizer: Any) -> SwapOptimizer | None:
    # LightningOptimizer and other wrappers keep the real optimizer in ``_optimizer`` / ``optimizer``.
    for _ in range(4):
        if isinstance(optimizer, SwapOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None


def keep_states_on_host(optimizers: Iterable[Any]) -> int:
    """Copy back into pinned host memory any swapped state of a swapping optimizer found on the device
    (moved there by a framework), freeing its device copy; returns how many states were re-homed."""
    moved = 0
    for optimizer in optimizers:
        opt = _swapping(optimizer)
        if opt is None:
            continue
        opt.wait_for_swap_out()
        before = moved
        for st in opt.state.values():
            for key, value in st.items():
                if key == "step" or not isinstance(value, torch.Tensor) or device.is_host_tensor(value):
                    continue
                if hasattr(value, "to_local"):  # DTensor: swapopt re-homes those at its next step
                    continue
                st[key] = pinned_copy(value)
                moved += 1
        if moved > before:
            opt.invalidate()  # the cached host layout points at the replaced tensors
    if moved:
        logger.debug("re-homed {} optimizer states into pinned host memory", moved)
    return moved


class SwapStatesOnHost:
    """Strategy mixin: swapping optimizers' states are never moved to the root device."""

    optimizers: list[torch.optim.Optimizer]
    root_device: torch.device

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        # Strategy.setup moved existing states (an optimizer with eager state, or one that already stepped)
        # to the root device; bring those of swapping optimizers straight back.
        keep_states_on_host(self.optimizers)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            # A swapping optimizer's load_state_dict writes into its pinned host tensors; moving them to the
            # device afterwards is the step this mixin exists to leave out.
            optimizer.load_state_dict(opt_state)
            if _swapping(optimizer) is None:
                _optimizer_to_device(optimizer, self.root_device)


class SwapSingleDeviceStrategy(SwapStatesOnHost, SingleDeviceStrategy):
    """``SingleDeviceStrategy`` that keeps swapped optimizer states in host memory."""


class SwapDDPStrategy(SwapStatesOnHost, DDPStrategy):
    """``DDPStrategy`` that keeps swapped optimizer states in host memory."""
