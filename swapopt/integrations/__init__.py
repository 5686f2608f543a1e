"""Integrations with training frameworks; each imports its framework, so import only the one you use:

- ``swapopt.integrations.mmengine``: ``SwapOptimWrapper`` / ``SwapAmpOptimWrapper`` and host-side resume.
- ``swapopt.integrations.xtuner``: XTuner v1 ``AdamWConfig`` with ``swap_optimizer`` on.
- ``swapopt.integrations.torchtitan``: ``SwapOptimizersContainer`` and its ``Config``.
- ``swapopt.integrations.lightning``: strategies that keep swapped states on the host on resume.

Hugging Face ``Trainer`` needs no module here: pass ``optimizer_cls_and_kwargs=(swapopt.SwapAdamW, {...})``.
"""
