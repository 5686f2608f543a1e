"""tests/cli_zygote.py runs a module, code or script as a fresh interpreter would: the same argv, working directory,
sys.path head, environment, output and exit status, and an uncaught exception printed and exit status 1."""

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
