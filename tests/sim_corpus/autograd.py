"""Autograd: each backward op runs on the stream of its forward op; the engine orders the streams it
uses after the caller's current stream and the caller's stream after them (PyTorch's CUDA notes,
"backward pass stream semantics")."""

from __future__ import annotations

import torch

from . import OK, RACE, program
from .common import side_stream

G = "autograd"


def _model():
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16)
    return w, x


@program(G, OK)
def forward_and_backward_on_a_side_stream(sim):
    w, x = _model()
    side = side_stream(sim)
    with sim.stream(side):
        (x @ w).sum().backward()
        w.grad.mul_(2)
    sim.synchronize()


@program(G, OK)
def forward_on_side_backward_called_on_compute(sim):
    w, x = _model()
    side = side_stream(sim)
    with sim.stream(side):
        loss = (x @ w).square().sum()
    sim.current_stream().wait_stream(side)  # loss is used on compute
    loss.backward()
    w.grad.add_(1)  # the caller's stream follows the backward streams
    sim.synchronize()


@program(G, OK)
def forward_on_compute_backward_called_on_side(sim):
    w, x = _model()
    loss = (x @ w).square().sum()
    side = side_stream(sim)
    with sim.stream(side):
        loss.backward()  # backward ops run on compute, where their forward ran
        w.grad.add_(1)
    sim.synchronize()


@program(G, RACE, op="aten.sum.default", earlier="aten.mm.default")
def grad_read_on_a_third_stream_without_wait(sim):
    w, x = _model()
    side = side_stream(sim)
    with sim.stream(side):
        (x @ w).sum().backward()
    other = sim.Stream()
    with sim.stream(other):
        w.grad.sum()


@program(G, RACE, op="aten.sum.default", earlier="aten.mm.default")
def forward_output_of_side_used_on_compute_without_wait(sim):
    w, x = _model()
    side = side_stream(sim)
    with sim.stream(side):
        y = x @ w
    y.sum().backward()


@program(G, RACE, op="aten.zero_.default", earlier="aten.mm.default")
def compute_overwrites_input_saved_by_a_side_forward(sim):
    w, x = _model()
    side = side_stream(sim)
    with sim.stream(side):
        y = (x @ w).sum()
    x.zero_()  # compute writes x while the side-stream matmul may still read it
    del y
