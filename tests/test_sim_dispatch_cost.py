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
