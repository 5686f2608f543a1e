"""Ordering primitives between streams and the host."""

from __future__ import annotations

import torch

from . import OK, RACE, program
from .common import h2d, side_stream

G = "ordering"


@program(G, RACE, op="aten.sum.default", earlier="aten.copy_.default")
def h2d_then_compute_read_without_wait(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    dst.sum()


@program(G, OK)
def h2d_then_wait_event(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    sim.current_stream().wait_event(side.record_event())
    dst.sum()


@program(G, OK)
def h2d_then_wait_stream(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    sim.current_stream().wait_stream(side)
    dst.sum()


@program(G, OK)
def h2d_then_device_synchronize(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    sim.synchronize()
    dst.sum()


@program(G, OK)
def h2d_then_stream_synchronize(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    side.synchronize()  # the host waits; later launches follow the host
    dst.sum()


@program(G, OK)
def h2d_then_event_synchronize(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    side.record_event().synchronize()
    dst.sum()


@program(G, RACE, op="aten.sum.default", earlier="aten.copy_.default")
def wait_on_event_recorded_before_the_copy(sim):
    side = sim.Stream()
    early = side.record_event()
    _, dst = h2d(sim, side)
    sim.current_stream().wait_event(early)
    dst.sum()


@program(G, RACE, op="aten.add_.Tensor", earlier="aten.copy_.default")
def wait_on_unrelated_stream(sim):
    side, other = sim.Stream(), sim.Stream()
    _, dst = h2d(sim, side)
    sim.current_stream().wait_stream(other)
    dst.add_(1)


@program(G, OK)
def transitive_waits(sim):
    a, b = sim.Stream(), sim.Stream()
    _, dst = h2d(sim, a)
    b.wait_event(a.record_event())
    sim.current_stream().wait_event(b.record_event())
    dst.mul_(2)


@program(G, OK)
def two_streams_read_the_same_tensor(sim):
    x = torch.ones(64)
    side = side_stream(sim)
    with sim.stream(side):
        a = x * 2
    b = x * 3
    sim.synchronize()
    del a, b


@program(G, RACE, op="aten.mul_.Tensor", earlier="aten.add_.Tensor")
def two_streams_write_the_same_tensor(sim):
    x = torch.ones(64)
    side = side_stream(sim)
    with sim.stream(side):
        x.add_(1)
    x.mul_(2)


@program(G, RACE, op="aten.sum.default", earlier="aten.fill_.Scalar")
def compute_writes_then_side_reads_without_wait(sim):
    x = torch.ones(64)
    side = side_stream(sim)
    x.fill_(5.0)  # after side's wait: unordered with side
    with sim.stream(side):
        x.sum()


@program(G, OK)
def successful_query_orders_the_host(sim):
    side = sim.Stream()
    _, dst = h2d(sim, side)
    done = side.record_event()
    while not done.query():
        pass
    dst.sum()  # the compute launch follows the host, which saw the copy finish


@program(G, RACE, op="aten.zero_.default", earlier="aten.mul.Tensor")
def write_after_read_on_another_stream(sim):
    x = torch.ones(64)
    side = side_stream(sim)
    with sim.stream(side):
        y = x * 2  # side reads x
    x.zero_()  # compute overwrites x while side may still read it
    del y
