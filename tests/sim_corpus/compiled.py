"""Compiled regions. While a dispatch mode is on the stack Dynamo runs a torch.compile'd function
eagerly, so the simulator sees (and judges) each of its ops as it would uncompiled code."""

from __future__ import annotations

import torch

from . import OK, RACE, program
from .common import h2d, side_stream


@torch.compile(backend="eager")
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


G = "compiled"


@program(G, RACE, op="aten.mul.Tensor", earlier="aten.copy_.default")
def compiled_read_of_an_inflight_h2d(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    _scale(dst)


@program(G, OK)
def compiled_read_after_wait(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    sim.current_stream().wait_stream(side)
    assert torch.equal(_scale(dst), torch.full_like(dst, 3.0))


@program(G, RACE, op="aten.sum.default", earlier="aten.add.Tensor")
def compiled_on_side_stream_output_read_on_compute(sim):
    x = torch.ones(64)
    side = side_stream(sim)
    with sim.stream(side):
        y = _scale(x)
    y.sum()


@program(G, OK)
def compiled_on_side_stream_with_wait(sim):
    x = torch.ones(64)
    side = side_stream(sim)
    with sim.stream(side):
        y = _scale(x)
    sim.current_stream().wait_stream(side)
    y.sum()
    y.record_stream(sim.current_stream())  # allocated on side, last used on compute
