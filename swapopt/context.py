"""StepContext: what the lower layers (swapopt.layout, swapopt.pipeline, swapopt.recovery) need of a
SwapOptimizer, handed to them instead of the wrapper itself, so that each knows only its inputs."""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from swapopt.config import SwapSettings
from swapopt.masters import Masters
from swapopt.operate import SwapOptimizerOperate


@dataclass(eq=False)
class StepContext:
    optimizer: torch.optim.Optimizer  # the wrapped optimizer; its state and param_groups are read live
    settings: SwapSettings
    operate: SwapOptimizerOperate
    step_fn: Callable[..., Any]  # the inner class's raw step (Note [raw step] in swapopt.internals)
    masters: Masters  # fp32 masters of low-precision params (master_weights), empty otherwise
    device: str = "cpu"  # the device type the layout was built for (get_device() at the last step)
    warned: set[str] = field(default_factory=set)  # once-only warnings already given
    # step_graph is on but this optimizer's steps cannot be captured, and why: it does not try again, and plans are
    # an eager step's (Note [replayed costs] in swapopt.costs)
    graph_off: str | None = None
    # Per group: step-time copies of tensor hyperparameters (overlap_forward), set for the length of a step.
    hyper: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def state(self) -> Any:
        # load_state_dict rebinds the inner optimizer's state: always read it through the optimizer.
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def warn_once(self, key: str, message: str) -> bool:
        """Warn ``message`` the first time ``key`` comes up for this optimizer, pointing at the user's line that
        led to it (see user_stacklevel); whether it was warned now."""
        if key in self.warned:
            return False
        self.warned.add(key)
        warnings.warn(message, stacklevel=user_stacklevel())
        return True


_INTERNAL_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the calling function's caller point at the user's line
    that led to it (``opt.step()``, ``scaler.step(opt)``, a forward that prefetches): past swapopt's and torch's
    own frames, however many wrappers (no_grad, step hooks, GradScaler, module hooks) the call went through."""
    frame = sys._getframe(1)  # the function that asked: stacklevel 1 once warnings.warn is called from it
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame = frame.f_back
        level += 1
    return level
