"""mmengine integration. Importing this module registers, in mmengine's registries:

- ``SwapOptimWrapper`` (OPTIM_WRAPPERS): an OptimWrapper whose optimizer is wrapped in a SwapOptimizer::

      optim_wrapper = dict(type="SwapOptimWrapper", optimizer=dict(type="AdamW", lr=1e-3),
                           swap_optimizer_times=16)   # also: chunk_mb, slots, resident_mb

- ``SwapAmpOptimWrapper`` (OPTIM_WRAPPERS): the same over AmpOptimWrapper (loss scaling, fp32 states swapped).
- ``SwapOptimWrapperConstructor`` (OPTIM_WRAPPER_CONSTRUCTORS): on an Ascend NPU without full-precision
  support, ``mmengine.optim.build_optim_wrapper`` replaces any wrapper type by ``AmpOptimWrapper``, which
  would silently drop swapping (and reject the swap keys with a TypeError). Add
  ``constructor="SwapOptimWrapperConstructor"`` to the optim_wrapper dict and the forced type becomes
  ``SwapAmpOptimWrapper`` instead, with a warning.

Checkpoints: ``Runner.save_checkpoint`` stores ``optim_wrapper.state_dict()``, whose states are the host
tensors themselves (nothing is allocated on the device). ``Runner.resume`` loads the whole checkpoint with
``map_location=get_device()``, i.e. onto the accelerator, before ``load_state_dict`` copies the states into
the optimizer's pinned host tensors; states end on the host, but device memory briefly holds all of them.
To keep resume off the device, call ``runner.resume(path, map_location="cpu")`` before ``runner.train()``
instead of setting ``resume=True``. With torch >= 2.6, mmengine <= 0.10.7 cannot resume at all: it calls
``torch.load`` without ``weights_only`` and torch now refuses the HistoryBuffer objects in mmengine's own
checkpoints (open-mmlab/mmengine#1655); for checkpoints you wrote yourself set
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``.
"""

from __future__ import annotations

from typing import Optional

import torch
from loguru import logger

from swapopt import SwapConfig

try:
    from mmengine.optim import AmpOptimWrapper, DefaultOptimWrapperConstructor, OptimWrapper
    from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS, OPTIM_WRAPPERS
except ImportError as err:  # pragma: no cover - exercised by a test that hides mmengine
    raise ImportError(
        "swapopt.integrations.mmengine needs mmengine: pip install 'swapopt[mmengine]' "
        "(mmengine-lite and opencv-python-headless)"
    ) from err


def _swap(optimizer: torch.optim.Optimizer, swap_optimizer_times: int, chunk_mb: Optional[float], slots: int,
          resident_mb: float) -> torch.optim.Optimizer:
    return SwapConfig(swap_optimizer=True, swap_optimizer_times=swap_optimizer_times, chunk_mb=chunk_mb,
                      slots=slots, resident_mb=resident_mb).wrap(optimizer)


@OPTIM_WRAPPERS.register_module()
class SwapOptimWrapper(OptimWrapper):
    """OptimWrapper over ``SwapOptimizer(optimizer)``; other keyword arguments go to OptimWrapper
    (``clip_grad``, ``accumulative_counts``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, swap_optimizer_times: int = 16,
                 chunk_mb: Optional[float] = None, slots: int = 3, resident_mb: float = 0.0, **kwargs) -> None:
        super().__init__(optimizer=_swap(optimizer, swap_optimizer_times, chunk_mb, slots, resident_mb), **kwargs)


@OPTIM_WRAPPERS.register_module()
class SwapAmpOptimWrapper(AmpOptimWrapper):
    """AmpOptimWrapper over ``SwapOptimizer(optimizer)``: GradScaler unscales the grads, the swapped fp32
    states stream through the device during step()."""

    def __init__(self, optimizer: torch.optim.Optimizer, swap_optimizer_times: int = 16,
                 chunk_mb: Optional[float] = None, slots: int = 3, resident_mb: float = 0.0, **kwargs) -> None:
        super().__init__(optimizer=_swap(optimizer, swap_optimizer_times, chunk_mb, slots, resident_mb), **kwargs)


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class SwapOptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """DefaultOptimWrapperConstructor that keeps swapping when mmengine forces ``AmpOptimWrapper``."""

    def __call__(self, model: torch.nn.Module) -> OptimWrapper:
        wrapper_type = self.optim_wrapper_cfg.get("type")
        if wrapper_type in ("AmpOptimWrapper", AmpOptimWrapper):
            logger.warning("mmengine selected AmpOptimWrapper (NPU without full-precision support): "
                           "using SwapAmpOptimWrapper so optimizer states stay swapped")
            self.optim_wrapper_cfg = {**self.optim_wrapper_cfg, "type": "SwapAmpOptimWrapper"}
        return super().__call__(model)
