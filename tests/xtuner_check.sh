#!/usr/bin/env bash
# Run the XTuner checks against a checkout of InternLM/xtuner (XTuner v1 is not on the package registry).
#   tests/xtuner_check.sh /path/to/xtuner            # a checkout; its commit is printed with the results
# Needs XTuner's config dependencies (pip install cyclopts), and ray for its models (the MoE, Muon and TrainEngine
# checks skip without it); the checks run on the simulator, no GPU needed. XTuner's TrainEngine also needs, under
# the npu flavour, a MindSpeed checkout on SWAPOPT_MINDSPEED_SRC, and under the cuda flavour triton 3.4.0 on
# SWAPOPT_TRITON_PATH (and pkg_resources, from setuptools 80.9.0 on SWAPOPT_PKG_RESOURCES_PATH where the
# environment's setuptools has none): a `pip install --target DIR --no-deps` directory each, put on the path of
# the check's own process only (tests/xtuner_real.py, docs/xtuner.md). Those checks skip without them.
# After a pass, record the commit in tests/xtuner_real.py (CHECKED_COMMIT) and docs/xtuner.md.
set -euo pipefail
src="$(cd "${1:?usage: tests/xtuner_check.sh /path/to/xtuner-checkout}" && pwd)"
cd "$(dirname "$0")/.."
export SWAPOPT_XTUNER_SRC="$src"
PYTHONPATH=tests python - <<'PY'
import sys, xtuner_real  # noqa: E401
sys.exit(0 if xtuner_real.xtuner_module("xtuner.v1.config.optim") else "xtuner.v1.config is not importable from $SWAPOPT_XTUNER_SRC")
PY
# An exported tree (git archive) has no .git: name the commit with SWAPOPT_XTUNER_COMMIT then.
commit="${SWAPOPT_XTUNER_COMMIT:-$(git -C "$src" rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
python -m pytest -q -p no:cacheprovider -rs \
  tests/test_xtuner_use_swapopt.py tests/test_xtuner_dist.py tests/test_integration_xtuner.py \
  tests/test_xtuner_moe.py tests/test_xtuner_muon.py tests/test_xtuner_npu.py tests/test_xtuner_engine_cuda.py
echo "XTuner checks passed on InternLM/xtuner ${commit}"
