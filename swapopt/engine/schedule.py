"""Learning rate: linear warmup, then cosine decay to a floor. A pure function of the step, so a resumed run
needs no scheduler state."""

from __future__ import annotations

import math

from swapopt.engine.config import LRConfig


def lr_at(step: int, total_steps: int, base_lr: float, cfg: LRConfig) -> float:
    """The learning rate for 0-based ``step`` of ``total_steps``."""
    if step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = base_lr * cfg.min_lr_ratio
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
