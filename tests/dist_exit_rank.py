"""One rank of a user's own 2-rank script, as torchrun would start it (launched by tests/test_dist_exit.py):
gloo, FSDP2 on a mesh of the simulated device, SwapOptimizer, a DCP save, training on, a DCP load into a
fresh model and optimizer, and the resumed run bitwise equal to the uninterrupted one on both ranks. It ends
as a plain script does: destroy_process_group and a normal interpreter exit (no os._exit, no barrier).
Usage: dist_exit_rank.py CHECKPOINT_DIR"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import device
from swapopt import SwapOptimizer


def build(world_size: int) -> tuple[nn.Module, SwapOptimizer]:
    torch.manual_seed(0)
    dev = device.torch_device()
    with dev:  # built on the device, as FSDP2 keeps it (a mesh of the device's type)
        model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    mesh = init_device_mesh(dev.type, (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    return model, SwapOptimizer(inner, swap_optimizer_times=3)


def train(model: nn.Module, opt: SwapOptimizer, start: int, steps: int, rank: int) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 6, generator=g).to(device.torch_device())
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    device.get_torch_device_module().set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    checkpoint = sys.argv[1]
    model, opt = build(world_size)
    train(model, opt, 0, 2, rank)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=checkpoint)  # fmt: skip
    train(model, opt, 2, 2, rank)
    want = [p.full_tensor().cpu() for p in model.parameters()]

    resumed, resumed_opt = build(world_size)
    sd = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_opt)}
    dcp.load(sd, checkpoint_id=checkpoint)
    set_model_state_dict(resumed, sd["model"])
    set_optimizer_state_dict(resumed, resumed_opt, sd["optim"])
    train(resumed, resumed_opt, 2, 2, rank)
    got = [p.full_tensor().cpu() for p in resumed.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(want, got))
    print(f"rank {rank}: resumed bitwise equal: {same}", flush=True)
    if not same:
        sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
