"""One rank of the FSDP2 + DCP checkpoint tests (launched by tests/test_dcp_fsdp.py, torchrun-style env).

Trains a tiny model whose dims do not divide by the world size, sharded with ``fully_shard`` on a mesh of
the (simulated) device (gloo), with SwapOptimizer(AdamW) (or plain AdamW: ``plain=1``). Optionally loads a DCP checkpoint
first, saves one after training, and dumps the full params and optimizer states (gathered) to a file.
Usage: dist_fsdp_ckpt.py JOB [JOB ...], a JOB being e.g. ``load=DIR,start=3,steps=3,dump=FILE``; ``mw=1``: bf16
params with master_weights (``recipe=1``: the hand-written master-weights recipe instead of SwapOptimizer).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import device
from dist_utils import end_rank, live_device_bytes, sharded_mlp
from swapopt import SwapOptimizer


class Recipe:
    """Note [master weights]'s recipe over FSDP2's bf16 shards, resident: fp32 DTensor masters stepped by a plain
    AdamW with master.grad = p.grad.float(), then p.copy_(master)."""

    def __init__(self, model) -> None:
        self.params = list(model.parameters())
        self.masters = [p.detach().float() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-2, weight_decay=0.1, foreach=True)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def build(world_size: int, plain: bool, masters: bool = False, recipe: bool = False):
    # 7, 5 and 3 rows: uneven shards on 2 ranks (4+3, 3+2, 2+1). ``masters``: bf16 params, master_weights.
    dtype = torch.bfloat16 if masters else torch.float32
    with device.torch_device():  # built on the device, as FSDP2 keeps it (mesh of the device's type)
        model = sharded_mlp((6, 7, 5, 3), world_size, mesh_device=device.torch_device().type, dtype=dtype)
    if recipe:
        return model, Recipe(model)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    opt = inner if plain else SwapOptimizer(inner, swap_optimizer_times=3, master_weights=masters)
    return model, opt


def train(model, opt, start: int, steps: int, rank: int) -> None:
    dtype = next(model.parameters()).dtype
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 6, generator=g).to(device.torch_device()).to(dtype)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def check_swapped(opt: SwapOptimizer, steps: int) -> None:
    """The states really live on the host as DTensors over host shards, and steps really streamed them."""
    assert device.is_simulated()
    opt.wait_for_swap_out()
    for p, st in opt.state.items():
        for key, value in st.items():
            if key != "step":
                assert isinstance(value, DTensor) and value.shape == p.shape and device.is_host_tensor(value), key
    assert steps == 0 or opt.swap_stats().h2d_bytes > 0


def load_optimizer(model, opt, osd: dict, options: StateDictOptions | None = None) -> None:
    mod = device.get_torch_device_module()
    before = live_device_bytes(mod)
    mod.reset_peak_memory_stats()
    set_optimizer_state_dict(model, opt, osd, options=options)
    # Loading optimizer state must not touch device memory (states go straight to host tensors) ...
    after = live_device_bytes(mod)  # temporaries DCP left in reference cycles are garbage, not held memory
    assert after == before, (before, after)
    # ... not even for a moment, except for DCP's own broadcast buffers: full_state_dict loads broadcast one
    # full tensor at a time on the device.
    if not (options and options.full_state_dict):
        assert mod.max_memory_allocated() == before, (before, mod.max_memory_allocated())


def dump(model, opt, path: str, rank: int) -> None:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }
    if rank == 0:
        torch.save(full, path)


def run(spec: str, rank: int, world_size: int) -> None:
    """One job: ``key=value`` pairs separated by commas (plain, load, loadfull, broadcast, start, steps, save,
    dump)."""
    job = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    model, opt = build(world_size, plain=job.get("plain") == "1", masters=job.get("mw") == "1",
                       recipe=job.get("recipe") == "1")  # fmt: skip
    if isinstance(opt, Recipe):
        train(model, opt, int(job.get("start", 0)), int(job.get("steps", 0)), rank)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": full}, job["dump"])
        return
    if "load" in job:
        sd = state(model, opt)  # on a fresh optimizer this runs DCP's zero-grad step to create the states
        dcp.load(sd, checkpoint_id=job["load"])
        set_model_state_dict(model, sd["model"])
        load_optimizer(model, opt, sd["optim"])
    if "loadfull" in job:
        # Full (unsharded) tensors keyed by FQN, straight into load_state_dict: each rank takes its slice.
        full = torch.load(job["loadfull"])
        set_model_state_dict(model, full["model"], options=StateDictOptions(full_state_dict=True))
        opt.load_state_dict(full["optim"])
    if "broadcast" in job:
        # The XTuner-style resume: rank 0 reads a full state dict and DCP broadcasts it into the shards.
        full = torch.load(job["broadcast"]) if rank == 0 else {"model": {}, "optim": {}}
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full["model"], options=opts)
        get_optimizer_state_dict(model, opt)  # the zero-grad step that creates the states
        load_optimizer(model, opt, full["optim"], opts)
    steps = int(job.get("steps", 0))
    train(model, opt, int(job.get("start", 0)), steps, rank)
    if isinstance(opt, SwapOptimizer):
        check_swapped(opt, steps)
    if "save" in job:
        dcp.save(state(model, opt), checkpoint_id=job["save"])
    if "dump" in job:
        dump(model, opt, job["dump"], rank)


def main() -> None:
    # Activates the process-wide simulator under SWAPOPT_DEVICE=sim; each rank on its own device, as on CUDA.
    device.get_torch_device_module().set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")
    # Several jobs per launch: starting processes (importing torch) costs more than the jobs themselves.
    for spec in sys.argv[1:]:
        run(spec, dist.get_rank(), dist.get_world_size())
    end_rank()  # barrier and destroy; the interpreter then exits normally


if __name__ == "__main__":
    main()
