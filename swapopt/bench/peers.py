"""Real peers, not reproductions of their schedules: each trains the same model on the same data as swapopt,
with its step time and device memory side by side.

Peers (each used through its own package, as a user would):

- ``resident``: torch.optim.AdamW (fused), states on the device: the baseline.
- ``swapopt``: swapopt.SwapOptimizer around the same AdamW.
- ``xtuner-swapadamw``: XTuner v1's ``SwapAdamW`` (per-param swap in / update / swap out on the caller's
  stream, one synchronize at the end) with its own defaults (``fused=None``, ``foreach=None``: torch picks
  foreach on a device), as its users run it. XTuner v1 is not on the package registry: it is imported when
  ``xtuner.v1`` is importable or ``SWAPOPT_XTUNER_SRC`` names a checkout of InternLM/xtuner.
- ``xtuner-swapadamw-fused``: the same with ``fused=True``, not its default; on CUDA it fails (its host ``step``
  tensors meet the fused kernel's device check), and the row says so with XTuner's error.
- ``torchao-cpu-offload``: ``torchao.optim.CPUOffloadOptimizer`` (grads go down in backward hooks, torch's
  fused CPU AdamW steps on the host, params go back up; params under 4,096 elements stay on the device).
- ``deepspeed-cpu-adam``: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` stepping fp32 master params in pinned
  host memory; the grads-down / params-up around it are this module's (what ZeRO-Offload does for one
  rank), since the optimizer itself only updates host tensors.

Every peer runs with its own defaults except where a row's name says otherwise. A peer that raises while it
trains is its own failure: the row has ``failed=True`` and the error (``reason``), never a figure.

The model is the engine's byte-level LM (``swapopt.engine.model.TinyLM``), the data the shipped Shakespeare
corpus through ``ByteBatches``, AdamW hyperparameters the same for every peer. A timed step is one train
step: forward, backward, ``step()``, until the params are back for the next forward (torchao's grad copies
run inside the backward, so the optimizer step alone would miss part of its cost).

Time is read from device events (the simulator's modeled time under ``device.sim``). Host CPU work that the
device timeline cannot see is measured in wall-clock time and said so in the row's note; see ``Peer.cpu``.

``compare(steps=..., dry_run=...)`` returns one ``PeerResult`` per peer; a peer that cannot run here
(package missing, op that cannot build, no device) gives a row with ``available=False`` and the reason.
``python -m swapopt.bench.peers [--out DIR]`` prints the table and writes ``DEVICE-DATE-peers.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

import device
from swapopt.bench import torchao_peer
from swapopt.bench.torchao_peer import short_reason as _reason

LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1
MB = 1 << 20
PEERS = ("resident", "swapopt", "xtuner-swapadamw", "xtuner-swapadamw-fused", "torchao-cpu-offload",
         "deepspeed-cpu-adam")
DEFAULT_OUT = Path("bench/results")


class PeerResult(BaseModel):
    name: str
    available: bool
    reason: str | None = None  # why the peer did not run (import error, build failure, ...) or the error it failed with
    failed: bool = False  # the peer was there and raised while it trained (in this row's configuration): its failure
    step_ms: float | None = None  # median train step (forward + backward + step); modeled on the simulator
    device_peak_bytes: int | None = None  # max_memory_allocated over the timed steps
    note: str | None = None  # how step_ms is counted, whether the result matches resident AdamW, ...


class Size(BaseModel):
    """Model and batch of one comparison."""

    dim: int
    n_layers: int
    n_heads: int
    batch: int
    seq_len: int
    warmup: int
    swap_optimizer_times: int

    def lm_config(self) -> Any:
        from swapopt.engine.config import ModelConfig

        return ModelConfig(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, max_seq_len=self.seq_len)


DRY_RUN = Size(dim=64, n_layers=1, n_heads=4, batch=2, seq_len=32, warmup=1, swap_optimizer_times=4)
MODERATE = Size(dim=512, n_layers=4, n_heads=8, batch=8, seq_len=128, warmup=2, swap_optimizer_times=16)


def _mod() -> Any:
    return device.get_torch_device_module()


def _adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, read after the copy is done."""
    h = device.pinned_empty(tuple(t.shape), dtype=t.dtype)
    h.copy_(t.detach())  # blocking
    return h


def _sim_seconds() -> float:
    """CPU seconds this thread spent inside the simulator's own frames (0 on a real device)."""
    if not device.is_simulated():
        return 0.0
    from device.sim import host_time

    return host_time.seconds()


@dataclass
class HostClock:
    """Wall-clock seconds of host CPU work that the device timeline does not show."""

    seconds: float = 0.0
    calls: int = 0
    nbytes: int = 0  # bytes the CPU kernel touched, where the simulator cannot see it (its price on the simulator)
    # Whether the simulator's own CPU time is taken out: yes where the kernel runs outside it (a C++ op the
    # simulator never sees), no where the kernel is an aten op that runs inside the simulator's frame.
    without_simulator: bool = True

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        sim0, t0 = _sim_seconds(), time.perf_counter()
        try:
            yield
        finally:
            # The simulator's own Python (dispatching the few aten ops around the kernel) is not host work a
            # device run would do: taken out where that leaves the kernel in.
            sim = _sim_seconds() - sim0 if self.without_simulator else 0.0
            self.seconds += max(time.perf_counter() - t0 - sim, 0.0)
            self.calls += 1

    def reset(self) -> None:
        self.seconds, self.calls, self.nbytes = 0.0, 0, 0


@dataclass
class Peer:
    """One optimizer set up over a model's params.

    ``step()`` ends with the params ready for the next forward (in stream order) and every state where it lives
    between steps; ``cpu`` collects the host wall time of CPU optimizer work during timed steps. ``cpu_hidden``:
    that work is no aten op (DeepSpeed's C++ kernel), so the simulator's host clock cannot see it; on the
    simulator it is then priced as the simulator prices aten ops on host tensors (bytes / the preset's host_gbps)
    and added to the modeled step, so that every row counts host CPU work alike.
    """

    opt: Any
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    close: Callable[[], None] = lambda: None
    cpu: HostClock | None = None
    cpu_hidden: bool = False
    notes: list[str] = field(default_factory=list)


# ----- the peers -------------------------------------------------------------------------------------------


def _resident(params: list[torch.nn.Parameter], size: Size) -> Peer:
    opt = _adamw(params)
    return Peer(opt, opt.step, lambda: opt.zero_grad(set_to_none=True), opt.state.clear,
                notes=["torch.optim.AdamW(fused=True), states on the device"])


def _swapopt(params: list[torch.nn.Parameter], size: Size) -> Peer:
    from swapopt import SwapOptimizer

    opt = SwapOptimizer(_adamw(params), swap_optimizer_times=size.swap_optimizer_times, slots=3)

    def step() -> None:
        opt.step()
        opt.wait_for_swap_out()  # states back on the host: the step's whole cost is counted

    def close() -> None:
        opt.wait_for_swap_out()
        opt.release_staging()
        opt.state.clear()

    return Peer(opt, step, lambda: opt.zero_grad(set_to_none=True), close,
                notes=[f"SwapOptimizer(AdamW fused, swap_optimizer_times={size.swap_optimizer_times}, slots=3)"])


def xtuner_swap_adamw() -> tuple[type | None, str]:
    """XTuner's SwapAdamW class and where it came from, or None and why not."""
    src = os.environ.get("SWAPOPT_XTUNER_SRC")
    if src and src not in sys.path:
        sys.path.insert(0, src)
    real = torch.accelerator.current_accelerator
    if device.is_simulated():
        # XTuner resolves its device once, at import, and knows cpu, cuda, npu and mlu only: import it as if on
        # the CPU, then point its SwapAdamW's module-level device at the simulated one (see _xtuner_device).
        torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
    try:
        module = importlib.import_module("xtuner.v1.optim.swap_adamw")
    except Exception as err:  # noqa: BLE001 - XTuner or one of its dependencies missing
        how = f"SWAPOPT_XTUNER_SRC={src}" if src else "no SWAPOPT_XTUNER_SRC"
        return None, (f"XTuner v1 is not importable ({how}; it is not on the package registry: set "
                      f"SWAPOPT_XTUNER_SRC to a checkout of InternLM/xtuner): {_reason(err)}")
    finally:
        torch.accelerator.current_accelerator = real
    where = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(module.__file__ or ""))))
    commit = os.environ.get("SWAPOPT_XTUNER_COMMIT") or _git_head(where)
    return module.SwapAdamW, f"xtuner {where}" + (f" at {commit[:12]}" if commit else "")


def _git_head(path: str) -> str | None:
    head = Path(path) / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            return (head.parent / ref[5:]).read_text().strip()
        return ref
    except OSError:
        return None


@contextlib.contextmanager
def _xtuner_device() -> Iterator[None]:
    """On the simulator, XTuner's SwapAdamW moves its states to the simulated device (its module-level DEVICE is
    what XTuner resolved at import: cpu there)."""
    module = sys.modules.get("xtuner.v1.optim.swap_adamw")
    if module is None or not device.is_simulated():
        yield
        return
    saved = module.DEVICE, module.DEVICE_MODULE
    module.DEVICE, module.DEVICE_MODULE = device.torch_device().type, _mod()
    try:
        yield
    finally:
        module.DEVICE, module.DEVICE_MODULE = saved


def _xtuner(params: list[torch.nn.Parameter], size: Size, fused: bool | None = None) -> Peer:
    """XTuner's SwapAdamW; ``fused=None`` passes no ``fused`` at all (its default)."""
    cls, where = xtuner_swap_adamw()
    if cls is None:
        raise _Unavailable(where)
    stack = contextlib.ExitStack()
    stack.enter_context(_xtuner_device())
    flags = {} if fused is None else {"fused": fused}
    try:
        opt = cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                  swap_optimizer_times=size.swap_optimizer_times, **flags)
    except BaseException:
        stack.close()
        raise

    def close() -> None:
        opt.state.clear()
        stack.close()

    # Its step synchronizes the device at the end: nothing left to drain.
    how = "its defaults: fused=None, foreach=None" if fused is None else f"fused={fused}, not its default"
    return Peer(opt, opt.step, lambda: opt.zero_grad(set_to_none=True), close,
                notes=[f"XTuner SwapAdamW({how}) from {where}"])


def _torchao(params: list[torch.nn.Parameter], size: Size) -> Peer:
    cls, why = torchao_peer.offload_class()
    if cls is None:
        raise _Unavailable(why or "torchao missing")
    stack = contextlib.ExitStack()
    notes = stack.enter_context(torchao_peer.on_simulator())
    try:
        opt = cls(params, torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    except BaseException:
        stack.close()
        raise
    cpu = HostClock(without_simulator=False)
    # The CPU AdamW steps run inside torchao's step(), between its waits for each grad and its param copies:
    # time each of them.
    for inner in opt.optim_dict.values():
        inner_step = inner.step

        def timed(*args: Any, _step: Callable = inner_step, **kwargs: Any) -> Any:
            with cpu.timing():
                return _step(*args, **kwargs)

        inner.step = timed
    small = sum(p.numel() for g in opt.d_param_groups for p in g["params"])

    def close() -> None:
        _mod().synchronize()
        opt.optim_dict.clear()
        opt.param_d2h_map.clear()
        stack.close()

    notes.insert(0, f"CPUOffloadOptimizer(torch AdamW fused), {len(opt.optim_dict)} params on the host, {small:,} "
                    "elements in params under 4,096 stay on the device")
    return Peer(opt, opt.step, lambda: opt.zero_grad(set_to_none=True), close, cpu=cpu, notes=notes)


def deepspeed_cpu_adam(build: bool) -> tuple[type | None, str | None]:
    """DeepSpeedCPUAdam when its CPU op loads (``build``: JIT-build it if needed, minutes on first use)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as err:  # noqa: BLE001 - not installed, or failing at import
        return None, f"deepspeed is not importable (pip install deepspeed): {_reason(err)}"
    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        return None, "DeepSpeed's CPU Adam op is not compatible with this machine (CPUAdamBuilder.is_compatible)"
    if not build and not _cpu_adam_built(builder):
        return None, ("DeepSpeed's CPU Adam op is not built yet and this run does not build it (a JIT build with "
                      "ninja/g++ takes minutes: run once without dry_run, or install with DS_BUILD_CPU_ADAM=1)")
    try:
        builder.load(verbose=False)
    except Exception as err:  # noqa: BLE001 - compiler missing, build error
        return None, f"DeepSpeed's CPU Adam op failed to build: {_reason(err)}"
    return DeepSpeedCPUAdam, None


def _cpu_adam_built(builder: Any) -> bool:
    """Whether the op loads without compiling: installed prebuilt, or already in torch's extension cache."""
    try:
        importlib.import_module(builder.absolute_name())
        return True
    except Exception:  # noqa: BLE001
        pass
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(builder.name, verbose=False))
    return any(folder.glob(f"{builder.name}*.so"))


def _omp_threads() -> str:
    return os.environ.get("OMP_NUM_THREADS") or f"{os.cpu_count()} (all cores)"


def _deepspeed(params: list[torch.nn.Parameter], size: Size, build: bool) -> Peer:
    cls, why = deepspeed_cpu_adam(build)
    if cls is None:
        raise _Unavailable(why or "deepspeed missing")
    mod = _mod()
    live = list(params)
    master = {p: _host_copy(p) for p in live}  # fp32 master params in pinned host memory
    grads = {p: device.pinned_empty(tuple(p.shape), dtype=p.dtype) for p in live}
    for p in live:
        master[p].grad = grads[p]
    opt = cls([master[p] for p in live], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    down, up = mod.Stream(), mod.Stream()
    cpu = HostClock()

    @torch.no_grad()
    def step() -> None:
        compute = mod.current_stream()
        with_grad = [p for p in live if p.grad is not None]
        down.wait_stream(compute)  # grads are final
        with mod.stream(down):
            for p in with_grad:
                grads[p].copy_(p.grad, non_blocking=True)
        down.synchronize()  # the CPU step reads them
        for p in live:
            master[p].grad = grads[p] if p.grad is not None else None
        with cpu.timing():
            opt.step()
        # What the kernel reads and writes: param, grad, exp_avg and exp_avg_sq, all fp32.
        cpu.nbytes += sum(4 * master[p].nbytes for p in with_grad)
        up.wait_stream(compute)  # params are overwritten once the compute stream is done reading them
        with mod.stream(up):
            for p in with_grad:
                p.copy_(master[p], non_blocking=True)
        compute.wait_stream(up)

    def close() -> None:
        up.synchronize()
        opt.state.clear()
        master.clear()
        grads.clear()

    notes = [f"DeepSpeedCPUAdam(adamw_mode=True) on fp32 master params in pinned host memory; grads down and "
             f"params up on two streams around it, as ZeRO-Offload does for one rank (this module's loop, not "
             f"DeepSpeed's engine)"]
    def zero_grad() -> None:
        for p in live:
            p.grad = None

    return Peer(opt, step, zero_grad, close, cpu=cpu, cpu_hidden=True, notes=notes)


class _Unavailable(Exception):
    """A peer that cannot run here, and why."""


# ----- the train loop shared by every peer -----------------------------------------------------------------


@dataclass
class _Run:
    times_ms: list[float]
    peaks: list[int]  # max_memory_allocated over each timed train step
    step_extra: list[int]  # over each timed step(): peak - memory allocated at its entry
    losses: list[float]
    eval_before: float
    eval_after: float
    params: list[torch.Tensor]  # host copies of the final params
    cpu_ms: float | None  # host wall time of the CPU Adam work per timed step
    cpu_modeled_ms: float | None  # the simulator's price of that work per timed step


def _event() -> Any:
    return _mod().Event(enable_timing=True)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _train(make: Callable[[list[torch.nn.Parameter]], Peer], size: Size, steps: int) -> tuple[_Run, Peer]:
    from swapopt.engine.data import ByteBatches, load_tokens
    from swapopt.engine.model import build_model

    mod = _mod()
    dev = device.torch_device()
    with torch.device("cpu"):  # built on the host whatever the default device, then moved as a script would
        model = build_model(size.lm_config(), seed=0)
        batches = ByteBatches(load_tokens(), batch=size.batch, seq_len=size.seq_len, seed=0)
        data = [batches.get(i) for i in range(size.warmup + steps)]
        held_out = ByteBatches(load_tokens(), batch=size.batch, seq_len=size.seq_len, seed=1).get(0)
    model.to(dev)
    on_device = [(x.to(dev), y.to(dev)) for x, y in data]
    hx, hy = held_out[0].to(dev), held_out[1].to(dev)
    with torch.no_grad():
        eval_before = _loss(model, hx, hy).item()
    peer = make(list(model.parameters()))
    times, peaks, extra, losses = [], [], [], []
    cpu_s, cpu_modeled_us = 0.0, 0.0
    simulated = device.is_simulated()
    for i, (x, y) in enumerate(on_device):
        timed = i >= size.warmup
        mod.synchronize()
        mod.reset_peak_memory_stats()
        if peer.cpu is not None:
            peer.cpu.reset()
        if simulated:
            mod.reset_timeline()
        start, end = _event(), _event()
        start.record()
        loss = _loss(model, x, y)
        loss.backward()
        before_step = mod.max_memory_allocated()  # forward and backward
        at_entry = mod.memory_allocated()
        mod.reset_peak_memory_stats()
        peer.step()
        in_step = mod.max_memory_allocated()
        peer.zero_grad()
        end.record()
        end.synchronize()
        losses.append(loss.item())
        if timed:
            times.append(start.elapsed_time(end))
            peaks.append(max(before_step, in_step))
            extra.append(in_step - at_entry)
            if peer.cpu is not None:
                cpu_s += peer.cpu.seconds
                if simulated:
                    cpu_modeled_us += _host_kernel_us(mod) + peer.cpu.nbytes / (mod.preset.host_gbps * 1e3)
    mod.synchronize()
    with torch.no_grad():
        eval_after = _loss(model, hx, hy).item()
    params = [_host_copy(p) for p in model.parameters()]
    cpu_ms = cpu_s * 1e3 / steps if peer.cpu is not None else None
    cpu_modeled_ms = cpu_modeled_us / 1e3 / steps if peer.cpu is not None and simulated else None
    run = _Run(times, peaks, extra, losses, eval_before, eval_after, params, cpu_ms, cpu_modeled_ms)
    del model, on_device, hx, hy
    return run, peer


def _host_kernel_us(mod: Any) -> float:
    """Modeled host time of the CPU optimizer kernels (aten ops on host tensors) since the timeline's reset."""
    return sum(op.end_us - op.start_us for op in mod.timeline if op.lane == "host" and "adam" in op.name)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def _trains(run: _Run, start: list[torch.Tensor] | None) -> str | None:
    """Why this run does not look like training, or None."""
    if not all(map(lambda v: v == v and abs(v) != float("inf"), run.losses + [run.eval_after])):
        return "loss is not finite"
    if not run.eval_after < run.eval_before:
        return f"held-out loss did not decrease ({run.eval_before:.4f} -> {run.eval_after:.4f})"
    if start is not None and _max_diff(run.params, start) == 0.0:
        return "params did not change"
    return None


def _initial_params(size: Size) -> list[torch.Tensor]:
    from swapopt.engine.model import build_model

    with torch.device("cpu"):
        return [p.detach().clone() for p in build_model(size.lm_config(), seed=0).parameters()]


def run_peer(name: str, size: Size, steps: int, build: bool, baseline: _Run | None,
             start: list[torch.Tensor]) -> tuple[PeerResult, _Run | None]:
    """One peer's row (and its run, for the comparisons against the baseline)."""
    makers: dict[str, Callable[[list[torch.nn.Parameter]], Peer]] = {
        "resident": lambda ps: _resident(ps, size),
        "swapopt": lambda ps: _swapopt(ps, size),
        "xtuner-swapadamw": lambda ps: _xtuner(ps, size),
        "xtuner-swapadamw-fused": lambda ps: _xtuner(ps, size, fused=True),
        "torchao-cpu-offload": lambda ps: _torchao(ps, size),
        "deepspeed-cpu-adam": lambda ps: _deepspeed(ps, size, build),
    }
    peer = None
    try:
        run, peer = _train(makers[name], size, steps)
    except _Unavailable as err:
        return PeerResult(name=name, available=False, reason=str(err)), None
    except Exception as err:  # noqa: BLE001 - a peer failing here is a row, never a crash of the comparison
        # The peer is there and failed in this configuration: its failure, with its error.
        detail = traceback.extract_tb(err.__traceback__)[-1]
        return PeerResult(name=name, available=True, failed=True,
                          reason=f"{_reason(err)} (at {Path(detail.filename).name}:{detail.lineno})"), None
    finally:
        if peer is not None:
            with contextlib.suppress(Exception):
                peer.close()
        gc.collect()
        _mod().empty_cache()
    step_ms = statistics.median(run.times_ms)
    notes = list(peer.notes)
    simulated = device.is_simulated()
    if run.cpu_ms is not None:
        threads = f"OpenMP threads {_omp_threads()}" if peer.cpu_hidden else f"{torch.get_num_threads()} torch threads"
        wall = f"host CPU Adam step measured at {run.cpu_ms:.2f} ms wall clock per step (mean of {steps}, {threads}"
        if simulated and not peer.cpu.without_simulator:
            wall += "; includes the simulator's dispatch of its aten ops, one Python frame per op"
        wall += ")"
        if not simulated:
            notes.append(wall + ", inside the step time")
        else:
            gbps = _mod().preset.host_gbps
            if peer.cpu_hidden:
                step_ms += run.cpu_modeled_ms or 0.0
                how = (f"its C++ kernel is no aten op, so the simulator cannot see it: step_ms adds the price the "
                       f"simulator gives aten ops on host tensors, bytes touched / host_gbps ({gbps:g} GB/s) = "
                       f"{run.cpu_modeled_ms:.2f} ms")
            else:
                how = (f"step_ms counts the simulator's price of its aten CPU kernels, bytes touched / host_gbps "
                       f"({gbps:g} GB/s) = {run.cpu_modeled_ms:.2f} ms, on the host clock")
            notes.append(f"{how}; {wall}, not in step_ms")
    notes.append(f"step() itself: +{max(run.step_extra) / MB:.1f} MB of device memory over its entry")
    problem = _trains(run, start)
    if problem:
        notes.append(f"DOES NOT TRAIN: {problem}")
    else:
        notes.append(f"trains: held-out loss {run.eval_before:.4f} -> {run.eval_after:.4f}")
    if baseline is not None and name != "resident":
        diff = _max_diff(run.params, baseline.params)
        if name in ("torchao-cpu-offload", "deepspeed-cpu-adam"):
            cpu_kernel = "torch's fused CPU AdamW" if name.startswith("torchao") else "DeepSpeed's C++ Adam"
            why = (" (0 here: the simulator's device kernels are torch's CPU kernels, the same code)"
                   if simulated and diff == 0.0 else "")
            notes.append(f"Adam on the CPU ({cpu_kernel}), not expected bitwise with the device AdamW: "
                         f"max |param - resident's| {diff:.3g}{why}")
        else:
            why = (" (its default kernel is torch's foreach AdamW, the baseline's fused: rounding differs)"
                   if name == "xtuner-swapadamw" else "")
            notes.append("bitwise equal to resident AdamW" if diff == 0.0
                         else f"NOT bitwise equal to resident AdamW: max |param - resident's| {diff:.3g}{why}")
    return PeerResult(name=name, available=True, step_ms=step_ms, device_peak_bytes=max(run.peaks),
                      note="; ".join(notes)), run


def compare(*, steps: int, dry_run: bool) -> list[PeerResult]:
    """Every peer on the same model and data, ``steps`` timed train steps each (after warm-up), one row per peer.

    ``dry_run``: a tiny model, and DeepSpeed's CPU op is used only if it is already built (no JIT build).
    Runs on the current device (the simulator when one is active)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    size = DRY_RUN if dry_run else MODERATE
    if device.get_device() == "cpu":
        reason = "no accelerator: activate the simulator (device.sim.activate or SWAPOPT_DEVICE=sim) or run on a GPU/NPU"
        return [PeerResult(name=n, available=False, reason=reason) for n in PEERS]
    start = _initial_params(size)
    rows: list[PeerResult] = []
    baseline: _Run | None = None
    for name in PEERS:
        row, run = run_peer(name, size, steps, build=not dry_run, baseline=baseline, start=start)
        if name == "resident":
            baseline = run
        rows.append(row)
    return rows


# ----- report ----------------------------------------------------------------------------------------------


def device_label() -> str:
    from swapopt.bench.run import device_label as label

    return label()


def markdown(rows: list[PeerResult], header: dict[str, Any]) -> str:
    resident = next((r for r in rows if r.name == "resident" and r.available), None)
    lines = [
        f"# Real peers, {header['device']}, {header['date']}",
        "",
        f"torch {header['torch']}; model: TinyLM dim {header['size']['dim']}, {header['size']['n_layers']} layers, "
        f"{header['params']:,} params; batch {header['size']['batch']} x {header['size']['seq_len']} tokens of the "
        f"shipped Shakespeare corpus; AdamW lr {LR}, betas {BETAS}, weight decay {WEIGHT_DECAY}; "
        f"{header['steps']} timed train steps after {header['size']['warmup']} warm-up, median.",
        "",
        header["time_note"],
        "",
        f"Host: {header['host']}.",
        "",
        f"Command: `{header.get('command') or 'compare()'}`",
        "",
        "| peer | available | train step | vs resident | peak device memory | vs resident |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r.available:
            lines.append(f"| {r.name} | no | - | - | - | - |")
            continue
        if r.failed:
            lines.append(f"| {r.name} | FAILED | - | - | - | - |")
            continue
        vs_t = f"{r.step_ms / resident.step_ms:.2f}x" if resident and resident.step_ms else "-"
        vs_m = f"{r.device_peak_bytes / resident.device_peak_bytes:.2f}x" \
            if resident and resident.device_peak_bytes else "-"
        lines.append(f"| {r.name} | yes | {r.step_ms:.3f} ms | {vs_t} | {r.device_peak_bytes / MB:.1f} MB | {vs_m} |")
    lines += ["", "## Notes and reasons", ""]
    for r in rows:
        text = f"failed: {r.reason}" if r.failed else (r.note or "" if r.available else f"unavailable: {r.reason}")
        lines.append(f"- **{r.name}**: " + text)
    lines.append("")
    return "\n".join(lines)


def write(rows: list[PeerResult], header: dict[str, Any], out: Path) -> tuple[Path, Path]:
    from swapopt.bench.report import unique_stem

    out.mkdir(parents=True, exist_ok=True)
    stem = unique_stem(out, f"{header['device']}-{header['date'][:10]}-peers")
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps({**header, "results": [r.model_dump() for r in rows]}, indent=2) + "\n")
    md_path.write_text(markdown(rows, header))
    return json_path, md_path


def _header(steps: int, dry_run: bool, command: str = "") -> dict[str, Any]:
    size = DRY_RUN if dry_run else MODERATE
    simulated = device.is_simulated()
    time_note = (
        "Simulated: train step = the simulator's modeled device time from an event before the forward to one after "
        "step() returned (copies: latency + bytes / link rate; kernels: max(bytes / HBM rate, FLOPs / peak); aten "
        "ops on host tensors: bytes / the preset's host_gbps on the host clock). Host CPU work the timeline does "
        "not see is measured in wall-clock time on this machine and each row's note says how it is counted. Peak "
        "device memory: max_memory_allocated during the step (the simulator's exact count)."
        if simulated else
        "Train step: device events from before the forward to after step() returned, host waits included. Peak "
        "device memory: max_memory_allocated during the step."
    )
    return {
        "device": device_label(),
        "command": command,
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
        "torch": torch.__version__,
        "steps": steps,
        "dry_run": dry_run,
        "size": size.model_dump(),
        "params": sum(p.numel() for p in _initial_params(size)),
        "time_note": time_note,
        "host": f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end of the run; "
                f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')}",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swapopt.bench.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed train steps per peer (default 3)")
    ap.add_argument("--dry-run", action="store_true", help="tiny model; DeepSpeed's CPU op only if already built")
    ap.add_argument("--sim", metavar="PRESET", help="run on the simulator with this preset (default without a "
                    "GPU/NPU: h100)")
    ap.add_argument("--sanitize", action="store_true", help="keep the simulator's stream sanitizer on")
    ap.add_argument("--cpu-threads", type=int, default=None, help="threads of the host CPU Adam steps (torch's "
                    "intra-op threads and OMP_NUM_THREADS for DeepSpeed's op; default: as the process has them)")
    ap.add_argument("--out", type=Path, default=None, help=f"write DEVICE-DATE-peers.md and .json here "
                    f"(e.g. {DEFAULT_OUT}); existing files are never overwritten")
    args = ap.parse_args(argv)
    if args.cpu_threads is not None:
        torch.set_num_threads(args.cpu_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.cpu_threads)  # read when DeepSpeed's op loads its OpenMP runtime
    with contextlib.ExitStack() as stack:
        if args.sim or (device.get_device() == "cpu" and not device.is_simulated()):
            from device import sim

            stack.enter_context(sim.activate(args.sim or "h100", sanitize=args.sanitize))
        rows = compare(steps=args.steps, dry_run=args.dry_run)
        argv = sys.argv[1:] if argv is None else argv
        header = _header(args.steps, args.dry_run, " ".join(["python -m swapopt.bench.peers", *argv]))
        print(markdown(rows, header))
        if args.out is not None:
            for path in write(rows, header, args.out):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
