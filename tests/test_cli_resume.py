"""Resuming ``python -m swapopt.train``: bad shards, a different model, a finished run, and a metrics file
that holds each step once."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import cli_zygote

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")
SMALL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16", "train.batch=2",
         "train.seq_len=16", "train.compare_resident=0", "lr.warmup_steps=1"]


def train(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SWAPOPT_DEVICE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return cli_zygote.run(["-m", "swapopt.train", TINY, *args], cwd=ROOT, env=env, timeout=300)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def one_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stdout
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def run_of_four(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Four steps with checkpoints at 2 and 4, and their metrics."""
    tmp = tmp_path_factory.mktemp("resume")
    ckpt, metrics = tmp / "ckpt", tmp / "m.jsonl"
    done = train("--cfg-options", *SMALL, "train.steps=4", f"train.checkpoint_dir={ckpt}",
                 "train.checkpoint_interval=2", f"train.metrics_path={metrics}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000002", "step_00000004"]
    return ckpt, rows(metrics)


@pytest.mark.slow
def test_resume_behind_the_metrics_file_writes_each_step_once_and_bitwise(run_of_four, tmp_path):
    ckpt, straight = run_of_four
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in straight))  # the run got to step 4, saved at 2
    done = train("--resume", str(ckpt / "step_00000002"), "--cfg-options", *SMALL, "train.steps=4",
                 f"train.metrics_path={metrics}")
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = rows(metrics)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_trains_nothing(run_of_four):
    ckpt, _ = run_of_four
    done = train("--resume", str(ckpt), "--cfg-options", *SMALL, "train.steps=4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step_00000004 is at step 4 and train.steps is 4, so this run is finished" in done.stdout
    assert "done:" not in done.stdout


@pytest.mark.slow
def test_different_model_config_names_the_keys(run_of_four):
    ckpt, _ = run_of_four
    line = one_error(train("--resume", str(ckpt), "--cfg-options", *SMALL, "train.steps=6", "model.dim=64",
                           "model.n_layers=3"))
    assert "model.dim: checkpoint 32, config 64" in line and "model.n_layers: checkpoint 2, config 3" in line
    assert "trainer.json" in line


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_bad_shard_names_the_file_and_suggests_the_previous_step(run_of_four, tmp_path, damage):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(run_of_four[0], ckpt)
    (shard,) = (ckpt / "step_00000004").glob("*.distcp")
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    else:
        shard.unlink()
    line = one_error(train("--resume", str(ckpt), "--cfg-options", *SMALL, "train.steps=6"))
    assert str(shard) in line and ("truncated" if damage == "truncate" else "missing") in line
    assert f"--resume {ckpt / 'step_00000002'}" in line
