"""XTuner's MoE model (Qwen3-MoE, tiny) with XTuner's own AdamWConfig(swap_optimizer=True) after use_swapopt():
trains bitwise like XTuner's plain AdamW, saves and resumes bitwise against an uninterrupted run, and the fused
expert weights are cut across chunks. 1 rank in process, 2 ranks as torchrun-style processes (FSDP2).

Needs XTuner v1 (see tests/xtuner_real.py and tests/xtuner_check.sh); skips without it."""

from __future__ import annotations

import importlib.machinery
import math
import os

import pytest
import torch
import xtuner_real  # before XTuner: it may put a checkout on sys.path
from dist_utils import launch

# Imported at collection, before any simulator is active: XTuner resolves its device at import and here sees the
# host, so the 1-rank test runs without triton (XTuner's cuda modules import it). The 2-rank test's ranks import it
# under the simulator and see cuda. tests/xtuner_moe_ops.py replaces the MoE kernels that cannot run in either case.
HAVE_MOE = all(
    xtuner_real.xtuner_module(m) is not None for m in ("xtuner.v1.config.optim", "xtuner.v1.model.moe.qwen3")
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.skipif(
        not HAVE_MOE,
        reason="XTuner v1's MoE model is not importable (set SWAPOPT_XTUNER_SRC to a checkout of InternLM/xtuner; "
        "its model package needs cyclopts and ray)",
    ),
]

if HAVE_MOE:
    import xtuner_moe_ops
    from test_integration_xtuner import assert_same, snapshot
    from xtuner_moe import MoETrainEngine, expert_chunks
    from xtuner_standin import train

    from swapopt import SwapOptimizer
    from swapopt.integrations.xtuner import use_swapopt

CFG = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, foreach=True)
# swap_optimizer_times: 280 KiB of Adam states in 6 chunks of about 47 KiB, so each layer's 64 KiB of fused_w1w3
# states must be cut.
TIMES = 6


@pytest.fixture
def moe_ops():
    with xtuner_moe_ops.install():
        yield


def test_moe_trains_saves_and_resumes_bitwise_with_experts_chunked(pg, moe_ops, tmp_path):
    cls = xtuner_real.xtuner_module("xtuner.v1.config.optim").AdamWConfig
    Engine = type("TrainEngine", (MoETrainEngine,), {})
    use_swapopt(cls, engine_cls=Engine)

    plain = Engine(cls(**CFG))
    assert type(plain.optimizer) is torch.optim.AdamW
    train(plain, 0, 4)  # uninterrupted, XTuner's plain AdamW
    expected = snapshot(plain)

    swap = Engine(cls(**CFG, swap_optimizer=True, swap_optimizer_times=TIMES))
    assert isinstance(swap.optimizer, SwapOptimizer)
    losses = [swap.train_step(0)]
    assert math.isfinite(losses[0])
    swap.step_optimizer(swap.clip_grad_norm())
    train(swap, 1, 1)
    swap.save_dcp(tmp_path / "swap2")
    train(swap, 2, 2)
    stats = swap.optimizer.swap_stats()
    assert stats.h2d_bytes > 0 and stats.d2h_bytes > 0
    assert_same(snapshot(swap), expected)  # uninterrupted, swapopt: bitwise XTuner's plain AdamW

    # Expert weights chunked: every fused expert weight is in the plan, some are cut across chunks, and the
    # experts are spread over several chunks (not one chunk holding them all).
    held = expert_chunks(swap)
    assert len(held) == 4 and all(held.values()), held  # fused_w1w3 and fused_w2 of 2 layers
    assert any(len(ks) > 1 for ks in held.values()), held
    assert len(set().union(*held.values())) > 1, held
    assert len(swap.optimizer._layout.prepared.plan.chunks) > 2

    # Resume from the step-2 checkpoint in a fresh engine (other init), 2 more steps: bitwise the uninterrupted runs.
    resumed = Engine(cls(**CFG, swap_optimizer=True, swap_optimizer_times=TIMES), seed=7)
    resumed.load_dcp(tmp_path / "swap2")
    train(resumed, 2, 2)
    assert_same(snapshot(resumed), expected)
    # and XTuner's plain AdamW resumes bitwise from swapopt's MoE checkpoint too
    plain_resumed = Engine(cls(**CFG), seed=7)
    plain_resumed.load_dcp(tmp_path / "swap2")
    train(plain_resumed, 2, 2)
    assert_same(snapshot(plain_resumed), expected)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.machinery.PathFinder.find_spec("triton", xtuner_real.cuda_paths()) is None,
    reason="the ranks run the simulator's cuda flavour, where XTuner's MoE model imports triton: set "
    "SWAPOPT_TRITON_PATH (and SWAPOPT_PKG_RESOURCES_PATH) as tests/xtuner_real.py says",
)
def test_two_rank_moe_trains_and_resumes_bitwise(tmp_path, monkeypatch):
    """The ranks import XTuner after the simulator is up (SWAPOPT_DEVICE=sim), so XTuner resolves cuda there and
    runs its cuda MoE layers, its Triton grouped GEMM replaced (tests/xtuner_moe_ops.py)."""
    src = os.environ.get("SWAPOPT_XTUNER_SRC")
    # the ranks find XTuner the same way, and triton (and pkg_resources) on the paths of their processes only
    paths = [*xtuner_real.cuda_paths(), *filter(None, [src, os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    launch("xtuner_dist_rank.py", 2, "moe", str(tmp_path), timeout=420)
    module, resolved = (tmp_path / "moe.ok").read_text().split()
    assert module.startswith("xtuner.") and resolved == "cuda"
