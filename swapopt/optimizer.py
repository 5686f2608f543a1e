"""SwapOptimizer: a torch.optim.Optimizer whose states live in pinned host memory between steps.

step() streams the states through the device in chunks (see swapopt.operate for the stream and event
choreography, swapopt.plan for the chunking) and runs the wrapped optimizer's own step on each chunk,
so the update is bitwise the one the unwrapped optimizer computes.

A failing step leaves each param fully stepped or untouched (Note [failure semantics], swapopt.recovery): a
param split across chunks whose update began before the failing chunk is completed by rolling it
forward through a synchronous recovery path, so the normal path keeps no backups.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from loguru import logger
from pydantic import BaseModel

import device
from swapopt import checkpoint, copying, hoststate, perparam, recovery
from swapopt.arena import Arenas, Run, itemsize
from swapopt.hoststate import is_swapped_state, local, new_host_like, wrap_like
from swapopt.hoststate import raw_step as _raw_step
from swapopt.operate import SwapOptimizerOperate
from swapopt.overlap import ForwardWaits
from swapopt.plan import DEFAULT_ALIGN, SLOT_ALIGN as _SLOT_ALIGN, ParamSize, Plan, make_plan

MiB = 1 << 20
_GRAD = "\0grad"  # region key of a grad gathered into the slot (no state key can collide with it)


class SwapStats(BaseModel):
    """Counters of the last step (``steps`` counts all swapped steps)."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    chunks: int = 0
    peak_staging_bytes: int = 0
    step_ms: float | None = None
    steps: int = 0
    failed: bool = False  # the last step raised; the counters are those of the last successful step
    last_error: str | None = None


def _refuse(optimizer: Any, per_param: bool) -> None:
    """Raise for optimizers whose state cannot be chunked and swapped, saying what to use instead."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"SwapOptimizer wraps a torch.optim.Optimizer instance, got {type(optimizer).__name__}; "
            "build the optimizer first, e.g. SwapOptimizer(torch.optim.AdamW(model.parameters()))"
        )
    if isinstance(optimizer, SwapOptimizer):
        raise ValueError("this optimizer is already a SwapOptimizer; wrap the inner optimizer once")
    cls = type(optimizer)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "LBFGS cannot be swapped: it keeps one flat history over all params and re-evaluates the closure "
            "several times per step, so its state cannot be split into chunks; use it unwrapped"
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError(
            "SparseAdam cannot be swapped: its updates touch only the rows of sparse gradients; use it unwrapped, "
            "or torch.optim.Adam/AdamW with dense gradients under SwapOptimizer"
        )
    if cls.__module__.split(".")[0] == "torch_npu" and "Fused" in cls.__name__:
        raise ValueError(
            f"{cls.__name__} keeps params, grads and states in one flat fused buffer, which cannot be "
            "streamed in chunks; use torch.optim.AdamW(..., foreach=True) (or fused=True) under SwapOptimizer"
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise ValueError(
                f"param group {i} has differentiable=True: its states carry autograd history through the "
                "step, which host copies cannot; use differentiable=False to swap, or run it unwrapped"
            )
    if not perparam.is_elementwise(cls) and cls.__module__.split(".")[0] != "torch":
        seen: dict[int, torch.Tensor] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                loc = local(p)
                if loc.numel() == 0:
                    continue
                ptr = loc.untyped_storage().data_ptr()
                other = seen.setdefault(ptr, p)
                if other is not p:
                    raise ValueError(
                        f"{cls.__name__}'s params are views of one flat buffer, which suggests a flat-buffer fused "
                        "optimizer whose state cannot be chunked per param; use a per-param optimizer such as "
                        "torch.optim.AdamW under SwapOptimizer"
                    )
    if not per_param and not perparam.is_per_param(cls):
        raise ValueError(
            f"{cls.__module__}.{cls.__qualname__} is not known to be a per-param optimizer. SwapOptimizer runs "
            "it once per chunk of params with a copy of each param group, which is exact only if each param's "
            "update reads nothing but that param, its grad, its own state and the group's hyperparameters, and "
            "step writes no group-level value (a LAMB-style global norm or group['step'] counter breaks this). "
            "If it is per-param, opt in with SwapOptimizer(optimizer, per_param=True) or "
            "swapopt.register_per_param(cls); otherwise run it unwrapped"
        )


def _unlike(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """A grad laid out unlike its dense param; equal shape and strides settle it without a layout walk."""
    if grad.shape == param.shape and grad.stride() == param.stride():
        return False
    return not hoststate.same_layout(grad, param)


@dataclass(eq=False)
class _Host:
    """Host states of one param as cached by the planner: the tensors stored in opt.state and their
    host-local tensors (the DTensor shards for DTensor params)."""

    keys: tuple[str, ...]
    stored: tuple[torch.Tensor, ...]
    locals: tuple[torch.Tensor, ...]
    nkeys: int  # len(opt.state[p]) when cached: a new key means the layout changed
    nbytes: int


@dataclass(eq=False)
class _Region:
    piece: int  # position of the piece in its chunk
    key: str
    offset: int  # bytes into the slot
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...] | None  # None: a flat piece; else the whole state's local shape
    host: torch.Tensor | None  # host-local view the region mirrors (the swap-in reads it); None: a gathered grad
    layout: torch.Tensor | None  # DTensor whose layout wraps the slot view (non-flat DTensor states)
    stride: tuple[int, ...] | None  # the host state's strides (non-flat states keep their dense layout)


@dataclass(eq=False)
class _Prepared:
    """Everything cached between re-plans."""

    key: tuple
    params: list[torch.Tensor]
    groups: list[int]
    flat: list[bool]
    plan: Plan
    regions: list[list[_Region]]
    slot_bytes: int
    resident: list[torch.Tensor]
    last_chunk: dict[torch.Tensor, int] = field(default_factory=dict)
    runs: list[list[Run]] = field(default_factory=list)  # per chunk: merged copies of arena regions
    covered: list[frozenset[int]] = field(default_factory=list)  # per chunk: regions a run moves
    h2d_bytes: list[int] = field(default_factory=list)  # per chunk: state bytes its swap-in moves
    covered_bytes: list[int] = field(default_factory=list)  # per chunk: state bytes of the covered regions


class _ChunkViews(list):
    """Per piece of one chunk: {key: (value the optimizer sees, slot view, host view)}; ``runs``: the
    (host, slot) byte views of the chunk's merged copies."""

    runs: list[tuple[torch.Tensor, torch.Tensor]]


class SwapOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that its states stay in pinned host memory between steps.

    ``swap_optimizer_times``: chunks per step; ``chunk_mb``: fixed chunk budget (MiB), overrides it;
    ``slots``: staging buffers (3 lets swap-in, update and swap-out overlap); ``resident_mb``: states
    that fit stay on the device and are stepped first; ``per_param``: vouch that an optimizer from
    outside torch.optim is per-param (see swapopt.perparam), so it is accepted. param_groups, state and defaults are the
    wrapped optimizer's own objects.

    ``overlap_forward``: run the updates on a dedicated stream and let the next forward start under
    them (swapopt.overlap): step() returns without the compute stream waiting, and each module's
    forward waits only for its own params' updates. Needs ``opt.attach(model)`` (after ``fully_shard``
    under FSDP2); code that reads params or states outside a module's forward (EMA, norms, saving the
    model) calls ``opt.wait_for_update()`` first. ``zero_grad(set_to_none=False)`` zeroes grads in
    place, so it first makes the current stream wait for the update (correct, but loses the overlap).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        swap_optimizer_times: int = 16,
        chunk_mb: float | None = None,
        slots: int = 3,
        resident_mb: float = 0.0,
        per_param: bool = False,
        overlap_forward: bool = False,
    ) -> None:
        _refuse(optimizer, per_param)
        if not isinstance(swap_optimizer_times, int) or swap_optimizer_times < 1:
            raise ValueError(f"swap_optimizer_times must be an int >= 1, got {swap_optimizer_times!r}")
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if chunk_mb is not None and not (chunk_mb > 0 and math.isfinite(chunk_mb)):
            raise ValueError(f"chunk_mb must be a positive number of MiB or None, got {chunk_mb!r}")
        if not (resident_mb >= 0 and math.isfinite(resident_mb)):
            raise ValueError(f"resident_mb must be a non-negative number of MiB, got {resident_mb!r}")
        self.optimizer = optimizer
        self.swap_optimizer_times = swap_optimizer_times
        self.chunk_mb = chunk_mb
        self.resident_mb = float(resident_mb)
        self.per_param = bool(per_param)  # a copy (deepcopy, pickle) must be accepted as the original was
        self._ready = False
        # Optimizer.__init__ sets up hooks and the step wrapper; it gets copies of the groups, then the
        # wrapper takes the inner optimizer's own objects so schedulers, clipping and DCP see one truth.
        super().__init__([dict(g) for g in optimizer.param_groups], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self.operate = SwapOptimizerOperate(slots, overlap=bool(overlap_forward))
        self._forward_waits = ForwardWaits(self.operate)
        self._hyper: dict[int, dict[str, Any]] = {}  # per group: step-time copies of tensor hyperparameters
        self._elementwise = perparam.is_elementwise(type(optimizer))
        self._pre_hosts: dict[torch.Tensor, dict[str, torch.Tensor]] = {}  # see _preallocate
        self._arenas = Arenas()  # pinned buffers holding new states in chunk order (swapopt.arena)
        self._split_cache: dict[torch.Tensor, tuple] = {}  # see _splittable
        self._step_fn = _raw_step(optimizer)
        self._host: dict[torch.Tensor, _Host] = {}
        self._prepared: _Prepared | None = None
        self._resident: set[torch.Tensor] = set()  # params whose states live on the device (resident_mb)
        self._probe_cache: dict[tuple, int] = {}
        self._version = 0  # bumped whenever cached host layouts change
        self._stats = SwapStats()
        self._warned: set[str] = set()
        self._ready = True
        self._device = device.get_device()
        if self._device != "cpu":
            self._adopt_existing()

    # ----- torch.optim.Optimizer surface -------------------------------------------------------
    @property
    def _step_supports_amp_scaling(self) -> bool:  # GradScaler: fused inners unscale in their kernel
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_ready", False):  # called by Optimizer.__init__ on the copies
            return super().add_param_group(param_group)
        self.wait_for_update()
        self.optimizer.add_param_group(param_group)
        self._prepared = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # zeroed in place: the update must be done reading them
            self.wait_for_update()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return (
            f"SwapOptimizer({self.optimizer!r}, swap_optimizer_times={self.swap_optimizer_times}, "
            f"chunk_mb={self.chunk_mb}, slots={self.operate.slots}, resident_mb={self.resident_mb})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # The inner optimizer and the settings; the copy builds its own streams, staging and pinned states.
        return copying.getstate(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        copying.setstate(self, state)

    def state_dict(self) -> dict[str, Any]:
        self.wait_for_update()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_for_update()
        checkpoint.load_state_dict(self, state_dict)
        # Optimizer.load_state_dict rebinds state/param_groups: keep sharing the inner's objects.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.invalidate()

    def offload(self, empty_cache: bool = False) -> None:
        # swapopt.offload (the package attribute) is the function, not the module: import from the module.
        from swapopt.offload import offload

        self.wait_for_update()
        offload(self, empty_cache=empty_cache)

    def onload(self) -> None:
        from swapopt.offload import onload

        onload(self)

    # ----- swapopt surface -------------------------------------------------------------------
    @property
    def overlap_forward(self) -> bool:
        return self.operate.overlap

    def attach(self, model: torch.nn.Module) -> None:
        """Register the forward pre-hooks that order each module's forward after the update of its own
        params (``overlap_forward``; harmless without it). Idempotent; a second model adds its modules.
        Under FSDP2, call it after ``fully_shard``."""
        self._forward_waits.attach(model)

    def wait_for_update(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Make the current stream wait for the pending updates of ``params`` (all if None), without
        blocking the host. Call it before reading params or states outside a module's forward (EMA,
        param norms, saving the model) when ``overlap_forward`` is on; a no-op otherwise."""
        self.operate.wait_for_update(params)

    def wait_for_swap_out(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Block the host until in-flight swap-outs of ``params`` (all if None) are done; host state
        may be read or written afterwards."""
        self.operate.wait_for_swap_out(params)

    def release_staging(self) -> None:
        self.operate.release_staging()

    def invalidate(self) -> None:
        """Forget cached host layouts and the plan (call after replacing state tensors by hand)."""
        self._host.clear()
        self._split_cache.clear()
        self._prepared = None
        self._version += 1

    def swap_stats(self) -> SwapStats:
        """Counters of the last successful step (step_ms waits for its last swap-out); ``failed`` and
        ``last_error`` say whether the step after it raised."""
        stats = self._stats.model_copy()
        if stats.steps:
            stats.step_ms = self.operate.step_ms()
        return stats

    # ----- step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.optimizer
        if self.operate.overlap and not self._forward_waits.attached:
            raise RuntimeError(
                "SwapOptimizer(overlap_forward=True) needs the model: call opt.attach(model) once before the "
                "first step (after fully_shard under FSDP2), so that each forward waits for its params' update"
            )
        args: tuple = ()
        for hook in inner._optimizer_step_pre_hooks.values():  # the inner's own hooks run once per step
            result = hook(inner, args, kwargs)
            if result is not None:
                args, kwargs = result
        # GradScaler hands fused optimizers grad_scale/found_inf as attributes of the optimizer it steps.
        # With overlap_forward the update reads step-time copies: scaler.update() may change them right away.
        amp = {k: getattr(self, k) for k in ("grad_scale", "found_inf") if hasattr(self, k)}
        for k, v in amp.items():
            setattr(inner, k, self.operate.snapshot(v))
        try:
            mode = device.get_device()
            if mode != self._device:
                self._device = mode
                self.invalidate()
            if mode == "cpu":
                if "cpu" not in self._warned:
                    self._warned.add("cpu")
                    warnings.warn(
                        f"swapopt: no accelerator or simulator is active, so SwapOptimizer steps "
                        f"{type(inner).__name__} in place and its states stay where torch puts them",
                        stacklevel=4,  # past torch's no_grad and step-hook wrappers: the caller of step()
                    )
                    logger.info("swapopt: no accelerator, stepping {} in place", type(inner).__name__)
                self._step_fn(inner, *args, **kwargs)
            else:
                self._swap_step(args, kwargs)
        finally:
            for k in amp:
                delattr(inner, k)
        for hook in inner._optimizer_step_post_hooks.values():
            hook(inner, args, kwargs)
        if hasattr(getattr(inner, "step", None), "_wrapped_by_lr_sched"):
            inner._opt_called = True  # a scheduler built on the inner optimizer counts this step
        return loss

    def _active(self) -> tuple[list[torch.Tensor], list[int], dict[int, list[torch.Tensor]]]:
        """Params with a grad, in group order, each once (tied params are stepped once): those to swap
        with their group indices, and those stepped in place by group (params outside device memory
        need no swapping; meta params get torch's own errors)."""
        params: list[torch.Tensor] = []
        groups: list[int] = []
        in_place: dict[int, list[torch.Tensor]] = defaultdict(list)
        seen: set[int] = set()
        for gi, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p.grad is None or id(p) in seen:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"SwapOptimizer does not support sparse gradients (param_groups[{gi}]['params'][{j}] has "
                        f"one), whatever the optimizer: use torch.optim.SparseAdam unwrapped for sparse "
                        "gradients, or make them dense (e.g. nn.Embedding(..., sparse=False))"
                    )
                seen.add(id(p))
                if p.device.type == "meta" or device.is_host_tensor(p):
                    in_place[gi].append(p)
                else:
                    params.append(p)
                    groups.append(gi)
        return params, groups, in_place

    def _swap_step(self, args: tuple, kwargs: dict) -> None:
        if args:
            raise TypeError("SwapOptimizer.step takes the closure and keyword arguments only")
        params, groups, in_place = self._active()
        if in_place:
            if "host" not in self._warned:
                self._warned.add("host")
                logger.info("swapopt: params outside device memory are stepped in place, without swapping")
            chunk_state = self._real_states([p for ps in in_place.values() for p in ps])
            self._run_inner(dict(in_place), chunk_state, kwargs)
            self._keep_new_states(chunk_state)
        if not params:
            return
        mod = device.get_torch_device_module(self._device)
        self.operate.bind(mod)
        self.operate.begin_step()  # swap_stats() must not pair this step's start with an older end
        try:
            prep = self._prepare(params, groups)
            # States this step creates get their pinned host memory before any param is touched, so a
            # failing allocation leaves every param untouched (Note [failure semantics]).
            self._pre_hosts = self._preallocate(prep)
        except BaseException as exc:
            self._failed(exc)
            raise
        op, plan = self.operate, prep.plan
        n = len(plan.chunks)
        pending: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        views: list[list[dict[str, tuple]] | None] = [None] * n
        # progress["stage"]: (stage, k) of the chunk being worked on; progress["chunk"]: what completing
        # chunk k needs once its inner update returned (see Note [failure semantics]).
        progress: dict[str, Any] = {"stage": ("done", -1)}
        h2d = d2h = 0
        try:
            if op.overlap:  # copies made before the entry event: a scheduler may change the originals
                self._hyper = {gi: self._snapshot_group(self.param_groups[gi]) for gi in set(groups)}
            op.begin(n, prep.slot_bytes, device.torch_device(self._device))
            for p in params:  # zero_grad(set_to_none=True) may free them before the update read them
                op.keep_for_update(p.grad)
            lookahead = op.nslots - 1
            for j in range(min(lookahead, n)):
                views[j], b = self._swap_in(prep, j)
                h2d += b
            if prep.resident:  # runs while the first swap-ins are in flight
                self._update_resident(prep, kwargs)
            for k in range(n):
                if k + lookahead < n:
                    views[k + lookahead], b = self._swap_in(prep, k + lookahead)
                    h2d += b
                d2h += self._update_and_swap_out(prep, k, views[k], pending, kwargs, progress)
                views[k] = None
            op.finish(prep.last_chunk, prep.resident)
            self._hyper = {}
        except BaseException as exc:  # Note [failure semantics]
            views.clear()
            recovery.recover(self, prep, progress, pending, kwargs)
            pending.clear()
            progress.clear()
            self._pre_hosts = {}
            self._hyper = {}
            op.release_staging()
            recovery.drop_frames(exc)
            self._failed(exc)
            raise
        self._pre_hosts = {}
        st = self._stats
        first = st.steps == 0
        self._stats = SwapStats(
            h2d_bytes=h2d, d2h_bytes=d2h, chunks=n, peak_staging_bytes=op.peak_staging_bytes, steps=st.steps + 1
        )
        (logger.info if first else logger.debug)(
            "swapopt step {}: {} chunks, H2D {:.1f} MiB, D2H {:.1f} MiB, staging {:.1f} MiB, {} resident params",
            st.steps + 1, n, h2d / MiB, d2h / MiB, op.peak_staging_bytes / MiB, len(prep.resident),
        )  # fmt: skip

    def _snapshot_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """Step-time copies of the group's tensor hyperparameters (lr tensors, tensor betas)."""
        out = {}
        for key, value in group.items():
            if key != "params":
                copy = self.operate.snapshot(value)
                if copy is not value:
                    out[key] = copy
        return out

    def _failed(self, exc: BaseException) -> None:
        """swap_stats() keeps the last successful step's counters and says the last step failed."""
        self._stats = self._stats.model_copy(update={"failed": True, "last_error": repr(exc)})

    def _real_states(self, params: Iterable[torch.Tensor]) -> defaultdict:
        """A state mapping over the real per-param dicts, without creating entries torch would not."""
        chunk_state: defaultdict = defaultdict(dict)
        for p in params:
            if p in self.state:
                chunk_state[p] = self.state[p]
        return chunk_state

    def _keep_new_states(self, chunk_state: dict) -> None:
        """Entries the inner optimizer created in a mapping from _real_states become real ones."""
        for p, st in chunk_state.items():
            if p not in self.state:
                self.state[p] = st

    # ----- host state bookkeeping --------------------------------------------------------------
    def _adopt_existing(self) -> None:
        """States that exist before the first swapped step (Adagrad builds them in __init__, or the
        optimizer already stepped) move into pinned host memory now."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    self._cache_host(p, quiet=True)

    def _cache_host(self, p: torch.Tensor, quiet: bool = False) -> _Host:
        """Record p's host states; any swapped state found in device memory is copied into host memory."""
        st = self.state[p]
        old = self._host.get(p)
        previous = dict(zip(old.keys, old.stored)) if old is not None else {}
        keys, stored, locs = [], [], []
        for key, value in list(st.items()):
            if not is_swapped_state(p, key, value):
                continue
            if not device.is_host_tensor(value) or not hoststate.is_dense(local(value)):
                if not quiet and not device.is_host_tensor(value) and "rehome" not in self._warned:
                    self._warned.add("rehome")
                    logger.warning(
                        "swapopt: optimizer state {!r} was found in device memory (moved there behind the "
                        "optimizer's back?); copying it back into pinned host memory",
                        key,
                    )
                src = local(value)
                home = previous.get(key)  # the pinned tensor it came from, when it still fits
                if home is None or not hoststate.same_layout(local(home), src) or local(home).dtype != src.dtype:
                    home = hoststate.pinned_empty_like(value)
                self.operate.wait_for_swap_out([p])
                local(home).copy_(src)
                value = st[key] = home
            keys.append(key)
            stored.append(value)
            locs.append(local(value))
        entry = _Host(tuple(keys), tuple(stored), tuple(locs), len(st), sum(t.numel() * t.element_size() for t in locs))
        self._host[p] = entry
        self._version += 1
        return entry

    def _check_host(self, p: torch.Tensor) -> bool:
        """Whether p's cached host layout still matches opt.state[p]."""
        entry = self._host.get(p)
        st = self.state.get(p)
        if entry is None:
            return not st
        if not st or len(st) != entry.nkeys:
            return False
        return all(st.get(k) is t for k, t in zip(entry.keys, entry.stored))

    def _ensure_resident(self, p: torch.Tensor, dev: torch.device) -> None:
        """Resident params keep their states in device memory."""
        st = self.state.get(p) or {}
        for key, value in list(st.items()):
            if is_swapped_state(p, key, value) and device.is_host_tensor(value):
                src = local(value)
                dst = torch.empty_strided(src.shape, hoststate.layout_strides(src), dtype=src.dtype, device=dev)
                dst.copy_(src)
                st[key] = wrap_like(value, dst)
        self._host.pop(p, None)

    # ----- planning ----------------------------------------------------------------------------
    def _splittable(self, p: torch.Tensor) -> bool:
        """p may be cut into flat pieces in memory order: an element-wise optimizer, a dense param and
        host states laid out like it (so the same flat range of each pairs the same elements)."""
        loc = local(p)
        # cached until host layouts change (_version) or the param's own layout does
        key = (self._version, loc.shape, loc.stride())
        hit = self._split_cache.get(p)
        if hit is not None and hit[0] == key:
            return hit[1]
        entry = self._host.get(p)
        ok = (
            self._elementwise
            and hoststate.is_dense(loc)
            and (entry is None or all(hoststate.same_layout(t, loc) for t in entry.locals))
        )
        self._split_cache[p] = (key, ok)
        return ok

    def _prepare(self, params: list[torch.Tensor], groups: list[int]) -> _Prepared:
        for p in params:  # resident params keep device states: nothing to check for them
            if p not in self._resident and not self._check_host(p):
                self._cache_host(p)
        flat = [self._splittable(p) for p in params]
        # A grad laid out unlike its split param is gathered piece by piece into the slot (never whole).
        gather = [f and _unlike(local(p.grad), local(p)) for p, f in zip(params, flat)]
        key = (tuple(map(id, params)), tuple(groups), tuple(gather), self._version)
        if self._prepared is not None and self._prepared.key == key:
            return self._prepared
        dev = device.torch_device(self._device)
        sizes = []
        for i, p in enumerate(params):
            nbytes, regions = self._state_bytes(p, groups[i])
            if gather[i]:
                nbytes += local(p).numel() * p.grad.element_size()
                regions += 1
            sizes.append(ParamSize(i, local(p).numel(), nbytes, flat[i], regions))
        chunk_bytes = None if self.chunk_mb is None else int(self.chunk_mb * MiB)
        plan = make_plan(
            sizes,
            times=self.swap_optimizer_times,
            chunk_bytes=chunk_bytes,
            resident_bytes=int(self.resident_mb * MiB),
            align=DEFAULT_ALIGN,
        )
        # A splittable param the plan left whole is stepped as itself, with states shaped like it: no
        # per-step flat views of it or its grad (DTensor and gathered ones keep the flat path).
        pieces_of = Counter(pc.index for c in plan.chunks for pc in c.pieces)
        flat = [
            f and (pieces_of[i] > 1 or gather[i] or hoststate.is_dtensor(params[i])) for i, f in enumerate(flat)
        ]
        resident = [params[i] for i in plan.resident]
        self._resident = set(resident)
        for p in resident:
            self._ensure_resident(p, dev)
        for i in range(len(params)):  # a param that left the resident set goes back to the host
            if i not in plan.resident and params[i] not in self._host and self.state.get(params[i]):
                self._cache_host(params[i], quiet=True)
        regions = [self._regions(chunk.pieces, params, flat, gather) for chunk in plan.chunks]
        slot_bytes = max((r[-1].offset + r[-1].nbytes for r in regions if r), default=0)
        last_chunk = {params[i]: k for i, k in plan.last_chunk.items()}
        key = (tuple(map(id, params)), tuple(groups), tuple(gather), self._version)
        if len(self._arenas):
            self._arenas.prune([t for e in self._host.values() for t in e.locals])
        runs = [self._arenas.runs(r) for r in regions]
        covered = [frozenset(i for run in rs for i in run.regions) for rs in runs]
        h2d_bytes = [sum(r.nbytes for r in rs if r.host is not None) for rs in regions]
        covered_bytes = [sum(rs[i].nbytes for i in cov) for rs, cov in zip(regions, covered)]
        self._prepared = _Prepared(
            key, params, groups, flat, plan, regions, slot_bytes, resident, last_chunk, runs, covered,
            h2d_bytes, covered_bytes,
        )
        logger.debug(
            "swapopt plan: {} params, {} chunks, budget {:.2f} MiB, slot {:.2f} MiB, {} resident, {} merged copies",
            len(params), len(plan.chunks), plan.budget / MiB, slot_bytes / MiB, len(resident), sum(map(len, runs)),
        )  # fmt: skip
        return self._prepared

    def _probe(self, p: torch.Tensor, gi: int) -> tuple[int, tuple] | None:
        loc = local(p)
        key = (gi, loc.dtype, loc.dim(), loc.device.type)
        if key not in self._probe_cache:
            self._probe_cache[key] = hoststate.probe_states(self.optimizer, self.param_groups[gi], p, self._step_fn)
        return self._probe_cache[key]

    def _state_bytes(self, p: torch.Tensor, gi: int) -> tuple[int, int]:
        """Swapped state bytes of p and their count: exact once it has states, probed (or guessed) before."""
        entry = self._host.get(p)
        if entry is not None:
            return entry.nbytes, len(entry.keys)
        if self.state.get(p):  # resident: states already on the device
            swapped = [v for k, v in self.state[p].items() if is_swapped_state(p, k, v)]
            return sum(hoststate.state_nbytes(v) for v in swapped), len(swapped)
        loc = local(p)
        probed = self._probe(p, gi)
        if probed is None:  # Adam-like guess: two states of the param's dtype
            name = type(self.optimizer).__name__
            logger.debug("swapopt: could not probe {}; assuming two param-like states", name)
            return loc.numel() * 2 * loc.element_size(), 2
        return loc.numel() * probed[0], len(probed[1])

    def _preallocate(self, prep: _Prepared) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Pinned host tensors for the param-shaped states an element-wise optimizer will create this
        step for params that have none yet (known from the probe)."""
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        if not self._elementwise:
            return out
        for chunk in prep.plan.chunks:
            # Whole params whose states are all param-shaped go into one arena per chunk, at the offsets
            # their regions take in the slot, so the chunk's states later move in one copy (swapopt.arena).
            placed: list[tuple[torch.Tensor, str, torch.dtype, int]] = []
            end = 0
            for piece in chunk.pieces:
                i = piece.index
                p = prep.params[i]
                if p in out or p in self._host or p in self._resident or self.state.get(p):
                    continue
                probed = self._probe(p, prep.groups[i])
                if probed is None:
                    continue
                loc = local(p)
                whole = piece.start == 0 and piece.stop == loc.numel()
                gathered = prep.flat[i] and p.grad is not None and not hoststate.same_layout(local(p.grad), loc)
                if not whole or gathered or not all(shaped for _, _, shaped in probed[1]):
                    out[p] = {key: new_host_like(p, dtype) for key, dtype, shaped in probed[1] if shaped}
                    continue
                out[p] = {}
                for key, dtype, _ in probed[1]:
                    size = itemsize(dtype)
                    if end % size:  # packed without padding: a misaligned dtype starts a new arena
                        self._place(placed, end, out)
                        placed, end = [], 0
                    placed.append((p, key, dtype, end))
                    end += loc.numel() * size
            self._place(placed, end, out)
        return out

    def _place(self, placed: list, nbytes: int, out: dict) -> None:
        if placed:
            base = self._arenas.allocate(nbytes)
            for p, key, dtype, offset in placed:
                out[p][key] = self._arenas.place(base, offset, p, dtype)

    def _regions(self, pieces, params: list[torch.Tensor], flat: list[bool], gather: list[bool]) -> list[_Region]:
        """Slot layout of one chunk: one region per (piece, host state), in piece order, plus one for
        the gathered grad of a piece whose grad is laid out unlike its param."""
        regions: list[_Region] = []
        offset = 0

        def add(r: _Region) -> None:
            nonlocal offset
            if regions and self._arenas.adjacent(regions[-1].host, r.host):
                # packed like its arena, so both move in one copy (swapopt.arena); never more than padded
                r.offset = regions[-1].offset + regions[-1].nbytes
            regions.append(r)
            offset = -(-(r.offset + r.nbytes) // _SLOT_ALIGN) * _SLOT_ALIGN

        for pos, piece in enumerate(pieces):
            p = params[piece.index]
            entry = self._host.get(p)
            for key, stored, loc in zip(entry.keys, entry.stored, entry.locals) if entry is not None else ():
                if flat[piece.index]:
                    host = hoststate.flat_view(loc)[piece.start : piece.stop]
                    shape, stride, layout = None, None, None
                else:
                    host = loc
                    shape, stride = tuple(loc.shape), tuple(loc.stride())
                    layout = stored if hoststate.is_dtensor(stored) else None
                nbytes = host.numel() * host.element_size()
                add(_Region(pos, key, offset, nbytes, host.dtype, shape, host, layout, stride))
            if gather[piece.index]:
                g = p.grad
                add(_Region(pos, _GRAD, offset, piece.numel * g.element_size(), g.dtype, None, None, None, None))
        return regions

    # ----- pipeline stages ---------------------------------------------------------------------
    def _region_view(self, r: _Region, slot: torch.Tensor | None) -> torch.Tensor:
        """The slot memory of region r, typed and laid out like the host tensor it mirrors."""
        if slot is None or r.nbytes == 0:  # nothing to stage (zero-element states): an empty tensor
            shape = r.shape if r.shape is not None else (0,)
            stride = r.stride if r.stride is not None else (1,)
            return torch.empty_strided(shape, stride, dtype=r.dtype, device=device.torch_device(self._device))
        v = slot[r.offset : r.offset + r.nbytes].view(r.dtype)
        if r.shape is not None:
            v = v.as_strided(r.shape, r.stride)
        return v

    def _swap_in(self, prep: _Prepared, k: int) -> tuple[list[dict[str, tuple]], int]:
        """Per piece of chunk k: {key: (value the optimizer sees, slot view, host view the swap-out
        writes)}, with the H2D copies filling the slot views queued."""
        chunk = prep.plan.chunks[k]
        views = _ChunkViews({} for _ in chunk.pieces)
        slot = self.operate.slot(k)
        covered = prep.covered[k]
        # a run's bytes: one copy per direction for the regions it covers
        views.runs = [(run.host, slot[run.offset : run.offset + run.nbytes]) for run in prep.runs[k]] if slot is not None else []
        copies = [(dev, host) for host, dev in views.runs]
        for i, r in enumerate(prep.regions[k]):
            v = self._region_view(r, slot)
            moved = i in covered and slot is not None
            host = None if moved else r.host  # None: the swap-out leaves it to the run
            views[r.piece][r.key] = (wrap_like(r.layout, v) if r.layout is not None else v, v, host)
            if host is not None and r.nbytes:
                copies.append((v, host))
        self.operate.swap_in(k, copies)
        return views, prep.h2d_bytes[k]

    def _run_inner(self, chunk_groups: dict[int, list[torch.Tensor]], chunk_state: Any, kwargs: dict) -> None:
        """One inner step over the given params and state; the shared groups and state are restored after.
        The step sees copies of the groups: a write to a group-level value would be lost, so it raises."""
        inner = self.optimizer
        order = sorted(chunk_groups)
        hyper = self._hyper
        groups = [dict(self.param_groups[gi], params=chunk_groups[gi], **hyper.get(gi, {})) for gi in order]
        inner.param_groups, inner.state = groups, chunk_state
        try:
            self._step_fn(inner, **kwargs)
        finally:
            inner.param_groups, inner.state = self.param_groups, self.state
        for gi, copy in zip(order, groups):
            orig = self.param_groups[gi]
            for key, value in copy.items():
                if key != "params" and (key not in orig or orig[key] is not value) and hyper.get(gi, {}).get(key) is not value:
                    raise RuntimeError(
                        f"{type(inner).__name__}.step wrote param_groups[{gi}][{key!r}]: SwapOptimizer steps each "
                        "chunk of params with its own copy of the group, so group-level writes (a step counter, a "
                        "norm over all params) would be lost or wrong; such an optimizer is not per-param and "
                        "cannot be swapped"
                    )

    def _update_resident(self, prep: _Prepared, kwargs: dict) -> None:
        with self.operate.updating(None), torch.profiler.record_function("swapopt.update[resident]"):
            chunk_groups: dict[int, list[torch.Tensor]] = defaultdict(list)
            for i in prep.plan.resident:
                chunk_groups[prep.groups[i]].append(prep.params[i])
            # the real dicts: resident states are updated where they live
            chunk_state = self._real_states(prep.params[i] for i in prep.plan.resident)
            self._run_inner(chunk_groups, chunk_state, kwargs)
            self._keep_new_states(chunk_state)

    def _piece_input(
        self, prep: _Prepared, piece, views: dict[str, tuple]
    ) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """The tensor the inner optimizer steps for one piece and its state dict (None when p has no
        state entry): swapped states are the device views in ``views``; scalar states are the param's
        own when the piece is the whole param (restored from a per-chunk snapshot if its update fails,
        see _snapshot_scalars), clones for a piece of a split param (written back once it is done)."""
        p = prep.params[piece.index]
        whole = not prep.flat[piece.index] or (piece.start == 0 and piece.stop == local(p).numel())
        if prep.flat[piece.index]:  # a leaf view of the flat range in memory order, its grad likewise
            t = hoststate.flat_view(local(p).detach())[piece.start : piece.stop]
            g = local(p.grad)
            if _GRAD in views:  # laid out unlike p: gather the piece's elements in p's memory order
                buf = views[_GRAD][1]
                order = hoststate.memory_order(local(p))
                hoststate.gather_range(buf, g.permute(order), piece.start, piece.stop)
                t.grad = buf
            else:
                t.grad = hoststate.flat_view(g)[piece.start : piece.stop]
        else:
            t = p
        if p not in self.state:
            return t, None
        pst: dict[str, Any] = {}
        for key, value in self.state[p].items():
            if key in views:
                pst[key] = views[key][0]
            elif isinstance(value, torch.Tensor):
                pst[key] = value if whole else value.clone()
            else:
                pst[key] = value
        return t, pst

    def _piece_output(
        self, prep: _Prepared, piece, t: torch.Tensor, pst: dict[str, Any], views: dict[str, tuple], pending: dict
    ) -> tuple[list, list, dict[str, Any] | None]:
        """After the inner step of one piece: its (host, device) swap-out copies, the device states it
        created (to keep alive until copied), and its scalar states when it is the param's last piece."""
        p = prep.params[piece.index]
        flat = prep.flat[piece.index]
        copies, hold, scalars = [], [], {}
        for key, value in pst.items():
            if key in views:
                _, slot_view, host = views[key]
                new = local(value)
                if new.data_ptr() != slot_view.data_ptr():
                    slot_view.copy_(new)  # the optimizer replaced the tensor instead of updating it
                if slot_view.numel() and host is not None:  # None: a run of the chunk copies it out
                    copies.append((host, slot_view))
            elif is_swapped_state(t, key, value):  # created by the optimizer this step
                src = local(value)
                host = local(self._pending_host(pending, p, key, value, flat))
                dst = hoststate.flat_view(host)[piece.start : piece.stop] if flat else host
                if src.numel():
                    copies.append((dst, src))
                    hold.append(src)
            else:
                scalars[key] = value
        last = not flat or piece.stop == local(p).numel()
        return copies, hold, (scalars if last else None)

    def _publish(self, p: torch.Tensor, scalars: dict[str, Any] | None, pending: dict) -> None:
        """p is fully stepped: its scalar states and the host states created this step become its state.
        ``scalars`` None: the inner optimizer made no state entry for p, so none is made (as in torch)."""
        created = pending.pop(p, None)
        if scalars is None and not created and p not in self.state:
            return
        st = self.state[p]
        st.update(scalars or {})
        if created:
            st.update(created)
            self._host.pop(p, None)
            self._version += 1

    def _update_and_swap_out(
        self, prep: _Prepared, k: int, views: list[dict[str, tuple]], pending: dict, kwargs: dict, progress: dict
    ) -> int:
        """Run the inner optimizer on chunk k's pieces, then queue their swap-out. Returns D2H bytes.
        ``progress`` tracks the stage reached for the failure path (Note [failure semantics])."""
        op = self.operate
        chunk = prep.plan.chunks[k]
        progress["stage"] = ("input", k)
        chunk_groups: dict[int, list[torch.Tensor]] = defaultdict(list)
        chunk_state: defaultdict = defaultdict(dict)
        targets: list[torch.Tensor] = []
        with op.updating(k), torch.profiler.record_function(f"swapopt.update[{k}]"):
            for pos, piece in enumerate(chunk.pieces):
                t, pst = self._piece_input(prep, piece, views[pos])
                if pst is not None:
                    chunk_state[t] = pst
                chunk_groups[prep.groups[piece.index]].append(t)
                targets.append(t)
            progress["scalars"] = self._snapshot_scalars(prep, chunk, chunk_state, targets)
            progress["stage"] = ("update", k)
            self._run_inner(chunk_groups, chunk_state, kwargs)
            progress["stage"] = ("output", k)
            progress["chunk"] = (targets, chunk_state, views)
            copies, hold, finals = self._chunk_output(prep, k, targets, chunk_state, views, pending)
            # a run also moves padding: count the bytes of the states it carries
            merged = len(views.runs) if isinstance(views, _ChunkViews) else 0
            nbytes = sum(src.numel() * src.element_size() for _, src in copies[merged:])
            nbytes += prep.covered_bytes[k] if merged else 0
        op.swap_out(k, copies, hold)
        for p, scalars in finals:  # the param is fully stepped: publish its scalars and new host states
            self._publish(p, scalars, pending)
        progress["stage"] = ("done", k)
        progress.pop("chunk", None)
        progress.pop("scalars", None)
        return nbytes

    def _snapshot_scalars(self, prep: _Prepared, chunk, chunk_state: dict, targets: list) -> list:
        """(own tensors, copies) of the scalar tensor states the chunk's update steps in place: one copy
        per device and dtype (a foreach op), not a clone per param, so that a failing update can put
        them back (Note [failure semantics])."""
        groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for piece, t in zip(chunk.pieces, targets):
            pst = chunk_state.get(t)
            if not pst:
                continue
            own = self.state[prep.params[piece.index]]
            for key, value in pst.items():
                if isinstance(value, torch.Tensor) and own.get(key) is value:
                    groups[(value.device, value.dtype)].append(value)
        return [(ts, torch._foreach_mul(ts, 1)) for ts in groups.values()]

    def _chunk_output(self, prep: _Prepared, k: int, targets: list, chunk_state: dict, views: list, pending: dict):
        """Swap-out copies, device tensors to hold, and (param, scalars) of params whose last piece this is."""
        copies, hold, finals = list(getattr(views, "runs", ())), [], []
        for pos, piece in enumerate(prep.plan.chunks[k].pieces):
            t = targets[pos]
            entered = t in chunk_state
            c, h, scalars = self._piece_output(prep, piece, t, chunk_state[t] if entered else {}, views[pos], pending)
            copies += c
            hold += h
            if scalars is not None:
                finals.append((prep.params[piece.index], scalars if entered else None))
        return copies, hold, finals

    def _pending_host(self, pending: dict, p: torch.Tensor, key: str, value: torch.Tensor, flat: bool) -> torch.Tensor:
        """Host tensor for a state the optimizer created this step: allocated once, reused every step."""
        states = pending.setdefault(p, {})
        if key not in states:
            src = local(value)
            pre = self._pre_hosts.get(p, {}).get(key)
            if pre is not None and local(pre).dtype == src.dtype and (flat or local(pre).shape == src.shape):
                states[key] = pre
            elif flat:
                if src.dim() != 1:
                    raise RuntimeError(
                        f"{type(self.optimizer).__name__} created state {key!r} of shape {tuple(src.shape)} for a "
                        "flat piece, so it is not element-wise; it cannot be split across chunks"
                    )
                states[key] = new_host_like(p, src.dtype)
            else:
                states[key] = hoststate.pinned_empty_like(value)
        return states[key]
