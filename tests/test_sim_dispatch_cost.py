"""What the simulator does to keep its per-op host cost down, checked for what it must not change: the collector
paused only while an op is handled (Note [garbage collection inside an op] in device/sim/modes.py), Dynamo kept out
of the dispatch mode without torch's wrapper frame (device/sim/frames.py), storages freed by a plain weak
reference's callback (Storages._register), and a block left open at exit closing quietly."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import torch

import device
from device.sim import host_time


def test_the_collector_does_not_run_inside_an_op_and_is_left_as_found(sim):
    params = [torch.zeros(4, device=sim.torch_device()) for _ in range(3000)]
    inside: list[str] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and host_time._local.depth:  # a collection while simulator frames run
            inside.append(f"generation {info['generation']}")

    gc.callbacks.append(watch)
    try:
        assert gc.isenabled()
        # One op over 3000 tensors makes tens of thousands of tracked objects: the young generation's
        # threshold (700) would be crossed many times inside it.
        torch._foreach_add_(params, 1.0)
        assert gc.isenabled()  # turned back on after the op
        gc.disable()
        try:
            torch._foreach_add_(params, 1.0)
            assert not gc.isenabled()  # a program that turned it off keeps it off
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(watch)
    assert inside == []
    assert all(p.tolist() == [2.0] * 4 for p in params[::997])


def test_dynamo_leaves_the_dispatch_mode_alone(sim):
    from torch._dynamo.utils import counters

    @torch.compile(backend="eager")
    def scaled(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        print(end="")  # a graph break
        return y + 1

    counters.clear()
    x = torch.ones(8, device=sim.torch_device())
    assert scaled(x).tolist() == [3.0] * 8
    # Dynamo runs compiled code eagerly under a dispatch mode, and must not compile the simulator's own frames.
    assert sum(counters["frames"].values()) == 0


def test_storages_free_their_blocks_when_they_die(sim):
    before = sim.memory_allocated()
    x = torch.empty(1024, device=sim.torch_device())
    views = [x[i::2] for i in range(2)]
    assert sim.memory_allocated() == before + 4096
    del x
    assert sim.memory_allocated() == before + 4096  # the views keep the storage
    del views
    assert sim.memory_allocated() == before
    assert not sim._finalizers or all(ref() is not None for ref, _, _ in sim._finalizers.values())


def test_a_block_left_open_at_exit_closes_quietly():
    program = textwrap.dedent(
        """
        import torch, device
        from device import sim
        dev = sim.activate("h100").__enter__()  # never closed: the interpreter's teardown closes it
        x = torch.ones(3, device=device.torch_device())
        print(float(x.sum()))
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3.0"
    assert done.stderr == "", done.stderr


def test_attribute_reads_of_simulated_tensors_run_no_python(sim):
    """A device tensor's ``.grad`` or ``.dtype`` is a C++ getter; torch's default ``__torch_function__`` would run
    Python for every such read of a subclass (1.3 us against 0.16 for ``p.grad`` on a 2-core host), charged as the
    program's host time. Simulated tensors leave it off: torch sees no override, and their ops still come back as
    simulated tensors from the dispatch."""
    where = device.torch_device()
    p = torch.nn.Parameter(torch.zeros(4, device=where))
    p.grad = torch.ones(4, device=where)
    # what torch checks for an argument's override: the type's __torch_function__ against the disabled one
    assert all(type(t).__torch_function__ is torch._C._disabled_torch_function_impl for t in (p, p.grad))
    assert type(p.grad) is type(p) and p.grad.device == p.device and p.dtype == torch.float32
    out = torch.stack([p.detach(), p.grad]) * 2
    assert type(out) is type(p) and out.device == p.device
    assert isinstance(p, torch.nn.Parameter)
