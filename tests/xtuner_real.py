"""Finding a real XTuner v1 for the tests that need one.

XTuner v1 is not on the package registry. Tests use it when ``xtuner.v1`` is importable, or when
``SWAPOPT_XTUNER_SRC`` names a checkout of InternLM/xtuner (put first on ``sys.path``); otherwise they skip.
``tests/xtuner_check.sh`` runs them against a checkout. Its config module needs ``cyclopts`` and ``pydantic``;
its models (tests/xtuner_moe.py) and TrainEngine also need ``ray`` (and ``more_itertools``).

Last passed on (tests/xtuner_check.sh: config route, checkpoints, MoE model, Muon; 1 and 2 ranks, simulator):
InternLM/xtuner b934f462095c1e750229de35367c50ae36caa786.
"""

from __future__ import annotations

import importlib
import os
import sys

CHECKED_COMMIT = "b934f462095c1e750229de35367c50ae36caa786"

_src = os.environ.get("SWAPOPT_XTUNER_SRC")
if _src and _src not in sys.path:
    sys.path.insert(0, _src)


def xtuner_module(name: str):
    """The XTuner module, or None when XTuner (or one of its dependencies) is not importable."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
