"""What real torch_npu would break, under the simulator's npu flavour (device.sim.kernels, npu_amp, streams,
device; docs/npu.md): GradScaler with fused kernels, torch_npu's grad_scaler kwarg, fused kernels op-plugin
lacks or refuses, fresh stream objects and NPU's recordStream, the device probe per call, pinned host
memory rounded up to a power of two, non-contiguous copies and elapsed_time that block the host, foreach
off on older chips, and torch_npu built for another torch.

torch names its PrivateUse1 backend once per process, so outside a session of the npu flavour this file
runs itself in a process of its own (test_in_npu_process)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

import cli_zygote
import simdevice as simulator
from swapopt import SwapOptimizer
from swapopt import npu as swapopt_npu

NPU = (simulator.registered_flavour() or simulator.process_flavour()) == "npu"
npu_only = pytest.mark.skipif(not NPU, reason="runs in a process of the npu flavour (test_in_npu_process)")


@pytest.mark.skipif(NPU, reason="this is the npu process")
def test_in_npu_process() -> None:
    env = {**os.environ, "SWAPOPT_SIM_PRESET": "910b"}
    env.pop("SWAPOPT_DEVICE", None)
    root = Path(__file__).parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    # forked from a process that imported torch once (tests/cli_zygote.py): the session names the backend itself
    run = cli_zygote.run(["-m", "pytest", "-v", "-n", "0", "-p", "no:cacheprovider", __file__], cwd=root, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _scaler(kind: str) -> torch.amp.GradScaler:
    if kind == "torch_npu":
        import torch_npu  # noqa: F401  (the simulated package)

        return torch.npu.amp.GradScaler(init_scale=256.0, growth_interval=1)
    return torch.amp.GradScaler("npu", init_scale=256.0, growth_interval=1)


def _states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = [p for g in opt.param_groups for p in g["params"]]
    return [v.detach().cpu().clone() for p in params for v in opt.state[p].values() if torch.is_tensor(v)]


def _amp_steps(make_opt, wrap: bool, kind: str, inf_at: int, steps: int = 4):
    """Train a few steps under a GradScaler; grads hold an inf at step ``inf_at``. Per step: the params and
    (host copies of) the states after it."""
    model = _model()
    inner = make_opt(model.parameters())
    opt = SwapOptimizer(inner, swap_optimizer_times=3) if wrap else inner
    scaler = _scaler(kind)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    seen = []
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step == inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if wrap:
            opt.wait_for_swap_out()
        seen.append(([p.detach().cpu().clone() for p in model.parameters()], _states(inner), scaler.get_scale()))
    return seen


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _python_scaled(make_opt):
    """An unwrapped optimizer that GradScaler drives the non-fused way: grads unscaled in Python, inf steps
    skipped; for fused AdamW, what a correct run on NPU computes."""

    def make(params):
        opt = make_opt(params)
        opt._step_supports_amp_scaling = False
        return opt

    return make


@npu_only
@pytest.mark.parametrize("kind", ["torch_npu", "upstream"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_adamw_under_grad_scaler_skips_inf_steps_bitwise(kind: str, fused: bool) -> None:
    # op-plugin's _fused_adamw_ ignores grad_scale/found_inf: the wrapper must not claim AMP support there,
    # so that the scaler unscales the grads and skips an inf step. The reference is the unwrapped
    # optimizer scaled in Python. (Fused and unfused are not compared with each other: torch's fused CPU
    # kernel rounds differently from its per-tensor loop, by an ulp.)
    def make(ps):
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=fused, foreach=False if not fused else None)

    with simulator.activate():
        got = _amp_steps(make, True, kind, inf_at=2)
    with simulator.activate():
        ref = _amp_steps(_python_scaled(make), False, kind, inf_at=2)
    params_before, states_before, _ = got[1]
    params_inf, states_inf, _ = got[2]
    assert _equal(params_inf, params_before) and _equal(states_inf, states_before)  # the inf step changed nothing
    for (gp, gs, gscale), (rp, rs, rscale) in zip(got, ref):
        assert gscale == rscale
        assert _equal(gp, rp) and _equal(gs, rs)  # bitwise the unwrapped reference, every step


@npu_only
def test_fused_adamw_kernel_ignores_grad_scale_on_the_npu_flavour() -> None:
    # The model behind the test above: stepped unwrapped with GradScaler's attributes set, the npu
    # flavour's kernel applies an inf step (a real 910B does the same, FusedAdamWKernelNpuOpApi.cpp).
    with simulator.activate():
        p = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        p.grad = torch.ones(4)
        opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(1.0)
        opt.step()
        assert not torch.equal(p.detach().cpu(), torch.ones(4, device="cpu"))
        swapped = SwapOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], fused=True))
        assert not swapped._step_supports_amp_scaling
        sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1, momentum=0.9, fused=True)
        assert SwapOptimizer(sgd)._step_supports_amp_scaling  # op-plugin's _fused_sgd_ reads both


@npu_only
def test_torch_npu_grad_scaler_kwarg_is_accepted_and_honoured() -> None:
    # torch_npu's GradScaler passes grad_scaler=self to an optimizer claiming AMP support (fused SGD, whose
    # NPU kernel reads grad_scale/found_inf) and neither unscales nor checks for infs itself.
    # The reference: the unwrapped fused SGD under upstream torch's scaler, which hands the kernel
    # grad_scale/found_inf as attributes (torch_npu's would pass it grad_scaler=, which torch.optim.SGD
    # does not take).
    fused = lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True)  # noqa: E731
    with simulator.activate():
        got = _amp_steps(fused, True, "torch_npu", inf_at=1)
    with simulator.activate():
        ref = _amp_steps(fused, False, "upstream", inf_at=1)
    assert _equal(got[1][0], got[0][0]) and _equal(got[1][1], got[0][1])
    for (gp, gs, gscale), (rp, rs, rscale) in zip(got, ref):
        assert gscale == rscale
        assert _equal(gp, rp) and _equal(gs, rs)


@npu_only
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, fused=True),
        lambda ps: torch.optim.Adagrad(ps, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-3), fused=True),
    ],
    ids=["adam", "adagrad", "adamw_tensor_lr"],
)
def test_fused_without_npu_kernel_warns_at_construction(make) -> None:
    with simulator.activate() as sim:
        model = _model()
        with pytest.warns(UserWarning, match="CPU fallback.*foreach=True"):
            opt = SwapOptimizer(make(model.parameters()))
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        assert sim.cpu_fallbacks  # what the warning is about: the npu flavour ran the kernel on the host


@npu_only
def test_fused_with_npu_kernel_does_not_warn() -> None:
    with simulator.activate() as sim:
        model = _model()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        assert not sim.cpu_fallbacks


@npu_only
@pytest.mark.filterwarnings("ignore:swapopt. prefetch holds")  # a small model: the first chunk is most of it
@pytest.mark.parametrize("overlap", [False, True])
def test_streams_compare_by_equality_and_the_allocating_stream_is_never_recorded(overlap: bool) -> None:
    # torch_npu's current_stream() is a new object per call, and NPU's recordStream does not skip the
    # allocating stream: a staging block recorded on it is held until that stream's later work is done.
    with simulator.activate() as sim:
        assert sim.current_stream() == sim.current_stream() and sim.current_stream() is not sim.current_stream()
        model = _model()
        inner = torch.optim.AdamW(model.parameters())
        opt = SwapOptimizer(inner, swap_optimizer_times=8, prefetch=True, overlap_forward=overlap)
        opt.attach(model)
        x = torch.randn(8, 16)
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        opt.wait_for_swap_out()
        assert opt.operate.prefetched is None and opt.swap_stats().steps == 3
        assert sim.self_stream_records == 0


@npu_only
def test_device_is_probed_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # SWAPOPT_DEVICE=npu: get_device() imports torch_npu and asks torch.npu.is_available() (a driver probe
    # on hardware). Counted at the import: torch.optim itself asks is_available() once per inner step.
    import importlib

    import device

    monkeypatch.setenv("SWAPOPT_DEVICE", "npu")
    with simulator.activate():
        calls = []
        real = importlib.import_module
        def counted(name, *args, **kwargs):  # torch's own lazy imports pass package=
            if name == "torch_npu":
                calls.append(name)
            return real(name, *args, **kwargs)

        monkeypatch.setattr(importlib, "import_module", counted)
        model = _model()
        opt = SwapOptimizer(torch.optim.AdamW(model.parameters()), swap_optimizer_times=3)
        for _ in range(2):
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
        assert device.get_device() == "npu"
        assert len(calls) <= 1


@npu_only
def test_foreach_off_on_this_chip_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch_npu drops npu from torch.optim's foreach devices on 910A and with CANN < 8.0 (utils/_optim.py).
    optimizer_module = sys.modules["torch.optim.optimizer"]
    monkeypatch.setattr(optimizer_module, "_get_foreach_kernels_supported_devices", lambda: ["cuda", "xpu"])
    monkeypatch.setattr(swapopt_npu, "SAID", set())
    with simulator.activate():
        model = _model()
        with pytest.warns(UserWarning, match="per-tensor loop"):
            SwapOptimizer(torch.optim.AdamW(model.parameters()))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            SwapOptimizer(torch.optim.Adam(_model().parameters()))  # said once per process
            SwapOptimizer(torch.optim.AdamW(_model().parameters(), foreach=False))  # chosen explicitly


@npu_only
def test_engine_config_refuses_fused_without_npu_kernel() -> None:
    from swapopt.engine.config import AdamWConfig, ConfigError

    with simulator.activate():
        with pytest.raises(ConfigError, match="optim.fused.*_fused_adam_.*CPU fallback"):
            AdamWConfig(type="Adam", fused=True).build(_model().parameters())
        with pytest.raises(ConfigError, match="optim.fused.*_fused_adagrad_"):
            AdamWConfig(type="Adagrad", fused=True, swap_optimizer=False).build(_model().parameters())
        assert AdamWConfig(type="AdamW", fused=True).build(_model().parameters()) is not None  # op-plugin has it


def _pinned_run(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(swapopt_npu, "SAID", set())
    monkeypatch.setattr(swapopt_npu, "PINNED_OVERHEAD_TOLD", 0)  # told for any size here
    with simulator.activate() as sim:
        model = torch.nn.Linear(64, 64)  # 4160 params: two fp32 Adam states are 33280 B, just over 32 KiB
        opt = SwapOptimizer(torch.optim.AdamW(model.parameters()), swap_optimizer_times=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model(torch.randn(2, 64)).sum().backward()
                opt.step()
        opt.wait_for_swap_out()
        return opt.swap_stats(), sim.host_memory_allocated(), [str(w.message) for w in caught]


@npu_only
def test_pinned_rounding_is_counted_and_told(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch_npu's default host allocator rounds pinned allocations up to a power of two.
    import device

    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    stats, host, said = _pinned_run(monkeypatch)
    assert stats.pinned_requested_bytes >= 2 * 4160 * 4
    assert stats.pinned_bytes == device.npu_pinned_bytes(stats.pinned_requested_bytes) == 65536
    assert host == stats.pinned_bytes  # what the (simulated) host allocator holds: nothing else is pinned
    assert sum("pin_memory_expandable_segments:True" in m for m in said) == 1  # once, at the first step

    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "pin_memory_expandable_segments:True")
    stats, host, said = _pinned_run(monkeypatch)
    assert stats.pinned_bytes == host < stats.pinned_requested_bytes + 1024
    assert not any("pin_memory_expandable_segments" in m for m in said)


@npu_only
def test_host_ram_estimate_counts_pinned_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    from swapopt.engine.config import load_config
    from swapopt.engine.preflight import count_params, pinned_rounding_bytes

    cfg = load_config(Path(__file__).parent.parent / "configs" / "tiny.py", ["optim.swap_optimizer=true"])
    n = count_params(cfg)
    monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    with simulator.activate():
        rounded = pinned_rounding_bytes(cfg, n)
        monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "pin_memory_expandable_segments:True")
        expandable = pinned_rounding_bytes(cfg, n)
    chunks = cfg.optim.swap_optimizer_times
    assert 0 < rounded < 8 * n and rounded > expandable and expandable <= chunks * 544


@npu_only
def test_swap_copies_are_contiguous_whatever_the_param_layout() -> None:
    # torch_npu copies a non-contiguous host<->device pair through temporaries and waits: the host blocks.
    import device

    with simulator.activate() as sim:
        ps = [
            torch.nn.Parameter(torch.randn(40, 33).t()),
            torch.nn.Parameter(torch.randn(4, 6, 9, 8).contiguous(memory_format=torch.channels_last)),
            torch.nn.Parameter(torch.randn(50)),
        ]
        opt = SwapOptimizer(torch.optim.AdamW(ps), swap_optimizer_times=3, resident_mb=0.006)
        for _ in range(2):
            for p in ps:
                p.grad = torch.ones_like(p)
            opt.step()
        opt.offload()
        opt.onload()
        opt.load_state_dict(opt.state_dict())
        opt.step()
        opt.wait_for_swap_out()
        assert sim.strided_copies == 0
        host = device.pinned_empty((33, 40)).t()
        torch.empty(40, 33).copy_(host, non_blocking=True)
        assert sim.strided_copies == 1  # the model: such a copy would have been seen


@npu_only
def test_engine_reads_device_timings_only_between_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # On NPU, Event.elapsed_time drains every task queue: inside a step it would stall the pipeline.
    import io

    from rich.console import Console

    from device.sim.streams import SimEvent
    from swapopt.engine import trainer
    from swapopt.engine.config import load_config
    from swapopt.engine.preflight import plan_device
    from swapopt.train import device_context, run

    monkeypatch.delenv("SWAPOPT_DEVICE", raising=False)
    inside, calls = [], []
    real_elapsed, real_step = SimEvent.elapsed_time, trainer.TrainEngine.train_step

    def elapsed(self, end):
        calls.append(bool(inside))
        return real_elapsed(self, end)

    def train_step(self, *a, **k):
        inside.append(1)
        try:
            return real_step(self, *a, **k)
        finally:
            inside.pop()

    monkeypatch.setattr(SimEvent, "elapsed_time", elapsed)
    monkeypatch.setattr(trainer.TrainEngine, "train_step", train_step)
    small = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16", "train.batch=2",
             "train.seq_len=16", "train.compare_resident=0", "lr.warmup_steps=1", "train.steps=4",
             "train.log_interval=2", "optim.swap_optimizer=true"]  # fmt: skip
    cfg = load_config(Path(__file__).parent.parent / "configs" / "tiny.py", small)
    with device_context(cfg, plan_device(cfg)):
        assert trainer.device.get_device() == "npu"
        summary = run(cfg, Console(file=io.StringIO()), modeled=True)
    assert len(summary["losses"]) == 4
    assert calls and not any(calls)  # read, but never while a step runs


@npu_only
def test_torch_npu_built_for_another_torch_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    import device

    with simulator.activate():
        import torch_npu  # the simulated package, importable once the npu flavour is registered
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        device.check_torch_npu_version(torch_npu)  # the simulated package matches the installed torch
    monkeypatch.setattr(torch_npu, "__version__", "2.6.0.post3", raising=False)
    with pytest.warns(UserWarning, match=r"torch_npu 2.6.0.post3 is built for torch 2.6.0"):
        device.check_torch_npu_version(torch_npu)


def test_npu_extra_names_a_supported_torch_npu() -> None:
    import tomllib

    root = Path(__file__).parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["npu"] == ["torch_npu>=2.6.0,<2.15"]
    torch_pin = [d for d in project["dependencies"] if d.startswith("torch")]
    assert torch_pin == ["torch>=2.6"]  # the extra's floor follows torch's
    pairs = {k: v for k, v in extras.items() if k.startswith("npu-torch")}
    assert "npu-torch26" in pairs
    for name, (torch_req, npu_req) in pairs.items():
        # each pair names one torch release and the torch_npu built for it
        release = torch_req.removeprefix("torch==")
        assert npu_req == f"torch_npu=={release}.*", name
        assert name == "npu-torch" + "".join(release.split(".")[:2]), name


@npu_only
def test_fused_sgd_without_momentum_is_refused_at_construction() -> None:
    with simulator.activate():
        p = torch.nn.Parameter(torch.ones(4))
        plain = torch.optim.SGD([p], lr=0.1, fused=True)
        p.grad = torch.ones(4)
        with pytest.raises(RuntimeError, match="momentum > 0"):
            plain.step()  # the model: op-plugin's kernel refuses it
        with pytest.raises(ValueError, match="momentum > 0"):
            SwapOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1, fused=True))
