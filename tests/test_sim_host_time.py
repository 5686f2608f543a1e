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


def test_the_reference_work_is_timed_as_cpu_time(monkeypatch):
    """reference_us() is the yardstick of a host's Python speed (Note [scaled Python]): this thread's CPU time, so
    time the thread spends off the CPU does not count, and the least of its runs, so a run stretched by an
    interruption does not either. (Two timings of the real work can differ twofold on a shared 2-core machine, whose
    speed drifts within seconds: ``python_scale_now`` exists for that, so this test does not compare two of them.)"""
    cpu_seconds = iter([0.03, 0.002, 0.03])

    def work() -> None:
        time.sleep(0.02)  # off the CPU: not counted
        _spin(next(cpu_seconds))

    monkeypatch.setattr(host_time, "reference_work", work)
    least = host_time.reference_us(repeats=3)
    assert 2_000 <= least < 15_000  # the 2 ms run; the sleep (20 ms) and the 30 ms runs would each exceed the bound
    monkeypatch.undo()
    assert 100 < host_time.reference_us(repeats=3) < 1e6
    assert host_time.reference_work() == host_time.reference_work()


def test_entry_costs_are_per_entry_and_per_tensor():
    per_entry, per_tensor = host_time.entry_costs()
    assert 0 < per_entry < 100  # microseconds
    assert 0 <= per_tensor < per_entry
    assert host_time.entry_costs() == (per_entry, per_tensor)  # measured once per process
