"""tests/cli_zygote.py runs a module, code or script as a fresh interpreter would: the same argv, working directory,
sys.path head, environment, output and exit status, and an uncaught exception printed and exit status 1; several at
once (a multi-process job's ranks), each with its own OMP_NUM_THREADS, the ones still running killed past the timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cli_zygote

PROBE = '''
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "probe": os.environ.get("PROBE"),
                  "swapopt": "swapopt" in sys.modules, "name": __name__}))
print("to stderr", file=sys.stderr)
if os.environ.get("PROBE") == "raise":
    raise ValueError("the probe raised")
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
'''


def _both(tmp_path, extra_env: dict[str, str], form: str = "-m") -> tuple[subprocess.CompletedProcess,
                                                                         subprocess.CompletedProcess]:  # fmt: skip
    (tmp_path / "lib").mkdir(exist_ok=True)
    (tmp_path / "lib" / "probe_module.py").write_text(PROBE)
    (tmp_path / "work").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib"), **extra_env}
    head = {"-m": ["-m", "probe_module"], "-c": ["-c", PROBE], "script": [str(tmp_path / "lib" / "probe_module.py")]}
    argv = [*head[form], "a b", "--flag"]
    fresh = subprocess.run([sys.executable, *argv], cwd=tmp_path / "work", env=env, capture_output=True, text=True,
                           timeout=120)
    forked = cli_zygote.run(argv, cwd=tmp_path / "work", env=env, timeout=120)
    return fresh, forked


@pytest.mark.parametrize("form", ["-m", "-c", "script"])
def test_a_forked_child_runs_the_command_as_a_fresh_interpreter_would(tmp_path, form):
    fresh, forked = _both(tmp_path, {"PROBE": "here", "PROBE_EXIT": "3"}, form)
    assert fresh.returncode == forked.returncode == 3
    assert forked.stdout == fresh.stdout and '"probe": "here"' in forked.stdout and '"swapopt": false' in forked.stdout
    assert forked.stderr == fresh.stderr == "to stderr\n"


def test_an_uncaught_exception_is_printed_and_exits_1(tmp_path):
    fresh, forked = _both(tmp_path, {"PROBE": "raise"})
    assert fresh.returncode == forked.returncode == 1
    for done in (fresh, forked):
        assert "Traceback" in done.stderr and done.stderr.rstrip().endswith("ValueError: the probe raised")


# Each child touches its own file, then waits for its peer's: both finish only if they run at the same time.
TOGETHER = '''
import os, pathlib, sys, time, torch
mine, peer = map(pathlib.Path, sys.argv[1:])
mine.touch()
deadline = time.monotonic() + 60
while not peer.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
print(os.environ["WHO"], torch.get_num_threads(), peer.exists())
sys.exit(int(os.environ["CODE"]))
'''


def test_children_started_together_run_at_once_each_with_its_own_environment_and_threads(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    commands = [cli_zygote.Command(["-c", TOGETHER, a, b], tmp_path, {**os.environ, "WHO": "first", "CODE": "0",
                                                                        "OMP_NUM_THREADS": "1"}),
                cli_zygote.Command(["-c", TOGETHER, b, a], tmp_path, {**os.environ, "WHO": "second", "CODE": "4",
                                                                        "OMP_NUM_THREADS": "2"})]  # fmt: skip
    first, second = cli_zygote.run_all(commands, timeout=120)
    # torch read OMP_NUM_THREADS when the zygote imported it: each child takes its own command's, as a fresh one would
    assert (first.returncode, first.stdout) == (0, "first 1 True\n")
    assert (second.returncode, second.stdout) == (4, "second 2 True\n")


def test_past_the_timeout_the_children_still_running_are_killed(tmp_path):
    env = {**os.environ, "WHO": "x", "CODE": "0"}
    quick = cli_zygote.Command(["-c", "print('done')"], tmp_path, env)
    stuck = cli_zygote.Command(["-c", "import time; time.sleep(120)"], tmp_path, env)
    done, killed = cli_zygote.run_all([quick, stuck], timeout=3)
    assert (done.returncode, done.stdout) == (0, "done\n")
    assert killed.returncode == -9  # SIGKILL, as subprocess reports it
    with pytest.raises(subprocess.TimeoutExpired):
        cli_zygote.run(["-c", "import time; time.sleep(120)"], cwd=tmp_path, env=env, timeout=3)
