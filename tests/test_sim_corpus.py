"""Every corpus program is judged as CUDA would: RACE programs raise StreamRaceError (during the
program or when the simulator exits) for the race they are labelled with, OK programs run clean."""

from __future__ import annotations

from collections import Counter

import pytest
import torch.distributed as dist

import simdevice as simulator
from device.sim import StreamRaceError
from sim_corpus import OK, PROGRAMS, RACE


@pytest.fixture(autouse=True)
def _single_rank_group():
    """The collectives programs start a one-rank group; it ends with the program, not with the module, so
    no later test finds a process group it did not make."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_corpus_covers_every_race_kind_and_host_read():
    """Each sanitizer check has programs of its own: access races, use-after-free races, and every host
    read outside the dispatcher that README names (tolist, numpy, DLPack, torch.save)."""
    races = [p for p in PROGRAMS if p.label == RACE]
    assert {p.kind for p in races} == {"access", "free"}
    assert {"Tensor.tolist", "Tensor.numpy", "Tensor.__dlpack__", "torch.save"} <= {p.op for p in races}


def test_corpus_covers_every_group():
    assert len(PROGRAMS) >= 60
    assert len({p.name for p in PROGRAMS}) == len(PROGRAMS)
    groups = Counter(p.group for p in PROGRAMS)
    expected = {
        "ordering", "copies", "aliases", "allocator", "views", "threads", "autograd", "collectives", "compiled", "storages",
    }  # fmt: skip
    assert set(groups) == expected
    for group in expected:
        labels = {p.label for p in PROGRAMS if p.group == group}
        assert labels == {OK, RACE}, f"{group} needs both racy and race-free programs"


@pytest.mark.parametrize("prog", PROGRAMS, ids=lambda p: f"{p.group}-{p.name}")
def test_program_is_judged_like_cuda(prog, clean_device_env):
    if prog.label == RACE:
        with pytest.raises(StreamRaceError) as caught:
            with simulator.activate() as sim:
                prog.run(sim)
        # Any race would do for pytest.raises; the labelled one must be what is reported, so a check of the
        # sanitizer that stops working cannot hide behind another one firing.
        err = caught.value
        assert err.kind == prog.kind, str(err)
        assert err.op == prog.op, str(err)
        assert err.earlier_op == prog.earlier, str(err)
        if prog.kind == "access":
            assert err.access is not None and err.earlier is not None
            assert err.access.write or err.earlier.write, "a race needs a write"
            assert err.stream != err.earlier_stream, "one stream orders its own work"
    else:
        with simulator.activate() as sim:
            prog.run(sim)
