"""Shared fixtures: a scoped simulated accelerator, a clean device environment, a one-rank process group
and the library's logging quieted after a CLI run."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from loguru import logger

import simdevice as simulator

# Under pytest-xdist (pyproject's addopts) each worker gets its share of the cores for torch's intra-op
# threads, and so do the processes its tests start (CLI runs, torchrun ranks): workers that each spread
# over every core only contend with one another.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


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
    """A simulated H100 whose launches and event calls cost no host time, so modeled times are exact sums of op
    costs."""
    preset = dataclasses.replace(simulator.PRESETS["h100"], launch_us=0.0, event_us=0.0)
    with simulator.activate(preset) as device:
        yield device


@pytest.fixture(autouse=True)
def _process_wide_torch_state() -> Iterator[None]:
    """Each test leaves torch's process-wide settings as it found them, so that no test passes or fails
    because of the ones that ran before it (the suite runs in random order): Lightning's deterministic=True
    turns on deterministic algorithms, importing torch.testing._internal freezes torch.backends flags."""
    frozen = torch.backends.flags_frozen()
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    environ = dict(os.environ)  # Lightning's deterministic=True also sets CUBLAS_WORKSPACE_CONFIG
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    dtype, default_device, grad = torch.get_default_dtype(), torch.get_default_device(), torch.is_grad_enabled()
    yield
    if (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) != cudnn:
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True  # frozen: reset below
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
    if torch.backends.flags_frozen() != frozen:
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = not frozen
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != deterministic:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    if torch.get_default_device() != default_device:
        torch.set_default_device(None if default_device.type == "cpu" else default_device)
    torch.set_grad_enabled(grad)


# Note [collection out of the collector's sight]
# Collection imports torch, its optim_db, the frameworks and every test module: some 200,000 objects that live
# until the process ends. Each full garbage collection walked all of them, 0.2-0.4 s on a 2-core host, and the suite
# makes hundreds: the benchmark collects between its rows (swapopt.bench.measure.free_device_memory), tests that
# count device memory collect first, and the interpreter collects on its own. gc.freeze() moves them to the
# permanent generation, which collections skip; objects made later, the tests' own, are collected as before. Once
# per process: `python -m tests.mutations` collects again for each mutation, in one process.
_collection_frozen = False


def pytest_collection_finish(session: pytest.Session) -> None:
    """Importing torch.testing._internal (optim_db) at collection freezes torch.backends flags for the whole
    process, as torch's own suite wants; tests here set them (Lightning sets cudnn.benchmark), so whatever
    modules were collected, the tests start with them settable. Then what collection built is moved out of the
    garbage collector's sight (Note [collection out of the collector's sight])."""
    global _collection_frozen
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    if not _collection_frozen:
        gc.collect()  # garbage left by the imports is freed, not kept for ever
        gc.freeze()
        _collection_frozen = True


@pytest.fixture(autouse=True)
def _process_simulator_races() -> Iterator[None]:
    """Under SWAPOPT_DEVICE=sim the process-wide simulator never exits: a race it found when a tensor was
    freed (not yet raised at a synchronize) fails the test that left it."""
    yield
    if simulator._PROCESS:
        simulator._PROCESS[0]._raise_pending()


# Note [heaviest files first]
# CI runs the suite on 2 workers that take a file at a time (--dist loadfile) in collection order
# (--no-loadscope-reorder: by default xdist orders files by their number of tests, which puts the one-test files
# that launch whole jobs, the longest of all, last). When a 90-second file comes last the other worker idles, and
# the run ends up a minute longer than its work over two. So the files go longest first: their seconds in tests/data/file-seconds.json, from a
# `--durations=0` run (tests/file_seconds.py writes it). Tests keep pytest-randomly's order within a file, and
# files missing from the table keep it among themselves, after the others.
_FILE_SECONDS = os.path.join(os.path.dirname(__file__), "data", "file-seconds.json")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    with open(_FILE_SECONDS) as f:
        seconds = json.load(f)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))  # stable: see the Note


def pytest_report_header(config: pytest.Config) -> str:
    """Which flavour this session simulates (SWAPOPT_SIM_PRESET; one per process)."""
    flavour = simulator.registered_flavour() or simulator.process_flavour() or "cuda"
    return f"simulated device: {flavour} flavour (device type {simulator.backend_name(flavour)})"


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The random order's seed, also under -q (which hides the header pytest-randomly writes it in), so a
    failure that depends on the order can be rerun in that order."""
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.has_plugin("randomly") and isinstance(seed, int):
        terminalreporter.write_line(f"random order: rerun it with --randomly-seed={seed}")
