"""resident_mb="auto": the device's spare memory at the forward/backward peak holds states (Note [resident auto]),
on the simulator's exact memory count (sanitizer on)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import simdevice as simulator
import torch

import device
from swapopt import SwapConfig, SwapOptimizer
from swapopt.config import settings_from
from swapopt.engine.config import ConfigError, load_config
from swapopt.engine.preflight import pinned_host_bytes
from swapopt.engine.trainer import TrainEngine
from swapopt.resident_auto import DEFAULT_FRACTION, MARGIN

KiB, MiB = 1 << 10, 1 << 20
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LAYERS, WIDTH, BATCH = 6, 128, 1024
STATE_BYTES = 2 * WIDTH * WIDTH * 4  # AdamW's two fp32 moments of one layer's weight
# Activations dominate: each layer saves a 1024 x 128 fp32 input (512 KiB) for its backward, so the forward/
# backward peak (about 5.9 MiB) is far above the step's own (params, grads, staging), as in LLM training.


@functools.cache
def _capacity() -> int:
    """A device on which the forward and backward leave five layers' states and 1000 bytes free: all six
    resident do not fit beside the forward, and five only without a margin."""
    with simulator.activate() as dev:
        _model()(_batch(0)).square().mean().backward()
        return dev.max_memory_allocated() + 5 * STATE_BYTES + 1000


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def _batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(BATCH, WIDTH, generator=g).to(device.torch_device())


def _forward_backward(model, opt, i: int) -> None:
    opt.zero_grad()
    model(_batch(i)).square().mean().backward()


def _train_step(model, opt, i: int) -> None:
    _forward_backward(model, opt, i)
    opt.step()


def _trains_with_some_states_resident() -> None:
    """Three train steps with resident_mb="auto" keep some layers' states resident, not all."""
    model = _model()
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), swap_optimizer_times=4, resident_mb="auto")
    for i in range(3):
        _train_step(model, opt, i)
    assert 0 < len(_resident(opt, model)) < LAYERS


def _resident(opt, model) -> list[torch.nn.Parameter]:
    opt.wait_for_swap_out()
    return [p for p in model.parameters() if not device.is_host_tensor(opt.state[p]["exp_avg"])]


def _reference(steps: int) -> list[torch.Tensor]:
    """The unwrapped AdamW over the same batches, on a device large enough for all its states."""
    with simulator.activate():
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        for i in range(steps):
            _train_step(model, opt, i)
        return [p.detach().cpu() for p in model.parameters()]


def _equal(model, ref) -> bool:
    return all(torch.equal(p.detach().cpu(), r) for p, r in zip(model.parameters(), ref))


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), (" Auto ", "auto"), ("auto:0.5", "auto:0.5"),
                                           ("auto:.25", "auto:0.25"), (3, 3.0), ("512", 512.0), (0, 0.0)])
def test_knob_takes_mib_auto_or_a_share(value, parsed):
    assert settings_from({"resident_mb": value}).resident_mb == parsed
    assert SwapConfig(swap_optimizer=True, resident_mb=value).settings().resident_mb == parsed


@pytest.mark.parametrize("value, message", [
    ("auto:1", r"resident_mb: 'auto:1': the share after 'auto:' must be a number in \(0, 0.9\]"),
    ("auto:0", r"the share after 'auto:' must be"),
    ("auto:half", r"got 'half'"),
    ("lots", r"resident_mb: must be a number of MiB >= 0, 'auto' or 'auto:F'"),
    (-1, r"resident_mb: must be a finite number of MiB >= 0 or 'auto', got -1"),
    (float("nan"), r"finite"),
    (True, r"resident_mb: must be a number of MiB >= 0 or 'auto', got True \(a budget, not a switch\)"),
])
def test_bad_values_name_the_knob(value, message):
    with pytest.raises(ValueError, match=message):
        settings_from({"resident_mb": value})


@pytest.mark.parametrize("value", ["auto", "auto:0.5", 1.0])
def test_master_weights_refuse_a_resident_share(sim, value):
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="master_weights=True with resident_mb=.* is not supported"):
        SwapOptimizer(torch.optim.AdamW([p]), master_weights=True, resident_mb=value)


def test_spare_memory_after_the_backward_peak_holds_states_and_the_link_moves_fewer_bytes():
    steps = 3
    ref = _reference(steps)
    # Swapped entirely: the forward/backward peak (before any step) and the link bytes of a step.
    cap = _capacity()
    with simulator.activate(capacity_bytes=cap) as dev:
        model = _model()
        opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), swap_optimizer_times=4)
        opt.zero_grad()
        model(_batch(0)).square().mean().backward()
        peak = dev.max_memory_allocated()
        opt.step()
        _train_step(model, opt, 1)
        swapped = opt.swap_stats()
    spare = cap - peak  # what the forward and backward leave free
    assert STATE_BYTES < spare < LAYERS * STATE_BYTES
    with simulator.activate(capacity_bytes=cap) as dev:
        model = _model()
        opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), swap_optimizer_times=4,
                            resident_mb="auto")
        budgets = []
        for i in range(steps):
            _train_step(model, opt, i)
            budgets.append(opt.swap_stats().resident_budget_bytes)
        stats = opt.swap_stats()
        resident = _resident(opt, model)
        assert _equal(model, ref)  # bitwise the unwrapped optimizer
        # spare less the margin: 10% of it (the re-plan tolerance) and 1% of the device (allocator rounding): the
        # exact allocator reserves what it allocates, so the process may use the whole device
        budget = int(DEFAULT_FRACTION * spare) - int(MARGIN * cap)
        assert budgets == [budget] * steps  # measured once, no re-plan while nothing changes
        held = len(resident) * STATE_BYTES
        assert resident == list(model.parameters())[: len(resident)]  # stepped first, in order (first fit)
        assert 0 < budget - STATE_BYTES < held <= budget
        # the link moves the states of the others only, each way
        assert stats.h2d_bytes == swapped.h2d_bytes - held and stats.d2h_bytes == swapped.d2h_bytes - held
        assert dev.max_memory_allocated() <= cap - (spare - held)


def test_tight_device_the_next_forward_does_not_run_out_of_memory():
    # All states resident do not fit beside the forward: a fixed budget for all of them runs out of memory in
    # the second forward, the first one the resident states are there for.
    cap = _capacity()
    with simulator.activate(capacity_bytes=cap):
        model = _model()
        opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), swap_optimizer_times=4, resident_mb=64)
        _train_step(model, opt, 0)
        with pytest.raises(torch.OutOfMemoryError):
            _train_step(model, opt, 1)
    # "auto" at the same capacity trains, with some states resident
    with simulator.activate(capacity_bytes=cap) as dev:
        _trains_with_some_states_resident()
        # the margin stays free at the forward's peak
        assert dev.max_memory_allocated() <= cap * (1 - MARGIN)


def test_a_process_memory_cap_is_honoured():
    # A job sharing its device (RL colocated with an inference engine) caps itself with
    # set_per_process_memory_fraction: mem_get_info still shows the whole device free, auto reads the cap.
    cap = _capacity()
    with simulator.activate(capacity_bytes=2 * cap) as dev:
        dev.set_per_process_memory_fraction(0.5)
        _trains_with_some_states_resident()
        assert dev.max_memory_allocated() <= cap * (1 - MARGIN)


def test_bench_rows_at_two_free_memory_levels_move_fewer_bytes():
    from swapopt.bench.run import BenchConfig, run_size

    cfg = BenchConfig(sizes=[0.0002], repeats=1, strategies=["swapopt-auto-25", "swapopt-auto-75"])
    with simulator.activate("h100", sanitize=True) as dev:
        size = run_size(0.0002, cfg)
        assert dev.get_per_process_memory_fraction() == 1.0  # each row gives its cap back
    low, high = size.rows
    for r in size.rows:  # proof: each step moved what it must (the states not resident) and stepped every param
        assert r.error is None and r.params_changed == r.params_total
        assert r.h2d_bytes == r.d2h_bytes == r.need_h2d_bytes
    # 25% of the states spare keeps about 0.9 x 25% resident less the margin; 75%, about 0.9 x 75%
    assert size.state_bytes * 0.7 < low.h2d_bytes < size.state_bytes * 0.85
    assert size.state_bytes * 0.25 < high.h2d_bytes < size.state_bytes * 0.4


def test_a_change_of_free_memory_past_ten_percent_replans_and_below_does_not():
    steps = 6
    ref = _reference(steps)
    with simulator.activate(capacity_bytes=_capacity() + 2 * STATE_BYTES):
        model = _model()
        opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), swap_optimizer_times=4,
                            resident_mb="auto")
        _train_step(model, opt, 0)
        first = opt.swap_stats().resident_budget_bytes
        n_first = len(_resident(opt, model))
        available = opt._auto.planned.available
        # Memory the rest of the job holds from one step through the next forward (a cache, another model):
        # 5% of what the states may use is within the tolerance, the plan stays, and the forward fits beside it.
        _forward_backward(model, opt, 1)
        held = torch.empty(available // 20 // 4)
        opt.step()
        _train_step(model, opt, 2)
        assert opt.swap_stats().resident_budget_bytes == first and len(_resident(opt, model)) == n_first
        # 30%: re-planned at once, with fewer states resident (back to the host) before the next forward
        _forward_backward(model, opt, 3)
        held = torch.empty(3 * available // 10 // 4)
        opt.step()
        _train_step(model, opt, 4)
        assert opt.swap_stats().resident_budget_bytes < first and len(_resident(opt, model)) < n_first
        assert opt._auto.replans == 1
        # freed: the states come back (the peak need not be reset: swapopt knows what it was made of)
        _forward_backward(model, opt, 5)
        del held
        opt.step()
        assert opt.swap_stats().resident_budget_bytes == first and len(_resident(opt, model)) == n_first
        assert opt._auto.replans == 2
        assert _equal(model, ref)  # bitwise through both re-plans


def test_offload_state_dict_and_copies_keep_auto(sim):
    model = _model()
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), swap_optimizer_times=4, resident_mb="auto")
    for i in range(2):
        _train_step(model, opt, i)
    assert len(_resident(opt, model)) == LAYERS  # the preset's 80 GB hold them all
    stats = opt.swap_stats()  # a step that swaps nothing still has a time (its end does not follow its entry)
    assert stats.h2d_bytes == stats.d2h_bytes == 0 and stats.step_ms is not None
    opt.offload()
    assert not _resident(opt, model)  # no optimizer byte on the device while offloaded
    opt.onload()
    _train_step(model, opt, 2)
    assert len(_resident(opt, model)) == LAYERS
    opt.load_state_dict(opt.state_dict())
    _train_step(model, opt, 3)
    assert len(_resident(opt, model)) == LAYERS and opt.resident_mb == "auto"
    assert "resident_mb='auto'" in repr(opt)
    clone = copy.deepcopy(opt)  # a copy measures for itself from its first step
    assert clone.resident_mb == "auto" and clone._auto is not opt._auto and clone._auto.planned is None


TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16", "train.batch=2",
        "train.seq_len=16", "train.steps=3", "train.compare_resident=0", "lr.warmup_steps=1"]


def test_engine_config_takes_auto_and_trains_bitwise(sim, tmp_path):
    yaml = tmp_path / "tiny_auto.yaml"  # a config file's `resident_mb: auto`, and the same as a command-line option
    yaml.write_text((CONFIGS / "tiny.yaml").read_text().replace("  slots: 3\n", "  slots: 3\n  resident_mb: auto\n"))
    assert load_config(yaml).optim.resident_mb == "auto"
    cfg = load_config(CONFIGS / "tiny.py", [*TINY, "optim.resident_mb=auto"])
    assert cfg.optim.resident_mb == "auto"
    # the start-up host-memory estimate counts every state: "auto" keeps none off the host for sure
    assert pinned_host_bytes(cfg, 1000) == pinned_host_bytes(load_config(CONFIGS / "tiny.py", TINY), 1000)
    auto = TrainEngine(cfg)
    assert isinstance(auto.optimizer, SwapOptimizer) and auto.optimizer.resident_mb == "auto"
    plain = TrainEngine(load_config(CONFIGS / "tiny.py", [*TINY, "optim.swap_optimizer=false"]))
    assert [auto.train_step()["loss"] for _ in range(3)] == [plain.train_step()["loss"] for _ in range(3)]
    assert auto.optimizer.swap_stats().resident_budget_bytes > 0 and _resident(auto.optimizer, auto.model)


@pytest.mark.parametrize("value", ["auto:2", "most"])
def test_engine_config_names_the_key_of_a_bad_value(value):
    with pytest.raises(ConfigError, match=r"optim\.resident_mb: "):
        load_config(CONFIGS / "tiny.py", [*TINY, f"optim.resident_mb={value}"])
