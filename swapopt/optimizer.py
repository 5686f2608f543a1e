"""SwapOptimizer: a torch.optim.Optimizer whose states live in pinned host memory between steps.

step() streams the states through the device in chunks (see swapopt.operate for the stream and event
choreography, swapopt.plan for the chunking) and runs the wrapped optimizer's own step on each chunk,
so the update is bitwise the one the unwrapped optimizer computes.

A failing step leaves each param fully stepped or untouched (see _swap_step's failure path): a param
split across chunks whose update began before the failing chunk is completed by rolling it forward
through a synchronous recovery path, so the normal path keeps no backups.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from loguru import logger
from pydantic import BaseModel

import device
from swapopt import checkpoint, copying, hoststate
from swapopt.hoststate import ELEMENTWISE, is_swapped_state, local, new_host_like, wrap_like
from swapopt.operate import SwapOptimizerOperate
from swapopt.plan import DEFAULT_ALIGN, ParamSize, Plan, make_plan

MiB = 1 << 20
_SLOT_ALIGN = 64  # bytes; every slot region starts on a cache line (and a 16-byte vector boundary)

class SwapStats(BaseModel):
    """Counters of the last step (``steps`` counts all swapped steps)."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    chunks: int = 0
    peak_staging_bytes: int = 0
    step_ms: float | None = None
    steps: int = 0


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The class's step without Optimizer's hook/profiler wrapper, so per-chunk calls do not fire hooks."""
    fn = type(optimizer).step
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "hooked", False) else fn


def _refuse(optimizer: Any) -> None:
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
    if not isinstance(optimizer, ELEMENTWISE) and cls.__module__.split(".")[0] != "torch":
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
    host: torch.Tensor  # host-local view the region mirrors (the swap-in reads it)
    layout: torch.Tensor | None  # DTensor whose layout wraps the slot view (non-flat DTensor states)


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


class SwapOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that its states stay in pinned host memory between steps.

    ``swap_optimizer_times``: chunks per step; ``chunk_mb``: fixed chunk budget (MiB), overrides it;
    ``slots``: staging buffers (3 lets swap-in, update and swap-out overlap); ``resident_mb``: states
    that fit stay on the device and are stepped first. param_groups, state and defaults are the
    wrapped optimizer's own objects.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        swap_optimizer_times: int = 16,
        chunk_mb: float | None = None,
        slots: int = 3,
        resident_mb: float = 0.0,
    ) -> None:
        _refuse(optimizer)
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
        self._ready = False
        # Optimizer.__init__ sets up hooks and the step wrapper; it gets copies of the groups, then the
        # wrapper takes the inner optimizer's own objects so schedulers, clipping and DCP see one truth.
        super().__init__([dict(g) for g in optimizer.param_groups], dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self.operate = SwapOptimizerOperate(slots)
        self._elementwise = type(optimizer) in ELEMENTWISE
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
        self.optimizer.add_param_group(param_group)
        self._prepared = None

    def zero_grad(self, set_to_none: bool = True) -> None:
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
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        checkpoint.load_state_dict(self, state_dict)
        # Optimizer.load_state_dict rebinds state/param_groups: keep sharing the inner's objects.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.invalidate()

    def offload(self, empty_cache: bool = False) -> None:
        # swapopt.offload (the package attribute) is the function, not the module: import from the module.
        from swapopt.offload import offload

        offload(self, empty_cache=empty_cache)

    def onload(self) -> None:
        from swapopt.offload import onload

        onload(self)

    # ----- swapopt surface -------------------------------------------------------------------
    def wait_for_swap_out(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Block the host until in-flight swap-outs of ``params`` (all if None) are done; host state
        may be read or written afterwards."""
        self.operate.wait_for_swap_out(params)

    def release_staging(self) -> None:
        self.operate.release_staging()

    def invalidate(self) -> None:
        """Forget cached host layouts and the plan (call after replacing state tensors by hand)."""
        self._host.clear()
        self._prepared = None
        self._version += 1

    def swap_stats(self) -> SwapStats:
        """Counters of the last step; step_ms waits for that step's last swap-out."""
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
        args: tuple = ()
        for hook in inner._optimizer_step_pre_hooks.values():  # the inner's own hooks run once per step
            result = hook(inner, args, kwargs)
            if result is not None:
                args, kwargs = result
        # GradScaler hands fused optimizers grad_scale/found_inf as attributes of the optimizer it steps.
        amp = {k: getattr(self, k) for k in ("grad_scale", "found_inf") if hasattr(self, k)}
        for k, v in amp.items():
            setattr(inner, k, v)
        try:
            mode = device.get_device()
            if mode != self._device:
                self._device = mode
                self.invalidate()
            if mode == "cpu":
                if "cpu" not in self._warned:
                    self._warned.add("cpu")
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

    def _active(self) -> tuple[list[torch.Tensor], list[int]]:
        """Params with a grad, in group order, each once (tied params are stepped once)."""
        params: list[torch.Tensor] = []
        groups: list[int] = []
        seen: set[int] = set()
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None or id(p) in seen:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SwapOptimizer does not support sparse gradients")
                seen.add(id(p))
                params.append(p)
                groups.append(gi)
        return params, groups

    def _swap_step(self, args: tuple, kwargs: dict) -> None:
        if args:
            raise TypeError("SwapOptimizer.step takes the closure and keyword arguments only")
        params, groups = self._active()
        if not params:
            return
        mod = device.get_torch_device_module(self._device)
        self.operate.bind(mod)
        prep = self._prepare(params, groups)
        op, plan = self.operate, prep.plan
        n = len(plan.chunks)
        op.begin(n, prep.slot_bytes, device.torch_device(self._device))
        pending: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        views: list[list[dict[str, tuple]] | None] = [None] * n
        progress: dict[str, int] = {}  # "entered": the last chunk the inner optimizer was entered for
        h2d = d2h = 0
        k = 0
        try:
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
        except BaseException:
            # Chunks before k are stepped and their swap-outs queued; chunk k's swap-out was not (unless
            # queuing it is what raised), so its host states are the old ones, and scalar states are only
            # ever written for a param's last piece. Drain every stream, then complete the param split
            # across the boundary into chunk k (if any) and drop the states created for params that were
            # not completed. Params only in chunk k or later keep their old host and scalar states. Their
            # values are old too unless the exception came from inside (or after) the inner optimizer's
            # update of chunk k: it updates params in place and may have written some before raising
            # (AdamW's weight decay comes first, say); nothing here can tell, and restoring them would
            # need a copy of every param piece each step, the cost this path exists to avoid.
            views.clear()
            op.drain()
            try:
                self._roll_forward(prep, k, progress.get("entered") == k, pending, kwargs)
            except Exception:  # noqa: BLE001 - never mask the original exception
                logger.exception("swapopt: completing split params after a failed step raised")
            pending.clear()
            op.release_staging()
            raise
        op.finish(prep.last_chunk)
        st = self._stats
        first = st.steps == 0
        self._stats = SwapStats(
            h2d_bytes=h2d, d2h_bytes=d2h, chunks=n, peak_staging_bytes=op.peak_staging_bytes, steps=st.steps + 1
        )
        (logger.info if first else logger.debug)(
            "swapopt step {}: {} chunks, H2D {:.1f} MiB, D2H {:.1f} MiB, staging {:.1f} MiB, {} resident params",
            st.steps + 1, n, h2d / MiB, d2h / MiB, op.peak_staging_bytes / MiB, len(prep.resident),
        )  # fmt: skip

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
            if not device.is_host_tensor(value) or not local(value).is_contiguous():
                if not quiet and not device.is_host_tensor(value) and "rehome" not in self._warned:
                    self._warned.add("rehome")
                    logger.warning(
                        "swapopt: optimizer state {!r} was found in device memory (moved there behind the "
                        "optimizer's back?); copying it back into pinned host memory",
                        key,
                    )
                src = local(value)
                home = previous.get(key)  # the pinned tensor it came from, when it still fits
                if home is None or local(home).shape != src.shape or local(home).dtype != src.dtype:
                    home = wrap_like(value, device.pinned_empty(tuple(src.shape), dtype=src.dtype))
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
                dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
                dst.copy_(src)
                st[key] = wrap_like(value, dst)
        self._host.pop(p, None)

    # ----- planning ----------------------------------------------------------------------------
    def _prepare(self, params: list[torch.Tensor], groups: list[int]) -> _Prepared:
        for p in params:  # resident params keep device states: nothing to check for them
            if p not in self._resident and not self._check_host(p):
                self._cache_host(p)
        key = (tuple(map(id, params)), tuple(groups), self._version)
        if self._prepared is not None and self._prepared.key == key:
            return self._prepared
        dev = device.torch_device(self._device)
        flat = [self._elementwise and local(p).is_contiguous() for p in params]
        sizes = [ParamSize(i, local(p).numel(), self._state_bytes(p, groups[i]), flat[i]) for i, p in enumerate(params)]
        chunk_bytes = None if self.chunk_mb is None else int(self.chunk_mb * MiB)
        plan = make_plan(
            sizes,
            times=self.swap_optimizer_times,
            chunk_bytes=chunk_bytes,
            resident_bytes=int(self.resident_mb * MiB),
            align=DEFAULT_ALIGN,
        )
        resident = [params[i] for i in plan.resident]
        self._resident = set(resident)
        for p in resident:
            self._ensure_resident(p, dev)
        for i in range(len(params)):  # a param that left the resident set goes back to the host
            if i not in plan.resident and params[i] not in self._host and self.state.get(params[i]):
                self._cache_host(params[i], quiet=True)
        regions = [self._regions(chunk.pieces, params, flat) for chunk in plan.chunks]
        slot_bytes = max((r[-1].offset + r[-1].nbytes for r in regions if r), default=0)
        last_chunk = {params[i]: k for i, k in plan.last_chunk.items()}
        key = (tuple(map(id, params)), tuple(groups), self._version)
        self._prepared = _Prepared(key, params, groups, flat, plan, regions, slot_bytes, resident, last_chunk)
        logger.debug(
            "swapopt plan: {} params, {} chunks, budget {:.2f} MiB, slot {:.2f} MiB, {} resident",
            len(params), len(plan.chunks), plan.budget / MiB, slot_bytes / MiB, len(resident),
        )  # fmt: skip
        return self._prepared

    def _state_bytes(self, p: torch.Tensor, gi: int) -> int:
        """Swapped state bytes of p: exact once it has states, probed (or guessed) before."""
        entry = self._host.get(p)
        if entry is not None:
            return entry.nbytes
        if self.state.get(p):  # resident: states already on the device
            return sum(hoststate.state_nbytes(v) for k, v in self.state[p].items() if is_swapped_state(p, k, v))
        loc = local(p)
        key = (gi, loc.dtype, loc.dim(), loc.device.type)
        if key not in self._probe_cache:
            probed = hoststate.probe_elem_bytes(self.optimizer, self.param_groups[gi], p, self._step_fn)
            if probed is None:  # Adam-like guess: two states of the param's dtype
                probed = 2 * loc.element_size()
                name = type(self.optimizer).__name__
                logger.debug("swapopt: could not probe {}; assuming {} state bytes per element", name, probed)
            self._probe_cache[key] = probed
        return loc.numel() * self._probe_cache[key]

    def _regions(self, pieces, params: list[torch.Tensor], flat: list[bool]) -> list[_Region]:
        """Slot layout of one chunk: one region per (piece, host state), in piece order."""
        regions: list[_Region] = []
        offset = 0
        for pos, piece in enumerate(pieces):
            p = params[piece.index]
            entry = self._host.get(p)
            if entry is None:
                continue
            for key, stored, loc in zip(entry.keys, entry.stored, entry.locals):
                if flat[piece.index]:
                    host = loc.view(-1)[piece.start : piece.stop]
                    shape, layout = None, None
                else:
                    host = loc
                    shape = tuple(loc.shape)
                    layout = stored if hoststate.is_dtensor(stored) else None
                nbytes = host.numel() * host.element_size()
                regions.append(_Region(pos, key, offset, nbytes, host.dtype, shape, host, layout))
                offset += -(-nbytes // _SLOT_ALIGN) * _SLOT_ALIGN
        return regions

    # ----- pipeline stages ---------------------------------------------------------------------
    def _swap_in(self, prep: _Prepared, k: int) -> tuple[list[dict[str, tuple]], int]:
        """Per piece of chunk k: {key: (value the optimizer sees, slot view, host view the swap-out
        writes)}, with the H2D copies filling the slot views queued."""
        chunk = prep.plan.chunks[k]
        views: list[dict[str, tuple]] = [{} for _ in chunk.pieces]
        slot = self.operate.slot(k)
        copies = []
        for r in prep.regions[k]:
            v = slot[r.offset : r.offset + r.nbytes].view(r.dtype)
            if r.shape is not None:
                v = v.view(r.shape)
            views[r.piece][r.key] = (wrap_like(r.layout, v) if r.layout is not None else v, v, r.host)
            copies.append((v, r.host))
        self.operate.swap_in(k, copies)
        return views, sum(r.nbytes for r in prep.regions[k])

    def _run_inner(self, chunk_groups: dict[int, list[torch.Tensor]], chunk_state: Any, kwargs: dict) -> None:
        """One inner step over the given params and state; the shared groups and state are restored after."""
        inner = self.optimizer
        groups = [dict(self.param_groups[gi], params=ps) for gi, ps in sorted(chunk_groups.items())]
        inner.param_groups, inner.state = groups, chunk_state
        try:
            self._step_fn(inner, **kwargs)
        finally:
            inner.param_groups, inner.state = self.param_groups, self.state

    def _update_resident(self, prep: _Prepared, kwargs: dict) -> None:
        with torch.profiler.record_function("swapopt.update[resident]"):
            chunk_groups: dict[int, list[torch.Tensor]] = defaultdict(list)
            chunk_state: defaultdict = defaultdict(dict)
            for i in prep.plan.resident:
                p = prep.params[i]
                chunk_groups[prep.groups[i]].append(p)
                chunk_state[p] = self.state[p]  # the real dict: resident states are updated where they live
            self._run_inner(chunk_groups, chunk_state, kwargs)

    def _piece_input(self, prep: _Prepared, piece, views: dict[str, tuple]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The tensor the inner optimizer steps for one piece and its state dict: swapped states are the
        device views in ``views``, scalar states are clones (written back once the whole param is done)."""
        p = prep.params[piece.index]
        if prep.flat[piece.index]:  # a leaf view of the flat range, its grad the matching view
            t = local(p).detach().view(-1)[piece.start : piece.stop]
            t.grad = local(p.grad).reshape(-1)[piece.start : piece.stop]  # a view unless the grad is strided
        else:
            t = p
        pst: dict[str, Any] = {}
        for key, value in (self.state.get(p) or {}).items():
            if key in views:
                pst[key] = views[key][0]
            elif isinstance(value, torch.Tensor):
                pst[key] = value.clone()
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
                copies.append((host, slot_view))
            elif is_swapped_state(t, key, value):  # created by the optimizer this step
                src = local(value)
                host = local(self._pending_host(pending, p, key, value, flat))
                copies.append((host.view(-1)[piece.start : piece.stop] if flat else host, src))
                hold.append(src)
            else:
                scalars[key] = value
        last = not flat or piece.stop == local(p).numel()
        return copies, hold, (scalars if last else None)

    def _publish(self, p: torch.Tensor, scalars: dict[str, Any], pending: dict) -> None:
        """p is fully stepped: its scalar states and the host states created this step become its state."""
        st = self.state[p]
        st.update(scalars)
        created = pending.pop(p, None)
        if created:
            st.update(created)
            self._host.pop(p, None)
            self._version += 1

    def _update_and_swap_out(
        self, prep: _Prepared, k: int, views: list[dict[str, tuple]], pending: dict, kwargs: dict, progress: dict
    ) -> int:
        """Run the inner optimizer on chunk k's pieces, then queue their swap-out. Returns D2H bytes.
        ``progress["entered"]`` is set to k once the inner optimizer may have written chunk k's params."""
        op = self.operate
        chunk = prep.plan.chunks[k]
        op.begin_update(k)
        chunk_groups: dict[int, list[torch.Tensor]] = defaultdict(list)
        chunk_state: defaultdict = defaultdict(dict)
        targets: list[torch.Tensor] = []
        with torch.profiler.record_function(f"swapopt.update[{k}]"):
            for pos, piece in enumerate(chunk.pieces):
                t, chunk_state[t] = self._piece_input(prep, piece, views[pos])
                chunk_groups[prep.groups[piece.index]].append(t)
                targets.append(t)
            progress["entered"] = k
            self._run_inner(chunk_groups, chunk_state, kwargs)
            copies, hold, finals = [], [], []
            for pos, piece in enumerate(chunk.pieces):
                t = targets[pos]
                c, h, scalars = self._piece_output(prep, piece, t, chunk_state[t], views[pos], pending)
                copies += c
                hold += h
                if scalars is not None:
                    finals.append((prep.params[piece.index], scalars))
            nbytes = sum(src.numel() * src.element_size() for _, src in copies)
            op.end_update(k)
        op.swap_out(k, copies, hold)
        for p, scalars in finals:  # the param is fully stepped: publish its scalars and new host states
            self._publish(p, scalars, pending)
        return nbytes

    # ----- failure path ------------------------------------------------------------------------
    def _name(self, prep: _Prepared, i: int) -> str:
        p = prep.params[i]
        gi = prep.groups[i]
        j = next(j for j, q in enumerate(self.param_groups[gi]["params"]) if q is p)
        return f"param_groups[{gi}]['params'][{j}] of shape {tuple(p.shape)}"

    def _roll_forward(self, prep: _Prepared, failed: int, entered: bool, pending: dict, kwargs: dict) -> None:
        """After a failure in chunk ``failed`` (streams drained): complete every param whose update began
        in an earlier chunk but whose last piece was not stepped, one piece at a time, synchronously.

        Chunk ``failed``'s own pieces are redone only when the inner optimizer had not been entered for
        that chunk (``entered`` False): then nothing of the chunk was written (the swap-out was never
        queued and scalar states are clones). Otherwise the inner optimizer may have updated part of the
        param in place before raising (AdamW's weight decay, say) and a redo could apply that part twice,
        so the param is left as it is: pieces before the chunk stepped, the rest with its old host
        states, its scalar states old; an ERROR names it.
        """
        plan = prep.plan
        begun = {pc.index for c in plan.chunks[:failed] for pc in c.pieces}
        rolled = 0
        for i in sorted(i for i in begun if plan.last_chunk[i] >= failed):
            p = prep.params[i]
            pieces = [
                (j, pos) for j in range(failed, len(plan.chunks)) for pos, pc in enumerate(plan.chunks[j].pieces)
                if pc.index == i
            ]  # fmt: skip
            cut = plan.chunks[pieces[0][0]].pieces[pieces[0][1]].start  # elements [0, cut) are stepped
            if entered and pieces[0][0] == failed:
                stop = plan.chunks[failed].pieces[pieces[0][1]].stop
                pending.pop(p, None)
                logger.error(
                    "swapopt: step failed inside the update of chunk {}; {} was split across it and is left "
                    "partially stepped: elements [0, {}) were stepped, the rest keep their old states (elements "
                    "[{}, {}) were in the failed update and may be partially updated in place); step count old{}",
                    failed, self._name(prep, i), cut, cut, stop,
                    "; the states this step created for it are dropped" if p not in self._host else "",
                )  # fmt: skip
                continue
            try:
                scalars = None
                for j, pos in pieces:
                    cut = plan.chunks[j].pieces[pos].start
                    scalars = self._recover_piece(prep, j, pos, pending, kwargs)
                self._publish(p, scalars or {}, pending)
                rolled += 1
            except Exception as exc:  # noqa: BLE001 - the original exception is the one to raise
                created = pending.pop(p, None)
                logger.error(
                    "swapopt: step failed in chunk {}; completing {} failed too ({!r}): elements [0, {}) were "
                    "stepped, the rest keep their old states (the piece from element {} on may be partially "
                    "updated in place); step count old{}",
                    failed, self._name(prep, i), exc, cut, cut,
                    "; the states this step created for it are dropped" if created else "",
                )  # fmt: skip
        if rolled:
            logger.debug("swapopt: step failed in chunk {}; rolled {} split params forward", failed, rolled)

    def _recover_piece(self, prep: _Prepared, j: int, pos: int, pending: dict, kwargs: dict) -> dict[str, Any] | None:
        """Step piece ``pos`` of chunk ``j`` on its own, as the pipeline does, in fresh device buffers on the
        compute stream; every copy is synchronous, so the host has seen all of it on return. Returns the
        piece's scalar states when it is its param's last piece."""
        op = self.operate
        piece = prep.plan.chunks[j].pieces[pos]
        dev = device.torch_device(self._device)
        with op.mod.stream(op.compute_stream), torch.profiler.record_function(f"swapopt.recover[{j}]"):
            views: dict[str, tuple] = {}
            for r in prep.regions[j]:
                if r.piece == pos:
                    buf = torch.empty(r.host.shape, dtype=r.dtype, device=dev)
                    buf.copy_(r.host)
                    views[r.key] = (wrap_like(r.layout, buf) if r.layout is not None else buf, buf, r.host)
            t, pst = self._piece_input(prep, piece, views)
            chunk_state: defaultdict = defaultdict(dict)
            chunk_state[t] = pst
            self._run_inner({prep.groups[piece.index]: [t]}, chunk_state, kwargs)
            copies, _, scalars = self._piece_output(prep, piece, t, chunk_state[t], views, pending)
            for dst, src in copies:
                dst.copy_(src)  # the host waits: the buffers are freed on return
        return scalars

    def _pending_host(self, pending: dict, p: torch.Tensor, key: str, value: torch.Tensor, flat: bool) -> torch.Tensor:
        """Host tensor for a state the optimizer created this step: allocated once, reused every step."""
        states = pending.setdefault(p, {})
        if key not in states:
            src = local(value)
            if flat:
                if src.dim() != 1:
                    raise RuntimeError(
                        f"{type(self.optimizer).__name__} created state {key!r} of shape {tuple(src.shape)} for a "
                        "flat piece, so it is not element-wise; it cannot be split across chunks"
                    )
                states[key] = new_host_like(p, src.dtype)
            else:
                states[key] = wrap_like(value, device.pinned_empty(tuple(src.shape), dtype=src.dtype))
        return states[key]
