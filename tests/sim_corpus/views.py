"""Views and strided slices: conflicts are judged on the exact elements each view touches."""

from __future__ import annotations

import torch

from . import OK, RACE, program
from .common import side_stream

G = "views"


def _on_two_streams(sim, first, second):
    """first(x) on a side stream, then second(x) on compute with no ordering between them."""
    side = side_stream(sim)
    with sim.stream(side):
        first()
    second()
    sim.synchronize()


@program(G, OK)
def interleaved_halves(sim):
    x = torch.zeros(64)
    _on_two_streams(sim, lambda: x[0::2].fill_(1), lambda: x[1::2].fill_(2))


@program(G, RACE, op="aten.fill_.Scalar", earlier="aten.fill_.Scalar")
def interleaved_overlapping_strides(sim):
    x = torch.zeros(64)
    _on_two_streams(sim, lambda: x[0::2].fill_(1), lambda: x[0::4].fill_(2))


@program(G, OK)
def column_blocks(sim):
    m = torch.zeros(8, 32)
    _on_two_streams(sim, lambda: m[:, :16].fill_(1), lambda: m[:, 16:].fill_(2))


@program(G, RACE, op="aten.fill_.Scalar", earlier="aten.fill_.Scalar")
def overlapping_column_blocks(sim):
    m = torch.zeros(8, 32)
    _on_two_streams(sim, lambda: m[:, :16].fill_(1), lambda: m[:, 8:24].fill_(2))


@program(G, OK)
def separate_rows(sim):
    m = torch.zeros(8, 32)
    _on_two_streams(sim, lambda: m[0].fill_(1), lambda: m[1].fill_(2))


@program(G, RACE, op="aten.sum.default", earlier="aten.fill_.Scalar")
def transposed_read_of_a_written_block(sim):
    m = torch.zeros(8, 8)
    _on_two_streams(sim, lambda: m.fill_(1), lambda: m.t().sum())


@program(G, OK)
def diagonal_and_off_diagonal(sim):
    m = torch.zeros(8, 8)
    _on_two_streams(sim, lambda: m.diagonal().fill_(1), lambda: m[0, 1:].fill_(2))


@program(G, RACE, op="aten.fill_.Scalar", earlier="aten.fill_.Scalar")
def diagonal_and_first_row(sim):
    m = torch.zeros(8, 8)
    _on_two_streams(sim, lambda: m.diagonal().fill_(1), lambda: m[0].fill_(2))


@program(G, OK)
def even_elements_written_odd_read(sim):
    x = torch.zeros(64)
    _on_two_streams(sim, lambda: x[0::2].fill_(1), lambda: x[1::2].sum())


@program(G, OK)
def byte_view_of_other_half(sim):
    x = torch.zeros(64)
    _on_two_streams(sim, lambda: x[:32].fill_(1), lambda: x[32:].view(torch.uint8).sum())
