"""Benchmarks: swapopt against every optimizer-state strategy users would pick instead.

``python -m swapopt.bench`` (or ``swapopt-bench``) measures, in one run, the copy bandwidth of the
link, the bound of design.md and each strategy's step time, peak extra device memory and pinned
host memory; ``--sim PRESET`` produces the same table from the simulator's timeline model.
"""

from swapopt.bench.strategies import STRATEGY_DOCS, AdamWSpec, make_strategy

__all__ = ["STRATEGY_DOCS", "AdamWSpec", "make_strategy"]
