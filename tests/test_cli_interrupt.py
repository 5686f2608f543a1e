"""Ctrl-C on a running ``python -m swapopt.train``: one line saying where to resume, exit 130, the checkpoint
and the metrics of every finished step kept; also when one long operation holds the main thread."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cli_zygote

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")
LLM_1B = str(ROOT / "configs" / "llm_1b.py")
SMALL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16", "train.batch=2",
         "train.seq_len=16", "train.compare_resident=0", "lr.warmup_steps=1"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SWAPOPT_DEVICE"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(predicate, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "the job ended before it could be interrupted"
        assert time.monotonic() < deadline, "the job did not get far enough in time"
        time.sleep(0.2)


def _interrupt(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return out, err


@pytest.mark.slow
def test_sigint_prints_resume_line_keeps_checkpoint_and_metrics(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [TINY, "--cfg-options", *SMALL, "train.steps=100000", f"train.checkpoint_dir={ckpt}",
            "train.checkpoint_interval=1000", f"train.metrics_path={metrics}", "train.save_on_interrupt=true"]
    proc = subprocess.Popen([sys.executable, "-m", "swapopt.train", *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_steps(metrics)) >= 3, proc, timeout=240)
        out, err = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("interrupted at step "), out
    step = int(last.split("interrupted at step ")[1].split(":")[0])
    assert step >= 3
    saved = ckpt / f"step_{step:08d}"
    assert f"last checkpoint {saved}; resume with: " in last
    assert json.loads((saved / "trainer.json").read_text())["step"] == step  # save_on_interrupt wrote it
    assert _steps(metrics) == list(range(1, step + 1))  # every finished step, once, nothing more

    # The printed command resumes (here told to stop two steps later) and appends each step once.
    command = shlex.split(last.split("resume with: ")[1])
    assert command[:3] == [Path(sys.executable).name, "-m", "swapopt.train"] and command[-2:] == ["--resume", str(saved)]
    argv = [a.replace("train.steps=100000", f"train.steps={step + 2}") for a in command[1:]]
    done = cli_zygote.run(argv, cwd=tmp_path, env=_env(), timeout=300)  # no signal: forked (tests/cli_zygote.py)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _steps(metrics) == list(range(1, step + 3))


# The CLI with one change: the first storage to die on the main thread in step 4 sends SIGINT from inside the
# simulator's weakref callback (Storages._storage_died), so the handler runs where Python swallows exceptions.
FINALIZER_DRIVER = """
import signal, sys, threading
from device.sim.storages import Storages
from swapopt import train
from swapopt.engine.trainer import TrainEngine

armed = []
storage_died, train_step = Storages._storage_died, TrainEngine.train_step

def died(self, ref, *args):
    if armed and threading.current_thread() is threading.main_thread():
        armed.clear()
        signal.raise_signal(signal.SIGINT)  # runs the handler now, inside the callback
    return storage_died(self, ref, *args)

def step(self):
    if self.step == 3:
        armed.append(True)
    return train_step(self)

Storages._storage_died, TrainEngine.train_step = died, step
sys.exit(train.main())
"""


@pytest.mark.slow
def test_sigint_inside_a_storage_finalizer_still_stops_the_run(tmp_path):
    """The flaky case made certain: a Ctrl-C whose KeyboardInterrupt would be raised inside a weakref callback
    (printed and dropped by Python) stops the run at the next safe point, as any other first Ctrl-C."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [TINY, "--cfg-options", *SMALL, "train.steps=100000", f"train.checkpoint_dir={ckpt}",
            "train.checkpoint_interval=1000", f"train.metrics_path={metrics}", "train.save_on_interrupt=true"]
    done = subprocess.run([sys.executable, "-c", FINALIZER_DRIVER, *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    out, err = done.stdout, done.stderr
    assert done.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Exception ignored" not in err, err
    last = out.strip().splitlines()[-1]
    # Step 4 was under way, its update not started: the run stops after step 3, whose checkpoint it saves.
    assert last.startswith(f"interrupted at step 3: last checkpoint {ckpt / 'step_00000003'}; resume with: "), out
    assert json.loads((ckpt / "step_00000003" / "trainer.json").read_text())["step"] == 3
    assert _steps(metrics) == [1, 2, 3]


@pytest.mark.slow
def test_sigint_stops_llm_1b_promptly_even_inside_one_long_operation(tmp_path):
    # One block of the 1B config at its full width and sequence length: single matmuls of tens of GFLOP.
    args = [LLM_1B, "--cfg-options", "model.n_layers=1", "train.steps=3", "train.checkpoint_interval=1"]
    proc = subprocess.Popen([sys.executable, "-m", "swapopt.train", *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        while not any("running on the simulated" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "the job ended before training started"
            lines.append(line)
        time.sleep(3)  # inside the first step's forward
        out, _ = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    model_line = next(line for line in lines if line.startswith("model: "))
    assert "M params" in model_line and "host RAM needed" in model_line and "per step" in model_line
    assert lines.index(model_line) < len(lines) - 1  # printed before training starts
    assert proc.returncode == 130
    # Stopped inside step 1's forward, not after it: a job that waited for the long operations to end would
    # finish that step and write its checkpoint (interval 1) before stopping. No wall-clock bound: a loaded
    # machine makes one slow, and these two facts say the same without it.
    assert "interrupted at step 0" in out
    assert not (tmp_path / "work_dirs" / "llm_1b" / "step_00000001").exists()


@pytest.mark.parametrize(
    ("options", "hint"),
    [
        ({}, "set train.checkpoint_dir and train.save_on_interrupt=true to save one on Ctrl-C"),
        ({"checkpoint_dir": "ckpt"}, "set train.save_on_interrupt=true to save one on Ctrl-C"),
        ({"save_on_interrupt": True}, "set train.checkpoint_dir to save one on Ctrl-C"),
        ({"checkpoint_dir": "ckpt", "save_on_interrupt": True}, "none had been saved when it stopped"),
    ],
)
def test_the_interrupted_line_without_a_checkpoint_names_only_what_is_missing(options, hint):
    from swapopt.engine.config import TrainConfig
    from swapopt.train import interrupted_line

    line = interrupted_line(7, None, [], TrainConfig(**options))
    assert line == f"interrupted at step 7: no checkpoint to resume from ({hint})"
