"""The simulator charges the host (Note [host clock] in device/sim/timeline.py): a device op starts no earlier than
the host has issued it, and issuing costs launch_us plus host_tensor_us per tensor beyond an op's first two, so
a step of many small tensors goes host-bound as the H100 did (resident fused AdamW on moe's 3,299 tensors: 16.5
ms of host for a 15.4 ms step). Deterministic by default; SWAPOPT_SIM_HOST_CLOCK=measured adds the program's
own Python time."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import simdevice as simulator
from device.sim import host_time
from device.sim import timeline as timeline_module
from device.sim.timeline import HOST_CLOCK_ENV, Timeline

H100 = simulator.PRESETS["h100"]


def test_an_op_costs_the_host_launch_plus_its_tensors(sim):
    xs = [torch.zeros(4) for _ in range(10)]
    sim.synchronize()
    start = sim.now_us()
    torch._foreach_add_(xs, 1.0)  # one launch over ten tensors
    assert sim.now_us() - start == pytest.approx(H100.launch_us + 8 * H100.host_tensor_us)
    (op,) = [op for op in sim.timeline if op.name.startswith("aten._foreach_add_")][-1:]
    assert op.start_us >= sim.now_us()  # it starts once issued, not before
    start = sim.now_us()
    xs[0].add_(1)  # one or two tensors: the launch alone, as calibrated on a tiny kernel
    assert sim.now_us() - start == pytest.approx(H100.launch_us)


def test_an_event_record_and_a_stream_wait_each_cost_the_host_event_us(sim):
    """A record and a wait are calls into the runtime's stream queue: on the H100 a record cost the host 6.3 us, a
    launch 6.2 (verify-a.json). A swapped step makes six a chunk; a wait for an event never recorded is still a call."""
    assert H100.event_us > 0
    side = sim.Stream()
    sim.synchronize()
    start = sim.now_us()
    event = sim.current_stream().record_event()
    assert sim.now_us() - start == pytest.approx(H100.event_us)
    start = sim.now_us()
    side.wait_event(event)
    assert sim.now_us() - start == pytest.approx(H100.event_us)
    start = sim.now_us()
    side.wait_stream(sim.current_stream())  # a record and a wait
    assert sim.now_us() - start == pytest.approx(2 * H100.event_us)
    start = sim.now_us()
    side.wait_event(sim.Event())
    assert sim.now_us() - start == pytest.approx(H100.event_us)


def test_a_captured_record_or_wait_costs_the_host_nothing(sim):
    """Inside a capture the calls make graph nodes and edges, which the replay issues (graph_launch_us, its nodes)."""
    x = torch.ones(16)
    side, other = sim.Stream(), sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=side):
        other.wait_stream(side)
        with sim.stream(other):
            x.mul_(2)
        side.wait_stream(other)
        start = sim.now_us()
        done = side.record_event()
        side.wait_event(done)
        assert sim.now_us() == start
    g.replay()


def test_the_planner_charges_a_chunk_its_event_calls():
    """What the planner models a chunk's host time at (swapopt.costs): its launches, its six event calls, its Python."""
    from swapopt import costs

    modeled = costs._from_preset(H100)
    assert costs.EVENT_CALLS_PER_CHUNK == 6
    assert modeled.host_chunk_us == pytest.approx(
        costs.LAUNCHES_PER_CHUNK * H100.launch_us + 6 * H100.event_us + costs.PYTHON_CHUNK_US
    )
    without = costs._from_preset(dataclasses.replace(H100, event_us=0.0))
    assert modeled.host_chunk_us - without.host_chunk_us == pytest.approx(6 * H100.event_us)


def _resident_step_ms(preset, params: int) -> tuple[float, float]:
    """(modeled step ms, host ms to issue it) of a resident fused AdamW step over `params` small params."""
    with simulator.activate(preset, sanitize=False) as dev:
        ps = [torch.nn.Parameter(torch.zeros(64)) for _ in range(params)]
        for p in ps:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
        opt.step()
        dev.synchronize()
        start, end = dev.Event(enable_timing=True), dev.Event(enable_timing=True)
        start.record()
        host = dev.now_us()  # after the record, whose own call the host pays too (event_us)
        opt.step()
        host = dev.now_us() - host
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host / 1e3


def test_a_step_of_many_small_tensors_is_host_bound(clean_device_env):
    n = 300
    step_ms, host_ms = _resident_step_ms(H100, n)
    # Its two ops take 6 tensors per param: the host issues them for longer than the device runs them.
    issue_ms = (2 * H100.launch_us + (6 * n - 4) * H100.host_tensor_us) / 1e3
    assert host_ms == pytest.approx(issue_ms, rel=1e-6)
    kernels_ms = n * 64 * 32 / (H100.hbm_gbps * 1e6)  # what the device does: 32 B per param at HBM speed
    assert step_ms >= issue_ms > 10 * kernels_ms
    # Without the per-tensor charge the same step is the device's alone: two launches and the kernels.
    free_ms, _ = _resident_step_ms(dataclasses.replace(H100, host_tensor_us=0.0), n)
    assert free_ms < 0.05 * step_ms
    # Deterministic: the same program gives the same modeled time.
    assert _resident_step_ms(H100, n)[0] == step_ms


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("clock", ["ops", "measured"])
def test_measured_clock_adds_the_programs_own_python(clean_device_env, clock):
    clean_device_env.setenv(HOST_CLOCK_ENV, clock)
    # Without host_ref_us the measured clock charges this machine's Python as it is.
    with simulator.activate(dataclasses.replace(H100, host_ref_us=0.0), sanitize=False) as sim:
        x = torch.zeros(4)
        x.add_(1)
        start = sim.now_us()
        _busy(0.02)  # 20 ms of the program's own CPU time between two ops
        x.add_(1)
        spent = sim.now_us() - start
    if clock == "ops":
        assert spent == pytest.approx(H100.launch_us)
    else:
        # Less one entry into the simulator (microseconds, Note [scaled Python] in device/sim/host_time.py).
        assert 19_900 + H100.launch_us <= spent < 40_000


def test_measured_clock_takes_out_a_frame_call_at_a_frame_calls_cost(clean_device_env):
    """A replayed step reads a data_ptr per tensor: each is a call of one of the simulator's frames, whose entry
    costs the Python call and the frame's wrapper, not what an op's entry through torch's mode stack costs. Taking an
    op's entry out for each would take out the Python around them too (Note [scaled Python])."""
    clean_device_env.setenv(HOST_CLOCK_ENV, "measured")
    assert host_time.frame_entry_us() < host_time.entry_costs()[0]
    with simulator.activate(dataclasses.replace(H100, host_ref_us=0.0), sanitize=False) as sim:
        x = torch.zeros(4)
        xs = [torch.zeros(4) for _ in range(4000)]
        x.add_(1)
        frames, start = host_time.frames(), sim.now_us()
        _busy(0.02)
        addresses = [t.data_ptr() for t in xs]
        x.add_(1)
        spent = sim.now_us() - start
        assert host_time.frames() - frames >= len(xs) and len(set(addresses)) == len(xs)
    # An op's entry taken out 4,000 times would leave well under the 20 ms (4,000 x 4-7 us on a 2-core host).
    assert 19_000 + H100.launch_us <= spent < 40_000


def test_measured_clock_scales_python_to_the_device_host(clean_device_env):
    """The program's Python is charged at the device host's speed: this machine's CPU time times host_ref_us over
    this machine's time for the same reference work; the per-tensor charge is then the launcher's part alone."""
    clean_device_env.setenv(HOST_CLOCK_ENV, "measured")
    assert H100.host_ref_us > 0 and 0 < H100.launcher_tensor_us <= H100.host_tensor_us
    with simulator.activate("h100", sanitize=False) as sim:
        scale = sim._timeline.python_scale
        assert 0 < scale < 1  # the H100's host runs this Python faster than a shared CI core
        x = torch.zeros(4)
        xs = [torch.zeros(4) for _ in range(10)]
        x.add_(1)
        start = sim.now_us()
        _busy(0.05)
        torch._foreach_add_(xs, 1.0)
        spent = sim.now_us() - start
    issue = H100.launch_us + 8 * H100.launcher_tensor_us
    assert 0.95 * (50_000 * scale) + issue <= spent <= 1.1 * (50_000 * scale) + issue


def test_measured_clock_times_the_reference_again_as_the_machine_drifts(clean_device_env, monkeypatch):
    """A shared machine's speed drifts within seconds: every SCALE_EVERY_S of CPU time the clock times the reference
    work again (host_time.python_scale_now) and charges what follows at the new scale; that timing itself is not
    charged as the program's Python."""
    clean_device_env.setenv(HOST_CLOCK_ENV, "measured")
    monkeypatch.setattr(timeline_module, "SCALE_EVERY_S", 0.02)
    retimed: list[float] = []

    def scale_now(host_ref_us: float) -> float:
        _busy(0.05)  # a slow reference: charged as the program's Python, it would show
        retimed.append(0.5)
        return 0.5

    monkeypatch.setattr(host_time, "python_scale_now", scale_now)
    with simulator.activate("h100", sanitize=False) as sim:
        x = torch.zeros(4)
        x.add_(1)
        _busy(0.03)
        x.add_(1)  # more than SCALE_EVERY_S since the first: timed again, after this op's charge
        assert retimed == [0.5] and sim._timeline.python_scale == 0.5
        start = sim.now_us()
        x.add_(1)  # what follows the retiming: charged at its scale, the retiming's 50 ms not
        spent = sim.now_us() - start
    assert spent < H100.launch_us + 0.5 * 20_000


def test_measured_clock_does_not_charge_the_simulators_entry(clean_device_env):
    """Ops issued back to back with no Python between them: what entering the simulator costs on this machine is
    taken out, so the clock advances by well under what this machine spends per op outside the simulator's
    frames."""
    clean_device_env.setenv(HOST_CLOCK_ENV, "measured")
    with simulator.activate(dataclasses.replace(H100, host_ref_us=0.0), sanitize=False) as sim:
        x = torch.zeros(4)
        x.add_(1)
        start = sim.now_us()
        for _ in range(200):
            x.add_(1)
        python_us = (sim.now_us() - start) / 200 - H100.launch_us
    entry_us, _ = host_time.entry_costs()
    assert entry_us > 0
    assert python_us < 2 * entry_us


def test_unknown_host_clock_is_refused(monkeypatch):
    monkeypatch.setenv(HOST_CLOCK_ENV, "wall")
    with pytest.raises(ValueError, match=HOST_CLOCK_ENV):
        Timeline(H100)
    with pytest.raises(ValueError, match="host_clock"):
        Timeline(H100, host_clock="wall")
