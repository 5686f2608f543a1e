"""Pinned host memory reached through a storage of its own (numpy() / from_numpy, frombuffer, DLPack,
pickling): judged by the bytes it touches, like the tensor it aliases (Note [aliases of host memory])."""

from __future__ import annotations

import io
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

import device

from . import OK, RACE, program
from .common import N

G = "aliases"


def d2h_into(sim, host: torch.Tensor, stream) -> None:
    """A non-blocking D2H on ``stream`` into ``host`` from a fresh device tensor."""
    src = torch.full(tuple(host.shape), 3.0)
    stream.wait_stream(sim.default_stream())
    with sim.stream(stream):
        host.copy_(src, non_blocking=True)
    src.record_stream(stream)  # dropping src adds no free race of the helper's own


def aliased(make):
    """(pinned tensor, alias made by ``make`` before anything writes it, the stream a D2H into it runs on)."""

    def run(sim):
        host = device.pinned_empty(N)
        alias = make(host)  # made before the copy: no host read races yet
        side = sim.Stream()
        d2h_into(sim, host, side)
        return host, alias, side

    return run


from_numpy = aliased(lambda host: torch.from_numpy(host.numpy()))


@program(G, RACE, op="torch.save", earlier="aten.copy_.default")
def torch_save_of_a_from_numpy_alias_before_d2h_finishes(sim):
    _, alias, _ = from_numpy(sim)
    torch.save({"exp_avg": alias}, io.BytesIO())


@program(G, RACE, op="Tensor.tolist", earlier="aten.copy_.default")
def tolist_of_a_view_of_a_from_numpy_alias(sim):
    _, alias, _ = from_numpy(sim)
    alias[8:16].tolist()


@program(G, RACE, op="aten.clone.default", earlier="aten.copy_.default")
def clone_of_a_from_numpy_alias(sim):
    _, alias, _ = from_numpy(sim)
    alias.clone()


@program(G, RACE, op="aten.fill_.Scalar", earlier="aten.copy_.default")
def host_write_through_a_from_numpy_alias(sim):
    _, alias, _ = from_numpy(sim)
    alias.fill_(0.0)


@program(G, RACE, op="aten.clone.default", earlier="aten.copy_.default")
def clone_of_unaligned_bytes_of_a_pinned_tensor(sim):
    # bytes [1, 9) of a float32 tensor: no float32 element of the pinned storage starts there
    _, raw, _ = aliased(lambda host: torch.from_numpy(host.numpy().view(np.uint8)[1:9]))(sim)
    raw.clone()


@program(G, RACE, op="aten.sum.default", earlier="aten.copy_.default")
def sum_of_a_dlpack_alias(sim):
    _, alias, _ = aliased(torch.from_dlpack)(sim)
    alias.sum()


@program(G, RACE, op="aten.sum.default", earlier="aten.copy_.default")
def sum_of_a_frombuffer_alias(sim):
    _, alias, _ = aliased(lambda host: torch.frombuffer(host.numpy(), dtype=torch.float32))(sim)
    alias.sum()


@program(G, RACE, op="aten.sum.default", earlier="aten.copy_.default")
def sum_of_a_tensor_shared_by_pickling(sim):
    _, alias, _ = aliased(lambda host: ForkingPickler.loads(bytes(ForkingPickler.dumps(host))))(sim)
    alias.sum()


@program(G, OK)
def torch_save_of_a_from_numpy_alias_after_the_copy_is_waited_for(sim):
    _, alias, side = from_numpy(sim)
    side.record_event().synchronize()
    torch.save({"exp_avg": alias}, io.BytesIO())
    alias.tolist()


@program(G, OK)
def alias_of_bytes_the_copy_does_not_write(sim):
    host = device.pinned_empty(2 * N)
    first = torch.from_numpy(host.numpy()[:N])
    d2h_into(sim, host[N:], sim.Stream())  # writes the second half only
    first.fill_(1.0)
    torch.save(first, io.BytesIO())
    sim.synchronize()


@program(G, OK)
def is_pinned_through_an_alias(sim):
    host = device.pinned_empty(N)
    assert torch.from_numpy(host.numpy()).is_pinned()  # CUDA asks the host allocator by address
    assert not torch.from_numpy(np.zeros(N, dtype=np.float32)).is_pinned()
