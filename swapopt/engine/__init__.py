"""Reference training engine (XTuner style) behind ``python -m swapopt.train``.

    cfg = load_config("configs/tiny.py", ["train.steps=20"])
    engine = TrainEngine(cfg)            # optim.swap_optimizer=True wraps AdamW in a SwapOptimizer
    while engine.step < cfg.train.steps:
        metrics = engine.train_step()
"""

from swapopt.engine.config import (
    AdamWConfig,
    ConfigError,
    DataConfig,
    EngineConfig,
    LRConfig,
    ModelConfig,
    RLConfig,
    TrainConfig,
    load_config,
)
from swapopt.engine.trainer import TrainEngine

__all__ = [
    "AdamWConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "LRConfig",
    "ModelConfig",
    "RLConfig",
    "TrainConfig",
    "TrainEngine",
    "load_config",
]
