"""Finding a real XTuner v1 for the tests that need one.

XTuner v1 is not on the package registry. Tests use it when ``xtuner.v1`` is importable, or when
``SWAPOPT_XTUNER_SRC`` names a checkout of InternLM/xtuner (put first on ``sys.path``); otherwise they skip.
``tests/xtuner_check.sh`` runs them against a checkout. Its config module needs ``cyclopts`` and ``pydantic``;
its models (tests/xtuner_moe.py) and TrainEngine also need ``ray`` (and ``more_itertools``).

Under the npu flavour XTuner's model package also imports MindSpeed (Ascend's training library, not on the package
registry either: its registry entry is a placeholder that refuses to install): on npu,
xtuner/v1/ops/moe/__init__.py:78 picks the grouped GEMM at import and xtuner/v1/ops/moe/npu/group_gemm.py:2 imports
``mindspeed.core.fusions.grouped_matmul``, which imports only torch. ``SWAPOPT_MINDSPEED_SRC`` names a checkout of
Ascend/MindSpeed, put on ``sys.path`` as XTuner's is (tests/test_xtuner_npu.py).

Under the cuda flavour XTuner's TrainEngine imports more than its config does: xtuner/v1/loss/__init__.py:42-43 imports
its Liger loss on cuda, whose module imports ``triton`` (xtuner/v1/loss/liger_with_weights.py:5), and its Float8 and
MoE kernels are Triton kernels defined at import; XTuner picks its grouped GEMM by Triton version (3.4.0 and later:
xtuner/v1/ops/moe/cuda/triton_kernels/__init__.py; triton 3.9.0 no longer defines its kernels:
xtuner/v1/float8/triton_kernels/trans_per_tile_quant_gemm.py:58 autotunes on a key, ``K``, that is not an argument of
the kernel). And every ``MHAConfig`` on cuda asks mmengine's ``is_installed("flash-attn")``, which imports
``pkg_resources`` (setuptools 80.9.0 has it; 84.2.1 has none). Installing triton into the
shared environment would change torch's own choices (it looks for triton), so the tests add them to their own
processes only: ``SWAPOPT_TRITON_PATH`` names a directory holding triton 3.4.0 (``pip install --target DIR --no-deps
triton==3.4.0``), ``SWAPOPT_PKG_RESOURCES_PATH`` one holding setuptools 80.9.0 where ``pkg_resources`` is not
importable (``cuda_paths()``; tests/test_xtuner_engine_cuda.py, and the 2-rank test of tests/test_xtuner_moe.py).
No Triton kernel runs: the simulator has no GPU.

Last passed on (tests/xtuner_check.sh: config route, checkpoints, MoE model, Muon, TrainEngine on cuda and npu; 1 and 2
ranks, simulator):
InternLM/xtuner b934f462095c1e750229de35367c50ae36caa786.
"""

from __future__ import annotations

import importlib
import os
import sys

CHECKED_COMMIT = "b934f462095c1e750229de35367c50ae36caa786"
# The MindSpeed checkout tests/test_xtuner_npu.py last passed with (Ascend/MindSpeed, 0.12.1).
MINDSPEED_CHECKED_COMMIT = "028de58ca629d035185b00ff7d1eb7eff4f7fd48"

for _src in (os.environ.get("SWAPOPT_MINDSPEED_SRC"), os.environ.get("SWAPOPT_XTUNER_SRC")):
    if _src and _src not in sys.path:
        sys.path.insert(0, _src)


def cuda_paths() -> list[str]:
    """The directories XTuner's cuda TrainEngine needs on its process's path (SWAPOPT_TRITON_PATH, and
    SWAPOPT_PKG_RESOURCES_PATH when set); not added to this process's sys.path."""
    names = ("SWAPOPT_TRITON_PATH", "SWAPOPT_PKG_RESOURCES_PATH")
    return [os.environ[name] for name in names if os.environ.get(name)]


def xtuner_module(name: str):
    """The XTuner module, or None when XTuner (or one of its dependencies) is not importable."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
