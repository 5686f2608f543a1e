"""Backward on the simulated device ends as on hardware (Note [backward on the caller's thread]): an error
inside the pass (an op's, a tensor hook's), or a Ctrl-C during it, reaches backward()'s caller when the
pass returns, with every gradient written, instead of ending the process. Each case runs in its own process: the failure it guards
against is a std::terminate."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

import cli_zygote

ROOT = Path(__file__).resolve().parents[1]

_PROGRAM = """
import signal, torch
from device.sim import activate, OutOfMemoryError
with activate(ACTIVATE) as dev:
    lin = torch.nn.Linear(8, 8).to(dev.torch_device())
    x = torch.randn(4, 8).to(dev.torch_device())
    h = lin(x)
    REGISTER(HOOK)
    loss = lin(h).sum()
    try:
        loss.backward()
        print("returned")
    except BaseException as err:
        print(type(err).__name__)
    print("weight grad", lin.weight.grad is not None, "bias grad", lin.bias.grad is not None)
"""


def _run(hook: str, prelude: str = "", register: str = "h.register_hook", activate: str = "") -> subprocess.CompletedProcess:
    program = _PROGRAM.replace("HOOK", hook).replace("REGISTER", register).replace("ACTIVATE", activate)
    code = textwrap.dedent(prelude) + program
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("SWAPOPT_DEVICE", None)
    # forked from a process that imported torch once (tests/cli_zygote.py): a std::terminate still ends only it
    return cli_zygote.run(["-c", code], cwd=os.getcwd(), env=env, timeout=300)


def test_ctrl_c_during_backward_raises_when_the_pass_returns():
    run = _run("lambda g: signal.raise_signal(signal.SIGINT)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == "KeyboardInterrupt weight grad True bias grad True".split(), run.stdout


def test_ctrl_c_during_backward_goes_to_the_callers_handler():
    # The handler installed when backward() began gets the signal once the pass is over (here it counts).
    prelude = """
    import signal
    seen = []
    signal.signal(signal.SIGINT, lambda *a: seen.append(a[0]))
    import atexit
    atexit.register(lambda: print("handled", len(seen)))
    """
    run = _run("lambda g: signal.raise_signal(signal.SIGINT)", prelude)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == "returned weight grad True bias grad True handled 1".split(), run.stdout


def test_ignored_ctrl_c_during_backward_stays_ignored():
    run = _run("lambda g: signal.raise_signal(signal.SIGINT)", "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == "returned weight grad True bias grad True".split(), run.stdout


def test_out_of_memory_inside_backward_raises_when_the_pass_returns():
    # The hook asks for more than the device holds: the error is kept and raised by backward() itself.
    run = _run("lambda g: [torch.empty(1 << 20, dtype=torch.uint8, device=dev.torch_device()), None][1]",
               activate="capacity_bytes=1 << 16")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == "OutOfMemoryError weight grad True bias grad True".split(), run.stdout


@pytest.mark.parametrize("register", ["h.register_hook", "lin.weight.register_post_accumulate_grad_hook"])
def test_a_tensor_hooks_error_raises_when_the_pass_returns(register):
    prelude = """
    def boom(*args):
        raise ValueError("a hook failed")
    """
    run = _run("boom", prelude, register=register)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == "ValueError weight grad True bias grad True".split(), run.stdout
