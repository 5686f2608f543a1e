"""Ops on other threads: each thread is a host of its own, ordered by start and join; the current
stream is per thread (a new thread starts on the default stream, as in PyTorch)."""

from __future__ import annotations

import threading

import torch

from . import OK, RACE, program
from .common import N, h2d, pinned, side_stream

G = "threads"


def _in_thread(fn) -> None:
    """Run fn on a new thread; re-raise what it raised (as a test would)."""
    errors: list[BaseException] = []

    def body():
        try:
            fn()
        except BaseException as err:  # handed to the caller below
            errors.append(err)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


@program(G, OK)
def worker_fills_pinned_buffer_then_h2d(sim):
    host = pinned()
    _in_thread(lambda: host.fill_(4.0))
    dst = torch.empty(N)
    dst.copy_(host, non_blocking=True)
    sim.synchronize()


@program(G, RACE, op="aten.fill_.Scalar", earlier="aten.copy_.default")
def worker_writes_pinned_buffer_an_h2d_reads(sim):
    side = sim.Stream()
    host, dst = h2d(sim, side)
    _in_thread(lambda: host.fill_(4.0))  # the copy may still be reading it


@program(G, RACE, op="aten.sum.default", earlier="aten.copy_.default")
def worker_runs_on_the_default_stream(sim):
    host = pinned()
    dst = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        dst.copy_(host, non_blocking=True)
        _in_thread(lambda: dst.sum())  # the worker's current stream is compute, not side


@program(G, OK)
def worker_waits_for_the_side_stream(sim):
    side = sim.Stream()
    host, dst = h2d(sim, side)

    def body():
        sim.current_stream().wait_stream(side)
        dst.sum()

    _in_thread(body)
    sim.synchronize()


@program(G, RACE, op="aten.sum.default", earlier="aten.fill_.Scalar")
def join_does_not_order_the_workers_stream(sim):
    x = torch.zeros(N)
    side = side_stream(sim)

    def body():
        with sim.stream(side):
            x.fill_(1.0)

    _in_thread(body)
    x.sum()  # the join orders the host, not the side stream's queued work


@program(G, OK)
def worker_synchronizes_its_stream_before_join(sim):
    x = torch.zeros(N)
    side = side_stream(sim)

    def body():
        with sim.stream(side):
            x.fill_(1.0)
        side.synchronize()

    _in_thread(body)
    x.sum()
