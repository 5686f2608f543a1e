"""Optimizer-state strategies compared by the benchmark, each labelled by what it reproduces.

Every strategy steps AdamW over the same device params (grads already set) and exposes:
``step()``, ``drain()`` (the host waits until every state is back where it lives between steps),
``state_of(p)`` (exp_avg / exp_avg_sq / step of param p, for parity checks), ``host_bytes()`` (pinned
host memory it holds), ``moves()`` (the bytes a step must copy host to device and device to host: its state
bytes for a swap; checked against what one step really copied, swapopt.bench.proof) and ``close()``. The
reference strategies call torch's own functional AdamW (``torch.optim.adamw.adamw``) with the same foreach/fused
flags as the resident optimizer, so their numbers are bitwise those of ``resident``: the comparison is about
schedules, not kernels.

``SerialSwap`` and ``OneInFlightSwap`` are also the reference schedules the modeled-time tests
compare swapopt against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict
from torch.optim.adamw import adamw as adamw_functional

import device
from swapopt.bench import torchao_peer

Impl = Literal["foreach", "fused"]
STATE_KEYS = ("exp_avg", "exp_avg_sq")


class AdamWSpec(BaseModel):
    """Hyperparameters and kernel flavour shared by every strategy of one comparison."""

    model_config = ConfigDict(frozen=True)

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    impl: Impl = "fused"
    # Note [master weights] (swapopt.masters): bf16 params stepped through fp32 masters that move with the
    # states (12 bytes a param each way instead of 8).
    master_weights: bool = False

    def state_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype AdamW steps ``param`` in: its master's with master_weights, else its own."""
        return torch.float32 if self.master_weights else param.dtype

    def keys(self) -> tuple[str, ...]:
        """The tensors a swapping strategy moves per param."""
        return (*STATE_KEYS, "master") if self.master_weights else STATE_KEYS

    def make(self, params: Sequence[torch.Tensor]) -> torch.optim.AdamW:
        flag = {"fused": True} if self.impl == "fused" else {"foreach": True}
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, **flag
        )

    def new_step(self, param: torch.Tensor) -> torch.Tensor:
        # Same placement as torch.optim.Adam._init_group: fused keeps `step` beside the param, the
        # other paths keep a CPU scalar (pageable host memory, named: not torch's default device).
        if self.impl == "fused":
            return torch.zeros((), dtype=torch.float32, device=param.device)
        return torch.tensor(0.0, dtype=torch.float32, device="cpu")

    def update(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[torch.Tensor],
    ) -> None:
        """One AdamW update of these tensors with the kernel torch.optim.AdamW.step would use."""
        adamw_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=self.impl == "foreach",
            fused=self.impl == "fused",
            amsgrad=False,
            beta1=self.betas[0],
            beta2=self.betas[1],
            lr=self.lr,
            weight_decay=self.weight_decay,
            eps=self.eps,
            maximize=False,
        )

    def update_params(self, params: list[torch.Tensor], views: list[dict[str, torch.Tensor]], steps: list[torch.Tensor]) -> None:
        """One AdamW update of ``params`` whose states are ``views`` (device tensors by key): of the params
        themselves, or with master_weights of their fp32 masters (``views[i]["master"]``), grads upcast,
        the params then written from the masters."""
        if not self.master_weights:
            grads = [p.grad for p in params]
            self.update(params, grads, [v["exp_avg"] for v in views], [v["exp_avg_sq"] for v in views], steps)
            return
        masters = [v["master"] for v in views]
        grads = [p.grad.float() for p in params]
        self.update(masters, grads, [v["exp_avg"] for v in views], [v["exp_avg_sq"] for v in views], steps)
        for p, m in zip(params, masters):
            p.copy_(m)


class Strategy(Protocol):
    label: str
    reproduces: str

    def step(self) -> None: ...
    def drain(self) -> None: ...
    def state_of(self, param: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def host_bytes(self) -> int: ...
    def moves(self) -> tuple[int, int]: ...
    def close(self) -> None: ...


def _mod():
    return device.get_torch_device_module()


def _host_zeros_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    # Allocated once per strategy and reused every step (the design's "host memory = state bytes").
    h = device.pinned_empty(tuple(t.shape), dtype=dtype or t.dtype)
    h.zero_()
    return h


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(params: Sequence[torch.Tensor], spec: AdamWSpec, keys: Sequence[str] | None = None) -> int:
    """Bytes of the tensors a swap moves each way per step (states, and masters with master_weights) of the params
    that have a grad."""
    keys = spec.keys() if keys is None else keys
    return sum(len(keys) * p.numel() * torch.empty((), dtype=spec.state_dtype(p)).element_size()
               for p in params if p.grad is not None)


class _HostStateStrategy:
    """Base of the reference strategies: AdamW states in pinned host memory, allocated once, plus the
    step counters, keyed by param."""

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec, step_on_host: bool = False):
        self.params, self.spec = list(params), spec
        self.keys = spec.keys()
        self.host = {p: {k: _host_zeros_like(p, spec.state_dtype(p)) for k in self.keys} for p in self.params}
        if spec.master_weights:
            for p in self.params:
                self.host[p]["master"].copy_(p.detach())  # master = p.float()
        # The host step keeps its counters on the host too (fused wants them beside the tensors it updates).
        self.steps = {
            p: torch.tensor(0.0, dtype=torch.float32, device="cpu") if step_on_host else spec.new_step(p)
            for p in self.params
        }

    def drain(self) -> None:
        pass

    def moves(self) -> tuple[int, int]:
        n = state_bytes(self.params, self.spec, self.keys)
        return n, n

    def state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**{k: self.host[p][k] for k in STATE_KEYS}, "step": self.steps[p]}

    def host_bytes(self) -> int:
        return _nbytes(t for s in self.host.values() for t in s.values())

    def close(self) -> None:
        self.drain()


class Resident:
    """States live on the device; the plain torch optimizer (fused or foreach)."""

    reproduces = "plain torch.optim.AdamW, states on the device"

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec):
        self.label = f"resident-{spec.impl}"
        self.params = list(params)
        # With master_weights, the recipe run resident: fp32 masters on the device beside the bf16 params.
        self.masters = [p.detach().float() for p in self.params] if spec.master_weights else self.params
        self.opt = spec.make(self.masters)

    @torch.no_grad()
    def step(self) -> None:
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def drain(self) -> None:
        pass

    def state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.opt.state[next(m for q, m in zip(self.params, self.masters) if q is p)]

    def host_bytes(self) -> int:
        return 0

    def moves(self) -> tuple[int, int]:
        return 0, 0  # nothing to move: it proves itself by changing every param

    def close(self) -> None:
        self.opt.state.clear()


class SwapOpt:
    """swapopt.SwapOptimizer around the same torch AdamW."""

    reproduces = "swapopt: chunked pipeline, H2D / update / D2H overlapped"
    name = "swapopt"
    step_graph = False

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec, times: int = 16, slots: int = 3):
        from swapopt import SwapOptimizer

        self.label = f"{self.name} t={times} s={slots}"
        self.times, self.slots = times, slots
        self.params, self.spec = list(params), spec
        self.opt = SwapOptimizer(
            spec.make(params), swap_optimizer_times=times, slots=slots, master_weights=spec.master_weights,
            step_graph=self.step_graph,
        )

    def step(self) -> None:
        self.opt.step()

    def drain(self) -> None:
        self.opt.wait_for_swap_out()

    def state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.opt.state[p]

    def host_bytes(self) -> int:
        return self.opt.swap_stats(wait=False).pinned_requested_bytes  # states and masters, in their arenas

    def moves(self) -> tuple[int, int]:
        n = state_bytes(self.params, self.spec)
        return n, n

    def close(self) -> None:
        self.opt.wait_for_swap_out()
        self.opt.release_staging()
        self.opt.state.clear()


class SwapOptGraph(SwapOpt):
    """swapopt with ``step_graph``: the fourth step is captured as a device graph and replayed, and each later one
    is one replay of it (Note [graphed step] in swapopt.graphed)."""

    reproduces = "swapopt, step_graph: the steady step captured once as a device graph and replayed"
    name = "swapopt-graph"
    step_graph = True


class SwapOptAuto(SwapOpt):
    """swapopt with ``resident_mb="auto"`` on a device that has ``spare`` x the state bytes free beyond the params,
    grads and the step's staging: the process's memory is capped for the row with
    ``set_per_process_memory_fraction`` (as a job sharing its device is), which auto honours; the states that
    fit stay resident and the link moves the others only (Note [resident auto] in swapopt.resident_auto)."""

    reproduces = "swapopt, resident_mb='auto': what the spare device memory holds stays resident"

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec, times: int = 16, slots: int = 3,
                 spare: float = 0.25):
        from swapopt import SwapOptimizer
        from swapopt.resident_auto import CHUNK_SLACK

        self.label = f"swapopt auto, {spare:.0%} of the states spare, t={times} s={slots}"
        self.times, self.slots = times, slots
        self.params, self.spec = list(params), spec
        mod, dev = _mod(), self.params[0].device
        n = state_bytes(self.params, spec)
        staging = (slots + 1) * -(-int(CHUNK_SLACK * n) // times)
        # what auto's forward/step term needs now, plus the spare; auto keeps 0.9 of the spare less 1% of this
        usable = mod.memory_allocated(dev) + staging + int(spare * n)
        total = mod.mem_get_info(dev)[1]
        self._restore: float | None = None
        if hasattr(mod, "set_per_process_memory_fraction") and usable < total:
            get = getattr(mod, "get_per_process_memory_fraction", None)
            self._restore = float(get(dev)) if get is not None else 1.0
            mod.set_per_process_memory_fraction(usable / total, dev)
        else:
            self.label += " (device not capped)"
        mod.reset_peak_memory_stats(dev)  # the rows before this one must not count as this job's peak
        self.opt = SwapOptimizer(spec.make(params), swap_optimizer_times=times, slots=slots, resident_mb="auto")

    def moves(self) -> tuple[int, int]:
        from swapopt.resident_auto import device_state_bytes

        n = state_bytes(self.params, self.spec) - device_state_bytes(self.opt.state, self.params)
        return n, n

    def close(self) -> None:
        super().close()
        if self._restore is not None:
            _mod().set_per_process_memory_fraction(self._restore, self.params[0].device)


# Note [low-bit rows]
# torchao's AdamW8bit keeps each moment of a param of at least 4096 elements (a multiple of its block of 256) as
# a tensor subclass: uint8 codes, an fp32 scale per block and a 256-entry fp32 lookup table; smaller params keep
# fp32 moments. Swapped (swapopt.subclass_state), a step moves exactly those parts: about 2.03 bytes a param each
# way instead of 8 (6.03 instead of 12 with master_weights). Its update is its own kernel, not torch's AdamW, so
# these rows are compared with the same torchao optimizer resident (resident-8bit), whose step is the floor of
# their own bound (Row.own_bound_ms). torchao compiles its update with torch.compile; the simulator cannot run
# compiled code, so there both rows step eagerly (torch.compiler.set_stance("force_eager")), launching every op of
# the quantization one by one, where a GPU runs a few fused kernels: the simulated rows pay those launches.
LOWBIT_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def lowbit_class() -> type | None:
    """torchao's AdamW8bit, or None when torchao is not importable."""
    try:
        from torchao.optim import AdamW8bit
    except Exception:  # noqa: BLE001 - not installed, or built for another torch
        return None
    return AdamW8bit


def _make_lowbit(params: Sequence[torch.Tensor], spec: AdamWSpec) -> torch.optim.Optimizer:
    cls = lowbit_class()
    if cls is None:
        raise RuntimeError("the 8-bit rows need torchao (pip install torchao)")
    return cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


def _eager_on_simulator():
    """torch.compile run eagerly on the simulator (Note [low-bit rows]); nothing changes on a device."""
    import contextlib

    return torch.compiler.set_stance("force_eager") if device.is_simulated() else contextlib.nullcontext()


def lowbit_state_bytes(states: dict, params: Sequence[torch.Tensor]) -> int:
    """Bytes of the moments of ``params`` (those with a grad) in the optimizer state ``states``: a subclass
    state's parts (codes, scales, lookup table), a plain state's own bytes."""
    from swapopt import subclass_state

    total = 0
    for p in params:
        if p.grad is None:
            continue
        for k in LOWBIT_STATE_KEYS:
            v = states[p][k]
            total += subclass_state.nbytes(v) if subclass_state.is_subclass_state(v) else v.numel() * v.element_size()
    return total


class ResidentLowBit(Resident):
    """torchao's AdamW8bit with its states on the device (with master_weights: over fp32 masters on the device, the
    recipe the swapped row reproduces)."""

    reproduces = "torchao AdamW8bit, states on the device"

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec):
        self.label = "resident-8bit"
        self.params = list(params)
        self.masters = [p.detach().float() for p in self.params] if spec.master_weights else self.params
        self.opt = _make_lowbit(self.masters, spec)

    def step(self) -> None:
        with _eager_on_simulator():
            super().step()


class SwapOptLowBit(SwapOpt):
    """swapopt.SwapOptimizer around torchao's AdamW8bit: every part of each 8-bit state swapped."""

    reproduces = "swapopt over torchao AdamW8bit: the 8-bit states' parts swapped"

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec, times: int = 16, slots: int = 3):
        from swapopt import SwapOptimizer

        self.label = f"swapopt-8bit t={times} s={slots}"
        self.times, self.slots = times, slots
        self.params, self.spec = list(params), spec
        self.opt = SwapOptimizer(
            _make_lowbit(params, spec), swap_optimizer_times=times, slots=slots, master_weights=spec.master_weights
        )

    def step(self) -> None:
        with _eager_on_simulator():
            self.opt.step()

    def moves(self) -> tuple[int, int]:
        # The states' parts as they are (the first step creates them), and each fp32 master with master_weights.
        self.opt.wait_for_swap_out()
        n = lowbit_state_bytes(self.opt.state, self.params)
        if self.spec.master_weights:
            n += 4 * sum(p.numel() for p in self.params if p.grad is not None)
        return n, n


class SerialSwap(_HostStateStrategy):
    """XTuner SwapAdamW's schedule: per param, swap in, update, swap out, all on the caller's
    stream; one device synchronize at the end of the step."""

    label = "serial"
    reproduces = "XTuner SwapAdamW (per-param, one stream, sync at end)"

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            host = self.host[p]
            # Fresh device buffers per param, freed in stream order on this same stream.
            dev = {k: torch.empty_like(p, dtype=self.spec.state_dtype(p)) for k in self.keys}
            for k in self.keys:
                dev[k].copy_(host[k], non_blocking=True)
            self.spec.update_params([p], [dev], [self.steps[p]])
            for k in self.keys:
                host[k].copy_(dev[k], non_blocking=True)
            del dev  # one param's states on the device at a time
        _mod().synchronize()


def mindspeed_chunks(params: Sequence[torch.Tensor], times: int) -> list[list[torch.Tensor]]:
    """MindSpeed's chunking: whole params, greedily, up to numel/times each (at least one param)."""
    budget = sum(p.numel() for p in params) // max(times, 1)
    chunks: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    count = 0
    for p in params:
        if current and count + p.numel() > budget:
            chunks.append(current)
            current, count = [], 0
        current.append(p)
        count += p.numel()
    if current:
        chunks.append(current)
    return chunks


class OneInFlightSwap(_HostStateStrategy):
    """MindSpeed swap-optimizer's schedule: chunks of numel/times whole params; H2D on one stream,
    D2H on another, per-param events inside a chunk, and the next chunk's swap-in waits until the
    previous chunk is fully swapped out (one chunk in flight, one staging buffer)."""

    reproduces = "MindSpeed swap-optimizer (one chunk in flight)"

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec, times: int = 16):
        super().__init__(params, spec)
        self.label = f"one-in-flight t={times}"
        self.times = times
        mod = _mod()
        self.h2d, self.d2h = mod.Stream(), mod.Stream()

    @torch.no_grad()
    def step(self) -> None:
        mod = _mod()
        compute = mod.current_stream()
        live = [p for p in self.params if p.grad is not None]
        chunks = mindspeed_chunks(live, self.times)
        if not chunks:
            return
        staging_numel = max(sum(p.numel() for p in c) for c in chunks)
        # Staging belongs to the compute stream: once it waits for the last swap-out below, dropping
        # the buffers is stream-ordered and needs no record_stream.
        dtype = self.spec.state_dtype(live[0])
        staging = {k: torch.empty(staging_numel, dtype=dtype, device=live[0].device) for k in self.keys}
        # Swap-in starts once the compute stream has reached step() (grads final, staging free).
        self.h2d.wait_stream(compute)
        previous_out = None
        for chunk in chunks:
            views, arrived = {}, {}
            with mod.stream(self.h2d):
                if previous_out is not None:
                    self.h2d.wait_event(previous_out)
                offset = 0
                for p in chunk:
                    views[p] = {k: staging[k][offset : offset + p.numel()].view(p.shape) for k in self.keys}
                    offset += p.numel()
                    for k in self.keys:
                        views[p][k].copy_(self.host[p][k], non_blocking=True)
                    arrived[p] = self.h2d.record_event()
            for p in chunk:
                compute.wait_event(arrived[p])
                v = views[p]
                self.spec.update_params([p], [v], [self.steps[p]])
                updated = compute.record_event()
                with mod.stream(self.d2h):
                    self.d2h.wait_event(updated)
                    for k in self.keys:
                        self.host[p][k].copy_(v[k], non_blocking=True)
            previous_out = self.d2h.record_event()
        compute.wait_stream(self.d2h)

    def drain(self) -> None:
        self.d2h.synchronize()

    def chunk_bytes(self) -> int:
        """State bytes of the largest chunk: the staging this schedule holds on the device."""
        per_elem = len(self.keys) * 4 if self.spec.master_weights else 2 * self.params[0].element_size()
        return max(per_elem * sum(p.numel() for p in c) for c in mindspeed_chunks(self.params, self.times))


class WholeSwap(_HostStateStrategy):
    """RL offload/onload style: move every state in, one step over all params, move every state
    out, synchronize."""

    label = "whole"
    reproduces = "RL onload / step / offload of all states"

    def moves(self) -> tuple[int, int]:
        n = state_bytes(self.params, self.spec, STATE_KEYS)
        return n, n

    @torch.no_grad()
    def step(self) -> None:
        live = [p for p in self.params if p.grad is not None]
        dev = {p: {k: torch.empty_like(p) for k in STATE_KEYS} for p in live}
        for p in live:
            for k in STATE_KEYS:
                dev[p][k].copy_(self.host[p][k], non_blocking=True)
        self.spec.update(
            live,
            [p.grad for p in live],
            [dev[p]["exp_avg"] for p in live],
            [dev[p]["exp_avg_sq"] for p in live],
            [self.steps[p] for p in live],
        )
        for p in live:
            for k in STATE_KEYS:
                self.host[p][k].copy_(dev[p][k], non_blocking=True)
        _mod().synchronize()


class HostStep(_HostStateStrategy):
    """ZeRO-Offload / torchao style: fp32 master params and states stay in host memory, grads go
    down, torch's fused CPU AdamW steps on the host, params go back up."""

    label = "host-step"
    reproduces = "ZeRO-Offload / torchao: fused CPU AdamW on the host"

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec):
        # The host step is torch's fused CPU AdamW whatever the device kernel is.
        super().__init__(params, spec.model_copy(update={"impl": "fused"}), step_on_host=True)
        mod = _mod()
        self.h2d, self.d2h = mod.Stream(), mod.Stream()
        self.master = {p: device.pinned_empty(tuple(p.shape), dtype=p.dtype) for p in self.params}
        self.grads = {p: device.pinned_empty(tuple(p.shape), dtype=p.dtype) for p in self.params}
        self.d2h.wait_stream(mod.current_stream())
        with mod.stream(self.d2h):
            for p in self.params:
                self.master[p].copy_(p.detach(), non_blocking=True)
        self.d2h.synchronize()

    @torch.no_grad()
    def step(self) -> None:
        mod = _mod()
        compute = mod.current_stream()
        live = [p for p in self.params if p.grad is not None]
        self.d2h.wait_stream(compute)
        with mod.stream(self.d2h):
            for p in live:
                self.grads[p].copy_(p.grad, non_blocking=True)
        self.d2h.synchronize()  # the CPU step reads the grads
        self.spec.update(
            [self.master[p] for p in live],
            [self.grads[p] for p in live],
            [self.host[p]["exp_avg"] for p in live],
            [self.host[p]["exp_avg_sq"] for p in live],
            [self.steps[p] for p in live],
        )
        # Params are overwritten only after the compute stream is done reading them.
        self.h2d.wait_stream(compute)
        with mod.stream(self.h2d):
            for p in live:
                p.copy_(self.master[p], non_blocking=True)
        compute.wait_stream(self.h2d)

    def drain(self) -> None:
        self.h2d.synchronize()

    def moves(self) -> tuple[int, int]:
        # Its states never move: grads go down, params come back up.
        n = _nbytes(p for p in self.params if p.grad is not None)
        return n, n

    def host_bytes(self) -> int:
        return super().host_bytes() + _nbytes(self.master.values()) + _nbytes(self.grads.values())


def torchao_offload_class():
    """torchao's CPUOffloadOptimizer class, or None when torchao (or a CUDA device or the simulator, which torchao
    runs on as on a GPU: swapopt.bench.peers) is absent."""
    if device.get_device() != "cuda":  # the simulator's cuda flavour presents cuda
        return None
    return torchao_peer.offload_class()[0]


class TorchaoOffload:
    """torchao.optim.CPUOffloadOptimizer wrapping torch AdamW (fused CPU step, per-param overlap).

    Its grads reach the host in post-accumulate-grad hooks, which only a backward fires: a step without one finds
    no grad on the host and updates nothing. So its step runs a backward that hands the fixed grads to the params
    (one view per param, its grad the benchmark's, accumulated into an empty ``.grad``), then ``step()``: the
    timed step is the grads' copies down (in the hooks), the CPU AdamW steps and the params' copies up.

    torchao gets leaves of its own that share the params' memory (its updates land in the benchmark's params), so
    its hooks, which torchao registers without keeping a handle, go with the strategy."""

    reproduces = "torchao CPUOffloadOptimizer (a backward drives its grad hooks)"

    def __init__(self, params: Sequence[torch.Tensor], spec: AdamWSpec):
        import contextlib

        cls = torchao_offload_class()
        if cls is None:
            raise RuntimeError("torchao CPUOffloadOptimizer needs torchao and a CUDA device (or the simulator)")
        self.label = "torchao-offload"
        self.params = list(params)
        self.leaves = [p.detach().requires_grad_(True) for p in self.params]
        self.grads = [p.grad for p in self.params]  # the benchmark's fixed grads, handed over each step
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torchao_peer.on_simulator())
        try:
            self.opt = cls(
                self.leaves, torch.optim.AdamW, fused=True,
                lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
            )
        except BaseException:
            self._stack.close()
            raise

    def step(self) -> None:
        live = [(q, g) for q, g in zip(self.leaves, self.grads) if g is not None]
        for q, _ in live:
            q.grad = None
        with torch.enable_grad():
            torch.autograd.backward([q.view_as(q) for q, _ in live], grad_tensors=[g for _, g in live])
        self.opt.step()

    def drain(self) -> None:
        _mod().synchronize()

    def moves(self) -> tuple[int, int]:
        # Params of at least torchao's minimal_size: grads down, params up; smaller ones step on the device.
        n = _nbytes(self.opt.param_d2h_map)
        return n, n

    def state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def host_bytes(self) -> int:
        # Host master copies (4 B/param), grads (4 B/param) and AdamW states (8 B/param).
        return 16 * sum(p.numel() for p in self.params)

    def close(self) -> None:
        _mod().synchronize()
        self.opt.optim_dict.clear()
        self.opt.param_d2h_map.clear()
        self._stack.close()


STRATEGY_DOCS: dict[str, str] = {
    "resident": Resident.reproduces,
    "swapopt": SwapOpt.reproduces,
    "swapopt-graph": SwapOptGraph.reproduces,
    "swapopt-auto-25": SwapOptAuto.reproduces,
    "swapopt-auto-75": SwapOptAuto.reproduces,
    "serial": SerialSwap.reproduces,
    "one-in-flight": OneInFlightSwap.reproduces,
    "whole": WholeSwap.reproduces,
    "host-step": HostStep.reproduces,
    "torchao-offload": TorchaoOffload.reproduces,
    "resident-8bit": ResidentLowBit.reproduces,
    "swapopt-8bit": SwapOptLowBit.reproduces,
}


# The strategies with a master-weights form (AdamWSpec.master_weights): the others step on the host or move
# all states at once, where fp32 masters change nothing of what they show.
MASTER_WEIGHT_STRATEGIES = ("resident", "swapopt", "serial", "one-in-flight", "resident-8bit", "swapopt-8bit")
# The rows over torchao's AdamW8bit (Note [low-bit rows]): run where torchao is importable.
LOWBIT_STRATEGIES = ("resident-8bit", "swapopt-8bit")
# What a run does unless told. On a device: every strategy (ALL_STRATEGIES). On the simulator: the others at the
# run's sizes (DEFAULT_STRATEGIES, also BenchConfig's default), and the 8-bit rows at SIM_LOWBIT_SIZE only, beside a
# resident row for that size's bound: torchao's eager quantization there (some 30 ops a state, each launched alone,
# run as real CPU work over every element) costs minutes at 0.1B where the others take seconds, and some 20 s more
# at 0.0002B (2 CPU cores). Named in --strategies, they run at the sizes asked.
ALL_STRATEGIES = tuple(STRATEGY_DOCS)
# swapopt-graph: on a device, where a graph's replay is what it measures; the layout bench runs it where asked.
DEFAULT_STRATEGIES = tuple(k for k in STRATEGY_DOCS if k not in LOWBIT_STRATEGIES and k != "swapopt-graph")
SIM_LOWBIT_SIZE = 0.0002  # billions of params: 213,440 params, 13 of its 20 tensors quantized


def make_strategy(
    kind: str, params: Sequence[torch.Tensor], spec: AdamWSpec, times: int = 16, slots: int = 3
) -> Strategy:
    """Build strategy `kind` (a key of STRATEGY_DOCS) over `params`."""
    if spec.master_weights and kind not in MASTER_WEIGHT_STRATEGIES:
        raise ValueError(f"{kind} has no master-weights form; those that do: {', '.join(MASTER_WEIGHT_STRATEGIES)}")
    if kind == "resident":
        return Resident(params, spec)
    if kind == "swapopt":
        return SwapOpt(params, spec, times=times, slots=slots)
    if kind == "swapopt-graph":
        return SwapOptGraph(params, spec, times=times, slots=slots)
    if kind.startswith("swapopt-auto-"):  # two free-memory levels: 25% and 75% of the state bytes spare
        return SwapOptAuto(params, spec, times=times, slots=slots, spare=int(kind.rsplit("-", 1)[1]) / 100)
    if kind == "serial":
        return SerialSwap(params, spec)
    if kind == "one-in-flight":
        return OneInFlightSwap(params, spec, times=times)
    if kind == "whole":
        return WholeSwap(params, spec)
    if kind == "host-step":
        return HostStep(params, spec)
    if kind == "torchao-offload":
        return TorchaoOffload(params, spec)
    if kind == "resident-8bit":
        return ResidentLowBit(params, spec)
    if kind == "swapopt-8bit":
        return SwapOptLowBit(params, spec, times=times, slots=slots)
    raise ValueError(f"unknown strategy {kind!r}; choose from {sorted(STRATEGY_DOCS)}")
