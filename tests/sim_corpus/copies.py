"""Pinned and pageable host memory around non_blocking copies, and host reads outside the dispatcher."""

from __future__ import annotations

import io

import torch

import device

from . import OK, RACE, program
from .common import N, d2h, h2d, side_stream

G = "copies"


@program(G, RACE, op="aten.sum.default", earlier="aten.copy_.default")
def d2h_pinned_host_read_before_sync(sim):
    _, host = d2h(sim, sim.Stream())
    host.sum()


@program(G, OK)
def d2h_pinned_host_read_after_event_sync(sim):
    side = sim.Stream()
    _, host = d2h(sim, side)
    side.record_event().synchronize()
    host.sum()


@program(G, OK)
def d2h_into_pageable_is_blocking(sim):
    src = torch.full((N,), 2.0)
    pageable = torch.tensor([0.0] * N, device="cpu")  # pageable host memory
    side = side_stream(sim)
    with sim.stream(side):
        pageable.copy_(src, non_blocking=True)  # returns once the copy is done, as CUDA does
    pageable.sum()
    sim.synchronize()


@program(G, RACE, op="aten.fill_.Scalar", earlier="aten.copy_.default")
def host_overwrites_pinned_source_of_inflight_h2d(sim):
    side = sim.Stream()
    host, dst = h2d(sim, side)
    host.fill_(0.0)


@program(G, OK)
def host_overwrites_pageable_source_of_h2d(sim):
    src = torch.tensor([1.0] * N, device="cpu")  # pageable host memory
    dst = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        dst.copy_(src, non_blocking=True)  # the host stages a pageable source before returning
    src.add_(1)
    sim.synchronize()


@program(G, OK)
def blocking_d2h_into_pinned(sim):
    src = torch.full((N,), 3.0)
    host = device.pinned_empty(N)
    host.copy_(src)  # non_blocking=False: the host waits
    host.sum()


@program(G, RACE, op="Tensor.tolist", earlier="aten.copy_.default")
def tolist_of_pinned_before_d2h_finishes(sim):
    _, host = d2h(sim, sim.Stream())
    host.tolist()


@program(G, OK)
def tolist_of_pinned_after_sync(sim):
    _, host = d2h(sim, sim.Stream())
    sim.synchronize()
    host.tolist()


@program(G, RACE, op="Tensor.numpy", earlier="aten.copy_.default")
def numpy_of_pinned_before_d2h_finishes(sim):
    _, host = d2h(sim, sim.Stream())
    host.numpy().sum()


@program(G, RACE, op="torch.save", earlier="aten.copy_.default")
def torch_save_of_pinned_before_d2h_finishes(sim):
    _, host = d2h(sim, sim.Stream())
    torch.save({"state": host}, io.BytesIO())


@program(G, OK)
def torch_save_of_pinned_after_sync(sim):
    side = sim.Stream()
    _, host = d2h(sim, side)
    side.synchronize()
    torch.save({"state": host}, io.BytesIO())


@program(G, RACE, op="Tensor.__dlpack__", earlier="aten.copy_.default")
def dlpack_of_pinned_before_d2h_finishes(sim):
    _, host = d2h(sim, sim.Stream())
    torch.from_dlpack(host)


@program(G, OK)
def tolist_of_device_tensor_syncs(sim):
    x = torch.full((4,), 2.0)
    assert x.tolist() == [2.0] * 4  # a blocking D2H on the current stream


@program(G, RACE, op="aten.fill_.Scalar", earlier="aten.copy_.default")
def host_writes_pinned_target_of_inflight_d2h(sim):
    _, host = d2h(sim, sim.Stream())
    host.fill_(0.0)
