"""One swapped step, run chunk by chunk through the device (``StepRun``).

Stages of a step (chunk k uses staging slot k % S; swapopt.operate orders the streams):

1. Swap-in: the first S-1 chunks' host states are queued host -> slot on the H2D stream, one copy per
   merged arena run (swapopt.arena) plus one per state outside a run.
2. Resident update: params whose states live on the device (resident_mb) are stepped while those
   copies are in flight.
3. For each chunk k: queue the swap-in of chunk k+S-1, then bind the pieces' inputs (the targets and
   group copies of ChunkInputs and the states as views into the slot, ChunkViews, built once per plan;
   the grad views of flat pieces, bound per step; the state dicts, kept from the last step for a chunk
   of whole params whose states are unchanged), run the wrapped optimizer's raw step on them, and
4. swap out: queue slot -> host copies on the D2H stream after the update, and publish the scalar
   states (step counts) and newly created host states of every param whose last piece this was.
5. Finish: the staging's memory is released stream-safely (the slot tensors and their views stay, Note
   [persistent slots] in swapopt.operate) and per-param events are kept; no device-wide sync.

``prefetch`` issues stage 1 ahead of the step (after the forward, so the copies run under the loss and
the backward): the step adopts its slots and views when it runs the very plan they were made for.

``pending``, ``views`` and ``progress`` are what the stages thread through: the host states created
this step (published when their param is fully stepped), each in-flight chunk's views, and the stage
reached, which the failure path (swapopt.recovery, Note [failure semantics]) reads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

import device
from swapopt import direct, flat, hoststate, inner, internals, recovery, subclass_state
from swapopt.arena import itemsize
from swapopt.hoststate import is_swapped_state, local, new_host_like, wrap_like
from swapopt.context import StepContext
from swapopt.cut_pieces import CutPieces
from swapopt.direct import DirectStep
from swapopt.flat import FlatStep
from swapopt.layout import GRAD, HostLayout, Prepared, Region, same_objects
from swapopt.masters import MASTER


def _split_plan(regions: list[Region], slot_bytes: int) -> list[tuple[torch.dtype, list[int], list[tuple[int, int]]]]:
    """Per dtype: the sizes that cut the slot's typed view into its 1-D regions and the gaps between
    them, and (region index, part index) of each region. Regions laid out otherwise, out of order or
    misaligned are left to region_view."""
    by_dtype: dict[torch.dtype, list[tuple[int, Region]]] = defaultdict(list)
    for i, r in enumerate(regions):
        flat = r.shape is None or (len(r.shape) == 1 and tuple(r.stride) == (1,))
        if r.nbytes and flat and r.offset % itemsize(r.dtype) == 0 and r.nbytes % itemsize(r.dtype) == 0:
            by_dtype[r.dtype].append((i, r))
    out = []
    for dtype, rs in by_dtype.items():
        if len(rs) < 2:
            continue
        size = itemsize(dtype)
        sizes: list[int] = []
        picks: list[tuple[int, int]] = []
        pos = 0
        for i, r in rs:
            start = r.offset // size
            if start < pos:  # out of order: keep the per-region views
                break
            if start > pos:
                sizes.append(start - pos)
            picks.append((i, len(sizes)))
            sizes.append(r.nbytes // size)
            pos = start + r.nbytes // size
        else:
            total = slot_bytes // size
            if total < pos:
                continue
            if total > pos:
                sizes.append(total - pos)
            out.append((dtype, sizes, picks))
    return out


class ChunkViews(list):
    """Per piece of one chunk: {key: (value the optimizer sees, slot view, host view)}; ``runs``: the
    (host, slot) byte views of the chunk's merged copies; ``h2d``: the (slot, host) copies of its swap-in.
    Made once per plan and slot tensor (kept on the Prepared, Note [persistent slots] in swapopt.operate)
    and never changed after: every step's memory of ``slot`` is seen through the same views."""

    runs: list[tuple[torch.Tensor, torch.Tensor]]
    h2d: list[tuple[torch.Tensor, torch.Tensor]]
    slot: torch.Tensor | None


def real_states(ctx: StepContext, params: Iterable[torch.Tensor]) -> defaultdict:
    """A state mapping over the real per-param dicts, without creating entries torch would not."""
    chunk_state: defaultdict = defaultdict(dict)
    for p in params:
        if p in ctx.state:
            chunk_state[p] = ctx.state[p]
    return chunk_state


def keep_new_states(ctx: StepContext, chunk_state: dict) -> None:
    """Entries the inner optimizer created in a mapping from real_states become real ones."""
    for p, st in chunk_state.items():
        if p not in ctx.state:
            ctx.state[p] = st


def step_in_place(ctx: StepContext, by_group: dict[int, list[torch.Tensor]], kwargs: dict) -> None:
    """Step params where they are (params in host memory, or no accelerator), each low-precision param
    through its master when master_weights is on (Note [master weights]: the master stays in host memory)."""
    masters = ctx.masters
    params = [p for ps in by_group.values() for p in ps]
    stand_in: dict[torch.Tensor, torch.Tensor] = {}  # param -> the master stepped for it
    for p in params:
        if masters.wanted(p):
            masters.ensure(p)
            m = masters.get(p)
            if p not in masters.ready:
                masters.init_from(p, m)
            m.grad = p.grad.float()
            if masters.inv_scale is not None:
                internals.amp_unscale_([m.grad], masters.inv_scale)
            stand_in[p] = m
    if not stand_in:
        chunk_state = real_states(ctx, params)
        inner.run_inner(ctx, by_group, chunk_state, kwargs)
        keep_new_states(ctx, chunk_state)
        return
    chunk_state: defaultdict = defaultdict(dict)
    for p in params:
        if p in ctx.state:  # the real dicts: states are updated where they live
            chunk_state[stand_in.get(p, p)] = ctx.state[p]
    inner.run_inner(ctx, {gi: [stand_in.get(p, p) for p in ps] for gi, ps in by_group.items()}, chunk_state, kwargs)
    for p in params:
        t = stand_in.get(p, p)
        if t in chunk_state and p not in ctx.state:
            ctx.state[p] = chunk_state[t]
    for p, m in stand_in.items():
        local(p).detach().copy_(local(m))
        m.grad = None


class ChunkInputs:
    """What the inner optimizer is handed for one chunk, built once per plan (kept on the Prepared) and
    reused every step while the plan holds: the tensor stepped for each piece (the param itself when it
    is not split, else a flat view of its range), and copies of the chunk's param groups over those
    tensors. Per step only the flat pieces' grads are bound and the groups' other values refreshed (a
    scheduler writes group["lr"] between steps). A param stepped through its master (Note [master weights])
    is stood for by its master's view into the slot, so the inputs hold only for the views they were made
    with (``views``)."""

    def __init__(self, run: "StepRun", k: int, views: Any) -> None:
        prep = run.prep
        self.targets: list[torch.Tensor] = []
        self.bound: list[tuple[int, int, torch.Tensor, int]] = []  # flat pieces: (position, param index, local param, its address)
        self.masters: list[int] = []  # positions of the pieces stepped through their masters
        self.views = None  # the chunk views the master targets look into (None: the chunk has no master)
        for pos, piece in enumerate(prep.plan.chunks[k].pieces):
            p = prep.params[piece.index]
            master = views[pos].get(MASTER) if views is not None else None
            if master is not None:
                t = master[0]
                self.masters.append(pos)
                self.views = views
            elif prep.flat[piece.index]:
                loc = local(p)
                t = hoststate.flat_view(loc.detach())[piece.start : piece.stop]
                self.bound.append((pos, piece.index, loc, loc.data_ptr()))
            else:
                t = p
            self.targets.append(t)
        pieces = prep.plan.chunks[k].pieces
        # Every piece a whole param and every state region moved by a run: when the inner step updated all
        # it was handed in place and added nothing, the chunk's swap-out is its runs and nothing is published
        # (StepRun.stepped_in_place), without looking at its pieces one by one.
        regions = prep.regions[k]
        moved = [i for i, r in enumerate(regions) if r.nbytes and r.host is not None]
        self.simple = (
            not self.bound
            and all(prep.is_whole(pc) for pc in pieces)
            and all(r.key != GRAD for r in regions)
            and bool(prep.runs[k])
            and set(moved) <= prep.covered[k]
        )
        # Note [mixed chunks]: a chunk that also holds pieces of cut params (or other pieces whose inputs are
        # bound per step) steps its plain whole params as a simple chunk does (kept dicts, the direct step) and the
        # rest, the ``cut`` positions, in a second call, their dicts made each step: a direct step over them where
        # the optimizer has one (Note [direct step]), else the inner step. Both calls are the chunk's inner update
        # (Note [failure semantics]); each param's update reads only its own states and the group's values, so the
        # split changes no result, as cutting params into chunks does not. Before, one cut piece sent every param
        # of its chunk through the inner step with dicts made afresh: on the H100 a plan that cuts a param at
        # every chunk boundary (the moe layout at 300 M params, 16 and 64 requested chunks) took 2.3-2.7x the host
        # CPU of the same plan stepped this way (bench/results/cuda-h100-2026-11-27-host.md).
        # A chunk of cut pieces alone (the middle of a param larger than a chunk, or the ends of two) is all ``cut``
        # positions and keeps no dict: its pieces' dicts are made from the plan (Note [cut pieces]).
        self.cut: list[int] = []
        bound = {pos for pos, _, _, _ in self.bound}
        if not self.simple and not self.masters and len(bound) == len(pieces):
            self.cut = list(range(len(pieces)))
        elif not self.simple and not self.masters and bool(prep.runs[k]):
            whole = [pos for pos, pc in enumerate(pieces) if pos not in bound and prep.is_whole(pc)]
            plain = set(whole)
            if whole and len(whole) < len(pieces) and all(
                i in prep.covered[k] for i in moved if regions[i].piece in plain
            ) and not any(r.key == GRAD and r.piece in plain for r in regions):
                self.cut = [pos for pos in range(len(pieces)) if pos not in plain]
        cut = set(self.cut)
        self.keeps = self.simple or bool(self.cut)  # the dicts of the kept positions are kept between steps
        # the positions whose dicts are kept (all of the chunk's but the cut ones) and the group copies of each side
        self.kept_positions = [pos for pos in range(len(pieces)) if pos not in cut]
        self.kept_targets = [self.targets[pos] for pos in self.kept_positions]
        self.order, self.members, self.groups = self._group_copies(run, pieces, self.kept_positions)
        self.cut_order, self.cut_members, self.cut_groups = self._group_copies(run, pieces, self.cut)
        self.kept: tuple | None = None  # see keep_states
        self.direct: DirectStep | None = None  # the kept dicts' lists for a direct step (Note [direct step])
        self.flat: FlatStep | None = None  # the kept dicts' flat tensors (Note [flat chunk update])
        self.direct_for: dict | None = None  # the kept dicts those lists were gathered from
        self.cut_pieces: CutPieces | None = None  # the cut positions' entries (Note [cut pieces])

    def _group_copies(
        self, run: "StepRun", pieces: Any, positions: list[int]
    ) -> tuple[list[int], list[list[torch.Tensor]], list[dict]]:
        """For the pieces at ``positions``: the indices of their param groups, in order, each group's targets (in
        piece order), and a copy of each group over them."""
        members: dict[int, list[torch.Tensor]] = defaultdict(list)
        for pos in positions:
            members[run.prep.groups[pieces[pos].index]].append(self.targets[pos])
        order = sorted(members)
        lists = [members[gi] for gi in order]
        return order, lists, [dict(run.ctx.param_groups[gi], params=ps) for gi, ps in zip(order, lists)]

    def keep_states(self, chunk_state: dict, handed: tuple, views: Any, direct_ok: bool = False) -> None:
        """A simple chunk's update left every state dict as handed (StepRun.stepped_in_place): keep the dicts
        for the next step. Each holds the slot views (fixed per plan, Note [persistent slots]) and the
        param's own scalar states. ``direct_ok``: the inner step has a direct form (swapopt.direct), whose
        lists are gathered from the kept dicts once, here."""
        if len(chunk_state) == len(self.kept_targets):  # a param without state: built afresh each step
            if self.direct_for is not chunk_state:
                self.direct = DirectStep.build(self.members, self.groups, chunk_state) if direct_ok else None
                self.flat = (
                    FlatStep.build(self.kept_targets, self.groups, chunk_state)
                    if flat.ENABLED and self.direct is not None
                    else None
                )
                self.direct_for = chunk_state
            self.kept = (chunk_state, handed, views)

    def take_states(self, views: Any, states_held: bool) -> tuple[dict, tuple] | None:
        """The state dicts kept by keep_states and what they were handed as, when they were made for these
        views and ``states_held``: the params' own state dicts still hold the very values they were made
        from (the plan's cache check covers the dicts and their swapped states, ScalarWatch the rest).
        Taken: a failing update leaves nothing kept."""
        kept, self.kept = self.kept, None
        if kept is None or kept[2] is not views or not states_held:
            return None
        return kept[0], kept[1]

    def valid(self, prep: Prepared, views: Any) -> bool:
        """The flat views still look at their params' memory (``p.data = ...`` rebinds it), and the master
        targets at this step's slot views."""
        if self.views is not None and self.views is not views:
            return False
        for _, i, loc, ptr in self.bound:
            now = local(prep.params[i])
            if now is not loc or now.data_ptr() != ptr:
                return False
        return True

    def refresh(self, ctx: StepContext) -> list[dict]:
        """The group copies with the groups' current values (and the step's hyperparameter copies); the cut
        positions' copies (Note [mixed chunks]) likewise."""
        hyper = ctx.hyper
        for order, copies in ((self.order, self.groups), (self.cut_order, self.cut_groups)):
            for i, (gi, copy) in enumerate(zip(order, copies)):
                ps = copy["params"]
                orig = ctx.param_groups[gi]
                copy.update(orig)
                if len(copy) != len(orig):  # a key was removed from the group: copy it afresh
                    copy = copies[i] = dict(orig)
                copy["params"] = ps
                if hyper:
                    copy.update(hyper.get(gi, ()))
        return self.groups

    def unbind(self) -> None:
        """Drop the flat pieces' grads: a cached view must not keep a grad (or a slot) alive between steps."""
        for pos, _, _, _ in self.bound:
            self.targets[pos].grad = None
        for pos in self.masters:
            self.targets[pos].grad = None


# Note [snapshot batches]: the failure path's copy of the step counts (StepRun.snapshot_scalars) is a stack of
# them, whose host cost grows with the tensors it stacks (torch.stack's launcher walks every one: 3,282 step counts
# of the 3,299-tensor MoE layout cost the simulated H100 host 1.9 ms). Taken as one stack before the first update,
# as it was, that cost sat between the first two swap-ins and the rest of the step, and the link idled for it
# (1.7 ms of a 19 ms step). So the chunks are stacked in batches, each just before the update of its first chunk
# that takes a copy (chunks stepped by the direct fused calls alone take none, Note [undone step counts] in
# swapopt.internals):
# the first batch up to SNAPSHOT_FIRST_BATCH tensors, each later one up to twice the one before (always at least
# one chunk), so a batch's host cost grows as the copies already queued ahead of it do (ramp chunks double too,
# Note [ramp] in swapopt.plan), and a plan stacks in a few launches: 3 for 291 step counts, 6 for 3,282. The
# first batch is small because the first update waits for it with only the first swap-ins queued: at 256 tensors
# it held one FSDP2 rank's first three chunks (246 step counts, 148 us of the simulated H100's host) and the
# swap-out lane started 200 us into the step; at 64, 60 us.
SNAPSHOT_FIRST_BATCH = 64


class ScalarRows:
    """Rows of a snapshot stack (StepRun.snapshot_scalars), cut out when iterated: only a failing update reads
    them back (Note [failure semantics]), so a step that succeeds makes no view per tensor."""

    def __init__(self, stacked: torch.Tensor, rows: list[int]) -> None:
        self.stacked, self.rows = stacked, rows

    def __iter__(self) -> Iterator[torch.Tensor]:
        cut = self.stacked.unbind(0)
        return iter([cut[i] for i in self.rows])

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(eq=False)
class ScalarWatch:
    """The non-swapped states (step counts, Python scalars) in the state dicts of a plan's whole params,
    kept on the Prepared (``scalars``): which tensors a step snapshots, and what tells whether the dicts
    still hold them. Worked out once per plan; a step checks it in one C-level pass."""

    # per entry: the state dict holding it
    dicts: list[dict] = field(default_factory=list)
    # per entry: its key
    keys: list[str] = field(default_factory=list)
    # per entry: its value
    values: list[Any] = field(default_factory=list)
    # the state dicts, each once
    owners: list[dict] = field(default_factory=list)
    # the owners' lengths
    lens: list[int] = field(default_factory=list)
    # per chunk: its entries [a, b) and its owners [c, d)
    bounds: list[tuple[int, int, int, int]] = field(default_factory=list)
    # the chunks [first, stop) one snapshot stacks together (Note [snapshot batches])
    batches: list[tuple[int, int]] = field(default_factory=list)
    # per chunk: its batch
    batch_of: list[int] = field(default_factory=list)
    # per batch, per (device, dtype, shape): the tensor states to stack
    stacks: list[list[list[torch.Tensor]]] = field(default_factory=list)
    # per chunk: (its batch's stack, its states, rows)
    rows: list[list[tuple[int, list[torch.Tensor], list[int]]]] = field(default_factory=list)

    @classmethod
    def of(cls, prep: Prepared, state: Any) -> "ScalarWatch":
        watch = cls()
        per_chunk: list[dict[tuple, list[torch.Tensor]]] = []  # per chunk, per (device, dtype, shape)
        for chunk in prep.plan.chunks:
            a, c = len(watch.values), len(watch.owners)
            tensors: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for piece in chunk.pieces:
                p = prep.params[piece.index]
                own = state.get(p)
                if not own or not prep.is_whole(piece):
                    continue
                watch.owners.append(own)
                for key, value in own.items():
                    tensor = isinstance(value, torch.Tensor)
                    if tensor and is_swapped_state(p, key, value):
                        continue
                    if tensor:
                        tensors[(value.device, value.dtype, value.shape)].append(value)
                    watch.dicts.append(own)
                    watch.keys.append(key)
                    watch.values.append(value)
            watch.bounds.append((a, len(watch.values), c, len(watch.owners)))
            per_chunk.append(tensors)
        watch.lens = list(map(len, watch.owners))
        counts = [sum(map(len, tensors.values())) for tensors in per_chunk]
        cap, k = SNAPSHOT_FIRST_BATCH, 0
        while k < len(per_chunk):  # Note [snapshot batches]
            stop, size = k + 1, counts[k]
            while stop < len(per_chunk) and size + counts[stop] <= cap:
                size += counts[stop]
                stop += 1
            watch.batches.append((k, stop))
            k, cap = stop, 2 * cap
        for b, (first, stop) in enumerate(watch.batches):
            keys: dict[tuple, int] = {}
            stacks: list[list[torch.Tensor]] = []
            for j in range(first, stop):
                rows = []
                for key, values in per_chunk[j].items():
                    si = keys.setdefault(key, len(stacks))
                    if si == len(stacks):
                        stacks.append([])
                    start = len(stacks[si])
                    stacks[si].extend(values)
                    rows.append((si, values, list(range(start, start + len(values)))))
                watch.rows.append(rows)
                watch.batch_of.append(b)
            watch.stacks.append(stacks)
        return watch

    def changed(self) -> set[int]:
        """The chunks where a state dict no longer holds the very values (or as many entries) it did;
        empty, from one C-level pass, when none changed (an optimizer that replaced a scalar state, a new
        state, a value set by hand)."""
        now, lens = list(map(dict.get, self.dicts, self.keys)), list(map(len, self.owners))
        if same_objects(now, self.values) and lens == self.lens:
            return set()
        return {
            k for k, (a, b, c, d) in enumerate(self.bounds)
            if not same_objects(now[a:b], self.values[a:b]) or lens[c:d] != self.lens[c:d]
        }


class StepRun:
    """One swapped step over a prepared plan (stages in the module docstring)."""

    def __init__(
        self, ctx: StepContext, layout: HostLayout, prep: Prepared, kwargs: dict, prefetched: Any = None,
        capturing: bool = False,
    ) -> None:
        self.ctx = ctx
        self.prefetched = prefetched  # operate.Prefetched made for this plan: stage 1 already issued
        self.layout = layout
        self.op = ctx.operate
        self.prep = prep
        self.kwargs = kwargs
        self.pending: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.views: list[ChunkViews | None] = [None] * len(prep.plan.chunks)
        # progress["stage"]: (stage, k) of the chunk being worked on; progress["chunk"]: what completing
        # chunk k needs once its inner update returned (see Note [failure semantics]).
        self.progress: dict[str, Any] = {"stage": ("done", -1)}
        self.snapshots: list[list] | None = None  # per chunk: (own scalars, their old values); see snapshot_scalars
        self.stale: set[int] | None = None  # chunks whose non-swapped states changed since the last step (None: all)
        self.h2d = 0
        self.d2h = 0
        self.typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # see region_view
        self.direct_ok = not kwargs and direct.supported(ctx.optimizer, ctx.step_fn)  # Note [direct step]
        self.scratch_live: torch.Tensor | None = None  # the flat updates' scratch, while it has memory
        # Note [graphed step] (swapopt.graphed): ``capturing``, this run is being captured (its device work is
        # recorded, not done); ``steady``, it made no Python-side change a replay would not make again: no state
        # created or replaced by another tensor, the scalar states the ones of the last step, published in place, no
        # resident update, no keyword arguments
        self.capturing = capturing
        self.steady = not kwargs
        # with step_graph, a cut param's scalars (its step count) are published into the tensors it has, not as
        # new tensors, so its state dict holds the same objects from step to step (Note [graphed step])
        self.in_place_scalars = ctx.settings.step_graph

    def run(self) -> None:
        op, prep = self.op, self.prep
        n = len(prep.plan.chunks)
        try:
            pf = self.prefetched
            op.begin(n, prep.slot_bytes, device.torch_device(self.ctx.device), pf)
            ready = (pf.payload or {}) if pf is not None else {}  # empty when begin discarded it
            if op.overlap:  # zero_grad(set_to_none=True) may free them before the update read them
                for p in prep.params:
                    op.keep_for_update(p.grad)
            lookahead = op.nslots - 1
            for j in range(min(lookahead, n)):  # stage 1 (done ahead for the chunks prefetched)
                views = ready.get(j)
                if views is None:
                    views = self.swap_in(j)
                else:
                    self.h2d += prep.h2d_bytes[j]  # counted once per step: at the step that uses them
                self.views[j] = views
            if prep.resident:  # stage 2, while the first swap-ins are in flight
                self.steady = False  # the inner step over the resident params' own dicts: not looked into
                self.update_resident()
            for k in range(n):  # stages 3 and 4
                if k + lookahead < n:
                    self.views[k + lookahead] = self.swap_in(k + lookahead)
                self.update_and_swap_out(k)
                self.views[k] = None
            op.finish(prep.last_chunk, prep.resident)  # stage 5
            self.free_scratch()
        except BaseException as exc:  # Note [failure semantics]
            self.views.clear()
            self.typed.clear()
            self.unbind_all()
            self.free_scratch()
            if not self.capturing:
                recovery.recover(self)
            self.pending.clear()
            self.progress.clear()
            self.layout.pre_hosts = {}
            if not self.capturing:  # else nothing ran on the device: GraphedStep.capture lets the staging go
                op.release_staging()
            recovery.drop_frames(exc)
            raise

    def scratch(self, nbytes: int) -> torch.Tensor:
        """The flat updates' scratch buffer (Note [flat chunk update]), given at least ``nbytes`` of memory on
        the current (the update's) stream at its first use in the step. The tensor outlives the step without
        its memory, like the slots (Note [persistent slots] in swapopt.operate), so views of it are made once;
        it grows (a new tensor) when a chunk needs more."""
        live = self.scratch_live
        if live is not None and live.nbytes >= nbytes:
            return live
        prep = self.prep
        kept = prep.scratch
        if kept is not None and kept.nbytes >= nbytes:
            device.alloc_storage(kept, kept.nbytes)
        else:
            if live is not None:  # too small for this chunk: a larger one from here on
                self.free_scratch()
            kept = prep.scratch = torch.empty(nbytes, dtype=torch.uint8, device=device.torch_device(self.ctx.device))
        self.scratch_live = kept
        return kept

    def free_scratch(self) -> None:
        """The scratch's memory goes back to the allocator: only the update's stream, where it was allocated,
        used it, so its queued work is ordered before any reuse."""
        live, self.scratch_live = self.scratch_live, None
        if live is not None:
            device.free_storage(live)

    # ----- stage 1: swap-in ---------------------------------------------------------------------
    def region_view(self, r: Region, slot: torch.Tensor | None) -> torch.Tensor:
        """The slot memory of region r, typed and laid out like the host tensor it mirrors: one view op
        on a typed view of the whole slot (made once per plan, see chunk_views)."""
        if slot is None or r.nbytes == 0:  # nothing to stage (zero-element states): an empty tensor
            shape = r.shape if r.shape is not None else (0,)
            stride = r.stride if r.stride is not None else (1,)
            return torch.empty_strided(shape, stride, dtype=r.dtype, device=device.torch_device(self.ctx.device))
        size = itemsize(r.dtype)
        if r.offset % size:  # never with the plan's alignment; kept exact anyway
            v = slot[r.offset : r.offset + r.nbytes].view(r.dtype)
            return v.as_strided(r.shape, r.stride) if r.shape is not None else v
        typed = self.typed_slot(slot, r.dtype)
        if r.shape is None:
            return typed.as_strided((r.nbytes // size,), (1,), r.offset // size)
        return typed.as_strided(r.shape, r.stride, r.offset // size)

    def typed_slot(self, slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The whole slot viewed as ``dtype`` (its trailing bytes short of one element left out), made once
        per (slot, dtype) while views are made: every region view of that dtype is one op on it."""
        key = (slot.data_ptr(), dtype)
        typed = self.typed.get(key)
        if typed is None:
            size = itemsize(dtype)
            typed = self.typed[key] = slot[: slot.numel() - slot.numel() % size].view(dtype)
        return typed

    def split_views(self, k: int, slot: torch.Tensor) -> dict[int, torch.Tensor]:
        """Slot views of chunk k's 1-D regions, one split op per dtype instead of one view op per region
        (the split sizes, gaps included, are worked out once per plan and kept on the Prepared)."""
        prep = self.prep
        plan = prep.splits[k]
        if plan is None:
            plan = prep.splits[k] = _split_plan(prep.regions[k], slot.numel())
        out: dict[int, torch.Tensor] = {}
        for dtype, sizes, picks in plan:
            parts = self.typed_slot(slot, dtype).split_with_sizes(sizes)
            for i, j in picks:
                out[i] = parts[j]
        return out

    def swap_in(self, k: int, ahead: bool = False) -> ChunkViews:
        """Chunk k's slot views (see chunk_views), with the H2D copies filling them queued. ``ahead``: into
        the prefetched slots (see prefetch), counted by the step that uses them."""
        prep = self.prep
        slot = self.op.prefetch_slot(k) if ahead else self.op.slot(k)
        views = prep.views[k]
        if views is None or views.slot is not slot:
            views = prep.views[k] = self.chunk_views(k, slot)
        if ahead:
            self.op.prefetch_in(k, views.h2d)
        else:
            self.op.swap_in(k, views.h2d)
            self.h2d += prep.h2d_bytes[k]
        return views

    def chunk_views(self, k: int, slot: torch.Tensor | None) -> ChunkViews:
        """Per piece of chunk k: {key: (value the optimizer sees, slot view, host view the swap-out
        writes)}, and the copies of its swap-in: made once per plan and slot tensor."""
        prep = self.prep
        chunk = prep.plan.chunks[k]
        views = ChunkViews({} for _ in chunk.pieces)
        views.slot = slot
        covered = prep.covered[k]
        # a run's bytes: one copy per direction for the regions it covers
        views.runs = [(run.host, slot[run.offset : run.offset + run.nbytes]) for run in prep.runs[k]] if slot is not None else []
        copies = [(dev, host) for host, dev in views.runs]
        split = self.split_views(k, slot) if slot is not None else {}
        for i, r in enumerate(prep.regions[k]):
            v = split.get(i)
            if v is None:
                v = self.region_view(r, slot)
            moved = i in covered and slot is not None
            host = None if moved else r.host  # None: the swap-out leaves it to the run
            views[r.piece][r.key] = (wrap_like(r.layout, v) if r.layout is not None else v, v, host)
            if host is not None and r.nbytes:
                copies.append((v, host))
        views.h2d = copies
        return views

    # ----- stage 2: resident update ---------------------------------------------------------------
    def update_resident(self) -> None:
        prep = self.prep
        with self.op.updating(None, "swapopt.update[resident]"):
            chunk_groups: dict[int, list[torch.Tensor]] = defaultdict(list)
            for i in prep.plan.resident:
                chunk_groups[prep.groups[i]].append(prep.params[i])
            # the real dicts: resident states are updated where they live
            chunk_state = real_states(self.ctx, (prep.params[i] for i in prep.plan.resident))
            inner.run_inner(self.ctx, chunk_groups, chunk_state, self.kwargs)
            keep_new_states(self.ctx, chunk_state)

    # ----- stage 3: update ----------------------------------------------------------------------
    def inputs(self, k: int) -> ChunkInputs:
        """Chunk k's cached inputs (ChunkInputs), built at the plan's first step."""
        cache = self.prep.inputs
        ci = cache[k]
        if ci is None or not ci.valid(self.prep, self.views[k]):
            ci = cache[k] = ChunkInputs(self, k, self.views[k])
        return ci

    def unbind_all(self) -> None:
        for ci in self.prep.inputs:
            if ci is not None:
                ci.unbind()

    def piece_input(
        self, piece, views: dict[str, tuple], t: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """The tensor the inner optimizer steps for one piece and its state dict (None when p has no
        state entry): swapped states are the device views in ``views``; scalar states are the param's
        own when the piece is the whole param (restored from the step's snapshot if its update fails,
        see snapshot_scalars), clones for a piece of a split param (written back once it is done).
        ``t``: the piece's cached target (ChunkInputs); None makes a fresh one (the failure path)."""
        prep, state = self.prep, self.ctx.state
        p = prep.params[piece.index]
        whole = prep.is_whole(piece)
        master = views.get(MASTER)
        if master is not None:
            t = self.master_input(piece, p, views, master[0], master[1])
        elif prep.flat[piece.index]:  # a leaf view of the flat range in memory order, its grad likewise
            if t is None:
                t = hoststate.flat_view(local(p).detach())[piece.start : piece.stop]
            g = local(p.grad)
            if GRAD in views:  # laid out unlike p: gather the piece's elements in p's memory order
                buf = views[GRAD][1]
                order = hoststate.memory_order(local(p))
                hoststate.gather_range(buf, g.permute(order), piece.start, piece.stop)
                t.grad = buf
            else:
                t.grad = hoststate.flat_view(g)[piece.start : piece.stop]
        else:
            t = p
        if p not in state:
            return t, None
        pst: dict[str, Any] = {}
        for key, value in state[p].items():
            if key in views:
                pst[key] = views[key][0]
            elif (parts := subclass_state.staged(key, value, views)) is not None:  # Note [subclass states]
                pst[key] = subclass_state.rebuild(value, {a: entry[0] for a, entry in parts.items()})
            elif isinstance(value, torch.Tensor):
                pst[key] = value if whole else value.clone()
            else:
                pst[key] = value
        return t, pst

    def param_piece(self, piece, p: torch.Tensor) -> torch.Tensor:
        """The piece's range of p's local tensor: flat in memory order for a flat piece, else all of it."""
        loc = local(p).detach()
        return hoststate.flat_view(loc)[piece.start : piece.stop] if self.prep.flat[piece.index] else loc

    def master_input(self, piece, p: torch.Tensor, views: dict[str, tuple], t: torch.Tensor, slot: torch.Tensor):
        """The master of a piece, as the inner optimizer steps it (Note [master weights]): its slot view
        ``t`` (``slot`` its local tensor), made from the param when the master holds no value yet, with
        the piece's grad upcast to fp32 into the slot (gathered in p's memory order when laid out unlike
        p) and unscaled for GradScaler when the step does that itself."""
        masters = self.ctx.masters
        if p not in masters.ready:
            slot.copy_(self.param_piece(piece, p))
        buf = views[GRAD][1]
        g = local(p.grad)
        if not self.prep.flat[piece.index]:
            buf.copy_(g)
        elif self.prep.key[2][piece.index]:
            hoststate.gather_range(buf, g.permute(hoststate.memory_order(local(p))), piece.start, piece.stop)
        else:
            buf.copy_(hoststate.flat_view(g)[piece.start : piece.stop])
        if masters.inv_scale is not None:
            internals.amp_unscale_([buf], masters.inv_scale)
        t.grad = wrap_like(t, buf) if hoststate.is_dtensor(t) else buf
        return t

    def update_and_swap_out(self, k: int) -> None:
        """Run the inner optimizer on chunk k's pieces, then queue their swap-out. ``progress`` tracks
        the stage reached for the failure path (Note [failure semantics])."""
        op, prep, progress, views = self.op, self.prep, self.progress, self.views[k]
        progress["stage"] = ("input", k)
        ci = self.inputs(k)
        targets = ci.targets
        with op.updating(k):
            if self.snapshots is None:  # on the stream of the step's first update, before any of them
                self.snapshots = self.snapshot_scalars()
            kept = ci.take_states(views, self.stale is not None and k not in self.stale) if ci.keeps else None
            if kept is not None:  # the dicts of the last step stand for the states as they are
                chunk_state, handed = kept
            else:
                chunk_state = self.made_states(k, ci.kept_positions, targets)
                handed = self.handed(chunk_state) if ci.keeps else None
            cut_state: defaultdict | None = None
            cuts: CutPieces | None = None
            if ci.cut:  # Note [cut pieces]
                cuts = ci.cut_pieces
                if cuts is None or cuts.views is not views:
                    cuts = ci.cut_pieces = CutPieces.build(prep, k, ci.cut, targets, views, self.ctx.state)
                cut_state = cuts.inputs(self.ctx.state) if cuts is not None else None
                if cut_state is None:
                    cuts = ci.cut_pieces = None  # tried again at the next step: the dicts may have changed
                    cut_state = self.made_states(k, ci.cut, targets)
            groups = ci.refresh(self.ctx)
            fast = ci.direct if self.direct_ok and kept is not None and ci.direct_for is chunk_state else None
            flat = ci.flat if fast is not None else None
            # The step counts' copy for the failure path, taken before the update changes them (copy_counts), but
            # for a chunk that the direct fused calls alone step: they take their adds back themselves (Note
            # [undone step counts] in swapopt.internals).
            undo: list = []
            progress["undo"] = undo

            def copy_counts() -> None:
                progress["scalars"] = self.chunk_snapshot(k)

            if ci.kept_positions and (fast is None or flat is not None):
                copy_counts()
            progress["stage"] = ("update", k)
            # The flat and direct steps update the tensors of their lists in place and never touch a state dict.
            stepped_directly = (
                not ci.kept_positions  # a chunk of cut pieces alone: nothing kept to step
                or flat is not None and flat.run(self.ctx.optimizer, groups, self.scratch)  # Note [flat chunk update]
                or fast is not None and fast.run(self.ctx.optimizer, groups, undo, copy_counts)  # Note [direct step]
            )
            if not stepped_directly:  # steady still where the step left every dict as handed (outputs)
                if "scalars" not in progress:  # the direct step declined: nothing was done
                    copy_counts()
                self.step_made(ci.order, ci.members, groups, chunk_state, bool(ci.masters))
            cut_direct = False
            if cut_state is not None:  # the cut positions: a call of their own (Note [mixed chunks])
                cut_direct = (
                    cuts is not None and self.direct_ok
                    and cuts.run_direct(ci.cut_members, ci.cut_groups, cut_state, self.ctx.optimizer)
                )  # fmt: skip
                if not cut_direct:
                    # steady still where the inner step left the dicts made from the plan's entries as handed; only
                    # step_graph reads steady, so only then is what was handed listed
                    handed_cut = self.handed(cut_state) if self.in_place_scalars else None
                    self.step_made(ci.cut_order, ci.cut_members, ci.cut_groups, cut_state, False)
                    if handed_cut is not None and not self.stepped_in_place(cut_state, handed_cut):
                        self.steady = False
            ci.unbind()  # the update is issued: the cached views let go of this step's grads
            progress["stage"] = ("output", k)
            every = chunk_state if cut_state is None else {**chunk_state, **cut_state}
            progress["chunk"] = (targets, every, views)
            copies, hold, finals = self.outputs(
                k, ci, views, chunk_state, every, handed, stepped_directly, cut_state, cuts if cut_direct else None
            )
            # a run also moves padding: count the bytes of the states it carries
            merged = len(views.runs) if isinstance(views, ChunkViews) else 0
            nbytes = sum(src.numel() * src.element_size() for _, src in copies[merged:])
            nbytes += prep.covered_bytes[k] if merged else 0
        op.swap_out(k, copies, hold)  # stage 4
        for p, scalars in finals:  # the param is fully stepped: publish its scalars and new host states
            self.publish(p, scalars)
        progress["stage"] = ("done", k)
        progress.pop("chunk", None)
        progress.pop("scalars", None)
        progress.pop("undo", None)
        self.d2h += nbytes

    def outputs(
        self, k: int, ci: ChunkInputs, views: Any, chunk_state: dict, every: dict, handed: tuple | None,
        stepped_directly: bool, cut_state: dict | None, cuts: CutPieces | None,
    ) -> tuple[list, list, list]:  # fmt: skip
        """Chunk k's swap-out copies, device tensors to hold and (param, scalars) of params it ends, after its update
        returned: where the kept dicts were stepped as handed, the chunk's runs, the cut positions' own copies and the
        scalars of params they end (from the plan where ``cuts`` stepped them directly, Note [cut pieces]); else every
        piece's (``every``: the kept positions' dicts and the cut ones'), looked at one by one (chunk_output)."""
        if handed is not None and (stepped_directly or self.stepped_in_place(chunk_state, handed)):
            copies, hold, finals = list(views.runs), [], []
            ci.keep_states(chunk_state, handed, views, self.direct_ok)
            if cut_state is not None:
                c, h, f = (
                    cuts.outputs(cut_state) if cuts is not None
                    else self.pieces_output(k, ci.targets, cut_state, views, ci.cut)
                )  # fmt: skip
                copies += c
                hold += h
                finals += f
            return copies, hold, finals
        copies, hold, finals = self.chunk_output(k, ci.targets, every, views)
        if hold:  # the inner step put new tensors in place of states: not assumed to do the same at every step
            self.steady = False
        return copies, hold, finals

    def made_states(self, k: int, positions: list[int], targets: list[torch.Tensor]) -> defaultdict:
        """The state dicts of chunk k's pieces at ``positions``, made this step (piece_input), keyed by the tensors
        stepped."""
        pieces, views = self.prep.plan.chunks[k].pieces, self.views[k]
        made: defaultdict = defaultdict(dict)
        for pos in positions:
            t, pst = self.piece_input(pieces[pos], views[pos], targets[pos])
            if pst is not None:
                made[t] = pst
        return made

    def snapshot_scalars(self) -> list[list | None]:
        """Per chunk, once its batch is stacked: (own tensors, copies) of the scalar tensor states (step counts) that
        its update steps in place, so that a failing update can put them back (Note [failure semantics]). Those are
        the existing non-swapped tensor states of params stepped whole (a split param's pieces step clones). The
        copies are rows of one stack per batch of chunks, device, dtype and shape (Note [snapshot batches]), cut out
        only by a failure (ScalarRows); a batch is stacked before the update of its first chunk that takes a copy
        (chunk_snapshot).
        Also sets ``stale``, the chunks whose whole params' non-swapped states changed since the last step (all of
        them: None), once, before the first update."""
        prep = self.prep
        watch = prep.scalars
        self.stale = watch.changed() if watch is not None else None
        if self.stale is None or self.stale:
            self.steady = False
            watch = prep.scalars = ScalarWatch.of(prep, self.ctx.state)
        return [None] * len(watch.rows)

    def chunk_snapshot(self, k: int) -> list:
        """Chunk k's snapshot (snapshot_scalars), its batch stacked now if it was not yet: on the update stream,
        before chunk k's update and those after it. Rows of the batch's earlier chunks, stepped already by direct
        fused calls (Note [undone step counts] in swapopt.internals), hold their new counts; a failed update reads
        its own chunk's rows only."""
        snapshots = self.snapshots
        if snapshots[k] is None:
            watch = self.prep.scalars
            b = watch.batch_of[k]
            first, stop = watch.batches[b]
            stacked = [torch.stack(values) for values in watch.stacks[b]]
            for j in range(first, stop):
                snapshots[j] = [(own, ScalarRows(stacked[si], rows)) for si, own, rows in watch.rows[j]]
        return snapshots[k]

    def step_made(self, order: list[int], members: list[list[torch.Tensor]], groups: list[dict], chunk_state: dict,
                  masters: bool) -> None:  # fmt: skip
        """Step tensors whose state dicts were made (or kept but not gathered) this step: a direct step over lists
        gathered from them where every state exists (Note [direct step]), else the inner step. Chunks with masters
        keep the inner step: the direct step is not checked against the masters' recipe (Note [master weights])."""
        fast = DirectStep.build(members, groups, chunk_state) if self.direct_ok and not masters else None
        if fast is None or not fast.run(self.ctx.optimizer, groups):
            inner.run_groups(self.ctx, order, groups, chunk_state, self.kwargs)

    @staticmethod
    def handed(chunk_state: dict) -> tuple[int, list[int], list[Any]]:
        """What the inner step is handed for a chunk: how many state dicts, their lengths, their values."""
        dicts = list(chunk_state.values())
        return len(dicts), list(map(len, dicts)), [v for d in dicts for v in d.values()]

    @staticmethod
    def stepped_in_place(chunk_state: dict, handed: tuple[int, list[int], list[Any]]) -> bool:
        """The inner step left every state dict as handed (same keys, the very same objects, so it updated
        the states in place and created none): nothing to copy but the chunk's runs, nothing to publish, since
        the scalars handed were the params' own (a chunk of whole params, see ChunkInputs.simple)."""
        n, lens, values = handed
        dicts = list(chunk_state.values())
        return (
            len(dicts) == n
            and list(map(len, dicts)) == lens
            and same_objects([v for d in dicts for v in d.values()], values)
        )

    # ----- stage 4: swap-out and publish --------------------------------------------------------
    def piece_output(self, piece, t: torch.Tensor, pst: dict[str, Any], views: dict[str, tuple]) -> tuple[list, list, dict[str, Any] | None]:
        """After the inner step of one piece: its (host, device) swap-out copies, the device states it
        created (to keep alive until copied), and its scalar states when it is the param's last piece."""
        p = self.prep.params[piece.index]
        flat = self.prep.flat[piece.index]
        copies, hold, scalars = [], [], {}
        master = views.get(MASTER)
        if master is not None:  # the param gets its stepped master, rounded to its dtype (Note [master weights])
            _, slot_view, host = master
            self.param_piece(piece, p).copy_(slot_view)
            if host is not None and slot_view.numel():  # None: a run of the chunk copies it out
                copies.append((host, slot_view))
        for key, value in pst.items():
            staged = views.get(key)
            if staged is not None:
                given, slot_view, host = staged
                if value is not given and local(value).data_ptr() != slot_view.data_ptr():
                    slot_view.copy_(local(value))  # the optimizer replaced the tensor instead of updating it
                if host is not None and slot_view.numel():  # None: a run of the chunk copies it out
                    copies.append((host, slot_view))
            elif (parts := subclass_state.staged(key, value, views)) is not None:  # Note [subclass states]
                for attr, part in subclass_state.parts(value):
                    given, slot_view, host = parts[attr]
                    if part is not given and part.data_ptr() != slot_view.data_ptr():
                        slot_view.copy_(part)  # the optimizer rebuilt the state over new tensors
                    if host is not None and slot_view.numel():
                        copies.append((host, slot_view))
            elif is_swapped_state(t, key, value):  # created by the optimizer this step
                src = local(value)
                host = local(self.pending_host(p, key, value, flat))
                dst = hoststate.flat_view(host)[piece.start : piece.stop] if flat else host
                if subclass_state.is_subclass_state(src):  # part by part: never through a dequantize
                    for (_, d), (_, s) in zip(subclass_state.parts(dst), subclass_state.parts(src)):
                        if s.numel():
                            copies.append((d, s))
                            hold.append(s)
                elif src.numel():
                    copies.append((dst, src))
                    hold.append(src)
            else:
                scalars[key] = value
        last = not flat or piece.stop == local(p).numel()
        return copies, hold, (scalars if last else None)

    def chunk_output(self, k: int, targets: list, chunk_state: dict, views: list):
        """Swap-out copies, device tensors to hold, and (param, scalars) of params whose last piece this is."""
        copies, hold, finals = self.pieces_output(k, targets, chunk_state, views, range(len(targets)))
        return list(getattr(views, "runs", ())) + copies, hold, finals

    def pieces_output(self, k: int, targets: list, chunk_state: dict, views: list, positions: Iterable[int]):
        """chunk_output of the pieces at ``positions`` alone, the chunk's runs left out."""
        copies, hold, finals = [], [], []
        params, output, get = self.prep.params, self.piece_output, chunk_state.get
        pieces = self.prep.plan.chunks[k].pieces
        for pos in positions:
            piece = pieces[pos]
            t = targets[pos]
            pst = get(t)
            c, h, scalars = output(piece, t, pst if pst is not None else {}, views[pos])
            if c:
                copies += c
            if h:
                hold += h
            if scalars is not None:
                finals.append((params[piece.index], scalars if pst is not None else None))
        return copies, hold, finals

    def publish(self, p: torch.Tensor, scalars: dict[str, Any] | None) -> None:
        """p is fully stepped: its scalar states and the host states created this step become its state.
        ``scalars`` None: the inner optimizer made no state entry for p, so none is made (as in torch)."""
        if p in self.ctx.masters.host:  # its master now holds a value on the host (Note [master weights])
            self.ctx.masters.ready.add(p)
        created = self.pending.pop(p, None) if self.pending else None
        if scalars is None and not created and p not in self.ctx.state:
            return
        st = self.ctx.state[p]
        if scalars:
            if self.in_place_scalars:
                scalars = _copy_into_own(st, scalars)
            if scalars:  # values that replace the param's (a new key, a Python number, another shape)
                self.steady = False
                st.update(scalars)
        if created:
            self.steady = False
            st.update(created)
            self.layout.forget(p)

    def pending_host(self, p: torch.Tensor, key: str, value: torch.Tensor, flat: bool) -> torch.Tensor:
        """Host tensor for a state the optimizer created this step: allocated once, reused every step."""
        states = self.pending.setdefault(p, {})
        if key not in states:
            src = local(value)
            pre = self.layout.pre_hosts.get(p, {}).get(key)
            if pre is not None and local(pre).dtype == src.dtype and (flat or local(pre).shape == src.shape):
                states[key] = pre
            elif flat:
                if src.dim() != 1:
                    raise RuntimeError(
                        f"{type(self.ctx.optimizer).__name__} created state {key!r} of shape {tuple(src.shape)} for a "
                        "flat piece, so it is not element-wise; it cannot be split across chunks"
                    )
                states[key] = new_host_like(p, src.dtype)
            else:
                states[key] = hoststate.pinned_empty_like(value)
        return states[key]


def _copy_into_own(st: dict, scalars: dict[str, Any]) -> dict[str, Any]:
    """Copy each tensor of ``scalars`` into the device tensor of the same shape and dtype the param's state dict
    ``st`` holds under its key (a step count: the value the optimizer stepped a clone of); the others returned, for
    the caller to put in as they are. Note [graphed step]: a replayed step writes only where its capture did."""
    rest = {}
    for key, value in scalars.items():
        own = st.get(key)
        if (
            isinstance(value, torch.Tensor) and isinstance(own, torch.Tensor) and own is not value
            and own.shape == value.shape and own.dtype == value.dtype and own.device == value.device
            and not device.is_host_tensor(own)
        ):  # fmt: skip
            own.copy_(value)
        elif own is not value:
            rest[key] = value
    return rest


def prefetch(ctx: StepContext, layout: HostLayout, prep: Prepared) -> bool:
    """Stage 1 of the next step over ``prep``, issued now: allocate its staging on the current stream and
    queue the swap-ins of its first S-1 chunks (swapopt.operate.prefetch_begin). The step adopts them if
    it runs this very plan; a re-plan discards them first (HostLayout.prepare). Returns whether anything
    was issued."""
    op = ctx.operate
    n = len(prep.plan.chunks)
    ahead = op.slots_for(n) - 1
    if ahead < 1 or not prep.slot_bytes:  # one slot, or nothing staged: nothing can be swapped in ahead
        return False
    pf = op.prefetch_begin(n, prep.slot_bytes, device.torch_device(ctx.device))
    run = StepRun(ctx, layout, prep, {})
    try:
        pf.payload = {j: run.swap_in(j, ahead=True) for j in range(ahead)}
    except BaseException:
        op.discard_prefetch()  # only device copies of host states: dropping them loses nothing
        raise
    _warn_if_prefetch_holds_most(ctx, prep, ahead)
    return True


# A prefetch keeps its chunks' states on the device from the forward to the step: past this share of the
# swapped states, it keeps most of what swapping was meant to take off the device through the backward.
PREFETCH_SHARE_WARNING = 1 / 3


def _warn_if_prefetch_holds_most(ctx: StepContext, prep: Prepared, ahead: int) -> None:
    total = prep.plan.total_bytes
    held = sum(c.nbytes for c in prep.plan.chunks[:ahead])
    if not total or held / total <= PREFETCH_SHARE_WARNING:
        return
    ctx.warn_once(
        "prefetch-share",
        f"swapopt: prefetch holds {held / total:.0%} of the swapped states on the device through the backward "
        f"({ahead} of {len(prep.plan.chunks)} chunks); raise swap_optimizer_times (or lower chunk_mb) so that "
        f"the {ahead} chunk(s) it swaps in ahead are a small share, or turn prefetch off",
    )
