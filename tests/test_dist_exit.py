"""A correct multi-process program ends with exit status 0, every time (Note [collective tensors at exit] in
device/sim/device.py): back-to-back 2-rank launches of a user's own script (tests/dist_exit_rank.py), which
ends with a normal interpreter exit. A rank that aborts ("terminate called without an active exception",
SIGABRT: exit status -6) fails the launch. SWAPOPT_EXIT_LAUNCHES sets the number of launches (1 here, to
keep the suite short: every other 2-rank test of the suite fails on a non-zero exit status too; 50 for the full
check)."""

from __future__ import annotations

import os

import pytest
from dist_utils import launch

LAUNCHES = int(os.environ.get("SWAPOPT_EXIT_LAUNCHES", "1"))


@pytest.mark.slow
def test_two_rank_fsdp_dcp_script_exits_normally_every_time(tmp_path):
    for i in range(LAUNCHES):
        # fresh interpreters, whose own exit is the subject; fails on any non-zero exit status
        launch("dist_exit_rank.py", 2, str(tmp_path / f"ckpt{i}"), fresh=True)


def test_collective_tensors_are_held_until_no_cpp_holder_is_left(sim, pg):
    """The mechanism: a tensor a collective took is held by the simulator while the collective's work holds
    it, so that the work's release is never the last reference; once only the simulator holds it, the next
    op or memory query lets go of it (on this thread) and its memory is free again."""
    import torch
    import torch.distributed as dist

    before = sim.memory_allocated()
    x = torch.ones(1024)
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    inner = x._elem if hasattr(x, "_elem") else x
    held = {id(v[1]) for v in sim._held.values()}
    assert id(inner) in held
    del x  # the work still holds the tensor: the simulator keeps it alive...
    assert sim.memory_allocated() == before + 4096
    assert id(inner) in {id(v[1]) for v in sim._held.values()}
    del work, inner  # ...until nothing but the simulator holds it
    assert sim.memory_allocated() == before
    assert not sim._held
