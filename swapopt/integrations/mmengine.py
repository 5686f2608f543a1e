"""mmengine integration. Importing this module registers, in mmengine's registries:

- ``SwapOptimWrapper`` (OPTIM_WRAPPERS): an OptimWrapper whose optimizer is wrapped in a SwapOptimizer::

      optim_wrapper = dict(type="SwapOptimWrapper", optimizer=dict(type="AdamW", lr=1e-3),
                           swap_optimizer_times=16)   # any SwapSettings knob: chunk_mb, master_weights, ...

- ``SwapAmpOptimWrapper`` (OPTIM_WRAPPERS): the same over AmpOptimWrapper (loss scaling, fp32 states swapped).
- ``SwapOptimWrapperConstructor`` (OPTIM_WRAPPER_CONSTRUCTORS): on an Ascend NPU without full-precision
  support, ``mmengine.optim.build_optim_wrapper`` replaces any wrapper type by ``AmpOptimWrapper``, which
  would silently drop swapping (and reject the swap keys with a TypeError). Add
  ``constructor="SwapOptimWrapperConstructor"`` to the optim_wrapper dict and the forced type becomes
  ``SwapAmpOptimWrapper`` instead, with a warning.

Checkpoints: ``Runner.save_checkpoint`` stores ``optim_wrapper.state_dict()``, whose states are the host
tensors themselves (nothing is allocated on the device). ``Runner.resume`` loads the whole checkpoint with
``map_location=get_device()``, i.e. every optimizer state onto the accelerator at once, before
``load_state_dict`` copies them into the optimizer's pinned host tensors. Importing this module therefore wraps
``Runner.resume`` once: when the runner's optim wrapper swaps (a ``SwapOptimWrapper``/``SwapAmpOptimWrapper``,
built or still a config dict) and ``map_location`` is left at ``'default'``, the checkpoint is loaded with
``map_location='cpu'``; the model weights are then copied into the (device) params as usual. So
``resume=True``, ``load_from`` + ``resume`` and ``runner.resume(path)`` keep the states off the device without
further settings; an explicit ``map_location`` is always honoured, and runners without swapping are untouched.
With torch >= 2.6, mmengine <= 0.10.7 cannot resume at all: it calls
``torch.load`` without ``weights_only`` and torch now refuses the HistoryBuffer objects in mmengine's own
checkpoints (open-mmlab/mmengine#1655); for checkpoints you wrote yourself set
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from loguru import logger

from swapopt import SwapConfig, SwapOptimizer
from swapopt.config import KNOBS, settings_from

try:
    from mmengine.optim import AmpOptimWrapper, DefaultOptimWrapperConstructor, OptimWrapper, OptimWrapperDict
    from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS, OPTIM_WRAPPERS
    from mmengine.runner import Runner
except ImportError as err:  # pragma: no cover - exercised by a test that hides mmengine
    raise ImportError(
        "swapopt.integrations.mmengine needs mmengine: pip install 'swapopt[mmengine]' "
        "(mmengine-lite and opencv-python-headless)"
    ) from err


def _swap(optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` with the swap knobs found in ``kwargs`` (removed from it: the rest go to mmengine's
    wrapper). The knobs are SwapSettings' own, checked there with errors naming the knob."""
    knobs = {k: kwargs.pop(k) for k in KNOBS if k in kwargs}
    return SwapConfig(swap_optimizer=True, **settings_from(knobs).model_dump()).wrap(optimizer)


@OPTIM_WRAPPERS.register_module()
class SwapOptimWrapper(OptimWrapper):
    """OptimWrapper over ``SwapOptimizer(optimizer)``. Keyword arguments that are swapopt knobs
    (``swapopt.SwapSettings``: ``swap_optimizer_times``, ``chunk_mb``, ``slots``, ``resident_mb``,
    ``master_weights``, ...) configure the swap; the others go to OptimWrapper (``clip_grad``,
    ``accumulative_counts``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        super().__init__(optimizer=_swap(optimizer, kwargs), **kwargs)


@OPTIM_WRAPPERS.register_module()
class SwapAmpOptimWrapper(AmpOptimWrapper):
    """AmpOptimWrapper over ``SwapOptimizer(optimizer)``: GradScaler unscales the grads, the swapped fp32
    states stream through the device during step(). Knobs as for SwapOptimWrapper."""

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        super().__init__(optimizer=_swap(optimizer, kwargs), **kwargs)


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


_SWAP_WRAPPERS = ("SwapOptimWrapper", "SwapAmpOptimWrapper", SwapOptimWrapper, SwapAmpOptimWrapper)


def swaps(optim_wrapper: Any) -> bool:
    """Whether a runner's ``optim_wrapper`` (built, an OptimWrapperDict, or still a config dict) swaps states."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        return any(swaps(w) for w in optim_wrapper.values())
    if isinstance(optim_wrapper, OptimWrapper):
        return isinstance(optim_wrapper.optimizer, SwapOptimizer)
    if isinstance(optim_wrapper, dict):
        if "type" in optim_wrapper or "optimizer" in optim_wrapper:
            return optim_wrapper.get("type") in _SWAP_WRAPPERS
        # Several optimizers: a dict of wrapper configs, keyed by module name (the constructor's own keys aside).
        return any(swaps(v) for k, v in optim_wrapper.items() if isinstance(v, dict) and k != "paramwise_cfg")
    return False


def _host_resume(resume: Any) -> Any:
    signature = inspect.signature(resume)

    @functools.wraps(resume)
    def wrapper(self: Runner, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments.get("map_location") == "default" and swaps(getattr(self, "optim_wrapper", None)):
            # The swapped states belong in host memory; loading them onto the accelerator first would hold
            # the whole optimizer state there at once.
            logger.info("resuming a swapping optim wrapper: loading the checkpoint with map_location='cpu'")
            bound.arguments["map_location"] = "cpu"
        return resume(*bound.args, **bound.kwargs)

    wrapper._swapopt_host_resume = True  # type: ignore[attr-defined]
    return wrapper


# Wrapped once per process, however often this module is reloaded.
if not getattr(Runner.resume, "_swapopt_host_resume", False):
    Runner.resume = _host_resume(Runner.resume)
