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


def __getattr__(name: str) -> object:
    # The trainer imports torch.distributed.checkpoint and DTensor (1.4 s on a 2-core host): loaded on first use, so
    # that reading a config, and reporting a mistake in it, does without them.
    if name == "TrainEngine":
        from swapopt.engine.trainer import TrainEngine

        return TrainEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
