"""Start-up checks of the main job: everything that would otherwise fail after minutes of training (an
unwritable checkpoint dir at the first save) or with a traceback (a bad device name, a missing data file).

Each check raises ConfigError with one line naming the key; none of them writes anything (the write probe
creates and removes a temporary file in the nearest existing folder).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

import device
from swapopt import internals
from swapopt.engine.config import ConfigError, EngineConfig, suggest

GiB = 2**30
DEVICE_ENV = "SWAPOPT_DEVICE"  # read by device.get_device()
BASE_HOST_BYTES = GiB // 2  # the interpreter, torch and the simulator's bookkeeping


def _probe_folder(folder: Path) -> str | None:
    """None when a file can be created in ``folder``, else the OS's reason."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".swapopt-write-probe-"):
            return None
    except OSError as err:
        return err.strerror or type(err).__name__


def check_writable(path: str, key: str, kind: Literal["dir", "file"]) -> None:
    """Raise ConfigError unless ``path`` (a folder or a file to create or append to) can be written."""
    target = Path(path).expanduser()
    if target.exists():
        if kind == "dir" and not target.is_dir():
            raise ConfigError(f"{key}={path}: exists and is not a directory")
        if kind == "file" and target.is_dir():
            raise ConfigError(f"{key}={path}: is a directory, expected a file path")
        folder = target if kind == "dir" else target.parent
    else:
        folder = target.parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            raise ConfigError(f"{key}={path}: cannot be created, {folder} is a file, not a directory")
    problem = _probe_folder(folder)
    if problem is None and kind == "file" and target.exists() and not os.access(target, os.W_OK):
        problem = "file is read-only"
    if problem is not None:
        raise ConfigError(f"{key}={path}: cannot write there ({problem}: {folder})")


def check_data(cfg: EngineConfig) -> None:
    path = cfg.data.path
    if path is None:
        return
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"data.path={path}: no such file")
    size = file.stat().st_size
    if size <= cfg.train.seq_len + 1:
        raise ConfigError(f"data.path={path}: {size} bytes is too short for train.seq_len={cfg.train.seq_len}")


class DevicePlan(BaseModel):
    """Where the job runs: "sim" (simulator with ``preset``), "plain-cpu" (neither accelerator nor simulator:
    a SwapOptimizer steps in place) or the detected accelerator ("cuda", "npu", "sim" from the environment)."""

    kind: str
    preset: str | None = None
    reason: str


def _detect(requested: str | None) -> str:
    """device.get_device() under ``SWAPOPT_DEVICE=requested`` (None: the environment as it is)."""
    previous = os.environ.get(DEVICE_ENV)
    if requested is not None:
        os.environ[DEVICE_ENV] = requested
    try:
        return device.get_device()
    except (ValueError, RuntimeError) as err:
        raise ConfigError(" ".join(str(err).split())) from None
    finally:
        if previous is None:
            os.environ.pop(DEVICE_ENV, None)
        else:
            os.environ[DEVICE_ENV] = previous


def plan_device(cfg: EngineConfig) -> DevicePlan:
    """Resolve ``train.device`` and ``SWAPOPT_DEVICE`` before anything runs; a bad choice is a ConfigError."""
    tcfg = cfg.train
    env = (os.environ.get(DEVICE_ENV) or "auto").strip().lower()
    detected = _detect(None)  # validates SWAPOPT_DEVICE itself
    wanted = tcfg.device
    if wanted in ("cuda", "npu"):
        try:
            detected = _detect(wanted)
        except ConfigError as err:
            raise ConfigError(f"train.device={wanted}: {err}".replace(f"{DEVICE_ENV}={wanted} but ", "")) from None
    explicit_cpu = wanted == "cpu" or (wanted == "auto" and env == "cpu")
    if explicit_cpu:
        source = "train.device=cpu" if wanted == "cpu" else f"{DEVICE_ENV}=cpu"
        return DevicePlan(kind="plain-cpu", reason=f"{source}: plain CPU, no accelerator and no simulator")
    if wanted == "sim" or (wanted == "auto" and detected in ("cpu", "sim")):
        from device import sim

        presets = list(sim.PRESETS)
        if tcfg.sim_preset.lower() not in presets:
            raise ConfigError(f"train.sim_preset={tcfg.sim_preset!r}: unknown simulator preset; choose one of: "
                              f"{', '.join(presets)}{suggest(tcfg.sim_preset.lower(), presets)}")
        reason = ("simulator requested" if wanted == "sim" else
                  f"{DEVICE_ENV}=sim" if detected == "sim" else "no accelerator found")
        return DevicePlan(kind="sim", preset=tcfg.sim_preset.lower(), reason=reason)
    return DevicePlan(kind=detected if wanted == "auto" else wanted, reason="")


def check_paths(cfg: EngineConfig) -> None:
    tcfg = cfg.train
    if tcfg.checkpoint_dir:
        check_writable(tcfg.checkpoint_dir, "train.checkpoint_dir", "dir")
    if tcfg.metrics_path:
        check_writable(tcfg.metrics_path, "train.metrics_path", "file")
    check_data(cfg)


# -- what a CPU-backed run (simulator or plain CPU) will cost ---------------------------------------------
class Estimate(BaseModel):
    """One step's cost on this host: its FLOPs at the host's matmul rate, plus its aten ops at the measured
    host cost of one op where the job runs (the simulator's dispatch, or plain torch's). On the simulator
    a small model's step is mostly the second term."""

    n_params: int
    host_bytes: int
    available_bytes: int | None
    step_flops: float
    cpu_flops: float  # measured FLOP/s of an fp32 matmul on this host
    step_ops: int = 0  # aten ops of one step (forward, backward, optimizer), counted on the meta device
    op_s: float = 0.0  # measured host seconds of one small op where the job runs

    @property
    def step_s(self) -> float:
        return self.step_flops / self.cpu_flops + self.step_ops * self.op_s


def count_step_ops(cfg: EngineConfig) -> int:
    """aten ops of one training step of ``cfg``'s model at its batch shape, counted on the meta device (no
    memory, no compute): forward, loss, backward, and the optimizer's update once per chunk plus one swap-in
    and one swap-out copy per chunk (each chunk's states are one arena). 0 when it cannot be counted (a
    Hugging Face model, a model that does not run on meta)."""
    if cfg.model.hf_path is not None:
        return 0
    import torch.nn.functional as F

    from swapopt.engine.model import build_model, logits_of

    t, o = cfg.train, cfg.optim
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, t.seed, t.gradient_checkpointing)
            tokens = torch.zeros(t.batch, t.seq_len, dtype=torch.long)
            probe = torch.nn.Parameter(torch.zeros(8))
            inner = o.model_copy(update={"swap_optimizer": False}).build([probe])  # the update's ops, unswapped
        with internals.counting_ops() as model_ops:
            logits = logits_of(model(tokens))
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
        probe.grad = torch.zeros_like(probe)
        inner.step()  # the first step creates the states
        with internals.counting_ops() as update_ops:
            inner.step()
    except Exception:  # meta lacks a kernel the model needs: no op term, the FLOP term stays
        return 0
    updates = o.swap_optimizer_times if o.swap_optimizer else 1
    return model_ops[0] + updates * (update_ops[0] + (2 if o.swap_optimizer else 0))


def measure_op_seconds(plan: DevicePlan, ops: int = 200) -> float:
    """Host seconds of one small elementwise op where the job will run: on a simulated device of the plan's
    preset (its dispatch is most of a small model's step), or on plain CPU."""
    def run(dev: torch.device | str) -> float:
        x = torch.ones(64, device=dev)
        for _ in range(10):  # warm-up: the first ops pay for caches
            x.add_(1)
        start = time.perf_counter()
        for _ in range(ops):
            x.add_(1)
        return (time.perf_counter() - start) / ops

    if plan.kind != "sim":
        return run("cpu")
    from device import sim

    with sim.activate(plan.preset or "h100", sanitize=True) as simulated:
        return run(simulated.torch_device())


def count_params(cfg: EngineConfig) -> int | None:
    """Exact parameter count, from a model built on the meta device (no memory); None for HF models."""
    if cfg.model.hf_path is not None:
        return None
    from swapopt.engine.model import build_model

    with torch.device("meta"):
        model = build_model(cfg.model, cfg.train.seed)
    return sum(p.numel() for p in model.parameters())


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_cpu_flops(seconds: float = 0.2) -> float:
    """FLOP/s of a 512 x 512 fp32 matmul on this host, over about ``seconds``."""
    a = torch.randn(512, 512)
    torch.mm(a, a)  # first call pays for thread-pool start-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, a)
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - start)


def pinned_rounding_bytes(cfg: EngineConfig, n_params: int) -> int:
    """Host bytes on top of the swapped Adam states (8 B/param) that torch_npu's pinned host allocator adds by
    rounding each state arena up to a power of two (device.npu_pinned_bytes; about one arena per chunk);
    0 off NPU, without swapping, or with PYTORCH_NPU_ALLOC_CONF=pin_memory_expandable_segments:True."""
    import device

    o = cfg.optim
    if not o.swap_optimizer or device.get_device() != "npu":
        return 0
    states = 8 * n_params
    chunks = max(1, o.swap_optimizer_times)
    per_chunk = -(-states // chunks)
    return max(0, chunks * device.npu_pinned_bytes(per_chunk) - states)


def estimate(cfg: EngineConfig, n_params: int, local_world: int = 1, plan: DevicePlan | None = None) -> Estimate:
    """Host RAM and compute of one step when the device's memory is host memory (simulator, plain CPU).

    Memory: fp32 params, grads and two Adam states (16 B/param, shared across ranks by FSDP2) plus each
    rank's activations: with checkpointing one saved input per block and one block's recompute, without it
    every block's intermediates; logits in fp32 with their grad. Compute: 6 x params x tokens (8 with
    recompute) plus attention's 12 x layers x seq^2 x dim per sequence; with ``plan``, also the step's aten
    ops (count_step_ops) at the measured host cost of one op there (measure_op_seconds)."""
    m, t = cfg.model, cfg.train
    tokens = t.batch * t.seq_len
    block = tokens * (10 * m.dim + 3 * m.hidden_dim) * 4
    acts = (m.n_layers * tokens * m.dim * 4 + block) if t.gradient_checkpointing else m.n_layers * block
    acts += 3 * tokens * m.vocab_size * 4
    host = 16 * n_params + local_world * (acts + BASE_HOST_BYTES) + pinned_rounding_bytes(cfg, n_params)
    factor = 8 if t.gradient_checkpointing else 6
    flops = local_world * (factor * n_params * tokens + 12 * m.n_layers * t.batch * t.seq_len**2 * m.dim)
    available = available_host_bytes()
    # A job check_fits refuses gets no time estimate: counting its step's ops steps the whole model on the meta
    # device, seconds for a model too large for the host, before an error that does not use them.
    refused = t.host_ram_check and available is not None and host > available
    step_ops = count_step_ops(cfg) if plan is not None and not refused else 0
    return Estimate(n_params=n_params, host_bytes=host, available_bytes=available,
                    step_flops=float(flops), cpu_flops=measure_cpu_flops(),
                    step_ops=local_world * step_ops, op_s=measure_op_seconds(plan) if step_ops else 0.0)


def _fmt_s(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def describe(est: Estimate) -> str:
    avail = "" if est.available_bytes is None else f" of {est.available_bytes / GiB:.1f} GiB available"
    return (f"model: {est.n_params / 1e6:,.2f}M params; host RAM needed about {est.host_bytes / GiB:.1f} GiB{avail}; "
            f"estimated about {_fmt_s(est.step_s)} per step on this CPU "
            f"({est.step_flops / 1e9:,.0f} GFLOP at a measured {est.cpu_flops / 1e9:.0f} GFLOP/s"
            + (f", {est.step_ops:,} ops at a measured {est.op_s * 1e6:.0f} us each)" if est.step_ops else ")"))


def check_fits(cfg: EngineConfig, est: Estimate) -> None:
    """Refuse a job that will not fit in host RAM, unless ``train.host_ram_check=false``."""
    if not cfg.train.host_ram_check or est.available_bytes is None or est.host_bytes <= est.available_bytes:
        return
    raise ConfigError(
        f"this job needs about {est.host_bytes / GiB:.1f} GiB of host RAM ({est.n_params / 1e9:.2f}B params x 16 B "
        f"plus activations) and {est.available_bytes / GiB:.1f} GiB is available; shrink model.* or train.batch / "
        "train.seq_len, or set train.host_ram_check=false to run anyway")


def slow_hint(est: Estimate) -> str | None:
    if est.step_s < 60:
        return None
    return (f"note: about {_fmt_s(est.step_s)} per step on this CPU: Ctrl-C stops it; smaller overrides are in "
            "the config's comments")


def local_world_size() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def pinned_host_bytes(cfg: EngineConfig, n_params: int, local_world: int = 1, world: int | None = None) -> tuple[int, int]:
    """(pinned bytes, of which fp32 masters) the ranks on this host keep for ``cfg``'s swapped optimizer: each
    rank its 1/world share of the params' AdamW moments (and masters), less a fixed ``resident_mb`` (swapopt.hostmem;
    ``"auto"`` keeps nothing off the host for sure)."""
    from swapopt import hostmem

    o = cfg.optim
    if not o.swap_optimizer:
        return 0, 0
    world = world or max(1, int(os.environ.get("WORLD_SIZE", "1")))
    dtype = getattr(torch, cfg.model.dtype)
    resident = hostmem.resident_bytes_of(o.resident_mb)  # "auto": none for sure (its share may shrink)
    total, masters = hostmem.job_host_bytes(n_params, dtype, o.master_weights, world, resident)
    return local_world * total, local_world * masters


def host_capacity(plan: DevicePlan) -> int | None:
    """Host RAM free for pinned memory where the job runs: the simulated host's (SWAPOPT_SIM_HOST_MB or the
    preset's host_capacity_bytes) on the simulator, MemAvailable on hardware."""
    if plan.kind == "sim":
        from device.sim.host_memory import capacity_from_env
        from device.sim.presets import get_preset

        return capacity_from_env(get_preset(plan.preset or "h100").host_capacity_bytes)
    if plan.kind == "plain-cpu":
        return None  # states are stepped in place: nothing is pinned
    return available_host_bytes()


def check_host_memory(cfg: EngineConfig, plan: DevicePlan, n_params: int | None, local_world: int = 1) -> None:
    """swapopt.HostMemoryError before anything is built when the swapped states (and masters) of the ranks on
    this host need more pinned host memory than it has free."""
    from swapopt import hostmem

    if n_params is None or not cfg.optim.swap_optimizer:
        return
    available = host_capacity(plan)
    if available is None:
        return
    needed, masters = pinned_host_bytes(cfg, n_params, local_world)
    hostmem.check(needed, needed, masters, available)
