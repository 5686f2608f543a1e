"""One rank of the low-bit FSDP2 + DCP tests (launched by tests/test_lowbit_dcp.py, torchrun-style env; the
one-rank test calls ``run`` in its own process).

Trains a tiny model sharded with ``fully_shard`` on a mesh of the (simulated) device (gloo) with one of
torchao's low-bit optimizers, resident or wrapped in SwapOptimizer. Its first weight is (128, 64): a (64, 64)
shard on each of 2 ranks, 4096 elements, so torchao quantizes its states (a DTensor over the low-bit subclass);
the other params are smaller and keep plain fp32 states, and the last layer's 7 rows shard unevenly.
Usage: dist_lowbit_dcp.py JOB [JOB ...], a JOB being e.g. ``kind=8bit,swap=1,load=DIR,start=2,steps=2,dump=FILE``.
``dump`` writes this rank's params and the plain tensors holding its states (a low-bit state's parts, never
dequantized) to FILE.<rank>.

torchao compiles its update with torch.compile, which the simulated device cannot run: the jobs run under
``torch.compiler.set_stance("force_eager")``, the swapped optimizer and its reference alike.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import end_rank, sharded_mlp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torchao import optim as ao

import device
from swapopt import SwapOptimizer, subclass_state
from swapopt.hoststate import local

KINDS = {"8bit": ao.AdamW8bit, "4bit": ao.AdamW4bit}


def build(world_size: int, kind: str, swap: bool):
    with device.torch_device():
        model = sharded_mlp((64, 128, 7), world_size, mesh_device=device.torch_device().type)
    inner = KINDS[kind](model.parameters(), lr=1e-2)
    return model, (SwapOptimizer(inner, swap_optimizer_times=2) if swap else inner)


def train(model, opt, start: int, steps: int, rank: int) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        model(torch.randn(4, 64, generator=g).to(device.torch_device())).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def check_swapped(model, opt: SwapOptimizer) -> None:
    """Every state but ``step`` lives on the host between steps, a low-bit one as a DTensor of the param's layout
    over its subclass with every part in pinned host memory; the last step moved exactly the parts' bytes."""
    opt.wait_for_swap_out()
    nbytes, lowbit = 0, 0
    for p in model.parameters():
        for key, value in opt.state[p].items():
            if key == "step":
                continue
            assert isinstance(value, DTensor) and value.placements == p.placements and value.shape == p.shape, key
            if subclass_state.is_subclass_state(value):
                lowbit += 1
                assert type(local(value)).__module__.startswith("torchao"), type(local(value))
                assert all(device.is_host_tensor(t) and t.is_pinned() for _, t in subclass_state.parts(value)), key
                nbytes += subclass_state.nbytes(value)
            else:
                assert device.is_host_tensor(value), key
                nbytes += local(value).nbytes
    assert lowbit == 2, lowbit  # the first weight's two moments
    stats = opt.swap_stats()
    assert (stats.h2d_bytes, stats.d2h_bytes) == (nbytes, nbytes), (stats.h2d_bytes, stats.d2h_bytes, nbytes)


def dump(model, opt, path: str) -> None:
    if isinstance(opt, SwapOptimizer):
        opt.wait_for_swap_out()
    out = {}
    for name, p in model.named_parameters():
        out[name] = [local(p).detach().cpu().clone()]
        for key in sorted(opt.state[p]):
            value = opt.state[p][key]
            if subclass_state.is_subclass_state(value):
                out[name] += [t.cpu().clone() for _, t in subclass_state.parts(value)]
            else:
                out[name].append(local(value).cpu().clone())
    torch.save(out, path)


def run(spec: str, rank: int, world_size: int) -> None:
    """One job: ``key=value`` pairs separated by commas (kind, swap, load, start, steps, save, dump)."""
    job = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    model, opt = build(world_size, job["kind"], job.get("swap") == "1")
    with torch.compiler.set_stance("force_eager"):
        if "load" in job:
            sd = state(model, opt)  # on a fresh optimizer this runs DCP's zero-grad step to create the states
            dcp.load(sd, checkpoint_id=job["load"])
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
        steps = int(job.get("steps", 0))
        train(model, opt, int(job.get("start", 0)), steps, rank)
        if isinstance(opt, SwapOptimizer) and steps:
            check_swapped(model, opt)
        if "save" in job:
            dcp.save(state(model, opt), checkpoint_id=job["save"])
        if "dump" in job:
            dump(model, opt, f"{job['dump']}.{rank}")


def main() -> None:
    # Activates the process-wide simulator under SWAPOPT_DEVICE=sim; each rank on its own device, as on CUDA.
    device.get_torch_device_module().set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")
    for spec in sys.argv[1:]:  # several jobs per launch: starting processes costs more than the jobs
        run(spec, dist.get_rank(), dist.get_world_size())
    end_rank()


if __name__ == "__main__":
    main()
