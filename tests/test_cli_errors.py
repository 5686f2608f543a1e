"""Start-up mistakes of ``python -m swapopt.train``: one ``error:`` line, exit 2, no traceback, nothing written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import cli_zygote

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")


def train(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "SWAPOPT_DEVICE"}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return cli_zygote.run(["-m", "swapopt.train", *args], cwd=cwd, env=full_env, timeout=300)


def assert_one_error_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder with a file where a folder is expected, a checkpoint dir holding one file, and nothing else."""
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("untouched")
    return tmp_path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


CASES = {
    "device-env-bogus": ({"SWAPOPT_DEVICE": "bogus"}, [], ["SWAPOPT_DEVICE='bogus'", "choose one of"]),
    "device-env-cuda-without-gpu": ({"SWAPOPT_DEVICE": "cuda"}, [], ["SWAPOPT_DEVICE=cuda", "is_available"]),
    "train-device-cuda-without-gpu": ({}, ["train.device=cuda"], ["train.device=cuda"]),
    "unknown-sim-preset": ({}, ["train.sim_preset=a100"], ["train.sim_preset", "h100", "910b"]),
    "missing-data-path": ({}, ["data.path={tmp}/nowhere.txt"], ["data.path=", "no such file"]),
    "metrics-under-a-file": ({}, ["train.metrics_path={tmp}/a_file/m.jsonl"], ["train.metrics_path", "a_file"]),
    "checkpoint-dir-under-a-file": ({}, ["train.checkpoint_dir={tmp}/a_file/run"], ["train.checkpoint_dir", "a_file"]),
    "checkpoint-dir-is-a-file": ({}, ["train.checkpoint_dir={tmp}/a_file"], ["train.checkpoint_dir", "not a directory"]),
    "misspelled-key": ({}, ["train.checkpoint_intervl=5"], ["train.checkpoint_intervl",
                                                              "did you mean train.checkpoint_interval?"]),
    "misspelled-section": ({}, ["optimm.lr=0.1"], ["optimm", "did you mean optim?"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_startup_mistake_is_one_error_line_and_writes_nothing(workdir, name):
    env, options, needles = CASES[name]
    before = snapshot(workdir)
    options = [o.format(tmp=workdir) for o in options]
    done = train(TINY, "--cfg-options", f"train.checkpoint_dir={workdir / 'ckpt'}",
                 f"train.metrics_path={workdir / 'ckpt' / 'm.jsonl'}", *options, env=env, cwd=workdir)
    assert_one_error_line(done, *needles)
    assert snapshot(workdir) == before


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: [128, 256\ntrain:\n  steps: 3\n")
    # The unclosed list of line 2 is found where the parser gives up: line 3 ("train:"), column 6.
    line = assert_one_error_line(train(str(bad)), f"{bad}: line 3, column 6: YAML syntax error")
    assert "<file>" not in line


def test_python_config_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    # The error on line 3, not 1, so that a line number the message made up could not match.
    bad.write_text("x = 1\ny = 2\nmodel = dict(dim=\n")
    assert_one_error_line(train(str(bad)), f"{bad}: line 3: Python syntax error")


def test_plain_cpu_banner_says_the_optimizer_steps_in_place(tmp_path):
    done = train(TINY, "--cfg-options", "train.steps=1", "train.compare_resident=0",
                 env={"SWAPOPT_DEVICE": "cpu"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "simulated" not in done.stdout
    assert "SWAPOPT_DEVICE=cpu: plain CPU" in done.stdout and "steps in place" in done.stdout
    assert "optimizer traffic: none" in done.stdout
    assert "Failed to initialize NumPy" not in done.stderr  # numpy is a dependency
