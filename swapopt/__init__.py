"""swapopt: optimizer states in pinned host memory, streamed through the accelerator during step().

Public API:
    SwapOptimizer          wrap any per-parameter-state torch.optim optimizer
    SwapAdamW, SwapAdam    class form, built from params like torch.optim.AdamW / Adam
    swap_class             class form of any supported torch.optim optimizer class
    SwapConfig             pydantic config; ``SwapConfig(swap_optimizer=True).wrap(opt)``
    SwapOptimizerOperate   the transfer engine (streams, staging slots, per-param events)
    register_per_param     vouch that a third-party optimizer is per-param (so it may be swapped)
    offload / onload       RL phase hooks (free staging memory / resume training)
    put_optimizer_to_device  XTuner-style helper: False for a SwapOptimizer
"""

from loguru import logger

from swapopt.classes import SwapAdam, SwapAdamW, swap_class
from swapopt.switch import SwapConfig
from swapopt.hostmem import HostMemoryError
from swapopt.offload import offload, offloaded, onload, put_optimizer_to_device
from swapopt.operate import SwapOptimizerOperate
from swapopt.optimizer import SwapOptimizer
from swapopt.perparam import register_per_param

# A library stays quiet unless the application asks; the CLI calls logger.enable("swapopt").
logger.disable("swapopt")

__all__ = [
    "HostMemoryError",
    "SwapAdam",
    "SwapAdamW",
    "SwapConfig",
    "SwapOptimizer",
    "SwapOptimizerOperate",
    "offload",
    "offloaded",
    "onload",
    "put_optimizer_to_device",
    "register_per_param",
    "swap_class",
]
__version__ = "0.1.0"
