"""device.host_time: the host CPU time spent inside the simulator's own frames, counted once however deeply
they nest, so a benchmark can tell the Python that drives the device from the simulator's bookkeeping."""

from __future__ import annotations

import time

import torch

from device.sim import host_time


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@host_time.counted
def _inner() -> None:
    _spin(0.01)


@host_time.counted
def _outer() -> None:
    _spin(0.01)
    _inner()


def test_nested_frames_count_once():
    before, calls = host_time.seconds(), host_time.calls()
    _outer()
    inside = host_time.seconds() - before
    assert host_time.calls() - calls == 1  # the outer frame only
    assert 0.02 <= inside < 0.2  # both spins, once (nesting does not double them)
    _spin(0.02)  # outside any frame: not counted
    assert host_time.seconds() - before < inside + 0.01


def test_a_failing_frame_still_closes():
    before = host_time.seconds()

    @host_time.counted
    def boom() -> None:
        _spin(0.01)
        raise ValueError("x")

    try:
        boom()
    except ValueError:
        pass
    spent = host_time.seconds() - before
    _spin(0.02)
    assert host_time.seconds() - before == spent  # depth back to 0: the clock stopped


def test_simulator_ops_and_streams_are_simulator_frames(sim):
    x = torch.ones(1000)  # device memory under the simulator
    before, calls = host_time.seconds(), host_time.calls()
    y = x * 2
    s = sim.Stream()
    s.wait_stream(sim.current_stream())
    with sim.stream(s):
        y.add_(1)
    s.synchronize()
    assert host_time.calls() - calls >= 3 and host_time.seconds() > before
    # plain host work is not
    before = host_time.seconds()
    _spin(0.02)
    assert host_time.seconds() == before


def test_the_reference_work_is_timed_as_cpu_time():
    """reference_us() is the yardstick of a host's Python speed (Note [scaled Python]): a CPU time that does not
    count time the thread spends off the CPU, stable to within a few percent between two timings."""
    first = host_time.reference_us()
    time.sleep(0.05)
    second = host_time.reference_us()
    assert 100 < first < 1e6
    assert 0.5 < first / second < 2.0
    assert host_time.reference_work() == host_time.reference_work()


def test_entry_costs_are_per_entry_and_per_tensor():
    per_entry, per_tensor = host_time.entry_costs()
    assert 0 < per_entry < 100  # microseconds
    assert 0 <= per_tensor < per_entry
    assert host_time.entry_costs() == (per_entry, per_tensor)  # measured once per process
