"""Storages made outside the dispatcher: deepcopy, storage clones, torch.save / torch.load."""

from __future__ import annotations

import copy
import io

import torch

from . import OK, RACE, program
from .common import h2d, side_stream

G = "storages"


@program(G, RACE, op="aten.copy_.default", earlier="aten.copy_.default")
def deepcopy_of_a_tensor_being_written(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    copy.deepcopy(dst)  # the copy reads dst on compute while the H2D writes it


@program(G, OK)
def deepcopy_after_wait_is_device_memory(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    sim.current_stream().wait_stream(side)
    clone = copy.deepcopy({"exp_avg": dst})["exp_avg"]
    assert not sim.is_host(clone)
    clone.add_(dst)  # device + device: no mixing error


@program(G, RACE, op="aten.copy_.default", earlier="aten.copy_.default")
def storage_clone_of_a_tensor_being_written(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    dst.untyped_storage().clone()


@program(G, OK)
def torch_load_of_device_tensors_gives_device_tensors(sim):
    x = torch.ones(32)
    buf = io.BytesIO()
    torch.save({"x": x}, buf)
    buf.seek(0)
    y = torch.load(buf)["x"]
    assert not sim.is_host(y)
    side = side_stream(sim)
    with sim.stream(side):
        y.add_(1)  # a block loaded on compute, used after the side stream waited
    sim.synchronize()


@program(G, OK)
def torch_load_block_used_on_side_after_its_blocking_copy(sim):
    buf = io.BytesIO()
    torch.save({"x": torch.ones(32)}, buf)
    buf.seek(0)
    y = torch.load(buf)["x"]  # rebuilt on the device by a blocking copy: the host saw compute drain
    side = sim.Stream()
    with sim.stream(side):
        y.add_(1)
