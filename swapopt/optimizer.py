"""SwapOptimizer: a torch.optim.Optimizer whose states live in pinned host memory between steps.

step() streams the states through the device in chunks (see swapopt.operate for the stream and event
choreography, swapopt.plan for the chunking) and runs the wrapped optimizer's own step on each chunk,
so the update is bitwise the one the unwrapped optimizer computes.

This module keeps the public class: the torch.optim.Optimizer surface, the constructor's checks and
``step`` handing off. The host layout and plan live in swapopt.layout, one step's run in
swapopt.pipeline, the failure path in swapopt.recovery (Note [failure semantics]) and every use of
private torch internals in swapopt.internals.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch
from loguru import logger
from pydantic import BaseModel

import device
from swapopt import checkpoint, config, copying, eviction, graphed, internals, npu, perparam, pipeline, resident_auto
from swapopt.hoststate import local
from swapopt.context import StepContext
from swapopt.layout import MiB, HostLayout
from swapopt.masters import Masters
from swapopt.operate import SwapOptimizerOperate
from swapopt.overlap import ForwardWaits


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
    # Pinned host memory of the state arenas now: asked for, and taken (torch_npu rounds each allocation up
    # to a power of two unless PYTORCH_NPU_ALLOC_CONF=pin_memory_expandable_segments:True; swapopt.npu).
    pinned_requested_bytes: int = 0
    pinned_bytes: int = 0
    # Host seconds spent pinning the arenas so far (Note [arena memory] in swapopt.arena; modeled on the simulator).
    pin_seconds: float = 0.0
    # The resident budget the last step was planned with (bytes): resident_mb, or what resident_mb="auto" measured.
    resident_budget_bytes: int = 0


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
    reason = perparam.refusal(cls)
    if reason is not None:
        raise ValueError(reason)
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
            "streamed in chunks; use torch.optim.AdamW(..., foreach=True) under SwapOptimizer"
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



# The live wrapper of each inner optimizer: two wrappers of one optimizer would each stream its states
# through the device on their own streams, one reading host states the other is still writing back.
_WRAPPERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref] = weakref.WeakKeyDictionary()


def _claim(optimizer: torch.optim.Optimizer, wrapper: "SwapOptimizer") -> None:
    """Make ``wrapper`` the one SwapOptimizer of ``optimizer``, refusing a second one while the first lives."""
    ref = _WRAPPERS.get(optimizer)
    first = ref() if ref is not None else None
    if first is not None and first is not wrapper:
        raise ValueError(
            f"this {type(optimizer).__name__} is already wrapped by another SwapOptimizer (id {id(first):#x}); "
            "two wrappers of one optimizer would both swap its states and race on them. Step the first "
            "wrapper, or drop it (del) before wrapping the optimizer again"
        )
    _WRAPPERS[optimizer] = weakref.ref(wrapper)


def _has_meta_params(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.is_meta for group in optimizer.param_groups for p in group["params"])


class SwapOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that its states stay in pinned host memory between steps.

    ``swap_optimizer_times``: about this many chunks per step (swapopt.plan); ``chunk_mb``: fixed chunk budget (MiB), overrides it;
    ``slots``: staging buffers (3 lets swap-in, update and swap-out overlap); ``resident_mb``: states
    that fit stay on the device and are stepped first (``"auto"``: as many as the device's spare memory holds,
    measured at each step, swapopt.resident_auto); ``per_param``: vouch that an optimizer from
    outside torch.optim is per-param (see swapopt.perparam), so it is accepted. param_groups, state and defaults are the
    wrapped optimizer's own objects.

    ``overlap_forward``: run the updates on a dedicated stream and let the next forward start under
    them (swapopt.overlap): step() returns without the compute stream waiting, and each module's
    forward waits only for its own params' updates. Needs ``opt.attach(model)`` (after ``fully_shard``
    under FSDP2); code that reads params or states outside a module's forward (EMA, norms, saving the
    model) calls ``opt.wait_for_update()`` first. ``zero_grad(set_to_none=False)`` zeroes grads in
    place, so it first makes the current stream wait for the update (correct, but loses the overlap).

    ``prefetch``: swap in the first ``slots - 1`` chunks of the next step ahead of step(), right after
    the model's forward (a forward hook that ``opt.attach(model)`` registers; without attach, step()
    works but never prefetches by itself), so they stream in under the loss and the backward and the
    first update starts at once. ``opt.prefetch()`` does the same by hand, knob or not. The step uses
    the prefetched slots only if it runs the very plan they were made for; otherwise (load_state_dict,
    invalidate(), offload(), add_param_group, a param that lost its grad) they are dropped and the step
    swaps in as usual. Memory: the staging (slots x slot bytes) is held from the prefetch to the end of
    the step instead of during step() only, a prefetch budget on top of the step's (slots + 1) x chunk
    (with gradient accumulation: from the first micro-batch's forward on).
    Host states must not be written in place between a prefetch and the step (load_state_dict and the
    other swapopt entry points drop the prefetch first).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, **knobs: Any) -> None:
        settings = knobs.pop("settings", None)
        if settings is None:
            settings = config.settings_from(knobs)
        elif knobs:
            raise TypeError("give the swap knobs either as settings=SwapSettings(...) or as keywords, not both")
        _refuse(optimizer, settings.per_param)
        auto = resident_auto.fraction_of(settings.resident_mb)
        if settings.master_weights and (auto is not None or settings.resident_mb > 0):
            raise ValueError(
                f"master_weights=True with resident_mb={settings.resident_mb!r} is not supported: resident params "
                "would need fp32 masters in device memory; use one or the other"
            )
        self.optimizer = optimizer
        self.settings = settings
        self._ready = False
        # Optimizer.__init__ sets up hooks and the step wrapper; it gets copies of the groups, then the
        # wrapper takes the inner optimizer's own objects so schedulers, clipping and DCP see one truth.
        super().__init__([dict(g) for g in optimizer.param_groups], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults  # `state` is a property over the inner's dict (Note [reading states])
        self.operate = SwapOptimizerOperate(settings.slots, overlap=settings.overlap_forward)
        self._forward_waits = ForwardWaits(self.operate)
        # What the lower layers get instead of this wrapper (swapopt.context). step_fn is the inner class's
        # raw step (Note [raw step]); one attribute, so that fault injection can wrap it (_step_fn below).
        # With resident_mb="auto" the lower layers get the measured budget as the number of MiB a fixed
        # resident_mb gives (0 until the first step measures it; Note [resident auto] in swapopt.resident_auto).
        self._auto = None if auto is None else resident_auto.AutoResident(
            auto, settings.slots, settings.swap_optimizer_times, settings.chunk_mb,
            overlaps=settings.overlap_forward or settings.prefetch,
        )
        ctx_settings = settings if auto is None else settings.model_copy(update={"resident_mb": 0.0})
        self._ctx = StepContext(
            optimizer, ctx_settings, self.operate, internals.raw_step(optimizer), Masters(settings.master_weights)
        )
        self._layout = HostLayout(self._ctx)  # host states, arenas and the plan (swapopt.layout)
        self._stats = SwapStats()
        # step_graph (Note [graphed step] in swapopt.graphed): the captured step, the plan whose last step ran
        # steadily (the next one of it is captured), captures in a row; why capturing stopped is the context's
        # (_graph_off), which the planner reads too
        self._graphed: graphed.GraphedStep | None = None
        self._steady: Any = None
        self._checked: Any = None  # the plan why_not last looked at
        self._captures = 0
        _claim(optimizer, self)
        self._ready = True
        self._ctx.device = device.get_device()
        if self._ctx.device != "cpu" and not _has_meta_params(optimizer):
            # Meta params have no data to swap: their states stay as torch made them, so the inner optimizer
            # gives torch's own error or result for them when it steps (docs/optimizer.md).
            self._layout.adopt_existing()
        if self._ctx.device == "npu":  # fused kernels torch_npu lacks, foreach off on older chips (swapopt.npu)
            npu.check_optimizer(optimizer)

    # The knobs, read-only (a changed knob is a new optimizer; SwapSettings documents each).
    swap_optimizer_times = property(lambda self: self.settings.swap_optimizer_times)
    chunk_mb = property(lambda self: self.settings.chunk_mb)
    resident_mb = property(lambda self: self.settings.resident_mb)
    per_param = property(lambda self: self.settings.per_param)
    prefetch_enabled = property(lambda self: self.settings.prefetch)
    master_weights = property(lambda self: self.settings.master_weights)

    @property
    def _step_fn(self) -> Callable[..., Any]:
        return self._ctx.step_fn

    @_step_fn.setter
    def _step_fn(self, fn: Callable[..., Any]) -> None:
        self._ctx.step_fn = fn

    # ----- torch.optim.Optimizer surface -------------------------------------------------------
    # Note [reading states]
    # A swapped step returns with its last chunks' swap-outs in flight: D2H copies still writing the pinned host
    # states that opt.state[p][key] are views of (the arena). Host code reading them before the copies land reads a
    # mix of two steps, on hardware as on the simulator (whose sanitizer reports it, naming 'swapopt.swap_out').
    # So `SwapOptimizer.state` is a property: fetching it blocks the host until the swap-outs in flight are done
    # (wait_for_swap_out) and orders the current stream after pending updates (wait_for_update: resident states
    # under overlap_forward are updated on the update stream), then returns the inner optimizer's own dict, so
    # `opt.state[p]["exp_avg"]` right after step() reads the stepped values. The wait falls on the reader only:
    # swapopt's own step, layout and pipeline read the inner optimizer's dict (StepContext.state), never this
    # property, so a step never waits on itself; between steps the wait is on events already done, and cheap.
    # What it cannot cover: a reference fetched before a step and read after it (the mapping `st = opt.state`, a
    # param's dict `opt.state[p]`, a state tensor, or `opt.optimizer.state`) reads host memory directly, and a
    # CPU load from pinned memory has no point at which anything could wait. Such a holder calls
    # `opt.wait_for_swap_out()` after the step, before reading. state_dict() waits itself and its aliases follow
    # the step (Note [state dict aliases] in swapopt.checkpoint); deepcopy and pickle wait (swapopt.copying).
    # Writing through `opt.state` between a prefetch and the step stays the caller's to avoid (class docstring).
    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state dict, read after the last step's swap-outs (Note [reading states])."""
        if self.__dict__.get("_ready"):
            self.wait_for_swap_out()
            self.wait_for_update()
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        if not self.__dict__.get("_ready"):
            return  # Optimizer.__init__'s fresh dict: the wrapper shares the inner optimizer's instead
        # Rebinding replaces the inner optimizer's states (one truth): none of the old ones may be in flight.
        self.wait_for_update()
        self.wait_for_swap_out()
        self.optimizer.state = value
        self.invalidate()  # the cached host layouts describe the old tensors

    @property
    def _step_supports_amp_scaling(self) -> bool:  # GradScaler's private flag (swapopt.internals)
        # With master weights the step unscales the masters' fp32 grads itself when the kernel does not
        # (GradScaler.unscale_ refuses the fp16 grads it would see): Note [master weights].
        return self.settings.master_weights or self._kernel_unscales()

    def _kernel_unscales(self) -> bool:
        """The wrapped optimizer's kernel unscales and skips inf steps given grad_scale/found_inf."""
        # On NPU, fused AdamW's kernel ignores them (swapopt.npu): the scaler unscales and skips itself.
        if device.get_device() == "npu" and npu.ignores_amp_scaling(self.optimizer):
            return False
        return internals.supports_amp_scaling(self.optimizer)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_ready", False):  # called by Optimizer.__init__ on the copies
            return super().add_param_group(param_group)
        self.wait_for_update()
        self.operate.discard_prefetch()  # made for the old plan
        self.optimizer.add_param_group(param_group)
        self._layout.prepared = None
        if self.operate.overlap and self._forward_waits.attached:
            unowned = self._forward_waits.unattached(self.optimizer.param_groups[-1]["params"])
            if unowned:
                warnings.warn(
                    f"swapopt: {unowned} param(s) of the new group belong to no model passed to attach(): with "
                    "overlap_forward, no forward waits for their update. Call opt.attach(module) with the "
                    "module that owns them",
                    stacklevel=2,
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # zeroed in place: the update must be done reading them
            self.wait_for_update()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.settings.model_dump().items())
        return f"SwapOptimizer({self.optimizer!r}, {knobs})"

    def __getstate__(self) -> dict[str, Any]:
        # The inner optimizer and the settings; the copy builds its own streams, staging and pinned states.
        return copying.getstate(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        copying.setstate(self, state, SwapOptimizer.__init__)

    def state_dict(self) -> dict[str, Any]:
        self.wait_for_update()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_for_update()
        self.operate.discard_prefetch()  # its copies read the host states the load writes
        checkpoint.load_state_dict(self, state_dict)
        # Optimizer.load_state_dict rebinds state/param_groups: keep sharing the inner's objects (`state` is
        # the inner's by construction, Note [reading states]).
        self.param_groups = self.optimizer.param_groups
        self.invalidate()

    def offload(self, empty_cache: bool = True) -> None:
        """Free the device memory this optimizer holds between steps (staging buffers, resident states, device
        step scalars), for another engine's phase (an RL rollout); ``empty_cache`` also returns the
        allocator's cached blocks to the device. See swapopt.offload."""
        self.wait_for_update()  # the other phase reads the params (overlap_forward: an update may be pending)
        self.wait_for_swap_out()  # in-flight D2H copies still read the staging buffers
        self.release_staging()
        self._drop_graph()  # its pool holds the staging it was captured with
        eviction.evict(self)
        if empty_cache:
            eviction.device_call("empty_cache")

    def onload(self) -> None:
        """Undo offload(): device step scalars move back; swapped states stay on the host and the next step
        streams them in (resident ones become resident again)."""
        eviction.restore_scalars(self)

    # ----- swapopt surface -------------------------------------------------------------------
    @property
    def overlap_forward(self) -> bool:
        return self.operate.overlap

    def attach(self, model: torch.nn.Module) -> None:
        """Register the forward pre-hooks that order each module's forward after the update of its own
        params (``overlap_forward``; harmless without it) and, with ``prefetch``, a forward hook on
        ``model`` that calls prefetch() after each forward run with grad enabled. Idempotent; a second
        model adds its modules. Under FSDP2, call it after ``fully_shard``."""
        self._forward_waits.attach(model, after_forward=_prefetch_hook(self) if self.prefetch_enabled else None)

    def prefetch(self) -> bool:
        """Swap in the first ``slots - 1`` chunks of the next step now, on the H2D stream, ordered after
        the current stream's work so far (call it after the forward: the copies run under the backward).
        Needs the plan of an earlier step (a no-op before the first step, or while the last plan is known
        to be stale); idempotent until the next step. Returns whether copies were issued. The staging
        is held until the step (see the class docstring on memory)."""
        if self.operate.prefetched is not None:
            return False
        layout = self._layout
        prep = layout.prepared
        if prep is None or not layout.unchanged_since(prep):  # none yet, or the next step plans anew
            return False
        mode = device.get_device()
        if mode == "cpu" or mode != self._ctx.device or self.operate.mod is None:
            return False
        self.operate.bind(device.get_torch_device_module(self._ctx.device))
        return pipeline.prefetch(self._ctx, layout, prep)

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
        """Wait for in-flight swap-outs and free the staging held on the device, a prefetch's included."""
        self.operate.release_staging()

    def invalidate(self) -> None:
        """Forget cached host layouts and the plan (call after replacing state tensors by hand); a
        prefetch made for that plan is dropped."""
        self.operate.discard_prefetch()
        self._layout.invalidate()
        self._drop_graph()

    def _drop_graph(self) -> None:
        if self._graphed is not None:
            self._graphed.drop()
            self._graphed = None
        self._steady = None

    def swap_stats(self, wait: bool = True) -> SwapStats:
        """Counters of the last successful step; ``failed`` and ``last_error`` say whether the step after it
        raised. ``step_ms`` makes the host wait for the step's last swap-out (which, with overlap_forward,
        comes after its last update); ``wait=False`` leaves it None and never waits: read it later from
        ``operate.last_step_events()``. With a prefetch the step's first swap-ins ran before its entry, so
        they are counted in ``h2d_bytes`` (once) but not timed in ``step_ms``."""
        arenas = self._layout.arenas
        stats = self._stats.model_copy(
            update={"pinned_requested_bytes": arenas.nbytes(), "pinned_bytes": arenas.pinned_bytes(),
                    "pin_seconds": arenas.pin_seconds}
        )
        if stats.steps and wait:
            stats.step_ms = self.operate.step_ms()
        return stats

    # ----- step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        # torch_npu's GradScaler passes itself to an optimizer that claims AMP support and leaves the
        # unscale and the inf check to it (Note [grad_scaler kwarg] in swapopt.internals).
        scaler = kwargs.pop("grad_scaler", None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            if scaler is not None:
                return self._scaled_step(scaler, loss, kwargs)
            return self._step(loss, kwargs)
        except BaseException:
            # Note [failure semantics]: a prefetch is only a device copy of host states; the next step
            # swaps in afresh from the host states this one left.
            self.operate.discard_prefetch()
            raise

    def _scaled_step(self, scaler: Any, loss: Any, kwargs: dict[str, Any]) -> Any:
        """step() given ``grad_scaler``: the inner kernel unscales and skips on inf where it can (GradScaler's
        grad_scale/found_inf); where it cannot (swapopt.npu), the grads are unscaled here and an inf step is
        skipped, leaving params and states as they were."""
        if self._step_supports_amp_scaling:
            with internals.scaler_attributes(self, scaler):
                return self._step(loss, kwargs)
        if internals.scaler_unscale_found_inf(self, scaler):
            return None
        return self._step(loss, kwargs)

    def _step(self, loss: Any, kwargs: dict[str, Any]) -> Any:
        inner = self.optimizer
        if self.operate.overlap and not self._forward_waits.attached:
            raise RuntimeError(
                "SwapOptimizer(overlap_forward=True) needs the model: call opt.attach(model) once before the "
                "first step (after fully_shard under FSDP2), so that each forward waits for its params' update"
            )
        masters = self._ctx.masters
        scaled = [k for k in internals.AMP_ATTRIBUTES if getattr(self, k, None) is not None]
        if masters.enabled and scaled and not self._kernel_unscales():
            # Note [master weights]: GradScaler left the unscale and the inf check to this step.
            found_inf = getattr(self, "found_inf", None)
            if found_inf is not None and found_inf.item():  # as the scaler's _maybe_opt_step: no step at all
                return loss
            grad_scale = getattr(self, "grad_scale", None)
            if grad_scale is not None:
                masters.inv_scale = internals.inverse_scale(grad_scale)
                self._unscale_own_masters(masters.inv_scale)
            lend: Any = contextlib.nullcontext()  # the kernel must not see them: it would refuse them
        else:
            lend = internals.lend_amp_attributes(self, inner)
        try:
            return self._step_lent(loss, kwargs, lend)
        finally:
            masters.inv_scale = None

    def _unscale_own_masters(self, inv_scale: torch.Tensor) -> None:
        """Unscale, in place, the grads of the params that are their own masters (not low-precision), as
        GradScaler.unscale_ would over the masters; low-precision ones are unscaled after their upcast."""
        seen: set[int] = set()
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in seen and not self._ctx.masters.wanted(p):
                    seen.add(id(p))
                    grads.append(p.grad)
        internals.amp_unscale_(grads, inv_scale)

    def _step_lent(self, loss: Any, kwargs: dict[str, Any], lend: Any) -> Any:
        inner = self.optimizer
        args, kwargs = internals.run_step_pre_hooks(inner, (), kwargs)  # once per step (Note [hook replay])
        with lend:
            # With overlap_forward the update reads step-time copies: scaler.update() may change them at once.
            for k in internals.AMP_ATTRIBUTES:
                if hasattr(inner, k):
                    setattr(inner, k, self.operate.snapshot(getattr(inner, k)))
            mode = device.get_device()
            if mode != self._ctx.device:
                self._ctx.device = mode
                self.invalidate()
            if mode == "cpu":
                if self._ctx.warn_once(
                    "cpu",
                    f"swapopt: no accelerator or simulator is active, so SwapOptimizer steps "
                    f"{type(inner).__name__} in place and its states stay where torch puts them",
                ):
                    logger.info("swapopt: no accelerator, stepping {} in place", type(inner).__name__)
                if self._ctx.masters.enabled:
                    if args:
                        raise TypeError("SwapOptimizer.step takes the closure and keyword arguments only")
                    params, groups, by_group = self._layout.active()
                    by_group = {gi: list(ps) for gi, ps in by_group.items()}
                    for p, gi in zip(params, groups):
                        by_group.setdefault(gi, []).append(p)
                    pipeline.step_in_place(self._ctx, by_group, kwargs)
                else:
                    self._step_fn(inner, *args, **kwargs)
            else:
                self._swap_step(args, kwargs)
                checkpoint.after_step(self)  # a live state dict gets this step's values (Note [state dict aliases])
        internals.run_step_post_hooks(inner, args, kwargs)
        internals.mark_scheduler_step(inner)
        return loss

    def _swap_step(self, args: tuple, kwargs: dict) -> None:
        if args:
            raise TypeError("SwapOptimizer.step takes the closure and keyword arguments only")
        layout = self._layout
        params, groups, in_place = layout.active()
        if self.operate.overlap:  # stream the first layers first (swapopt.overlap)
            params, groups = self._forward_waits.order(params, groups)
        if in_place:
            # Meta params (no data) are left to torch's own error or result, not reported as host memory.
            n = sum(not p.is_meta for ps in in_place.values() for p in ps)
            if "host" not in self._ctx.warned and n:
                self._ctx.warn_once(
                    "host",
                    f"swapopt: {n} param(s) are in host memory, not on the {self._ctx.device} device, so their states "
                    "are stepped in place and not swapped (swap_stats() counts only swapped steps). Move the "
                    "model to the device (model.to(device.torch_device())) before building the optimizer",
                )
            pipeline.step_in_place(self._ctx, dict(in_place), kwargs)
        if not params:
            return
        mod = device.get_torch_device_module(self._ctx.device)
        self.operate.bind(mod)  # another module: a prefetch made with the old one is dropped
        self.operate.begin_step()  # swap_stats() must not pair this step's start with an older end
        try:
            if self._auto is not None:
                self._measure_resident(mod, params, groups)
            # A prefetch outlives prepare() only when the plan it was made for still holds (see prepare)
            prep = layout.prepare(params, groups)
            # States this step creates get their pinned host memory before any param is touched, so a
            # failing allocation leaves every param untouched (Note [failure semantics], swapopt.recovery).
            layout.pre_hosts = layout.preallocate(prep)
            self._snapshot_hyper(prep.group_ids)
            run: Any = self._graphed_step(mod, prep, kwargs)
            if run is None:
                run = pipeline.StepRun(self._ctx, layout, prep, kwargs, self.operate.prefetched)
                run.run()
                if self._ctx.settings.step_graph:
                    self._after_eager_step(mod, prep, kwargs, run.steady)
        except BaseException as exc:
            layout.pre_hosts = {}
            self._ctx.hyper = {}
            self._failed(exc)
            raise
        layout.pre_hosts = {}
        self._ctx.hyper = {}
        op, n = self.operate, len(prep.plan.chunks)
        st = self._stats
        first = st.steps == 0
        if self._auto is not None:
            self._auto.planned_resident(layout, prep)
        self._stats = SwapStats(
            h2d_bytes=run.h2d, d2h_bytes=run.d2h, chunks=n, peak_staging_bytes=op.peak_staging_bytes, steps=st.steps + 1,
            resident_budget_bytes=int(self._ctx.settings.resident_mb * MiB),
        )
        if first:  # the shape of the swap, once; swap_stats() has every step's counters
            if self._ctx.device == "npu":
                npu.check_pinned(layout.arenas.nbytes(), layout.arenas.pinned_bytes())
            logger.info(
                "swapopt step 1: {} chunks, H2D {:.1f} MiB, D2H {:.1f} MiB, staging {:.1f} MiB, {} resident params, "
                "{:.1f} MiB of host memory pinned in {:.2f} s",
                n, run.h2d / MiB, run.d2h / MiB, op.peak_staging_bytes / MiB, len(prep.resident),
                layout.arenas.pinned_total / MiB, layout.arenas.pin_seconds,
            )  # fmt: skip

    def _graphed_step(self, mod: Any, prep: Any, kwargs: dict) -> graphed.GraphedStep | None:
        """step_graph (Note [graphed step] in swapopt.graphed): replay the captured step where it holds, else capture
        one where the last step of this plan ran steadily; the step done (with its byte counts), or None: run it."""
        ctx, graph = self._ctx, self._graphed
        if graph is not None:
            if graph.holds(ctx, prep, kwargs):
                graph.replay(self.operate, prep.last_chunk, len(prep.plan.chunks))
                self._captures = 0
                return graph
            self._drop_graph()
        if not ctx.settings.step_graph or self._graph_off is not None or self._steady is not prep:
            return None
        try:
            graph = graphed.GraphedStep.capture(ctx, self._layout, prep, mod)
        except Exception as err:  # noqa: BLE001 - nothing ran: the step runs without a graph (Note [graphed step])
            self._give_up_graphs(repr(err))
            ctx.warn_once("graph", f"swapopt: step_graph: the step could not be captured ({err!r}); steps run without "
                          "a graph")  # fmt: skip
            logger.opt(exception=err).debug("swapopt step_graph: capture failed")
            return None
        self._graphed = graph
        self._captures += 1
        if self._captures == graphed.RECAPTURE_WARNING:
            ctx.warn_once(
                "recapture",
                f"swapopt: step_graph captured the step {self._captures} times in a row: something it bakes in changes "
                "at every step (a float lr set by a scheduler: pass lr as a tensor on the device; grads at new "
                "addresses; replaced states). Each capture costs more than an ordinary step",
            )
        graph.replay(self.operate, prep.last_chunk, len(prep.plan.chunks))
        return graph

    def _after_eager_step(self, mod: Any, prep: Any, kwargs: dict, steady: bool) -> None:
        """step_graph: after the first step of a plan (its states exist), whether its steps can be captured at all,
        said once; the next step of a plan that ran steadily is captured (Note [graphed step])."""
        ctx = self._ctx
        if self._graph_off is None and self._checked is not prep:
            self._checked = prep
            reason = graphed.why_not(ctx, prep, kwargs, mod)
            if reason is not None:
                self._give_up_graphs(reason)
                ctx.warn_once("graph", f"swapopt: step_graph is on but the step cannot be captured: {reason}; steps "
                              "run without a graph")  # fmt: skip
        self._steady = prep if steady and self._graph_off is None else None

    @property
    def _graph_off(self) -> str | None:
        """step_graph: why this optimizer's steps cannot be captured (None: they can, or it is off)."""
        return self._ctx.graph_off

    def _give_up_graphs(self, reason: str) -> None:
        """step_graph: this optimizer's steps cannot be captured (``reason``) and it does not try again; the next step
        plans for eager steps, since the plan for replays (Note [replayed costs] in swapopt.costs) would cost the host
        time on every chunk."""
        self._ctx.graph_off, self._steady = reason, None
        self._layout.prepared = None

    def _measure_resident(self, mod: Any, params: list[torch.Tensor], groups: list[int]) -> None:
        """resident_mb="auto": measure the device's spare memory and, when the budget changes, hand the planner
        the new one (a new plan: states move between the device and the host at this step's prepare)."""
        auto = self._auto
        assert auto is not None
        dev = local(params[0]).device
        if auto.update(mod, dev, self._layout, params, groups):
            self._ctx.settings = self._ctx.settings.model_copy(update={"resident_mb": auto.budget / MiB})
            self._layout.prepared = None  # the cached plan was made for the old budget

    def _snapshot_hyper(self, groups: Iterable[int]) -> None:
        """Step-time copies of the tensor hyperparameters (lr tensors, tensor betas) of the given groups,
        made on the compute stream before the step's entry event: a scheduler may change the originals
        in place while the update still runs (overlap_forward; inner.run_inner reads the copies)."""
        self._ctx.hyper = {}
        if not self.operate.overlap:
            return
        for gi in set(groups):
            copies = {}
            for key, value in self.param_groups[gi].items():
                if key != "params":
                    copy = self.operate.snapshot(value)
                    if copy is not value:
                        copies[key] = copy
            self._ctx.hyper[gi] = copies

    def _failed(self, exc: BaseException) -> None:
        """swap_stats() keeps the last successful step's counters and says the last step failed."""
        self._stats = self._stats.model_copy(update={"failed": True, "last_error": repr(exc)})


def _prefetch_hook(opt: SwapOptimizer) -> Callable[..., None]:
    """The forward hook of the ``prefetch`` knob: after a forward that builds a graph (a backward and a
    step follow), start swapping in the next step's first chunks. Holds the optimizer weakly: the model
    must not keep it alive."""
    ref = weakref.ref(opt)

    def prefetch_after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        target = ref()
        if target is not None and torch.is_grad_enabled():
            target.prefetch()

    return prefetch_after_forward
