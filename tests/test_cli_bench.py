"""``python -m swapopt.bench`` as a new user meets it: no GPU, no matplotlib, a second run the same day."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import cli_zygote

ROOT = Path(__file__).resolve().parents[1]
TINY_SWEEP = ["--sizes", "0.001", "--times", "4", "--slots", "3", "--reference-times", "4", "--e2e", "none",
              "--no-progress"]


def bench(*args: str, pythonpath: list[Path] = (), cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SWAPOPT_DEVICE"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(ROOT), env.get("PYTHONPATH", "")])
    return cli_zygote.run(["-m", "swapopt.bench", *args], cwd=cwd, env=env, timeout=600)


@pytest.mark.slow
def test_without_gpu_falls_back_to_simulator_prints_table_and_never_overwrites(tmp_path):
    first = bench(*TINY_SWEEP, "--out", str(tmp_path))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "no accelerator found: running on the simulated h100 device" in first.stdout
    assert "x bound (modeled)" in first.stdout
    for label in ("swapopt t=4 s=3", "serial", "one-in-flight t=4", "whole", "host-step", "resident-fused"):
        assert f"| {label} |" in first.stdout
    (json_path,) = tmp_path.glob("*.json")
    before = json_path.read_bytes()
    stem = json_path.stem

    second = bench(*TINY_SWEEP, "--strategies", "resident,swapopt", "--out", str(tmp_path))  # lean: names only
    assert second.returncode == 0, second.stdout + second.stderr
    assert json_path.read_bytes() == before
    assert {f"{stem}-2.json", f"{stem}-2.md", f"{stem}-2-chart.png", f"{stem}-2-timeline.png"} <= {
        p.name for p in tmp_path.iterdir()}
    assert str(tmp_path / f"{stem}-2.json") in second.stdout


def test_missing_matplotlib_is_one_error_line_naming_the_extra(tmp_path):
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    done = bench(*TINY_SWEEP, "--out", str(tmp_path / "out"), pythonpath=[tmp_path / "block"])
    assert done.returncode == 2
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "swapopt[bench]" in lines[0], done.stdout
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_help_states_quick_and_full_cost():
    done = bench("--help")
    text = " ".join(done.stdout.split())
    full = text.split("options:")[1].split("--full")[1].split("--sim")[0]
    assert "minutes" in full and "GB of host RAM" in full and "quick" in full
