"""Every corpus program is judged as CUDA would: RACE programs raise StreamRaceError (during the
program or when the simulator exits), OK programs run clean."""

from __future__ import annotations

from collections import Counter

import pytest
import torch.distributed as dist

import simdevice as simulator
from device.sim import StreamRaceError
from sim_corpus import OK, PROGRAMS, RACE


@pytest.fixture(scope="module", autouse=True)
def _single_rank_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_corpus_covers_every_group():
    assert len(PROGRAMS) >= 60
    assert len({p.name for p in PROGRAMS}) == len(PROGRAMS)
    groups = Counter(p.group for p in PROGRAMS)
    expected = {"ordering", "copies", "allocator", "views", "threads", "autograd", "collectives", "compiled", "storages"}
    assert set(groups) == expected
    for group in expected:
        labels = {p.label for p in PROGRAMS if p.group == group}
        assert labels == {OK, RACE}, f"{group} needs both racy and race-free programs"


@pytest.mark.parametrize("prog", PROGRAMS, ids=lambda p: f"{p.group}-{p.name}")
def test_program_is_judged_like_cuda(prog, clean_device_env):
    if prog.label == RACE:
        with pytest.raises(StreamRaceError):
            with simulator.activate() as sim:
                prog.run(sim)
    else:
        with simulator.activate() as sim:
            prog.run(sim)
