"""FSDP2 (fully_shard on a mesh of the simulated device, gloo) + DCP with SwapOptimizer(AdamW), each run in fresh processes on
the simulator: resume is bitwise equal to an uninterrupted run, and checkpoints reshard between 2 and 1 ranks.
The model's dims (7, 5, 3 rows) do not divide by 2, so shards are uneven. The rank processes are new ones that
share nothing with the run that saved (forked from a process that imported only torch: tests/dist_utils.py's
launch); tests/test_dist_exit.py runs such a job in fresh interpreters."""

from __future__ import annotations

import pytest
import torch
from dist_utils import launch

pytestmark = pytest.mark.slow


def assert_same(a: dict, b: dict, path: str = "") -> None:
    """Nested dicts/lists of tensors and values: same keys, and tensors of equal shape, dtype and bits."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{path}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert torch.equal(a, b), f"{path} differs"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three launches of fresh processes; each test below compares the files they leave."""
    d = tmp_path_factory.mktemp("fsdp")
    launch("dist_fsdp_ckpt.py", 2,
           f"steps=6,dump={d}/full6.pt",
           f"plain=1,steps=6,dump={d}/plain6.pt",
           f"steps=3,save={d}/ckpt3,dump={d}/full3.pt")
    launch("dist_fsdp_ckpt.py", 1,
           f"load={d}/ckpt3,dump={d}/ckpt3_on_1.pt",
           f"steps=3,save={d}/ckpt1,dump={d}/saved_on_1.pt")
    launch("dist_fsdp_ckpt.py", 2,
           f"load={d}/ckpt3,start=3,steps=3,dump={d}/resumed.pt",
           f"load={d}/ckpt1,dump={d}/ckpt1_on_2.pt",
           f"loadfull={d}/full3.pt,dump={d}/full3_via_load_state_dict.pt",
           f"broadcast={d}/full3.pt,dump={d}/full3_via_broadcast.pt")
    # The dumps are full state dicts offloaded to the host (cpu_offload): they load without a simulator.
    return lambda name: torch.load(d / name)


def test_resume_in_fresh_processes_is_bitwise_equal_to_uninterrupted(runs):
    full6 = runs("full6.pt")
    assert_same(full6, runs("resumed.pt"))
    # And the swapped FSDP2 run is the plain AdamW run, bit for bit.
    assert_same(full6, runs("plain6.pt"))
    assert full6["optim"]["state"]["0.weight"]["exp_avg"].shape == (7, 6)


def test_save_with_two_ranks_load_with_one(runs):
    assert_same(runs("full3.pt"), runs("ckpt3_on_1.pt"))


def test_save_with_one_rank_load_with_two(runs):
    assert_same(runs("saved_on_1.pt"), runs("ckpt1_on_2.pt"))


def test_full_state_dict_loads_into_uneven_shards(runs):
    assert_same(runs("full3.pt"), runs("full3_via_load_state_dict.pt"))
    assert_same(runs("full3.pt"), runs("full3_via_broadcast.pt"))


@pytest.fixture(scope="module")
def master_runs(tmp_path_factory):
    """bf16 shards with master_weights on 2 ranks: uninterrupted, the recipe, and a DCP resume in the middle."""
    d = tmp_path_factory.mktemp("fsdp_masters")
    launch("dist_fsdp_ckpt.py", 2,
           f"mw=1,steps=6,dump={d}/full6.pt",
           f"mw=1,recipe=1,steps=6,dump={d}/recipe6.pt",
           f"mw=1,steps=3,save={d}/ckpt3")
    launch("dist_fsdp_ckpt.py", 2, f"mw=1,load={d}/ckpt3,start=3,steps=3,dump={d}/resumed.pt")
    return lambda name: torch.load(d / name)


def test_master_weights_on_two_ranks_match_the_recipe_and_resume_bitwise(master_runs):
    full = master_runs("full6.pt")
    assert all(v.dtype == torch.bfloat16 for v in full["model"].values())
    assert_same(full["model"], master_runs("recipe6.pt")["model"])
    # the masters go through DCP with the states: the resumed run continues bitwise, masters included
    masters = [k for st in full["optim"]["state"].values() for k in st if k == "master_weight"]
    assert len(masters) == len(full["model"])
    assert_same(master_runs("resumed.pt"), full)
