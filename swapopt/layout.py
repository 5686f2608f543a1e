"""Host layout of the swapped states and the plan built over it.

``HostLayout`` owns what planning shares between steps: the cached host states of each param
(``Host``), the slot layout of each chunk (``Region``), the prepared plan (``Prepared``), the probe of
the states an optimizer creates, their preallocation into chunk-ordered pinned arenas (swapopt.arena),
which params stay resident, and which may be split across chunks.
"""

from __future__ import annotations

import operator
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Any

import torch
from loguru import logger

import device
from swapopt import flat as flat_update, hostmem, hoststate, perparam, subclass_state
from swapopt.arena import Arenas, Run, arena_limit, itemsize, pack
from swapopt.context import StepContext
from swapopt.hoststate import is_swapped_state, local, new_host_like, wrap_like
from swapopt.masters import MASTER
from swapopt.costs import link_costs
from swapopt.plan import DEFAULT_ALIGN, SLOT_ALIGN as _SLOT_ALIGN, ParamSize, Plan, make_plan

MiB = 1 << 20
GRAD = "\0grad"  # region key of a grad gathered into the slot (no state key can collide with it)
_GRAD = operator.attrgetter("grad")
_SPARSE = operator.attrgetter("is_sparse")


def same_objects(a: list, b: list) -> bool:
    """The same objects in the same order (identity: comparing tensors with == would compare values)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))

def _unlike(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """A grad laid out unlike its dense param; equal shape and strides settle it without a layout walk."""
    if grad.shape == param.shape and grad.stride() == param.stride():
        return False
    return not hoststate.same_layout(grad, param)


@dataclass(eq=False)
class _ToCome:
    """A state the first step will create for ``param``, of ``dtype`` and the param's shape (relayout
    places room for it beside the param's master)."""

    param: torch.Tensor
    dtype: torch.dtype


def _by_key(items: list, keys: list[str] | None = None) -> list:
    """``items`` sorted in place, stably, key by key (each key ranked where it first appears): the arena order
    of a group of chunks (Note [flat chunk update] in swapopt.flat). ``keys``: each item's key (default: the
    item's second field, as relayout's (param, key, state) triples have it)."""
    keys = [item[1] for item in items] if keys is None else keys
    rank = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    order = sorted(range(len(items)), key=lambda i: rank[keys[i]])
    items[:] = [items[i] for i in order]
    return items


def _sizes(stored: Any) -> tuple[int, int]:
    """(bytes, itemsize) of a host state, or of one to come, as pack() takes them."""
    if isinstance(stored, _ToCome):
        return local(stored.param).numel() * itemsize(stored.dtype), itemsize(stored.dtype)
    return hoststate.state_nbytes(stored), local(stored).element_size()


@dataclass(eq=False)
class Host:
    """Host states of one param as cached by the planner: the tensors stored in opt.state and their
    host-local tensors (the DTensor shards for DTensor params)."""

    keys: tuple[str, ...]
    stored: tuple[torch.Tensor, ...]
    locals: tuple[torch.Tensor, ...]
    nkeys: int  # len(opt.state[p]) when cached: a new key means the layout changed
    nbytes: int


@dataclass(eq=False)
class Region:
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
class Prepared:
    """Everything cached between re-plans."""

    key: tuple
    params: list[torch.Tensor]
    groups: list[int]
    flat: list[bool]
    plan: Plan
    regions: list[list[Region]]
    slot_bytes: int
    resident: list[torch.Tensor]
    last_chunk: dict[torch.Tensor, int] = field(default_factory=dict)
    runs: list[list[Run]] = field(default_factory=list)  # per chunk: merged copies of arena regions
    covered: list[frozenset[int]] = field(default_factory=list)  # per chunk: regions a run moves
    h2d_bytes: list[int] = field(default_factory=list)  # per chunk: state bytes its swap-in moves
    covered_bytes: list[int] = field(default_factory=list)  # per chunk: state bytes of the covered regions
    # What a cache hit compares, built once per plan (see HostLayout.still_valid): the state dict of every
    # non-resident param and its length, and every cached (dict, key, host state) triple.
    watch_params: list[torch.Tensor] = field(default_factory=list)
    watch_dicts: list[Any] = field(default_factory=list)
    watch_present: list[Any] = field(default_factory=list)  # the watched dicts that exist
    watch_lens: list[int] = field(default_factory=list)
    watch_states: tuple[list, list, list] = ((), (), ())
    # The whole state mapping (it, its keys, its values) when the per-param check of the dicts last passed: the same
    # keys and values, by identity and in order, give every param the same dict without hashing each param (a
    # tensor's hash is a Python call, about 0.3 us a param on a GPU host)
    watch_mapping: tuple[Any, list, list] | None = None
    recheck: list[int] = field(default_factory=list)  # flat params: their grad layout decides gathering
    group_ids: list[int] = field(default_factory=list)  # distinct groups of the params, sorted
    preallocated: bool = False  # a preallocate found nothing to create: none will while this plan holds
    splits: list[Any] = field(default_factory=list)  # per chunk: how the pipeline splits the slot into views
    inputs: list[Any] = field(default_factory=list)  # per chunk: the pipeline's cached inputs (swapopt.pipeline)
    views: list[Any] = field(default_factory=list)  # per chunk: its slot views (Note [persistent slots])
    scalars: Any = None  # the non-swapped states the pipeline snapshots and checks each step (pipeline.ScalarWatch)
    scratch: Any = None  # the flat updates' scratch tensor, memory only during a step (Note [flat chunk update])

    def __post_init__(self) -> None:
        # filled lazily by the pipeline, chunk by chunk, at the plan's first step
        self.splits = self.splits or [None] * len(self.plan.chunks)
        self.inputs = self.inputs or [None] * len(self.plan.chunks)
        self.views = self.views or [None] * len(self.plan.chunks)

    def is_whole(self, piece: Any) -> bool:
        """The piece is its param's whole range (a param not split is stepped as itself)."""
        return not self.flat[piece.index] or (piece.start == 0 and piece.stop == local(self.params[piece.index]).numel())



class HostLayout:
    """Host states, slot layout and plan of one SwapOptimizer, cached between steps.

    ``ctx`` (swapopt.context) gives the wrapped optimizer, whose ``state`` and ``param_groups`` are read live
    (load_state_dict rebinds them), the settings, the masters (Note [master weights]) and the transfer
    engine, which waits for swap-outs before a state is rewritten.
    """

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.elementwise = perparam.is_elementwise(type(ctx.optimizer))
        self.pre_hosts: dict[torch.Tensor, dict[str, torch.Tensor]] = {}  # see preallocate
        # States relayout placed beside a master before the optimizer creates them (Note [master weights]):
        # preallocate hands them out.
        self.pre_placed: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.arenas = Arenas()  # pinned buffers holding states in chunk order (swapopt.arena)
        self.arena_limit = arena_limit(0)  # the most bytes one arena packs (Note [arena memory]), set per plan
        self.split_cache: dict[torch.Tensor, tuple] = {}  # see splittable
        self.host: dict[torch.Tensor, Host] = {}
        self.prepared: Prepared | None = None
        self.plan_cache: tuple[tuple, Plan] | None = None  # (sizes and settings, the plan made from them)
        self.resident: set[torch.Tensor] = set()  # params whose states live on the device (resident_mb)
        self.probe_cache: dict[tuple, int] = {}
        self.version = 0  # bumped whenever cached host layouts change
        # active()'s result and what it was computed from (see active)
        self.active_cache: tuple | None = None

    @property
    def state(self) -> Any:
        return self.ctx.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.ctx.param_groups

    def holder(self, p: torch.Tensor, key: str) -> dict[str, torch.Tensor] | None:
        """The dict that stores p's host tensor ``key``: its state dict, or its master's (Note [master weights]);
        for a part of a subclass state, the state dict holding the subclass."""
        return self.ctx.masters.host.get(p) if key == MASTER else self.state.get(p)

    def current(self, p: torch.Tensor, key: str) -> Any:
        """p's host tensor ``key`` as opt.state holds it now: a part key (Note [subclass states] in
        swapopt.subclass_state) gives that part of the subclass state its holder keeps."""
        split = subclass_state.split_key(key)
        value = (self.holder(p, split[0] if split else key) or {}).get(split[0] if split else key)
        if split is None or not subclass_state.is_subclass_state(value):
            return value if split is None else None
        return dict(subclass_state.parts(value)).get(split[1])

    def put(self, p: torch.Tensor, key: str, new: torch.Tensor) -> None:
        """Store ``new`` as p's host tensor ``key``: a part goes into a rebuilt subclass state."""
        split = subclass_state.split_key(key)
        if split is None:
            self.holder(p, key)[key] = new
            return
        st = self.holder(p, split[0])
        st[split[0]] = subclass_state.rebuild(st[split[0]], {split[1]: new})

    def has_states(self, p: torch.Tensor) -> bool:
        """p's cached host entry holds states (not only its master)."""
        entry = self.host.get(p)
        return entry is not None and any(k != MASTER for k in entry.keys)

    def invalidate(self) -> None:
        """Forget cached host layouts and the plan."""
        self.host.clear()
        self.split_cache.clear()
        self.prepared = None
        self.active_cache = None
        self.version += 1

    def forget(self, p: torch.Tensor) -> None:
        """p's host states changed (new states published): re-read them at the next plan."""
        self.host.pop(p, None)
        self.version += 1

    def active(self) -> tuple[list[torch.Tensor], list[int], dict[int, list[torch.Tensor]]]:
        """Params with a grad, in group order, each once (tied params are stepped once): those to swap
        with their group indices, and those stepped in place by group (params outside device memory
        need no swapping; meta params get torch's own errors).

        The same param lists with the same params having grads give the same (cached) lists: what a
        step compares is one C-level pass over the params and their grads, not a Python loop."""
        groups = self.param_groups
        lists = [g["params"] for g in groups]
        grads = [list(map(_GRAD, ps)) for ps in lists]
        present = [list(map(operator.is_not, gs, repeat(None))) for gs in grads]
        hit = self.active_cache
        if hit is not None and len(hit[0]) == len(lists) and all(map(same_objects, hit[0], lists)) and hit[1] == present:
            for gs, mask in zip(grads, present):
                if any(map(_SPARSE, compress(gs, mask))):
                    break  # a grad turned sparse: the full pass below raises
            else:
                return hit[2]
        result = self._active()
        self.active_cache = ([list(ps) for ps in lists], present, result)
        return result

    def _active(self) -> tuple[list[torch.Tensor], list[int], dict[int, list[torch.Tensor]]]:
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
        return params, groups, dict(in_place)

    # ----- host state bookkeeping --------------------------------------------------------------
    def adopt_existing(self) -> None:
        """States that exist before the first swapped step (Adagrad builds them in __init__, or the
        optimizer already stepped) move into pinned host memory now."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    if self.ctx.masters.wanted(p):
                        self.restate_for_master(p, group)
                    self.cache_host(p, quiet=True)

    def restate_for_master(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """Note [master weights]: the states an optimizer built in its constructor for a low-precision param
        (Adagrad's sum, at step 0) are built again for the param's fp32 master, as the recipe's optimizer
        over the masters builds them (``initial_accumulator_value`` rounded to fp32, not to bf16). States of
        an optimizer that has stepped are only upcast (cache_host)."""
        st = self.state[p]
        step = st.get("step")
        if step is None or float(step) != 0:
            return
        loc = local(p)
        twin = torch.empty_strided(loc.shape, hoststate.layout_strides(loc), dtype=torch.float32, device="cpu")
        cls = type(self.ctx.optimizer)
        try:
            kwargs = hoststate.constructor_kwargs(cls, {k: v for k, v in group.items() if k != "params"})
            fresh = cls([twin], **kwargs).state.get(twin, {})
        except Exception:  # noqa: BLE001 - cannot rebuild: the states are upcast instead
            return
        for key, value in fresh.items():
            old = st.get(key)
            if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and is_swapped_state(p, key, old):
                st[key] = wrap_like(old, value) if hoststate.is_dtensor(old) else value

    def cache_host(self, p: torch.Tensor, quiet: bool = False) -> Host:
        """Record p's host states (and its master); any swapped state found in device memory is copied into
        host memory."""
        st = self.state.get(p, {})
        old = self.host.get(p)
        previous = dict(zip(old.keys, old.stored)) if old is not None else {}
        keys, stored, locs = [], [], []
        # Note [master weights]: a param stepped through its fp32 master has fp32 states, as the recipe's
        # optimizer over the masters has; states built before in the param's dtype (Adagrad builds its sum
        # in __init__, a checkpoint of plain training) are upcast.
        want = torch.float32 if self.ctx.masters.wanted(p) else None
        for key, value in list(st.items()):
            if not is_swapped_state(p, key, value):
                continue
            if subclass_state.is_subclass_state(value):  # swapped part by part (Note [subclass states])
                value = st[key] = self.host_parts(p, key, value, previous, quiet)
                for attr, part in subclass_state.parts(value):
                    keys.append(subclass_state.part_key(key, attr))
                    stored.append(part)
                    locs.append(part)
                continue
            upcast = want is not None and value.is_floating_point() and local(value).dtype != want
            if upcast or not device.is_host_tensor(value) or not hoststate.is_dense(local(value)):
                if not quiet and not device.is_host_tensor(value):
                    self.ctx.warn_once(
                        "rehome",
                        f"swapopt: optimizer state {key!r} was found in device memory, moved there behind the "
                        "optimizer's back (an 'optimizer to device' helper, such as Lightning's default "
                        "strategies on resume); it is copied back into pinned host memory, but held device "
                        "memory until now. With Lightning use swapopt.integrations.lightning's "
                        "SwapSingleDeviceStrategy / SwapDDPStrategy; elsewhere, do not move a SwapOptimizer's "
                        "states (swapopt.put_optimizer_to_device keeps swapped states on the host)",
                    )
                src = local(value)
                home = previous.get(key)  # the pinned tensor it came from, when it still fits
                dtype = want if upcast else src.dtype
                if home is None or not hoststate.same_layout(local(home), src) or local(home).dtype != dtype:
                    home = hoststate.pinned_empty_like(value, dtype)
                self.ctx.operate.wait_for_swap_out([p])
                local(home).copy_(src)
                value = st[key] = home
            keys.append(key)
            stored.append(value)
            locs.append(local(value))
        master = self.ctx.masters.get(p)
        if master is not None:  # moves with the states (Note [master weights])
            keys.append(MASTER)
            stored.append(master)
            locs.append(local(master))
        entry = Host(tuple(keys), tuple(stored), tuple(locs), len(st), sum(t.numel() * t.element_size() for t in locs))
        self.host[p] = entry
        self.version += 1
        return entry

    def host_parts(self, p: torch.Tensor, key: str, value: torch.Tensor, previous: dict, quiet: bool) -> torch.Tensor:
        """The subclass state ``value`` with every part in dense host memory: parts found elsewhere (the optimizer
        created the state on the device, or it was resident) are copied into pinned host tensors, the ones they
        came from when those still fit. Never through a dequantize: byte for byte."""
        new = {}
        for attr, part in subclass_state.parts(value):
            if device.is_host_tensor(part) and hoststate.is_dense(part):
                continue
            if not quiet:
                self.ctx.warn_once("rehome-part", f"swapopt: a part of optimizer state {key!r} was found in device "
                                   "memory; it is copied back into pinned host memory")  # fmt: skip
            home = previous.get(subclass_state.part_key(key, attr))
            if home is None or not hoststate.same_layout(home, part) or home.dtype != part.dtype:
                home = hoststate.pinned_empty_like(part)
            self.ctx.operate.wait_for_swap_out([p])
            home.copy_(part)
            new[attr] = home
        return subclass_state.rebuild(value, new) if new else value

    def check_host(self, p: torch.Tensor) -> bool:
        """Whether p's cached host layout still matches opt.state[p]."""
        entry = self.host.get(p)
        st = self.state.get(p)
        if entry is None:
            return not st and self.ctx.masters.get(p) is None
        if len(st or ()) != entry.nkeys:
            return False
        return all(self.current(p, k) is t for k, t in zip(entry.keys, entry.stored))

    def ensure_resident(self, p: torch.Tensor, dev: torch.device) -> None:
        """Resident params keep their states in device memory."""
        st = self.state.get(p) or {}
        if any(is_swapped_state(p, k, v) and device.is_host_tensor(v) for k, v in st.items()):
            # swapped until now (a re-plan made it resident): the last step's swap-out may still write them
            self.ctx.operate.wait_for_swap_out([p])
        for key, value in list(st.items()):
            if subclass_state.is_subclass_state(value) and device.is_host_tensor(value):
                st[key] = subclass_state.map_parts(value, lambda t: t.to(dev))  # part by part, byte for byte
                continue
            if is_swapped_state(p, key, value) and device.is_host_tensor(value):
                src = local(value)
                dst = torch.empty_strided(src.shape, hoststate.layout_strides(src), dtype=src.dtype, device=dev)
                dst.copy_(src)
                st[key] = wrap_like(value, dst)
        self.host.pop(p, None)

    # ----- planning ----------------------------------------------------------------------------
    def splittable(self, p: torch.Tensor) -> bool:
        """p may be cut into flat pieces in memory order: an element-wise optimizer, a dense param and
        host states laid out like it (so the same flat range of each pairs the same elements)."""
        loc = local(p)
        # cached until host layouts change (_version) or the param's own layout does
        key = (self.version, loc.shape, loc.stride())
        hit = self.split_cache.get(p)
        if hit is not None and hit[0] == key:
            return hit[1]
        entry = self.host.get(p)
        ok = (
            self.elementwise
            and hoststate.is_dense(loc)
            and (entry is None or all(hoststate.same_layout(t, loc) for t in entry.locals))
        )
        self.split_cache[p] = (key, ok)
        return ok

    def still_valid(self, prep: Prepared, params: list[torch.Tensor], groups: list[int]) -> bool:
        """Whether ``prep`` holds for this step without re-checking every param in Python: the same params
        and groups, no host layout change this layout made (``version``), the same state dicts with the
        same lengths holding the same host states (C-level identity passes, which also catch a state the
        user replaced by hand), and the grads of flat params still laid out as when it was planned."""
        if not self.unchanged_since(prep) or not (params is prep.params or same_objects(params, prep.params)):
            return False
        if groups != prep.groups:
            return False
        state = self.state
        owners, dicts_now = list(state), list(state.values())
        seen = prep.watch_mapping
        if (seen is None or seen[0] is not state
                or not same_objects(owners, seen[1]) or not same_objects(dicts_now, seen[2])):
            if not same_objects(list(map(state.get, prep.watch_params)), prep.watch_dicts):
                return False
            prep.watch_mapping = (state, owners, dicts_now)
        if list(map(len, prep.watch_present)) != prep.watch_lens:
            return False
        dicts, keys, stored = prep.watch_states
        if not same_objects(list(map(dict.get, dicts, keys)), stored):
            return False
        for i in prep.recheck:
            p = params[i]
            if p.grad is None or _unlike(local(p.grad), local(p)) != prep.key[2][i]:
                return False
        return True

    def watch(self, prep: Prepared) -> None:
        """Record on ``prep`` what still_valid compares: taken after planning, from the states as they are."""
        resident = self.resident
        prep.watch_params = [p for p in prep.params if p not in resident]
        prep.watch_dicts = [self.state.get(p) for p in prep.watch_params]
        prep.watch_present = [d for d in prep.watch_dicts if d is not None]
        prep.watch_lens = [len(d) for d in prep.watch_present]
        dicts: list = []
        keys: list = []
        stored: list = []
        for p, d in zip(prep.watch_params, prep.watch_dicts):
            entry = self.host.get(p)
            if entry is None or d is None:
                continue
            for k, t in zip(entry.keys, entry.stored):
                split = subclass_state.split_key(k)
                if split is not None:  # a part: watch the subclass state that holds it, once
                    k = split[0]
                    t = d.get(k)
                    if keys and keys[-1] == k and dicts[-1] is d:
                        continue
                dicts.append(self.holder(p, k))
                keys.append(k)
                stored.append(t)
        prep.watch_states = (dicts, keys, stored)
        prep.recheck = [i for i, (f, g) in enumerate(zip(prep.flat, prep.key[2])) if f or g]
        prep.group_ids = sorted(set(prep.groups))

    def unchanged_since(self, prep: Prepared) -> bool:
        """No host layout changed since ``prep`` was made (``version``): its plan may still hold."""
        return prep.key[3] == self.version

    def prepare(self, params: list[torch.Tensor], groups: list[int]) -> Prepared:
        prep = self.prepared
        if prep is not None and self.still_valid(prep, params, groups):
            return prep
        del prep  # the old plan holds views of arenas a re-layout may empty (Note [arena memory])
        # A prefetch was made for the plan that no longer holds, and the re-plan below may move the host
        # states its copies read: drop it first (it is only a device copy of them).
        self.ctx.operate.discard_prefetch()
        masters = self.ctx.masters
        hostmem.check_layout(self, params, groups)  # HostMemoryError before any host memory is taken
        for p in params:  # resident params keep device states: nothing to check for them
            if masters.ensure(p):  # pinned host memory for its master, filled at its first step
                self.forget(p)
            if p not in self.resident and not self.check_host(p):
                self.cache_host(p)
        flat = [self.splittable(p) for p in params]
        # A grad laid out unlike its split param is gathered piece by piece into the slot (never whole).
        gather = [f and _unlike(local(p.grad), local(p)) for p, f in zip(params, flat)]
        key = (tuple(map(id, params)), tuple(groups), tuple(gather), self.version)
        if self.prepared is not None and self.prepared.key == key:
            self.watch(self.prepared)
            return self.prepared
        dev = device.torch_device(self.ctx.device)
        # A master's piece gets its grad upcast into the slot (Note [master weights]); gathered there if needed.
        upcast = [masters.get(p) is not None for p in params]
        sizes = []
        for i, p in enumerate(params):
            nbytes, regions = self.state_bytes(p, groups[i])
            if gather[i] or upcast[i]:
                nbytes += local(p).numel() * (4 if upcast[i] else p.grad.element_size())
                regions += 1
            sizes.append(ParamSize(i, local(p).numel(), nbytes, flat[i], regions))
        knobs = self.ctx.settings
        chunk_bytes = None if knobs.chunk_mb is None else int(knobs.chunk_mb * MiB)
        # With prefetch the first chunks stream in under the backward: no ramp (Note [ramp] in swapopt.plan)
        ramp = not knobs.prefetch
        # the link's costs choose between plans of the same budget (Note [chunk count from costs] in swapopt.plan),
        # a replayed step's under step_graph while steps can be captured (Note [replayed costs] in swapopt.costs)
        costs = link_costs(self.ctx.device, replayed=knobs.step_graph and self.ctx.graph_off is None)
        settings = (knobs.swap_optimizer_times, chunk_bytes, int(knobs.resident_mb * MiB), DEFAULT_ALIGN, ramp, costs,
                    knobs.slots)
        plan_key = (tuple(sizes), settings)
        if self.plan_cache is not None and self.plan_cache[0] == plan_key:
            # the probe gave the exact sizes: the states the first step created change nothing
            plan = self.plan_cache[1]
        else:
            times, chunk_bytes, resident_bytes, align, ramp, costs, slots = settings
            plan = make_plan(
                sizes, times=times, chunk_bytes=chunk_bytes, resident_bytes=resident_bytes, align=align, ramp=ramp,
                costs=costs, slots=slots,
            )
            self.plan_cache = (plan_key, plan)
        # A splittable param the plan left whole is stepped as itself, with states shaped like it: no
        # per-step flat views of it or its grad (DTensor and gathered ones keep the flat path).
        pieces_of = Counter(pc.index for c in plan.chunks for pc in c.pieces)
        flat = [
            f and (pieces_of[i] > 1 or gather[i] or hoststate.is_dtensor(params[i])) for i, f in enumerate(flat)
        ]
        resident = [params[i] for i in plan.resident]
        self.resident = set(resident)
        for p in resident:
            self.ensure_resident(p, dev)
        for i in range(len(params)):  # a param that left the resident set goes back to the host
            if i not in plan.resident and params[i] not in self.host and self.state.get(params[i]):
                self.cache_host(params[i], quiet=True)
        # The old plan's regions and runs are views of the arenas a re-layout empties: let go of them first,
        # so that each old arena is freed as soon as its states have moved (Note [arena memory])
        self.prepared = None
        self.arena_limit = arena_limit(sum(s.state_bytes for s in sizes))
        self.relayout(plan, params, flat, groups, gather)
        # Masters are made unpinned (Masters.ensure): those the re-layout did not move into an arena are pinned
        # now, before any copy reads them
        self.arenas.pin_also([t for e in self.host.values() for t in e.locals])
        regions = [self.regions(chunk.pieces, params, flat, gather, upcast) for chunk in plan.chunks]
        slot_bytes = max((r[-1].offset + r[-1].nbytes for r in regions if r), default=0)
        last_chunk = {params[i]: k for i, k in plan.last_chunk.items()}
        key = (tuple(map(id, params)), tuple(groups), tuple(gather), self.version)
        if len(self.arenas):
            self.arenas.prune(
                [t for e in self.host.values() for t in e.locals]
                + [local(t) for st in self.pre_placed.values() for t in st.values()]
            )
        runs = [self.arenas.runs(r) for r in regions]
        covered = [frozenset(i for run in rs for i in run.regions) for rs in runs]
        h2d_bytes = [sum(r.nbytes for r in rs if r.host is not None) for rs in regions]
        covered_bytes = [sum(rs[i].nbytes for i in cov) for rs, cov in zip(regions, covered)]
        self.prepared = Prepared(
            key, params, groups, flat, plan, regions, slot_bytes, resident, last_chunk, runs, covered,
            h2d_bytes, covered_bytes,
        )
        self.watch(self.prepared)
        logger.debug(
            "swapopt plan: {} params, {} chunks, budget {:.2f} MiB, slot {:.2f} MiB, {} resident, {} merged copies",
            len(params), len(plan.chunks), plan.budget / MiB, slot_bytes / MiB, len(resident), sum(map(len, runs)),
        )  # fmt: skip
        return self.prepared

    @staticmethod
    def arena_groups(plan: Plan) -> list[list[Any]]:
        """The plan's chunks grouped by arena: a chunk that starts with a later piece of a param split
        across chunks shares the arena of the chunk before it, where the param's states lie whole."""
        groups: list[list[Any]] = []
        for chunk in plan.chunks:
            if groups and chunk.pieces and chunk.pieces[0].start > 0:
                groups[-1].append(chunk)
            else:
                groups.append([chunk])
        return groups

    def relayout(
        self, plan: Plan, params: list[torch.Tensor], flat: list[bool], groups: list[int], gather: list[bool]
    ) -> None:
        """Host states that exist before they are first swapped (loaded by load_state_dict, built by the
        optimizer's constructor, adopted at wrap time) or that an earlier plan placed for other chunks
        move into one pinned arena per chunk, in region order, so each chunk moves in one copy each way
        (swapopt.arena). Costs one host-side copy per state, only when the plan changes.

        A param split across chunks keeps each state one tensor, laid whole where its first piece is: the
        chunks it spans share one arena, and each of them moves in one copy per state each way (the first
        state's piece joins the run before it, the last state's piece the run after it).

        A master whose param has no states yet (Note [master weights]) is laid out with room for the states
        the first step will create before it (``pre_placed``, handed out by preallocate), as this layout
        would place them once they exist: the next plan then finds everything packed and moves nothing."""
        self.pre_placed = {}
        moves: list[list[tuple[torch.Tensor, str, Any]]] = []
        for group in self.arena_groups(plan):
            want: list[tuple[torch.Tensor, str, Any]] = []
            for chunk in group:
                for piece in chunk.pieces:
                    p = params[piece.index]
                    entry = self.host.get(p)
                    if entry is None or piece.start > 0:  # a later piece: placed with the first
                        continue
                    if entry.keys == (MASTER,):
                        want += [(p, key, _ToCome(p, dtype)) for key, dtype in self.states_to_come(
                            p, groups[piece.index], gather[piece.index])]  # fmt: skip
                    for key, stored, loc in zip(entry.keys, entry.stored, entry.locals):
                        if loc.numel() and hoststate.is_dense(loc):
                            want.append((p, key, stored))
            if flat_update.ENABLED:
                _by_key(want)
            if any(isinstance(s, _ToCome) for _, _, s in want) or not self.packed([local(s) for _, _, s in want]):
                moves.append(want)
        if not moves:
            return
        self.ctx.operate.wait_for_swap_out()  # the last step's swap-outs still write these states
        nstates = nbytes = 0
        while moves:  # arena by arena, so the old copies are let go of as the new ones are filled
            want = moves.pop(0)
            sizes = [_sizes(s) for _, _, s in want]
            for members, offsets, size in pack(sizes, self.arena_limit):
                placed = [(*want[i], offset) for i, offset in zip(members, offsets)]
                for i in members:  # only ``placed`` holds the old copies now: move lets go of each in turn
                    want[i] = None  # type: ignore[call-overload]
                self.move(placed, size)
                self.release_emptied()
            nstates += len(want)
            nbytes += sum(n for n, _ in sizes)
            del want
        self.arenas.pin_pending()
        logger.debug(
            "swapopt: re-layout of {} host states ({:.2f} MiB) into chunk-ordered arenas, one host copy each",
            nstates, nbytes / MiB,
        )  # fmt: skip

    def packed(self, states: list[torch.Tensor]) -> bool:
        """``states`` (host-local, in region order) already follow each other in arenas: adjacent, or starting
        the next arena where the one before ends (a misaligned dtype, or the arena limit), as relayout and
        preallocate pack them."""
        for prev, cur in zip(states, states[1:]):
            if self.arenas.adjacent(prev, cur):
                continue
            where, before = self.arenas.locate(cur), self.arenas.locate(prev)
            if where is None or before is None or where[1] != 0:
                return False
            if before[1] + prev.numel() * prev.element_size() != before[0].numel():
                return False
        return all(self.arenas.locate(s) is not None for s in states[:1])

    def release_emptied(self) -> None:
        """Let go of the arenas no state lies in any more (a re-layout moved them all out)."""
        if len(self.arenas):
            self.arenas.prune(
                [t for e in self.host.values() for t in e.locals]
                + [local(t) for st in self.pre_placed.values() for t in st.values()]
            )

    def move(self, placed: list[tuple[torch.Tensor, str, torch.Tensor, int]], nbytes: int) -> None:
        """Copy the ``placed`` states into one new arena at their offsets; opt.state points at the copies."""
        if not placed:
            return
        base = self.arenas.allocate(nbytes)
        moved: dict[torch.Tensor, None] = {}
        for j, (p, key, stored, offset) in enumerate(placed):
            placed[j] = None  # type: ignore[call-overload]  # the old copy is let go of once moved (relayout)
            if isinstance(stored, _ToCome):  # room for a state the first step creates: nothing to copy
                self.pre_placed.setdefault(p, {})[key] = self.arenas.place(base, offset, p, stored.dtype)
                continue
            new = self.arenas.place(base, offset, stored, local(stored).dtype)
            local(new).copy_(local(stored))
            self.put(p, key, new)
            moved[p] = None
        del stored
        for p in moved:
            self.cache_host(p, quiet=True)

    def states_to_come(self, p: torch.Tensor, gi: int, gathered: bool) -> list[tuple[str, torch.dtype]]:
        """(key, dtype) of the param-shaped states the first step will create for p, when preallocate would
        place them in an arena (an element-wise optimizer, a probe that knows them, a grad laid out like p);
        else none."""
        if not self.elementwise or gathered or not local(p).numel():
            return []
        probed = self.probe(p, gi)
        if probed is None or not all(shaped for _, _, shaped in probed[1]):
            return []
        return [(key, dtype) for key, dtype, _ in probed[1]]

    def probe(self, p: torch.Tensor, gi: int) -> tuple[int, tuple] | None:
        loc = local(p)
        dtype = self.ctx.masters.state_dtype(p)  # fp32 for a param stepped through its master
        key = (gi, dtype, loc.dim(), loc.device.type)
        if key not in self.probe_cache:
            self.probe_cache[key] = hoststate.probe_states(
                self.ctx.optimizer, self.param_groups[gi], p, self.ctx.step_fn, dtype=dtype
            )
        return self.probe_cache[key]

    def state_bytes(self, p: torch.Tensor, gi: int) -> tuple[int, int]:
        """Swapped state bytes of p and their count: exact once it has states, probed (or guessed) before."""
        entry = self.host.get(p)
        if entry is not None and self.has_states(p):
            return entry.nbytes, len(entry.keys)
        # Before p has states: its master (if any) and the states the probe says the first step creates.
        base, count = (entry.nbytes, len(entry.keys)) if entry is not None else (0, 0)
        if self.state.get(p):  # resident: states already on the device
            swapped = [v for k, v in self.state[p].items() if is_swapped_state(p, k, v)]
            return sum(hoststate.state_nbytes(v) for v in swapped), len(swapped)
        loc = local(p)
        dtype = self.ctx.masters.state_dtype(p)
        sized_key = ("sized", gi, dtype, tuple(loc.shape), loc.device.type)
        if sized_key not in self.probe_cache:  # states whose kind depends on p's size (hoststate.sized_probe)
            self.probe_cache[sized_key] = hoststate.sized_probe(
                self.ctx.optimizer, self.param_groups[gi], p, self.ctx.step_fn, dtype=dtype
            )
        sized = self.probe_cache[sized_key]
        if sized is not None:
            return base + sized[0], count + sized[1]
        probed = self.probe(p, gi)
        if probed is None:  # Adam-like guess: two states of the dtype p steps in
            name = type(self.ctx.optimizer).__name__
            logger.debug("swapopt: could not probe {}; assuming two param-like states", name)
            return base + loc.numel() * 2 * self.ctx.masters.state_dtype(p).itemsize, count + 2
        return base + loc.numel() * probed[0], count + len(probed[1])

    def preallocate(self, prep: Prepared) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Pinned host tensors for the param-shaped states an element-wise optimizer will create this
        step for params that have none yet (known from the probe)."""
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        if not self.elementwise or prep.preallocated:
            return out
        for group in self.arena_groups(prep.plan):
            # Params whose states are all param-shaped go into one arena per group of chunks (see relayout),
            # at the offsets their regions take in the slot, so each chunk's states later move in one copy
            # per run (swapopt.arena); a split param's states lie whole where its first piece is.
            placed: list[tuple[torch.Tensor, str, torch.dtype]] = []
            sizes: list[tuple[int, int]] = []
            for piece in (pc for chunk in group for pc in chunk.pieces):
                i = piece.index
                p = prep.params[i]
                if p in out or self.has_states(p) or p in self.resident or self.state.get(p):
                    continue
                if p in self.pre_placed:  # laid out beside its master by relayout
                    out[p] = self.pre_placed.pop(p)
                    continue
                probed = self.probe(p, prep.groups[i])
                if probed is None:
                    continue
                loc = local(p)
                gathered = prep.flat[i] and p.grad is not None and not hoststate.same_layout(local(p.grad), loc)
                if piece.start > 0 or gathered or not all(shaped for _, _, shaped in probed[1]):
                    out[p] = {key: new_host_like(p, dtype) for key, dtype, shaped in probed[1] if shaped}
                    continue
                out[p] = {}
                for key, dtype, _ in probed[1]:
                    placed.append((p, key, dtype))
                    sizes.append((loc.numel() * itemsize(dtype), itemsize(dtype)))
            if flat_update.ENABLED:
                order = _by_key(list(range(len(placed))), [key for _, key, _ in placed])
                placed, sizes = [placed[i] for i in order], [sizes[i] for i in order]
            for members, offsets, size in pack(sizes, self.arena_limit):
                self.place([(*placed[i], offset) for i, offset in zip(members, offsets)], size, out)
        self.arenas.pin_pending()
        # Every param had its states: while this plan holds (same state dicts, see still_valid) none lacks any.
        prep.preallocated = not out
        return out

    def place(self, placed: list, nbytes: int, out: dict) -> None:
        if placed:
            base = self.arenas.allocate(nbytes)
            for p, key, dtype, offset in placed:
                out[p][key] = self.arenas.place(base, offset, p, dtype)

    def regions(
        self, pieces, params: list[torch.Tensor], flat: list[bool], gather: list[bool], upcast: list[bool]
    ) -> list[Region]:
        """Slot layout of one chunk: one region per (piece, host state), in piece order, plus one for
        the gathered grad of a piece whose grad is laid out unlike its param, or its grad upcast to fp32
        for its master (Note [master weights])."""
        regions: list[Region] = []
        offset = 0

        def add(r: Region) -> None:
            nonlocal offset
            if regions and self.arenas.adjacent(regions[-1].host, r.host):
                # packed like its arena, so both move in one copy (swapopt.arena); never more than padded
                r.offset = regions[-1].offset + regions[-1].nbytes
            regions.append(r)
            offset = -(-(r.offset + r.nbytes) // _SLOT_ALIGN) * _SLOT_ALIGN

        # Piece by piece, or with the flat update on key by key (Note [flat chunk update] in swapopt.flat):
        # every piece's first state, then every piece's second, ...; either way as relayout and preallocate
        # pack the arenas, so the chunk moves in one run where its arena is contiguous. Key by key is not the
        # default because a re-layout then empties no old arena until late (each new arena gathers one key
        # from all of them), which holds more host memory at once (Note [arena memory]).
        entries = [self.host.get(params[pc.index]) for pc in pieces]
        todo = [(pos, j) for pos, entry in enumerate(entries) if entry is not None for j in range(len(entry.keys))]
        if flat_update.ENABLED:
            _by_key(todo, [entries[pos].keys[j] for pos, j in todo])
        for pos, j in todo:
            piece, entry = pieces[pos], entries[pos]
            key, stored, loc = entry.keys[j], entry.stored[j], entry.locals[j]
            if flat[piece.index]:
                host = hoststate.flat_view(loc)[piece.start : piece.stop]
                shape, stride, layout = None, None, None
            else:
                host = loc
                shape, stride = tuple(loc.shape), tuple(loc.stride())
                layout = stored if hoststate.is_dtensor(stored) else None
            nbytes = host.numel() * host.element_size()
            add(Region(pos, key, offset, nbytes, host.dtype, shape, host, layout, stride))
        for pos, piece in enumerate(pieces):
            p = params[piece.index]
            if upcast[piece.index]:  # flat like the piece, or shaped and laid out like the whole param
                loc = local(p)
                shape, stride = (None, None) if flat[piece.index] else (tuple(loc.shape), hoststate.layout_strides(loc))
                add(Region(pos, GRAD, offset, piece.numel * 4, torch.float32, shape, None, None, stride))
            elif gather[piece.index]:
                g = p.grad
                add(Region(pos, GRAD, offset, piece.numel * g.element_size(), g.dtype, None, None, None, None))
        return regions
