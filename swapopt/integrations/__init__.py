"""Integrations with training frameworks; each imports its framework, so import only the one you use:

- ``swapopt.integrations.hf``: ``swap_optimizer_cls_and_kwargs(args)`` for the Hugging Face ``Trainer``: the
  optimizer its ``TrainingArguments`` pick, swapped.
- ``swapopt.integrations.mmengine``: ``SwapOptimWrapper`` / ``SwapAmpOptimWrapper`` and host-side resume.
- ``swapopt.integrations.xtuner``: ``use_swapopt()`` (XTuner's own ``AdamWConfig(swap_optimizer=True)``
  builds swapopt), an ``AdamWConfig`` to import instead, and the multi-rank checkpoint check.
- ``swapopt.integrations.torchtitan``: ``SwapOptimizersContainer`` and its ``Config``.
- ``swapopt.integrations.lightning``: strategies that keep swapped states on the host on resume.
"""
