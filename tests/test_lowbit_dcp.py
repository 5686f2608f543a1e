"""torchao's low-bit optimizers over FSDP2 (DTensor) params, swapped (Note [subclass states] in
swapopt.subclass_state): trained, saved with DCP, resumed in a fresh optimizer (and, for 2 ranks, fresh processes
and process group) and trained on, bitwise to the same torchao optimizer resident trained straight through, on 1
rank (in this process) and 2 (tests/dist_lowbit_dcp.py). Each swapped run also checks that its low-bit states
live on the host as DTensors over pinned parts and that a step moves exactly the parts' bytes.

The resident reference does not go through DCP itself: a resident low-bit state on the simulated device cannot
be saved (DCP copies each state to the host with ``.cpu()``, which there leaves torchao's subclass on the device,
so DCP's writer refuses it: "Tensor must be on CPU"), and its uninterrupted run is the stronger check.
"""

from __future__ import annotations

import pytest
import simdevice as simulator
import torch
from dist_utils import launch

pytest.importorskip("torchao.optim", reason="torchao is not installed")

KINDS = ("8bit", "4bit")


def _jobs(kind: str, d) -> list[str]:
    """Resident straight through 4 steps; swapped 2 steps and a DCP save; a fresh swapped optimizer loads it and
    takes steps 3 and 4."""
    return [
        f"kind={kind},steps=4,dump={d}/resident_{kind}",
        f"kind={kind},swap=1,steps=2,save={d}/ckpt_{kind}",
        f"kind={kind},swap=1,load={d}/ckpt_{kind},start=2,steps=2,dump={d}/resumed_{kind}",
    ]


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name, tensors in a.items():
        assert len(tensors) == len(b[name]), (what, name)
        for i, (x, y) in enumerate(zip(tensors, b[name])):
            assert x.dtype == y.dtype and torch.equal(x, y), (what, name, i)


def _check(d, kind: str, ranks: int) -> None:
    for rank in range(ranks):
        resident = torch.load(f"{d}/resident_{kind}.{rank}")
        resumed = torch.load(f"{d}/resumed_{kind}.{rank}")
        # the first weight's states are the parts (codes, scale, qmap) of two low-bit moments, not fp32 moments
        assert [t.dtype for t in resident["0.weight"]][1] == torch.uint8
        _assert_same(resident, resumed, f"{kind} rank {rank}")


@pytest.mark.slow  # one launch of 2 new ranks: about 7 s, most of it importing torchao and the job itself
def test_two_ranks_resume_in_fresh_processes_bitwise_to_resident(tmp_path):
    launch("dist_lowbit_dcp.py", 2, *(job for kind in KINDS for job in _jobs(kind, tmp_path)))
    for kind in KINDS:
        _check(tmp_path, kind, 2)


def test_one_rank_resume_bitwise_to_resident(pg, tmp_path):
    import dist_lowbit_dcp

    # as in the rank processes (and a training script), torch's default device is the host's: torchao keeps its
    # lr tensor there
    with simulator.host_default():
        for job in _jobs("8bit", tmp_path):
            dist_lowbit_dcp.run(job, 0, 1)
    _check(tmp_path, "8bit", 1)
