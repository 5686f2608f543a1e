"""Shared fixtures: a scoped simulated accelerator, a clean device environment, a one-rank process group
and the library's logging quieted after a CLI run."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from loguru import logger

import simdevice as simulator


@pytest.fixture
def clean_device_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No SWAPOPT_DEVICE override: detection runs as on a plain machine."""
    monkeypatch.delenv("SWAPOPT_DEVICE", raising=False)
    return monkeypatch


@pytest.fixture
def sim(clean_device_env: pytest.MonkeyPatch) -> Iterator[simulator.SimDevice]:
    """A fresh simulated H100 (sanitizer on) for the duration of the test."""
    with simulator.activate() as device:
        yield device


@pytest.fixture
def pg(sim, tmp_path) -> Iterator[None]:
    """One gloo rank over a file store, on the simulated device: a process group for FSDP2 and DCP."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def quiet_library_after() -> Iterator[None]:
    # main() enables the library's logging as a CLI should; give the rest of the session its default back.
    yield
    logger.disable("swapopt")
    logger.disable("device")


@pytest.fixture
def sim_no_launch(clean_device_env: pytest.MonkeyPatch) -> Iterator[simulator.SimDevice]:
    """A simulated H100 whose launches cost no host time, so modeled times are exact sums of op costs."""
    preset = dataclasses.replace(simulator.PRESETS["h100"], launch_us=0.0)
    with simulator.activate(preset) as device:
        yield device


@pytest.fixture(autouse=True)
def _process_simulator_races() -> Iterator[None]:
    """Under SWAPOPT_DEVICE=sim the process-wide simulator never exits: a race it found when a tensor was
    freed (not yet raised at a synchronize) fails the test that left it."""
    yield
    if simulator._PROCESS:
        simulator._PROCESS[0]._raise_pending()


def pytest_report_header(config: pytest.Config) -> str:
    """Which flavour this session simulates (SWAPOPT_SIM_PRESET; one per process)."""
    flavour = simulator.registered_flavour() or simulator.process_flavour() or "cuda"
    return f"simulated device: {flavour} flavour (device type {simulator.backend_name(flavour)})"
