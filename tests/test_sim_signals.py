"""Ctrl-C while a simulated op runs Python (Note [signals inside simulated ops] in device/sim/signals.py): the
program's handler gets the signal when the op returns, outside the simulator's frames, as on a device where the
op is C++. Each case runs in its own process: what it guards against is a std::terminate."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import cli_zygote

ROOT = Path(__file__).resolve().parents[1]

# A saved-tensor hook is Python that torch calls inside an op (activation checkpointing installs such hooks): a
# Ctrl-C raised there lands inside the simulator's torch-function frame of the op.
_PROGRAM = """
import signal, torch
from device.sim import activate, host_time
depths = []
def handler(signum, frame):
    depths.append(host_time.depth())
    HANDLER_BODY
signal.signal(signal.SIGINT, handler)
def pack(t):
    signal.raise_signal(signal.SIGINT)
    return t
with activate() as dev:
    lin = torch.nn.Linear(8, 8).to(dev.torch_device())
    x = torch.randn(4, 8, requires_grad=True).to(dev.torch_device())
    inside = signal.getsignal(signal.SIGINT) is not handler
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = lin(x)
        print("returned", tuple(y.shape))
    except KeyboardInterrupt:
        print("KeyboardInterrupt")
    print("handler depths", depths)
    y = lin(x)  # the simulator goes on
    signal.raise_signal(signal.SIGINT)  # outside any op: at once
    print("depths after", depths)
print("gated", inside, "restored", signal.getsignal(signal.SIGINT) is handler)
"""


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a process of its own (forked from the CLI zygote), on the simulator picked by the code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("SWAPOPT_DEVICE", None)
    return cli_zygote.run(["-c", code], cwd=os.getcwd(), env=env, timeout=300)


def _run(handler_body: str) -> tuple[int, str, str]:
    run = _python(textwrap.dedent(_PROGRAM.replace("HANDLER_BODY", handler_body)))
    return run.returncode, run.stdout, run.stderr


def test_ctrl_c_inside_an_op_raises_when_the_op_returns():
    rc, out, err = _run("if len(depths) == 1: raise KeyboardInterrupt")
    assert rc == 0, err[-3000:]
    # The handler ran once the op had returned (no simulator frame open), and its KeyboardInterrupt came out of
    # the op's call; the later Ctrl-C, outside any op, reached it at once.
    assert out.split("\n")[:4] == ["KeyboardInterrupt", "handler depths [0]", "depths after [0, 0]",
                                   "gated True restored True"], out


def test_ctrl_c_inside_an_op_reaches_a_handler_that_does_not_raise_once():
    rc, out, err = _run("pass")
    assert rc == 0, err[-3000:]
    assert out.split("\n")[:4] == ["returned (4, 8)", "handler depths [0]", "depths after [0, 0]",
                                   "gated True restored True"], out


def test_ignored_ctrl_c_stays_ignored_and_is_not_gated():
    code = textwrap.dedent("""
    import signal, torch
    from device.sim import activate
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with activate() as dev:
        gated = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        x = torch.ones(4).to(dev.torch_device())
        with torch.autograd.graph.saved_tensors_hooks(lambda t: [signal.raise_signal(signal.SIGINT), t][1], lambda t: t):
            y = (x.requires_grad_() * 2).sum()
    print("gated", gated, "ignored", signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
    """)
    run = _python(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == "gated False ignored True".split(), run.stdout


# Training steps (activation checkpointing, backward, a swapped step) under a Ctrl-C every 2 ms for 3 seconds: each
# lands wherever the main thread is. Without the gate this ended in std::terminate within the 3 seconds in each of
# five runs; the main job's Ctrl-C test met it once in some 60 runs.
_STORM = """
import os, signal, sys, threading, time, torch
from torch.utils.checkpoint import checkpoint
from device.sim import activate
import swapopt
armed, caught, swallowed = [False], [0], [0]
def handler(signum, frame):
    if armed[0]:  # raises only inside the try below
        armed[0] = False
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, handler)
sys.unraisablehook = lambda u: swallowed.append(u)  # a Ctrl-C inside a finalizer between ops, as Python drops it
with activate() as dev:
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
                                 for _ in range(3)).to(dev.torch_device())
    opt = swapopt.SwapOptimizer(torch.optim.AdamW(blocks.parameters(), fused=True), swap_optimizer_times=2)
    x = torch.randn(8, 32).to(dev.torch_device())
    done, stop = threading.Event(), time.monotonic() + 3.0
    def storm():
        while not done.is_set():
            time.sleep(0.002)
            os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=storm, daemon=True).start()
    steps = 0
    while time.monotonic() < stop:
        armed[0] = True
        try:
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False)
            h.square().mean().backward()
            opt.step()
            opt.zero_grad()
            steps += 1
        except KeyboardInterrupt:
            caught[0] += 1
        armed[0] = False
    done.set()
    time.sleep(0.01)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
print("steps", steps, "caught", caught[0])
"""


def test_a_storm_of_ctrl_c_through_training_steps_never_ends_the_process():
    run = _python(_STORM)
    assert run.returncode == 0, run.stderr[-3000:]
    words = run.stdout.split()
    assert words[0] == "steps" and words[2] == "caught" and int(words[3]) > 100, run.stdout


def test_a_ctrl_c_held_in_an_op_goes_to_the_main_thread_not_to_a_worker_whose_op_returns_first():
    # Noted while the main thread was inside an op; a worker thread's op then returns before the main thread's next
    # one: the handler runs on the main thread, as Python runs every signal handler.
    code = textwrap.dedent("""
    import threading, torch
    from device.sim import activate, signals
    seen = []
    with activate() as dev:
        x = torch.ones(4).to(dev.torch_device())
        signals.OWED.append((lambda signum, frame: seen.append(threading.current_thread().name), 2, None))
        worker = threading.Thread(target=lambda: x.add(1), name="worker")
        worker.start()
        worker.join()
        print("after the worker's op", seen)
        x.add(1)
        print("after the main thread's op", seen)
    """)
    run = _python(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["after the worker's op []", "after the main thread's op ['MainThread']"], run.stdout
