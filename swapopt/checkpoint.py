"""state_dict / load_state_dict for SwapOptimizer: host tensors out, host tensors in, no device memory.

``torch.optim.Optimizer.load_state_dict`` casts every state to ``param.device``: for swapped states that
would allocate all of them on the accelerator at once (the resume-time OOM this module exists to avoid).
Here loaded values are copied straight into the pinned host tensors the swap engine streams from (new
pinned tensors for states that have none yet), after the whole state dict has been checked.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from loguru import logger

import device
from swapopt import hoststate, internals, statespec, subclass_state
from swapopt.hoststate import ELEMENTWISE, is_dtensor
from swapopt.masters import MASTER_KEY

# Note [state dict aliases]
# torch's Optimizer.state_dict() returns references to the live state tensors, so a state dict taken before
# a step and saved after it holds that step's values (torch.save of a CUDA tensor copies it on the stream,
# after the step's kernels). swapopt's swapped states are host memory that the next step's swap-outs write
# asynchronously: a state dict is a set of aliases of that memory (each with a storage of its own bytes, so
# that torch.save, DCP and async staging write only those), and reading one while the copies are in flight
# would mix two steps. So while any alias handed out by state_dict() is alive (a view of one counts), each
# step ends by waiting for its own swap-outs: the state dict then holds that step's values, as torch's does,
# whatever reads it (torch.save, DCP, tolist, numpy). A step with none alive waits for nothing. Copies would
# cost host memory equal to the states; refusing would break the common `sd = opt.state_dict()` kept in a
# loop variable.
_HANDED_OUT: weakref.WeakKeyDictionary[Any, list[weakref.ref]] = weakref.WeakKeyDictionary()


def state_dict(opt) -> dict[str, Any]:
    """The inner optimizer's state dict, its swapped states (and masters) being aliases of the host states
    (Note [state dict aliases]): no copy is made, and the state dict follows the optimizer as torch's does.

    For DTensor params the states are DTensors over the host shards (the param's mesh, placements, global
    shape and stride), which DCP saves and loads in place.
    """
    for hook in internals.state_dict_hooks(opt, "state_dict_pre"):
        hook(opt)
    # In-flight D2H copies still write these tensors; reading before they land gives a mix of two steps.
    opt.wait_for_swap_out()
    # Between steps the swapped states are the pinned host tensors (DTensors over host shards for DTensor
    # params), so the inner optimizer's own state_dict already has the right format and copies nothing.
    sd = opt.optimizer.state_dict()
    masters = opt._ctx.masters
    # Without an accelerator the states are stepped in place, synchronously: torch's own references will do.
    swapped = opt._ctx.device != "cpu"
    handed = _handed_out(opt) if swapped else []
    params = dict(_indexed_params(opt))
    if swapped or masters.ready:  # new dicts: the inner's state_dict shares the per-param ones
        # Entries that are not a param's state dict (a hook's `opt.state["key"] = value`) pass as torch passes them.
        sd["state"] = {
            i: {k: _alias(v, handed) if swapped and _swapped(params.get(i), k, v) else v for k, v in st.items()}
            if isinstance(st, dict) else st
            for i, st in sd["state"].items()
        }  # fmt: skip
    if masters.ready:
        # Note [master weights]: each master that holds a value goes with its param's state, in host memory.
        for i, p in params.items():
            if p in masters.ready:
                master = masters.get(p)
                value = _alias(master, handed) if swapped and device.is_host_tensor(master) else master
                sd["state"].setdefault(i, {})[MASTER_KEY] = value
    for hook in internals.state_dict_hooks(opt, "state_dict_post"):
        result = hook(opt, sd)
        if result is not None:
            sd = result
    return sd


def after_step(opt) -> None:
    """The end of a swapped step: while a state dict's aliases are alive, wait for this step's swap-outs
    (Note [state dict aliases])."""
    refs = _HANDED_OUT.get(opt)
    if not refs:
        return
    live = [r for r in refs if r() is not None]
    if live:
        opt.wait_for_swap_out()
    refs[:] = live


def _handed_out(opt) -> list[weakref.ref]:
    refs = _HANDED_OUT.get(opt)
    if refs is None:
        refs = _HANDED_OUT[opt] = []
    refs[:] = [r for r in refs if r() is not None]
    return refs


def _swapped(p: torch.Tensor | None, key: Any, value: Any) -> bool:
    """A swapped state in host memory (resident ones and device step scalars are device tensors, which a
    reader copies on the stream)."""
    return (
        p is not None and isinstance(value, torch.Tensor) and hoststate.is_swapped_state(p, key, value)
        and device.is_host_tensor(value)
    )


def _alias(value: torch.Tensor, handed: list[weakref.ref]) -> torch.Tensor:
    """The same host memory as ``value`` (a DTensor: its local shard), seen through a storage of exactly its
    bytes, remembered as handed out (Note [state dict aliases]). A subclass state (Note [subclass states] in
    swapopt.subclass_state) is the same subclass over aliases of its parts."""
    if subclass_state.is_subclass_state(value):
        return subclass_state.map_parts(value, lambda part: _alias(part, handed))
    loc = hoststate.local(value)
    if loc.numel() == 0 or loc.layout is not torch.strided:
        return value
    first = loc.storage_offset()
    span = 1 + sum((size - 1) * stride for size, stride in zip(loc.shape, loc.stride()))
    raw = loc.as_strided((span,), (1,), first).view(torch.uint8)
    # numpy() of a slice of the host memory yields a buffer of exactly these bytes (the array keeps the state's
    # storage alive) and torch.from_numpy a storage of that size: no copy.
    own = torch.from_numpy(raw.numpy()).view(loc.dtype).as_strided(tuple(loc.shape), tuple(loc.stride()), 0)
    handed.append(weakref.ref(own.untyped_storage()))
    return hoststate.wrap_like(value, own) if hoststate.is_dtensor(value) else own


@dataclass
class _Copy:
    """One swapped state to load: ``src`` (this rank's piece of the saved value) goes into ``dst``: the host
    tensor that already holds this state (written in place, no second copy of the states in host memory) or
    a new pinned tensor of ``dtype`` (``shape``: None for the param's shape and layout)."""

    param: torch.Tensor
    index: int
    key: Any
    src: torch.Tensor
    dst: torch.Tensor | None
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None
    placeholder: Any = None  # the object standing for this state until the copies are done

    @property
    def in_place(self) -> bool:
        return self.dst is not None


def load_state_dict(opt, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` into ``opt`` as ``torch.optim.Optimizer.load_state_dict`` would, except that
    swapped states go into pinned host memory instead of ``param.device``.

    Like torch, the loaded state and groups pass through the inner optimizer's ``__setstate__``, which
    upgrades older formats (a Python-number ``step``, param-group keys added since). The result is checked
    against what the optimizer needs (statespec) and every copy is tried on one element before anything
    changes: on error the optimizer is left as it was.
    """
    state_dict = state_dict.copy()
    for hook in internals.state_dict_hooks(opt, "load_state_dict_pre"):
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result

    inner = opt.optimizer
    name = type(inner).__name__
    groups = opt.param_groups
    saved_groups = deepcopy(state_dict["param_groups"])
    _check_groups(groups, saved_groups)
    params = list(chain.from_iterable(g["params"] for g in groups))
    id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups), params))
    index_of = {id(p): i for i, p in enumerate(params)}
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    saved_state = state_dict["state"]
    unknown = [k for k in saved_state if k not in id_map]
    if unknown:
        raise ValueError(f"optimizer state dict has state for ids {unknown!r} that no param group lists")
    # Like torch: the saved groups' fused/capturable flags decide whether ``step`` lives on the device.
    step_on_device = {
        pid: bool(g.get("fused") or g.get("capturable")) for g in state_dict["param_groups"] for pid in g["params"]
    }

    # 1. Check each param's saved state and plan its copies; nothing is written yet.
    specs: dict[tuple, dict[str, statespec.KeySpec] | None] = {}
    new_state: defaultdict[torch.Tensor, dict[Any, Any]] = defaultdict(dict)
    copies: list[_Copy] = []
    masters = opt._ctx.masters
    master_copies: list[_Copy] = []  # Note [master weights]: loaded into the masters, not into opt.state
    for saved_id, values in saved_state.items():
        p = id_map[saved_id]
        index = index_of[id(p)]
        if not isinstance(values, dict):
            raise ValueError(f"param {index} ({saved_id!r}): state must be a dict, got {type(values)}")
        if MASTER_KEY in values:
            values = dict(values)
            master_copies.append(_plan_master(opt, p, index, values.pop(MASTER_KEY)))
        spec = _spec(opt, specs, saved_groups[group_of[id(p)]], group_of[id(p)], p)
        if spec:
            statespec.check_keys(spec, index, values, name)
        new_state[p], planned = _plan_param(opt, p, index, values, step_on_device[saved_id])
        copies += planned

    # 2. Upgrade older formats the way torch does: the inner class's own __setstate__, run on a stand-in
    # object so that the optimizer itself changes only once everything has been checked and copied.
    new_groups = []
    for group, saved in zip(groups, saved_groups):
        saved["params"] = group["params"]
        if "param_names" in group and "param_names" not in saved:
            saved["param_names"] = group["param_names"]
        new_groups.append(saved)
    stand_in = object.__new__(type(inner))
    stand_in.__dict__.update(inner.__dict__)
    stand_in.__dict__["defaults"] = dict(inner.defaults)
    type(inner).__setstate__(stand_in, {"state": new_state, "param_groups": new_groups})
    new_state, new_groups = stand_in.state, stand_in.param_groups

    # 3. Check the upgraded state: shapes the optimizer creates (a 0-dim ``step``, param-shaped moments).
    for p, values in new_state.items():
        spec = specs.get(_spec_key(group_of[id(p)], p))
        if spec:
            statespec.check_shapes(spec, index_of[id(p)], p, values, name)

    # 4. Try every copy on one element: a value that cannot be copied (a meta tensor, say) is refused now.
    opt.wait_for_swap_out()  # values may be this optimizer's own host tensors, still written by swap-outs
    scratch: dict[torch.dtype, torch.Tensor] = {}
    for c in copies + master_copies:
        _try_copy(c, scratch)

    # 5. New host tensors are allocated and filled first: a failure here leaves the optimizer as it was.
    staged: dict[int, torch.Tensor] = {}
    for c in copies + master_copies:
        if not c.in_place and subclass_state.is_subclass_state(c.src):  # part by part, never dequantized
            staged[id(c)] = hoststate.pinned_copy(c.src)
        elif not c.in_place:
            dst = hoststate.new_host_like(c.param, c.dtype) if c.shape is None \
                else device.pinned_empty(c.shape, dtype=c.dtype)
            hoststate.local(dst).copy_(c.src)
            staged[id(c)] = dst

    # 6. Commit. In-place copies into the existing host tensors come last; they were all tried above.
    written: list[tuple[int, Any]] = []
    current: _Copy | None = None
    try:
        for c in copies + master_copies:
            if c.in_place:
                current = c
                if subclass_state.is_subclass_state(c.src):
                    for (_, d), (_, s) in zip(subclass_state.parts(c.dst), subclass_state.parts(c.src)):
                        if not _same_tensor(d, s):
                            d.copy_(s)
                    written.append((c.index, c.key))
                    continue
                dst_local = hoststate.local(c.dst)
                if not _same_tensor(dst_local, c.src):  # DCP loads into the tensors state_dict() returned
                    dst_local.copy_(c.src)
                written.append((c.index, c.key))
    except BaseException:
        # Every copy was tried above, so only an interrupt or a failing host gets here: say what changed.
        logger.error(
            "swapopt: load_state_dict failed while writing the existing host states; loaded: {}; param {} state "
            "{!r} may be partly written; every other state, the step counts and the param groups are unchanged",
            written, *((current.index, current.key) if current is not None else (None, None)),
        )  # fmt: skip
        raise
    by_key = {(id(c.param), c.key): c for c in copies}
    for p in params:
        if p not in new_state and p in opt.state:
            del opt.state[p]
    for p, values in new_state.items():
        for key, value in values.items():
            c = by_key.get((id(p), key))
            if c is not None and c.placeholder is value:
                values[key] = c.dst if c.in_place else staged[id(c)]
        st = opt.state.get(p)
        if st is None:
            opt.state[p] = values
        else:  # the dict itself is kept: the engine and DCP may hold references to it
            st.clear()
            st.update(values)
    for group, new in zip(groups, new_groups):
        # Updated in place: SwapOptimizer and its inner optimizer share these dicts.
        group.clear()
        group.update(new)
    for key, value in stand_in.defaults.items():
        inner.defaults.setdefault(key, value)
    _commit_masters(opt, masters, master_copies, staged, new_state)

    for hook in internals.state_dict_hooks(opt, "load_state_dict_post"):
        hook(opt)


def _indexed_params(opt) -> list[tuple[int, torch.Tensor]]:
    """(index, param) as torch's Optimizer.state_dict numbers params: by position over the groups, a param
    listed twice keeping its first index."""
    out, seen, start = [], set(), 0
    for group in opt.param_groups:
        for i, p in enumerate(group["params"], start):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((i, p))
        start += len(group["params"])
    return out


def _plan_master(opt, p: torch.Tensor, index: int, value: Any) -> _Copy:
    """The copy of a saved master into p's master (the one it has, else a new pinned fp32 tensor)."""
    where = f"param {index}, state {MASTER_KEY!r}"
    masters = opt._ctx.masters
    if not masters.wanted(p):
        raise ValueError(
            f"{where}: the state dict holds an fp32 master for a param that has none here (master_weights is "
            f"{'on, but the param is ' + str(hoststate.local(p).dtype) if masters.enabled else 'off'}); load it "
            "into SwapOptimizer(..., master_weights=True) over the same low-precision params"
        )
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{where}: {shape}, but the master of a param of shape {tuple(p.shape)} has its shape")
    existing = masters.get(p)
    if existing is not None and not device.is_host_tensor(existing):
        existing = None
    return _Copy(param=p, index=index, key=MASTER_KEY, src=_local_piece(existing if existing is not None else p, value, where),
                 dst=existing, dtype=torch.float32)


def _commit_masters(opt, masters: Any, copies: list[_Copy], staged: dict[int, torch.Tensor], new_state: dict) -> None:
    """Point the loaded params at their masters; a param loaded with states but without a master gets one
    made from it at its next step, said once (a checkpoint of training without master weights)."""
    loaded = {id(c.param) for c in copies}
    for c in copies:
        if not c.in_place:
            masters.set(c.param, staged[id(c)])
        masters.ready.add(c.param)
    missing = [p for p, values in new_state.items() if values and masters.wanted(p) and id(p) not in loaded]
    if missing:
        masters.ready.difference_update(missing)  # made from the params at the next step
        if not masters.warned_missing:
            masters.warned_missing = True
            warnings.warn(
                f"swapopt: the loaded state dict has no fp32 master for {len(missing)} low-precision param(s) (saved "
                "without master_weights); their masters are made from the params at the next step, so the "
                "precision the params lost in rounding is not recovered",
                stacklevel=4,
            )


def _spec_key(gi: int, p: torch.Tensor) -> tuple:
    loc = hoststate.local(p)
    return (gi, loc.dtype, loc.dim())


def _spec(opt, specs: dict, saved_group: dict[str, Any], gi: int, p: torch.Tensor):
    key = _spec_key(gi, p)
    if key not in specs:
        specs[key] = statespec.probe(opt.optimizer, saved_group, p)
    return specs[key]


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and a.device == b.device
    )


def _try_copy(c: _Copy, scratch: dict[torch.dtype, torch.Tensor]) -> None:
    """Copy one element of ``c.src`` into a scratch host tensor (one per dtype), so that a value that cannot
    be copied at all is refused before anything changes."""
    src = c.src
    if subclass_state.is_subclass_state(src):  # each part on its own: the subclass is copied part by part
        for attr, part in subclass_state.parts(src):
            _try_copy(_Copy(param=c.param, index=c.index, key=f"{c.key}.{attr}", src=part, dst=None, dtype=part.dtype),
                      scratch)
        return
    if src.is_meta or src.layout != torch.strided:
        raise ValueError(f"param {c.index}, state {c.key!r}: a {src.layout} {src.device} tensor holds no data to load")
    if src.numel() == 0:
        return
    if c.dtype not in scratch:
        scratch[c.dtype] = device.pinned_empty((1,), dtype=c.dtype)
    try:
        scratch[c.dtype].copy_(src.reshape(-1)[:1] if src.is_contiguous() else src[(0,) * src.dim()].reshape(1))
    except Exception as exc:
        raise ValueError(f"param {c.index}, state {c.key!r}: cannot be copied into host memory ({exc})") from exc


def _check_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer has {len(groups)}"
        )
    for i, (g, s) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(s["params"]):
            raise ValueError(
                f"parameter group {i}: loaded state dict lists {len(s['params'])} params, "
                f"the optimizer has {len(g['params'])}"
            )


def _plan_param(opt, p: torch.Tensor, index: int, values: dict[Any, Any],
                step_on_device: bool) -> tuple[dict[Any, Any], list[_Copy]]:
    """The param's state as torch would load it, swapped tensors standing in for their host copies, and
    those copies."""
    current = opt.state.get(p, {})
    out: dict[Any, Any] = {}
    copies: list[_Copy] = []
    for key, value in values.items():
        where = f"param {index}, state {key!r}"
        if subclass_state.is_subclass_state(hoststate.local(value)) and hoststate.is_swapped_state(p, key, value):
            copies.append(_plan_subclass(p, index, key, value, current.get(key), where))
            out[key] = value
        elif isinstance(value, torch.Tensor) and hoststate.is_swapped_state(p, key, value):
            existing = current.get(key)
            if not (isinstance(existing, torch.Tensor) and device.is_host_tensor(existing)):
                existing = None  # none yet, or resident on the device: it gets a new host tensor
            c = _plan_swapped(opt, p, index, key, value, existing, where)
            c.placeholder = value
            copies.append(c)
            out[key] = value
        elif isinstance(value, torch.Tensor):
            out[key] = _small_tensor(p, key, value, step_on_device, opt._ctx.masters.state_dtype(p))
        else:
            out[key] = deepcopy(value)
    return out, copies


def _plan_subclass(p: torch.Tensor, index: int, key: Any, value: torch.Tensor, existing: Any, where: str) -> _Copy:
    """A saved subclass state (Note [subclass states] in swapopt.subclass_state) goes part by part into the
    host subclass state p has, when its parts match, else into a new one; kept as it was saved (its class,
    parts and appearance dtype), as torch's own load keeps it."""
    if is_dtensor(p) != is_dtensor(value):
        # a full subclass state cannot be sliced into this rank's shard block by block, nor a shard made whole
        raise ValueError(
            f"{where}: a {type(hoststate.local(value)).__name__} state {'in' if is_dtensor(value) else 'not in'} a "
            f"DTensor for a param that is {'not ' if is_dtensor(value) else ''}one; load it through "
            "torch.distributed.checkpoint, which hands each rank its shard"
        )
    if is_dtensor(value):  # this rank's shard of the same layout (_local_piece's check), whole blocks
        _local_piece(p, value, where)
        if tuple(hoststate.local(value).shape) != tuple(hoststate.local(p).shape):
            raise ValueError(f"{where}: local shape {tuple(hoststate.local(value).shape)} does not match the "
                             f"param's {tuple(hoststate.local(p).shape)}")
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"{where}: shape {tuple(value.shape)} does not match the param's {tuple(p.shape)}")
    fits = (
        subclass_state.is_subclass_state(existing) and device.is_host_tensor(existing)
        and subclass_state.same_parts(existing, value)
    )
    return _Copy(param=p, index=index, key=key, src=value, dst=existing if fits else None, dtype=value.dtype,
                 placeholder=value)


def _plan_swapped(opt, p: torch.Tensor, index: int, key: Any, value: torch.Tensor, existing: torch.Tensor | None,
                  where: str) -> _Copy:
    if existing is not None and tuple(existing.shape) != tuple(value.shape):
        existing = None  # a state shaped unlike the one it replaces gets a new host tensor
    # The layout the value must have: the host tensor it goes into, else the param's.
    ref: torch.Tensor | None = existing if existing is not None else p
    if tuple(value.shape) != tuple(ref.shape):
        # Only a non-element-wise optimizer (Adafactor's factored states) has states shaped unlike the param.
        if is_dtensor(p) or isinstance(opt.optimizer, ELEMENTWISE):
            raise ValueError(f"{where}: shape {tuple(value.shape)} does not match {tuple(ref.shape)}")
        ref = None
    if existing is not None:
        dtype = existing.dtype
    else:  # the dtype the optimizer steps p in: fp32 for a param stepped through its master
        dtype = opt._ctx.masters.state_dtype(p) if p.is_floating_point() else value.dtype
    if not torch.can_cast(value.dtype, dtype):
        raise ValueError(f"{where}: dtype {value.dtype} cannot be cast to {dtype}")
    if ref is None:
        if is_dtensor(value):
            raise ValueError(f"{where}: value is a DTensor but the param is not")
        return _Copy(param=p, index=index, key=key, src=value, dst=None, dtype=dtype, shape=tuple(value.shape))
    return _Copy(param=p, index=index, key=key, src=_local_piece(ref, value, where), dst=existing, dtype=dtype)


def _local_piece(ref: torch.Tensor, value: torch.Tensor, where: str) -> torch.Tensor:
    """This rank's part of ``value`` (global shape checked) laid out like ``ref``: the local shard of a
    DTensor, the slice of a full tensor that this rank owns, or the value itself."""
    if is_dtensor(value):
        if not is_dtensor(ref):
            raise ValueError(f"{where}: value is a DTensor but the param is not")
        if value.device_mesh != ref.device_mesh or tuple(value.placements) != tuple(ref.placements):
            raise ValueError(
                f"{where}: DTensor layout {value.placements} on {value.device_mesh} differs from "
                f"{ref.placements} on {ref.device_mesh}; load through torch.distributed.checkpoint to reshard"
            )
        return hoststate.local(value)
    if is_dtensor(ref):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(value.shape, ref.device_mesh, ref.placements)
        piece = value
        for dim, (size, start) in enumerate(zip(shape, offset)):
            piece = piece.narrow(dim, start, size)
        return piece
    return value


def _small_tensor(p: torch.Tensor, key: Any, value: torch.Tensor, step_on_device: bool, dtype: torch.dtype) -> torch.Tensor:
    """A new unswapped tensor state (``step`` and other scalars), placed as torch places it; other floating
    states take ``dtype``, the dtype the optimizer steps p in (torch's: the param's)."""
    target = hoststate.local(p)
    if key == "step":
        if step_on_device:
            return value.to(dtype=torch.float32, device=target.device)
        if value.dim() == 0:
            # A fresh CPU scalar, as the optimizers create it (device="cpu": not torch's default device),
            # not an alias of the caller's tensor.
            return torch.tensor(value.item(), dtype=value.dtype, device="cpu")
        return value.clone()
    return value.to(dtype=dtype if target.is_floating_point() else value.dtype, device=target.device)
