"""The link costs the planner models (swapopt.costs, Note [chunk count from costs] in swapopt.plan)."""

from __future__ import annotations

import dataclasses

import pytest

import device
import simdevice as simulator
from device.sim.preset_file import save_preset
from device.sim.presets import PRESETS
from swapopt import costs


def test_costs_come_from_the_simulators_preset():
    with simulator.activate("910b"):
        got = costs.link_costs(device.get_device())
    p = PRESETS["910b"]
    assert (got.copy_latency_us, got.h2d_gbps, got.d2h_gbps, got.duplex_gbps) == (
        p.copy_latency_us, p.h2d_gbps, p.d2h_gbps, p.duplex_gbps,
    )
    assert got.host_chunk_us == pytest.approx(
        costs.LAUNCHES_PER_CHUNK * p.launch_us + costs.EVENT_CALLS_PER_CHUNK * p.event_us + costs.PYTHON_CHUNK_US
    )
    # each direction's latency and the rates with both busy, as the simulator times copies
    for way in ("h2d", "d2h"):
        assert got.latency_us(way) == pytest.approx(p.latency_us(way))
        for nbytes in (1 << 20, 64 << 20, 1 << 30):
            assert got.both_bytes_per_us(way, nbytes) == pytest.approx(p.both_gbps(way, nbytes) * 1e3)
    assert (got.host_copy_us, got.host_tensor_us) == (p.launch_us, p.host_tensor_us)
    # a chunk with cut pieces: their own call and step clones, and a chunk's Python (Note [cut chunks])
    assert got.host_cut_chunk_us == costs.CUT_CHUNK_LAUNCHES * p.launch_us + costs.PYTHON_CHUNK_US
    h100 = costs._named("h100")
    # the H100's queued copies: H2D waits longer than D2H, both a few us (Note [queued copies])
    assert h100.latency_us("d2h") < h100.latency_us("h2d") < 5.0
    assert h100.both_bytes_per_us("h2d", 256 << 20) == pytest.approx(PRESETS["h100"].both_gbps("h2d", 256 << 20) * 1e3)


def test_costs_on_a_device_from_a_calibrated_file_else_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "is_simulated", lambda: False)
    monkeypatch.delenv(costs.ENV, raising=False)
    assert costs.link_costs("cuda").copy_latency_us == PRESETS["h100"].copy_latency_us
    assert costs.link_costs("npu").h2d_gbps == PRESETS["910b"].h2d_gbps
    assert costs.link_costs("cpu") is None
    calibrated = dataclasses.replace(PRESETS["h100"], name="measured", copy_latency_us=21.0, h2d_gbps=44.0)
    path = save_preset(calibrated, tmp_path / "preset.json")
    monkeypatch.setenv(costs.ENV, str(path))
    got = costs.link_costs("cuda")
    assert (got.copy_latency_us, got.h2d_gbps) == (21.0, 44.0)
    monkeypatch.setenv(costs.ENV, str(tmp_path / "missing.json"))
    with pytest.warns(UserWarning, match=costs.ENV):
        assert costs.link_costs("cuda").copy_latency_us == PRESETS["h100"].copy_latency_us
