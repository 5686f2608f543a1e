"""The typed simulator (Note [simulated device type]) judged on a program written for CUDA or Ascend:
tests/sim_typed_program.py, run in a process of its own per flavour (torch names PrivateUse1 once per process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import cli_zygote
PROGRAM = Path(__file__).with_name("sim_typed_program.py")
ROOT = PROGRAM.parent.parent

FLAVOURS = {"h100": ("cuda", "sim"), "910b": ("npu", "npu")}  # preset -> (get_device(), tensors' device type)


@pytest.fixture(scope="module", params=sorted(FLAVOURS))
def seen(request: pytest.FixtureRequest) -> tuple[str, dict]:
    env = {**os.environ, "SWAPOPT_DEVICE": "sim", "SWAPOPT_SIM_PRESET": request.param}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    run = cli_zygote.run([str(PROGRAM)], cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return request.param, json.loads(run.stdout.strip().splitlines()[-1])


def test_device_identity(seen: tuple[str, dict]) -> None:
    preset, s = seen
    flavour, dtype = FLAVOURS[preset]
    assert s["get_device"] == flavour and s["simulated"] is True
    assert s["torch_device"] == f"{dtype}:0"
    # .to(device.torch_device()), .to(device.get_device()) and .cuda()/.npu() all move a CPU-built model
    assert s["moved"] == {"torch_device": f"{dtype}:0", "get_device": f"{dtype}:0", "method": f"{dtype}:0"}
    assert s["data_moved"] == [f"{dtype}:0", True, True]
    if flavour == "npu":
        assert s["torch_npu"] == 8  # `import torch_npu` works and torch.npu answers (SWAPOPT_SIM_DEVICES)


def test_swapped_training_is_bitwise_and_swaps(seen: tuple[str, dict]) -> None:
    _, s = seen
    assert s["bitwise"] is True
    assert s["swap_steps"] == 3 and s["swapped_state_device"] == "cpu"


def test_host_and_device_are_apart(seen: tuple[str, dict]) -> None:
    _, s = seen
    assert s["cpu_copies"] is True  # .cpu() copies: writing the copy leaves the device tensor alone
    assert s["mix_raises"] is True  # a kernel over a device and a host tensor raises, as on CUDA


def test_offload_of_a_plain_optimizer_moves_its_states(seen: tuple[str, dict]) -> None:
    preset, s = seen
    dtype = FLAVOURS[preset][1]
    assert s["offload_freed"] > 0 and s["offloaded_to"] == "cpu"
    assert s["onloaded_to"] == f"{dtype}:0" and s["onload_bitwise"] is True


def test_set_device_places_new_tensors_and_their_memory(seen: tuple[str, dict]) -> None:
    preset, s = seen
    assert s["set_device_1"] == {"tensor": f"{FLAVOURS[preset][1]}:1", "bytes_on_1": 4096}


def test_torch_device_module_streams_order_work(seen: tuple[str, dict]) -> None:
    assert seen[1]["streams"] is True  # torch.cuda.Stream / torch.npu.Stream used directly, as libraries do


def test_save_load_round_trips_on_the_device(seen: tuple[str, dict]) -> None:
    assert seen[1]["saved_loaded"] is True


def test_engine_builds_on_its_ranks_device(seen: tuple[str, dict]) -> None:
    """torchrun's rank with LOCAL_RANK=1 builds its model on device 1: the engine sets the device before it
    asks for the current one (asked first, device 0 becomes current on every rank)."""
    preset, s = seen
    assert s["engine_device"] == f"{FLAVOURS[preset][1]}:1"


def test_fully_shard_moves_a_cpu_built_model_onto_the_meshs_device(pg) -> None:
    # FSDP2 moves each param with `param.data = param.to(device)`, which a CUDA program relies on.
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import device

    dev = device.torch_device()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, device="cpu"), torch.nn.Linear(8, 8, device="cpu"))
    fully_shard(model, mesh=init_device_mesh(dev.type, (1,)))
    assert {p.to_local().device for p in model.parameters()} == {dev}
    model(torch.randn(2, 8, device=dev)).sum().backward()
    assert {p.grad.to_local().device for p in model.parameters()} == {dev}
