"""Host RAM at its true size: the simulated host (SWAPOPT_SIM_HOST_MB) counts pinned memory as the caching host
allocators take it (a power of two, freed blocks kept), and swapopt's arenas at their own size; a job that
needs more than the host has free is refused before anything is allocated (swapopt.HostMemoryError)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import device
import simdevice as simulator
import swapopt
from swapopt import HostMemoryError, SwapOptimizer, arena, hostmem

MiB = 1 << 20


def _bound(kept: int) -> float:
    """What the host may hold for ``kept`` bytes of states and masters at any moment (docs/optimizer.md)."""
    return 1.02 * kept + 256 * MiB


def _job(shapes, dtype=torch.bfloat16, master_weights=True, **knobs):
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s, dtype=dtype) / 10) for s in shapes])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, SwapOptimizer(inner, master_weights=master_weights, **knobs)


def _grads(model, step, only=None):
    g = torch.Generator().manual_seed(step)
    for i, p in enumerate(model):
        p.grad = None if only is not None and i not in only else torch.randn(p.shape, generator=g).to(p)


def _kept(model) -> int:
    return sum(12 * p.numel() for p in model)  # two fp32 moments and an fp32 master per bf16 param


# one bf16 param whose masters and states (12 B/param) are 33 MiB: its state arena is just over a power of two
ONE = [(2816, 1024)]


def test_power_of_two_arenas_fail_at_60_percent_and_true_size_arenas_train(monkeypatch):
    kept = _kept([torch.empty(s) for s in ONE])
    assert kept == 33 * MiB
    monkeypatch.setenv("SWAPOPT_SIM_HOST_MB", str(kept / 0.6 / MiB))  # the job needs 60% of the host
    # Yesterday's arenas: every buffer from the caching host allocator, rounded up to a power of two (the 33 MiB
    # arena takes 64) beside the masters it is moved from, as on the H100 host that ran out of memory.
    monkeypatch.setattr(device, "_registers", lambda nbytes, exact=False: False)
    with simulator.activate() as dev:
        if dev.flavour != "cuda":
            # NPU arenas come from torch_npu's pinned allocator in both halves (no host-register binding;
            # docs/optimizer.md "Host memory"): true-size arenas are the cuda flavour's.
            pytest.skip("true-size arenas register host memory through CUDA")
        model, opt = _job(ONE, swap_optimizer_times=1)
        _grads(model, 0)
        with pytest.raises(RuntimeError, match="CUDA error: out of memory"):
            opt.step()
        assert dev.host_memory_reserved() <= dev.host_mem.capacity
    monkeypatch.undo()
    monkeypatch.setenv("SWAPOPT_SIM_HOST_MB", str(kept / 0.6 / MiB))
    with simulator.activate() as dev:
        model, opt = _job(ONE, swap_optimizer_times=1)
        for step in range(3):
            _grads(model, step)
            opt.step()
        stats = opt.swap_stats()
        assert stats.pinned_bytes == stats.pinned_requested_bytes == kept  # at its true size
        assert dev.host_memory_allocated() == kept  # the masters it was moved from are gone, not cached
        # the masters were allocated before the arena they move into: never more than both
        assert dev.max_host_memory_reserved() <= kept + 4 * ONE[0][0] * ONE[0][1]
        assert stats.pin_seconds > 0  # modeled: the preset's pinning rate


def _check_bound(dev, kept: int, arena_bytes: int) -> None:
    peak = dev.max_host_memory_reserved()
    assert peak <= _bound(kept)
    # What makes it hold at any size: a re-layout holds about one arena twice (Note [arena memory]). Buffers
    # under device.REGISTER_MIN come from the caching host allocator, which keeps them when freed.
    assert peak <= kept + dev.host_mem.cached + 2 * arena_bytes, (peak - kept) / MiB


SHAPES = [(128, 128)] * 8 + [(64, 128)] * 4  # 160K bf16 params: 1.9 MiB of states and masters


def _small_buffers(monkeypatch) -> None:
    """The sizes of a large job, scaled down 16 times: host_empty registers from 64 KiB, arenas of 64 KiB."""
    monkeypatch.setattr(device, "REGISTER_MIN", 64 << 10)
    monkeypatch.setattr(arena, "ARENA_MIN", 64 << 10)


def test_70_percent_steps_replans_and_resumes_from_dcp_within_the_bound(monkeypatch, tmp_path):
    kept = _kept([torch.empty(s) for s in SHAPES])
    monkeypatch.setenv("SWAPOPT_SIM_HOST_MB", str(kept / 0.7 / MiB))
    _small_buffers(monkeypatch)  # the arena limit acts on a small job
    limit = arena.arena_limit(kept)
    with simulator.activate() as dev:
        model, opt = _job(SHAPES, swap_optimizer_times=4)
        for step, only in enumerate([None, set(range(0, 12, 2)), None, set(range(6))]):
            _grads(model, step, only)  # params without grads leave the plan: re-plans and re-layouts
            opt.step()
            _check_bound(dev, kept, limit)
        assert len(opt._layout.arenas) > 4  # packed up to the limit, not one arena per chunk
        opt.wait_for_swap_out()
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp_path)
        saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        del opt
        gc.collect()
        dev.empty_cache()
        dev.host_mem.reset_peak()
        resumed, opt2 = _job(SHAPES, swap_optimizer_times=4)
        with torch.no_grad():
            for p, q in zip(resumed, model):
                p.copy_(q)
        sd = {"optim": get_optimizer_state_dict(resumed, opt2)}
        dcp.load(sd, checkpoint_id=tmp_path)
        set_optimizer_state_dict(resumed, opt2, sd["optim"])
        loaded = opt2.state_dict()["state"][0]
        assert all(torch.equal(loaded[k].cpu(), v.cpu()) for k, v in saved.items())
        for step in range(4, 6):
            _grads(resumed, step, None if step != 5 else set(range(5)))
            opt2.step()
        _check_bound(dev, kept, limit)
        assert opt2.swap_stats().pinned_bytes == kept


def test_110_percent_raises_before_allocating(monkeypatch):
    kept = _kept([torch.empty(s) for s in SHAPES])
    monkeypatch.setenv("SWAPOPT_SIM_HOST_MB", str(kept / 1.1 / MiB))
    with simulator.activate() as dev:
        model, opt = _job(SHAPES)
        _grads(model, 0)
        with pytest.raises(HostMemoryError) as info:
            opt.step()
        err = info.value
        assert isinstance(err, MemoryError) and swapopt.HostMemoryError is HostMemoryError
        assert err.needed == kept and err.available == dev.host_mem.capacity
        text = str(err)
        for word in ("master_weights", "resident_mb", "ranks", f"{kept:,} bytes", f"{err.available:,} bytes"):
            assert word in text
        assert dev.max_host_memory_reserved() == 0  # refused before anything was pinned
        assert all(not opt.state.get(p) for p in model)  # and nothing was stepped


def test_resident_mb_lets_the_same_job_fit(monkeypatch):
    states = sum(8 * s[0] * s[1] for s in SHAPES)  # fp32 params: two fp32 moments each
    monkeypatch.setenv("SWAPOPT_SIM_HOST_MB", str(states / 1.1 / MiB))
    with simulator.activate() as dev:
        model, opt = _job(SHAPES, torch.float32, master_weights=False)
        _grads(model, 0)
        with pytest.raises(HostMemoryError, match="resident_mb"):
            opt.step()
        model, opt = _job(SHAPES, torch.float32, master_weights=False, resident_mb=states * 0.3 / MiB)
        _grads(model, 0)
        opt.step()  # the knob the error names: the states that fit stay in device memory
        assert 0 < dev.host_memory_allocated() < dev.host_mem.capacity


def test_resident_auto_keeps_the_states_the_device_holds_off_the_host(monkeypatch):
    states = sum(8 * s[0] * s[1] for s in SHAPES)
    monkeypatch.setenv("SWAPOPT_SIM_HOST_MB", str(states / 1.1 / MiB))
    with simulator.activate() as dev:  # the preset's 80 GB hold every state beside this job
        model, opt = _job(SHAPES, torch.float32, master_weights=False, resident_mb="auto")
        _grads(model, 0)
        opt.step()  # measured before the plan: the host-memory check counts only the states it swaps
        assert opt.swap_stats().resident_budget_bytes >= states and dev.host_memory_allocated() == 0
    # the engine's start-up estimate cannot know the device's spare memory: "auto" keeps nothing off the host
    # for sure (a re-plan may bring every state back), so it counts them all
    assert hostmem.resident_bytes_of("auto") == hostmem.resident_bytes_of("auto:0.5") == 0
    assert hostmem.resident_bytes_of(1.5) == int(1.5 * MiB)
    assert "resident_mb='auto'" in hostmem.describe(2 * MiB, MiB, 2 * MiB)


def test_job_host_bytes_is_the_arithmetic_of_the_docs():
    # 6.5B params in bf16 with master weights: 8 B of fp32 moments and 4 B of master a param
    total, masters = hostmem.job_host_bytes(6_500_000_000, torch.bfloat16, master_weights=True)
    assert (total, masters) == (78_000_000_000, 26_000_000_000)
    assert hostmem.job_host_bytes(1000, torch.float32, world=4) == (2000, 0)  # FSDP: a quarter each
    assert hostmem.job_host_bytes(1000, torch.bfloat16) == (4000, 0)  # bf16 moments without masters


def test_the_engine_prints_one_error_line_when_the_host_is_too_small(tmp_path):
    import os

    import cli_zygote

    env = {**os.environ, "SWAPOPT_SIM_HOST_MB": "1"}
    # a start-up check: forked from a process that imported torch once (tests/cli_zygote.py)
    out = cli_zygote.run(["-m", "swapopt.train", "configs/tiny.py", "--cfg-options", f"train.checkpoint_dir={tmp_path}",
                          "train.metrics_path=None"], cwd=os.getcwd(), env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: swapopt: the optimizer states need"), out.stdout
    assert "1.0 MiB (1,048,576 bytes) free" in lines[0] and "Traceback" not in out.stderr


def test_capacity_figure_says_a_6_5b_bf16_job_with_masters_fits_an_h100_and_125_gib():
    from swapopt.bench import capacity
    from swapopt.engine.config import ModelConfig
    from swapopt.engine.model import build_model

    cfg = ModelConfig(dim=4096, n_heads=32, n_layers=32, ffn_dim=11008)
    with torch.device("meta"):  # the arithmetic counts the engine's own LM
        assert capacity.lm_params(4096, 32, 11008) == sum(p.numel() for p in build_model(cfg, 0).parameters())
    host = 125 * 2**30
    job = capacity.row("masters", 4096, 32, 79 * 2**30, host, ffn_dim=11008)
    assert job.fits and 77e9 < job.pinned_bytes < 78e9  # masters and moments: 12 B a param
    assert not capacity.row("resident", 4096, 32, 79 * 2**30, host, ffn_dim=11008).fits
    # with torchao AdamW8bit's moments (a uint8 code a param, an fp32 scale per 256): 4 + 2 x (1 + 4/256) B
    small = capacity.row("masters-8bit", 4096, 32, 79 * 2**30, host, ffn_dim=11008)
    assert small.fits and small.pinned_bytes == 4 * job.n_params + -(-job.n_params * 2 * 260 // 256)
    assert 39.0e9 < small.pinned_bytes < 39.1e9 and small.device_bytes < job.device_bytes
    rows = {r.mode: r for r in capacity.capacity_table("h100", host)}
    assert list(rows) == list(capacity.MODES)
    n = [rows[m].n_params for m in ("resident", "swapped", "masters", "masters-8bit")]
    assert n == sorted(n) and len(set(n)) == 4
    assert rows["masters"].n_params >= job.n_params and all(r.fits for r in rows.values())
    assert 12.4e9 < rows["masters-8bit"].n_params < 12.6e9  # docs/optimizer.md: about 12.5B
    # the host decides for the masters: half the host, a smaller model
    half = {r.mode: r for r in capacity.capacity_table("h100", host // 2)}
    assert half["masters"].n_params < rows["masters"].n_params
    # the device decides with 8-bit moments: the host's 125 GiB are not all needed
    assert rows["masters-8bit"].host_bytes < 0.7 * host
