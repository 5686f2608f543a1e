"""overlap_forward under FSDP2 (fully_shard on a mesh of the simulated device, gloo, 2 ranks on the simulator, sanitizer on):
losses and params bitwise equal with the knob on and off, and the per-unit waits really used.

Run as a script, this file is one rank: ``test_overlap_fsdp.py on|off OUT``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

STEPS = 4


def _rank(mode: str, out: str) -> None:
    import torch.distributed as dist
    from dist_utils import sharded_mlp

    import device
    from swapopt import SwapOptimizer

    assert device.is_simulated()
    device.get_torch_device_module().set_device(int(os.environ["LOCAL_RANK"]))  # each rank its device, as on CUDA
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device.torch_device()
    with dev:  # built on the device, as FSDP2 keeps it (mesh of the device's type)
        model = sharded_mlp((12, 16, 9, 3), world, mesh_device=dev.type)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    opt = SwapOptimizer(inner, swap_optimizer_times=3, overlap_forward=mode == "on")
    opt.attach(model)  # after fully_shard: the unit hooks run before FSDP's all-gather
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(4, 12, generator=g).to(dev)).pow(2).mean()
        if mode == "on" and step:
            assert not opt.operate.pending, "the forward waited for every param's update"
        losses.append(loss.detach().clone())
        loss.backward()
        opt.step()
        if mode == "on":
            assert len(opt.operate.pending) == len(list(model.parameters()))
    opt.wait_for_update()  # before reading the params outside a forward
    full = [p.full_tensor().clone() for p in model.parameters()]
    opt.wait_for_swap_out()
    if rank == 0:
        torch.save({"losses": [l.clone() for l in losses], "params": full}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_ranks_bitwise_equal_on_and_off(sim, tmp_path):  # sim: to load what the ranks saved
    from dist_utils import launch

    runs = {}
    for mode in ("on", "off"):
        out = tmp_path / f"{mode}.pt"
        launch("test_overlap_fsdp.py", 2, mode, str(out))
        runs[mode] = torch.load(out)
    on, off = runs["on"], runs["off"]
    assert len(on["losses"]) == STEPS and len(on["params"]) == 6
    assert all(torch.equal(a, b) for a, b in zip(on["losses"], off["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
    assert not torch.equal(on["losses"][0], on["losses"][-1])  # it trained


if __name__ == "__main__":
    _rank(sys.argv[1], sys.argv[2])
