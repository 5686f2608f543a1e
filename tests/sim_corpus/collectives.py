"""Async collectives run on their own stream until `work.wait()` (a single-rank gloo group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import OK, RACE, program

G = "collectives"


def group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@program(G, OK)
def async_all_reduce_then_wait(sim):
    group()
    t = torch.ones(64)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    t.mul_(2)
    sim.synchronize()


@program(G, RACE, op="aten.mul_.Tensor", earlier="c10d.allreduce_.default")
def async_all_reduce_written_before_wait(sim):
    group()
    t = torch.ones(64)
    work = dist.all_reduce(t, async_op=True)
    t.mul_(2)
    work.wait()


@program(G, RACE, op="aten.sum.default", earlier="c10d.allreduce_.default")
def async_all_reduce_read_before_wait(sim):
    group()
    t = torch.ones(64)
    work = dist.all_reduce(t, async_op=True)
    t.sum()
    work.wait()


@program(G, OK)
def sync_all_reduce_then_use(sim):
    group()
    t = torch.ones(64)
    dist.all_reduce(t)
    t.mul_(2)
    sim.synchronize()


@program(G, OK)
def async_broadcast_of_another_tensor(sim):
    group()
    t, u = torch.ones(64), torch.ones(64)
    work = dist.broadcast(t, src=0, async_op=True)
    u.mul_(2)  # untouched by the collective
    work.wait()
    t.add_(u)
    sim.synchronize()
