"""The layout benchmark's host budget and link floor per row: Python ms against 60 us x chunks + 2 us x tensors,
and each swapped row's floor at its own copy size (a sized link moves small copies at lower rates)."""

from __future__ import annotations

import device
from swapopt.bench.layout_run import (
    HOST_CHUNK_US,
    HOST_TENSOR_US,
    LayoutResult,
    LayoutRow,
    derive,
    layout_targets,
    layouts_markdown,
    link_floor_ms,
)
from swapopt.bench.measure import Bandwidth


def _bw() -> Bandwidth:
    return Bandwidth(h2d_alone=50.0, d2h_alone=50.0, h2d_both=40.0, d2h_both=40.0, chunk_bytes=1 << 20)


def test_link_floor_takes_the_copy_size(sim):
    preset = device.get_torch_device_module().preset
    n = 200 << 20
    for copy in (1 << 20, 16 << 20, 256 << 20):
        floor, rule = link_floor_ms(n, n, _bw(), copy)
        assert floor == preset.link_floor_us(n, n, copy) / 1e3 and rule == preset.link_sharing
    assert link_floor_ms(n, n, _bw())[0] == preset.link_floor_us(n, n) / 1e3


def test_rows_are_held_to_the_host_budget():
    rows = [
        LayoutRow(kind="resident", label="resident-fused", step_ms=1.0, python_ms=3.0, launches=2),
        LayoutRow(kind="swapopt", label="swapopt t=16 s=3", times=16, chunks=20, step_ms=5.0, python_ms=1.0,
                  launches=80, floor_ms=4.0),
        LayoutRow(kind="swapopt", label="swapopt t=64 s=3", times=64, chunks=64, step_ms=5.0, python_ms=9.0,
                  launches=300),
    ]
    res = derive(LayoutResult(
        layout="fsdp256", source="test", scale=1, tensors=291, numel=10, state_bytes=80,
        bandwidth=_bw(), resident_ms=1.0, bound_ms=4.5, rows=rows, floor_ms=4.5,
    ))
    ok, over = res.rows[1], res.rows[2]
    assert ok.python_limit_ms == (HOST_CHUNK_US * 20 + HOST_TENSOR_US * 291) / 1e3
    assert ok.python_over_limit < 1 < over.python_over_limit
    assert ok.floor_ratio == 5.0 / 4.0 and over.floor_ratio == 5.0 / 4.5  # its own floor, else the layout's
    lines = layout_targets(res)
    assert "Python 1.0 <=" in lines[0] and "met" in lines[0].split("Python")[1].split(";")[0]
    assert "MISSED" in lines[1].split("Python")[1].split(";")[0]
    assert "| 1.78 | 0.6 |" in layouts_markdown([res])  # Python limit ms, Python / limit
