"""The engine with ``optim.overlap_forward``: bitwise the same training, checkpoints and rollouts ordered after
the update, and no train step that makes the host wait for the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import device
from dist_utils import launch_argv
from swapopt.engine.config import load_config
from swapopt.engine.trainer import StepMetrics, TrainEngine

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.py"
SMALL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16", "train.batch=2",
         "train.seq_len=16", "train.steps=6", "train.compare_resident=0", "lr.warmup_steps=1"]


def engine(*options: str) -> TrainEngine:
    return TrainEngine(load_config(TINY, [*SMALL, *options]))


def losses(e: TrainEngine, n: int) -> list[float]:
    return [e.train_step()["loss"] for _ in range(n)]


class HostWaits:
    """Counts every point where the simulated host waits for device work: synchronize (device, stream,
    event), blocking copies, .item() / tolist() of device memory. All of them end in the timeline's
    ``wait_host``, the one place the simulator moves host time up to device time."""

    def __init__(self, sim, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        timeline = sim._timeline
        original = timeline.wait_host

        def counted(until_us: float) -> None:
            self.count += 1
            original(until_us)

        monkeypatch.setattr(timeline, "wait_host", counted)


@pytest.mark.parametrize("overlap", [False, True])
def test_train_steps_never_make_the_host_wait_for_the_device(sim, monkeypatch, overlap):
    e = engine(f"optim.overlap_forward={overlap}")
    assert e.overlap is overlap
    e.train_step()  # the first step builds states and plans
    waits = HostWaits(sim, monkeypatch)
    pending = [e.train_step() for _ in range(4)]
    assert waits.count == 0
    assert all(isinstance(m, StepMetrics) and not m.resolved for m in pending)
    assert [m.step for m in pending] == [2, 3, 4, 5]
    # Reading the metrics is where the host waits, once per step read, and only then.
    values = [m.resolve() for m in pending]
    assert waits.count > 0
    assert [v["step"] for v in values] == [2, 3, 4, 5]
    assert all(v["step_ms"] > 0 and v["forward_ms"] > 0 and v["swap_ms"] > 0 for v in values)


def test_losses_params_and_states_are_bitwise_equal_with_overlap_on_and_off(sim):
    on, off = engine("optim.overlap_forward=true"), engine("optim.overlap_forward=false")
    assert on.optimizer.overlap_forward and not off.optimizer.overlap_forward
    assert losses(on, 5) == losses(off, 5)
    on.wait_for_update()
    for a, b in zip(on.model.parameters(), off.model.parameters()):
        assert torch.equal(a, b)
    on.optimizer.wait_for_swap_out()
    off.optimizer.wait_for_swap_out()
    for a, b in zip(on.model.parameters(), off.model.parameters()):
        state_on, state_off = on.optimizer.state[a], off.optimizer.state[b]
        assert state_on.keys() == state_off.keys()
        for key in state_on:
            assert torch.equal(state_on[key], state_off[key]), key
            if key != "step":
                assert device.is_host_tensor(state_on[key]), key


def test_checkpoint_and_rollout_right_after_an_overlapped_step_see_the_updated_params(sim, tmp_path):
    # A save or an offload right after step() reads params the update stream may still be writing: they must be
    # ordered after the update (the sanitizer of the `sim` fixture reports any unordered read), and what is
    # saved and resumed must continue exactly as a run with overlap off.
    straight = losses(engine("optim.overlap_forward=false"), 4)
    first = engine("optim.overlap_forward=true", f"train.checkpoint_dir={tmp_path}")
    got = losses(first, 1)
    first.rollout(buffer_mb=1.0)
    got += losses(first, 1)
    saved = first.save_checkpoint()
    assert saved.name == "step_00000002"
    resumed = engine("optim.overlap_forward=true", f"train.resume={tmp_path}")
    assert resumed.step == 2
    got += losses(resumed, 2)
    assert got == straight


def _two_ranks(*args: str) -> None:
    """The main job as 2 torchrun-style ranks (tests/dist_utils.py's launch: torchrun's environment and rendezvous,
    the ranks forked from a process that imported torch; tests/test_train.py runs torchrun itself)."""
    launch_argv(["-m", "swapopt.train", str(TINY), "--cfg-options", *SMALL, *args], 2, timeout=300)


@pytest.mark.slow
def test_two_rank_fsdp2_engine_is_bitwise_equal_with_overlap_on_and_off(tmp_path):
    rows = {}
    for overlap in (False, True):
        path = tmp_path / f"overlap_{overlap}.jsonl"
        _two_ranks("train.steps=3", "train.log_interval=2", f"optim.overlap_forward={overlap}",
                   f"train.metrics_path={path}")
        rows[overlap] = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows[True]] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in rows[True]] == [r[key] for r in rows[False]], key
