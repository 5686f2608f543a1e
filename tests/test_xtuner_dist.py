"""2 ranks (FSDP2, simulator): use_swapopt() trains bitwise like XTuner's plain AdamW and checkpoints both
ways; a checkpoint written by XTuner's own SwapAdamW is refused (needs XTuner v1, see tests/xtuner_real.py)."""

from __future__ import annotations

import os

import pytest
import xtuner_real
from dist_utils import launch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_two_rank_drop_in_trains_and_resumes_bitwise(tmp_path):
    launch("xtuner_dist_rank.py", 2, "dropin", str(tmp_path), timeout=300)
    assert (tmp_path / "dropin.ok").exists()


def test_two_rank_checkpoint_of_xtuner_swapadamw_is_refused(tmp_path, monkeypatch):
    if xtuner_real.xtuner_module("xtuner.v1.config.optim") is None:
        pytest.skip("XTuner v1 is not importable (set SWAPOPT_XTUNER_SRC to a checkout of InternLM/xtuner)")
    src = os.environ.get("SWAPOPT_XTUNER_SRC")
    if src:  # the ranks find XTuner the same way
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    launch("xtuner_dist_rank.py", 2, "xtuner_swap_ckpt", str(tmp_path), timeout=300)
    message = (tmp_path / "xtuner_swap.err").read_text()
    assert "XTuner's own SwapAdamW" in message and "load_states=False" in message
