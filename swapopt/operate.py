"""SwapOptimizerOperate: the transfer engine behind SwapOptimizer.

Owns one H2D and one D2H stream (created lazily through the device module), the staging slots of the
running step and the events that order everything:

    compute stream   |-entry-|  ...update[k]...                  ...update[k+1]...
    D2H stream                       wait(update[k]) -> copy out[k] -> event (= slot free)
    H2D stream           wait(entry), wait(slot free) -> copy in[k+S-1] -> event   (issued after copy out[k])

Chunk k uses slot k % S. Its swap-in waits for the D2H that last read the slot, the update waits for
the swap-in, the swap-out waits for the update. A failing step drains every stream (drain); what the
host then runs synchronously on the compute stream is ordered after everything they did.

With ``overlap`` on, the updates run on a fourth, dedicated update stream instead of the compute
stream (see swapopt.overlap): it waits for the step's entry event and each chunk's swap-in, and each
param's "updated" event (recorded after the chunk holding its last piece) is left pending for the
next forward to wait on, so step() returns without the compute stream waiting for anything.
With prefetch (``prefetch_begin``), the staging and the swap-ins of the first S-1 chunks are issued
before the step, typically right after the forward, so they run under the loss and the backward; the
step's ``begin`` then adopts them instead of allocating and swapping in again, or ``discard_prefetch``
drops them. Nothing here knows about optimizers.

Note [swap-in after swap-out]: once the pipeline is full, the swap-in of chunk k+S-1 and the swap-out
of chunk k become ready at the same moment (the one waits for its slot, freed by chunk k-1's swap-out; the
other follows that swap-out on its stream), and both directions at once share one cap (Note [link sharing]
in device/sim/presets.py). Where the copy launched first keeps its rate, launching the swap-in first, as
the pipeline asks for it, makes every swap-out give way: the swap-in ends early and waits for its slot while
the swap-out runs on alone, and the step takes about 1.13x the link floor on the H100 preset. Launched after
the swap-out, the swap-in gives way to it, and the swap-out of chunk k+1, launched after the swap-in, gives
way in turn: the two directions take turns and finish together, within a few percent of the floor. Where
one direction always keeps its rate, the order changes nothing, so it needs no knowledge of the rule. So
``swap_in`` of a chunk whose slot a swap-out not yet issued will free holds its copies back, and that
swap-out issues them right after its own; nothing waits for them before (the chunk's update comes after).

Note [persistent slots]: the slot tensors outlive the step that uses them, without their memory. At
the end of a step (or of a discarded prefetch) each slot's memory goes back to the allocator with
device.free_storage, after record_stream for every stream that used it, as dropping the tensor would;
the next step gives the same tensor objects memory again with device.alloc_storage, on the stream it
allocates on. Views made of a slot see whatever memory it has, so the pipeline makes its slot views
once per plan, not once per step. A change of slot size or device makes new slot tensors.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

import torch

import device
from swapopt import internals

Copies = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (dst, src)
_NO_RANGE = nullcontext()


def step_range(label: str) -> AbstractContextManager[Any]:
    """A profiler range named ``label`` (``swapopt.swap_in[k]``, ...) while a profiler records or the
    simulator labels its timeline with ranges; else a no-op that costs no host time (Note [profiler
    ranges] in swapopt.internals)."""
    if ranges_wanted():
        return torch.profiler.record_function(label)
    return _NO_RANGE


# Note [stream switches]
# ~~~~~~~~~~~~~~~~~~~~~~
# Each chunk's copies are issued on the H2D and D2H streams, two switches of the current stream and two back. A stream
# context (``torch.cuda.stream(s)``) asks for the current stream and the device index of each on entry and exit: some
# ten Python calls a switch on CUDA, paid per chunk. The engine knows which stream the host is on (``_here``: the
# step's compute stream, the update stream inside ``updating`` with overlap, the caller's stream at a prefetch), so it
# sets the copy stream and sets ``_here`` back, a call each (``_copies_on``).


def ranges_wanted() -> bool:
    """Whether step_range opens ranges now: a profiler records, or the simulator labels its timeline."""
    return internals.profiler_recording() or device.labels_ranges()


class _Updating:
    """The block of SwapOptimizerOperate.updating, a class rather than a generator: it is entered once a chunk. Inside
    it, the profiler range ``label`` where the step opens ranges (step_range)."""

    __slots__ = ("op", "k", "label", "stream", "here", "range")

    def __init__(self, op: "SwapOptimizerOperate", k: int | None, label: str) -> None:
        self.op, self.k, self.label, self.stream, self.here, self.range = op, k, label, None, None, None

    def __enter__(self) -> None:
        op, k = self.op, self.k
        if op.overlap:
            self.stream = op.mod.stream(op.update_stream)
            self.stream.__enter__()
            self.here, op._here = op._here, op.update_stream
        if k is not None:
            try:
                op.begin_update(k)
            except BaseException:
                self.__exit__(None, None, None, failed=True)
                raise
        if op.ranges:
            self.range = torch.profiler.record_function(self.label if k is None else f"{self.label}[{k}]")
            self.range.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any, failed: bool = False) -> None:
        op, k, stream = self.op, self.k, self.stream
        if self.range is not None:
            self.range.__exit__(exc_type, exc, tb)
            self.range = None
        try:
            if exc_type is None and not failed:  # only a block that completes records its update event
                if k is not None:
                    op.end_update(k)
                elif stream is not None:
                    op._resident_event = op.update_stream.record_event()
        finally:
            if stream is not None:
                self.stream = None
                op._here = self.here
                stream.__exit__(exc_type, exc, tb)


class _StepEvents(NamedTuple):
    """A finished step's events per chunk, and which chunk last held each param it swapped."""

    last_chunk: dict[torch.Tensor, int]
    h2d: list[Any]
    update: list[Any]
    d2h: list[Any]


@dataclass(eq=False)
class Prefetched:
    """Staging allocated ahead of a step and the swap-ins queued into it (see prefetch_begin)."""

    n_chunks: int
    nslots: int
    staging: list[torch.Tensor]
    stream: Any  # the stream the staging was allocated on (the current one at prefetch time)
    h2d_events: dict[int, Any] = field(default_factory=dict)  # chunk -> event after its swap-in
    payload: Any = None  # the caller's per-chunk views of the slots


class SwapOptimizerOperate:
    """Streams, staging slots and per-param events of one SwapOptimizer."""

    def __init__(self, slots: int = 3, overlap: bool = False) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.slots = slots
        self.overlap = bool(overlap)
        self.mod: Any = None
        self._h2d: Any = None
        self._d2h: Any = None
        self._upd: Any = None
        self._resident_event: Any = None
        # param -> its "updated" event, until a stream waited for it (overlap only; see swapopt.overlap)
        self.pending: dict[torch.Tensor, Any] = {}
        self._snapshots: list[torch.Tensor] = []  # this step's copies of hyperparameters (snapshot)
        self._compute: Any = None
        self.nslots = 0
        self._staging: list[torch.Tensor] = []  # the running step's slots (with memory)
        self._slot_store: list[torch.Tensor] = []  # Note [persistent slots]: every slot tensor made so far
        self._slot_key: tuple = ()  # the (bytes, device) of the slots in _slot_store
        self._slot_free: list[Any] = []  # per slot: the D2H event of its last user
        self._held: list[list[torch.Tensor]] = []  # per slot: device tensors an in-flight D2H reads
        self._held_bytes = 0
        self.peak_staging_bytes = 0
        self.h2d_events: list[Any] = []
        self.update_events: list[Any] = []
        self.d2h_events: list[Any] = []
        self._last_d2h: Any = None
        self._start: Any = None
        self._end: Any = None
        self._pending_start: Any = None  # the running step's start event
        # Per-param events (swap_in_event, ...): the last finished step's, read through its plan's map of each
        # param to its last chunk and that step's event lists (``_last``: (that map, h2d, update, d2h events));
        # older steps' for params that step did not swap, in the dicts. Finishing a step of the same plan replaces
        # ``_last`` without a per-param loop; a step of another plan first folds ``_last`` into the dicts.
        self._last: _StepEvents | None = None
        self._swap_in: dict[torch.Tensor, Any] = {}
        self._update: dict[torch.Tensor, Any] = {}
        self._swap_out: dict[torch.Tensor, Any] = {}
        # (chunk, copies) of a swap-in held back until the swap-out before it is issued (Note [swap-in after
        # swap-out])
        self._held_in: tuple[int, Copies] | None = None
        self.prefetched: Prefetched | None = None  # staging and swap-ins issued ahead of the next step
        self._staging_stream: Any = None  # where the running step's staging was allocated, if not on _compute
        # whether this step's copies and updates are labelled with profiler ranges (step_range), asked once a step
        self.ranges = False
        # the stream the host issues on outside swapopt's copies (Note [stream switches]): the step's compute stream,
        # the update stream inside updating() with overlap, the caller's at a prefetch
        self._here: Any = None
        self._step_upd: Any = None  # update_stream, as begin() found it
        # the running step is being captured as a graph (Note [graphed step] in swapopt.graphed): its events order
        # work inside the graph only, and are made without timing (a replay is timed by events around it)
        self.capturing = False

    # ----- streams ---------------------------------------------------------------------------
    def bind(self, mod: Any) -> None:
        """Use device module ``mod``; streams of a previous module are drained and dropped."""
        if mod is self.mod:
            return
        if self.mod is not None:
            self.release_staging()  # also discards a prefetch: its events belong to the old module
            self.sync_updates()
        self.mod, self._h2d, self._d2h, self._upd = mod, None, None, None
        self._slot_store, self._slot_key = [], ()
        self._last_d2h = None
        self.pending.clear()
        self._last = None
        self._swap_in.clear()
        self._update.clear()
        self._swap_out.clear()

    @property
    def h2d_stream(self) -> Any:
        if self._h2d is None:
            self._h2d = self.mod.Stream()
        return self._h2d

    @property
    def compute_stream(self) -> Any:
        """The stream the running (or last) step's updates were issued on."""
        return self._compute if self._compute is not None else self.mod.current_stream()

    @property
    def d2h_stream(self) -> Any:
        if self._d2h is None:
            self._d2h = self.mod.Stream()
        return self._d2h

    @property
    def update_stream(self) -> Any:
        """Where the updates run: a dedicated stream with ``overlap``, else the step's compute stream."""
        if not self.overlap:
            return self.compute_stream
        if self._upd is None:
            self._upd = self.mod.Stream()
        return self._upd

    # ----- overlap: what the update reads stays valid, what reads its results waits ------------
    def keep_for_update(self, t: torch.Tensor | None) -> None:
        """t (a grad, a snapshot) is read by this step's update: freeing it on the compute stream (e.g.
        zero_grad(set_to_none=True)) must not hand its memory out before the update stream is done."""
        if self.overlap and t is not None and not device.is_host_tensor(t):
            device.record_stream(t, self.update_stream)

    def snapshot(self, value: Any) -> Any:
        """A copy, made now on the current (compute) stream, of a tensor the update reads but the caller
        may change in place right after step() (a scheduler's tensor lr, GradScaler's scale and
        found_inf): the update reads the copy. Tuples of tensors are copied element-wise."""
        if not self.overlap or device.get_device() == "cpu":  # no accelerator: the step runs in place
            return value
        if isinstance(value, torch.Tensor):
            copy = value.clone()
            self._snapshots.append(copy)  # kept for the update stream at begin(), once it exists
            return copy
        if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self.snapshot(v) if isinstance(v, torch.Tensor) else v for v in value)
        return value

    def wait_for_update(self, params: Iterable[torch.Tensor] | None = None, stream: Any = None) -> None:
        """``stream`` (the current one if None) waits for the pending updates of ``params`` (all if
        None); they are no longer pending. No host block."""
        if not self.pending:
            return
        if params is None:
            events = list(self.pending.values())
            self.pending.clear()
        else:
            events = [e for e in (self.pending.pop(p, None) for p in params) if e is not None]
        if not events:
            return
        stream = stream if stream is not None else self.mod.current_stream()
        for event in {id(e): e for e in events}.values():
            stream.wait_event(event)

    def sync_updates(self) -> None:
        """The host waits for every update issued on the update stream (no-op without overlap)."""
        if self._upd is not None:
            self._upd.synchronize()

    # ----- one step --------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A step starts: the last finished step's timing events stay what step_ms() reports."""
        self._pending_start = None

    def begin(self, n_chunks: int, slot_bytes: int, dev: torch.device, prefetched: Prefetched | None = None) -> None:
        """Allocate staging on the compute stream and mark the step's entry on it: no swap-in starts
        before the compute stream reaches this point (the end of backward, typically). ``prefetched``
        (this engine's ``prefetched``, made for this step's plan): adopt its staging and its swap-ins
        instead; any other prefetch is discarded first."""
        mod = self.mod
        self._compute = self._here = mod.current_stream()
        # the stream of this step's updates, and the copy streams made now (the H2D one by _order_h2d_after below):
        # the per-chunk calls read them as attributes
        self._step_upd = self.update_stream
        self.d2h_stream  # noqa: B018 - made here, read as self._d2h
        self.ranges = ranges_wanted()
        if prefetched is not None and prefetched is self.prefetched and prefetched.n_chunks == n_chunks:
            self.prefetched = None
            self.nslots = prefetched.nslots
            self._staging = prefetched.staging
            self._staging_stream = prefetched.stream
        else:
            prefetched = None
            self.discard_prefetch()
            self.nslots = self.slots_for(n_chunks)
            self._staging = self._allocate(self.nslots, slot_bytes, dev)
            self._staging_stream = None
        self._slot_free = [None] * self.nslots
        self._held = [[] for _ in range(self.nslots)]
        self._held_bytes = 0
        self._held_in = None
        self.peak_staging_bytes = sum(t.nbytes for t in self._staging)
        self.h2d_events = [None] * n_chunks
        if prefetched is not None:
            for k, event in prefetched.h2d_events.items():
                self.h2d_events[k] = event
        self.update_events = [None] * n_chunks
        self.d2h_events = [None] * n_chunks
        start = self._pending_start = mod.Event(enable_timing=not self.capturing)
        start.record(self._compute)
        self._resident_event = None
        if self.overlap:  # the update reads grads the backward wrote and the staging allocated above
            self.update_stream.wait_event(start)
            for t in self._snapshots:
                self.keep_for_update(t)
        self._snapshots = []
        self._order_h2d_after(start)

    def slots_for(self, n_chunks: int) -> int:
        """Staging slots a step of ``n_chunks`` chunks uses: no more than it has chunks."""
        return max(1, min(self.slots, n_chunks))

    def _order_h2d_after(self, entry: Any) -> None:
        """No swap-in starts before ``entry`` (where its staging was allocated) or before the last step's
        last swap-out (the host states it wrote are read again)."""
        h2d = self.h2d_stream
        h2d.wait_event(entry)
        if self._last_d2h is not None:
            h2d.wait_event(self._last_d2h)

    def _issue_copies(self, stream: Any, after: Any, copies: Copies, label: str, k: int) -> Any:
        """``stream`` waits for ``after`` (if any), then ``copies`` are queued on it, in the profiler range
        ``label[k]`` where the step opens ranges; the event after them."""
        span = torch.profiler.record_function(f"{label}[{k}]") if self.ranges else None
        if span is not None:
            span.__enter__()
        try:
            if after is not None:
                stream.wait_event(after)
            self._copies_on(stream, copies)
            return stream.record_event()
        finally:
            if span is not None:
                span.__exit__(None, None, None)

    def _copies_on(self, stream: Any, copies: Copies) -> None:
        """Queue ``copies`` on ``stream``, then make the stream the host was on (``_here``) current again (Note
        [stream switches])."""
        set_stream = self.mod.set_stream
        set_stream(stream)
        try:
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
        finally:
            set_stream(self._here)

    def _allocate(self, nslots: int, slot_bytes: int, dev: torch.device) -> list[torch.Tensor]:
        """``nslots`` slots of ``slot_bytes`` with memory from the current stream: the slot tensors of the
        last steps given memory again (Note [persistent slots]), new ones where there are too few."""
        if not slot_bytes:
            return []
        if self._slot_key != (slot_bytes, dev):
            self._slot_store, self._slot_key = [], (slot_bytes, dev)
        store = self._slot_store
        given: list[torch.Tensor] = []
        try:
            for i in range(nslots):
                if i < len(store):
                    device.alloc_storage(store[i], slot_bytes)
                else:
                    store.append(torch.empty(slot_bytes, dtype=torch.uint8, device=dev))
                given.append(store[i])
        except BaseException:
            self._free_slots(given)  # out of memory part way: the slots given memory give it back
            raise
        return given

    @staticmethod
    def _free_slots(slots: list[torch.Tensor]) -> None:
        """The slots' memory goes back to the allocator; the tensors stay (Note [persistent slots])."""
        for t in slots:
            device.free_storage(t)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one staging slot of the last plan (its largest chunk, alignment included): the peak extra
        device memory of a step stays within (slots + 1) x this."""
        return int(self._slot_key[0]) if self._slot_key else 0

    def slot(self, k: int) -> torch.Tensor | None:
        return self._staging[k % self.nslots] if self._staging else None

    # ----- prefetch: the first swap-ins of the next step, issued ahead of it --------------------------
    def prefetch_begin(self, n_chunks: int, slot_bytes: int, dev: torch.device) -> Prefetched:
        """Allocate the next step's staging now, on the current stream, and order the H2D stream after
        this point (the allocation) and after the last step's last swap-out (the host states it wrote),
        as begin() does. The slots stay allocated until the step adopts them or they are discarded."""
        if self.prefetched is not None:
            raise RuntimeError("a prefetch is already pending; adopt or discard it first")
        stream = self._here = self.mod.current_stream()
        self.ranges = ranges_wanted()
        nslots = self.slots_for(n_chunks)
        pf = Prefetched(n_chunks, nslots, self._allocate(nslots, slot_bytes, dev), stream)
        self._order_h2d_after(stream.record_event())
        self.prefetched = pf
        return pf

    def prefetch_slot(self, k: int) -> torch.Tensor | None:
        pf = self.prefetched
        return pf.staging[k % pf.nslots] if pf is not None and pf.staging else None

    def prefetch_in(self, k: int, copies: Copies) -> None:
        """Copy host -> prefetched slot for chunk k on the H2D stream (fresh slots: nothing to wait for)."""
        pf = self.prefetched
        if pf is not None and copies:  # the H2D stream was made by prefetch_begin
            pf.h2d_events[k] = self._issue_copies(self._h2d, None, copies, "swapopt.prefetch", k)

    def discard_prefetch(self) -> bool:
        """Drop a prefetch the step will not use: the host waits for its copies (what follows may write
        or free the host states they read), and the slots go back to the allocator stream-safely.
        Returns whether there was one."""
        pf, self.prefetched = self.prefetched, None
        if pf is None:
            return False
        for event in pf.h2d_events.values():
            event.synchronize()
        for t in pf.staging:
            for stream in _others([self.h2d_stream], pf.stream):
                device.record_stream(t, stream)
        self._free_slots(pf.staging)
        pf.staging.clear()
        pf.payload = None
        return True

    def swap_in(self, k: int, copies: Copies) -> None:
        """Copy host -> slot for chunk k on the H2D stream, after the slot's last D2H. Issued when the swap-out
        of chunk k - S + 1 is (Note [swap-in after swap-out]), or now when that one is issued already or
        none is to come (the step's first S - 1 chunks)."""
        if not copies:
            return
        before = k - (self.nslots - 1)
        if self.nslots > 1 and before >= 0 and self.d2h_events[before] is None and self._held_in is None:
            self._held_in = (k, copies)
            return
        self._issue_in(k, copies)

    def _issue_in(self, k: int, copies: Copies) -> None:
        free = self._slot_free[k % self.nslots]  # the H2D stream was made by begin()
        self.h2d_events[k] = self._issue_copies(self._h2d, free, copies, "swapopt.swap_in", k)

    def _release_held_in(self, upto: int) -> None:
        """Issue the held-back swap-in if it is of a chunk <= ``upto``."""
        held = self._held_in
        if held is not None and held[0] <= upto:
            self._held_in = None
            self._issue_in(*held)

    def begin_update(self, k: int) -> None:
        """Order the update stream after chunk k's swap-in (or its slot's last D2H), and drop the
        device tensors that D2H read: reusing their memory on the update stream is now safe."""
        self._release_held_in(k)  # never with the pipeline's order: chunk k's swap-in went with an earlier swap-out
        s = k % self.nslots
        ready = self.h2d_events[k] if self.h2d_events[k] is not None else self._slot_free[s]
        if ready is not None:
            self._step_upd.wait_event(ready)
        if self._held[s]:
            self._held_bytes -= sum(t.nbytes for t in self._held[s])
            self._held[s] = []

    def end_update(self, k: int) -> None:
        self.update_events[k] = self._step_upd.record_event()

    def updating(self, k: int | None, label: str = "swapopt.update") -> _Updating:
        """The optimizer's update of chunk k (None: the resident params) is issued inside this block, on
        the stream the update runs on, in the profiler range ``label`` (with ``[k]``) where the step opens
        ranges. Chunk k's update event is recorded only when the block completes."""
        return _Updating(self, k, label)

    def swap_out(self, k: int, copies: Copies, hold: Iterable[torch.Tensor] = ()) -> None:
        """Copy device -> host for chunk k on the D2H stream after its update. ``hold``: device tensors
        (states the optimizer created this step) kept alive until the slot is reused."""
        event = self._issue_copies(self._d2h, self.update_events[k], copies, "swapopt.swap_out", k)  # D2H made by begin()
        s = k % self.nslots
        self.d2h_events[k] = self._slot_free[s] = self._last_d2h = event
        self._release_held_in(k + self.nslots - 1)  # Note [swap-in after swap-out]
        held = list(hold)
        if held:
            self._held[s] = held
            self._held_bytes += sum(t.nbytes for t in held)
            self.peak_staging_bytes = max(
                self.peak_staging_bytes, self._held_bytes + sum(t.nbytes for t in self._staging)
            )

    def finish(self, last_chunk: dict[torch.Tensor, int], resident: Iterable[torch.Tensor] = ()) -> None:
        """End the step without waiting: staging and held tensors are released stream-safely (the
        allocator reuses them only after the D2H stream's queued copies), per-param events recorded.
        With overlap, each stepped param's update event becomes pending (``resident``: the params
        updated in the updating(None) block)."""
        if self._held_in is not None:  # never with the pipeline's order: every swap-out before it was issued
            self._release_held_in(self._held_in[0])
        d2h = self.d2h_stream
        end = self.mod.Event(enable_timing=not self.capturing)
        end.record(d2h)
        # only a finished step's events are paired: a failed step never pairs with an older end
        self._start, self._end, self._pending_start = self._pending_start, end, None
        # The staging was allocated on the compute stream (or, prefetched, on the stream of the forward) and
        # used on the D2H stream; on the H2D and update streams too where no stream its allocator pairs it
        # with waited for them (prefetched: filled ahead; overlap: the compute stream never waits).
        users = [d2h]
        if self._staging_stream is not None or self.overlap:
            users.append(self.h2d_stream)
        if self._staging_stream is not None:
            users.append(self._compute)
        if self.overlap:
            users.append(self.update_stream)
        allocating = self._staging_stream if self._staging_stream is not None else self._compute
        for t in self._staging:
            for stream in _others(users, allocating):
                device.record_stream(t, stream)
        for held in self._held:
            for t in held:
                device.record_stream(t, d2h)
        self._drop()
        if self._last is not None and self._last[0] is not last_chunk:
            self._fold_last()
        self._last = _StepEvents(last_chunk, self.h2d_events, self.update_events, self.d2h_events)
        if self.overlap:
            for p, k in last_chunk.items():
                if self.update_events[k] is not None:
                    self.pending[p] = self.update_events[k]
            if self._resident_event is not None:
                for p in resident:
                    self.pending[p] = self._update[p] = self._resident_event

    def begin_capture(self) -> None:
        """The next step is captured as a graph (Note [graphed step]). A capture may not wait on an event from outside
        it: the host waits for the last step's swap-outs now, and the capture records no wait for them."""
        self.wait_for_swap_out()
        self._last_d2h = None
        self.capturing = True

    def end_capture(self, failed: bool) -> None:
        """The capture ended. Its events order work inside the graph only: none is waited on after it. ``failed``:
        nothing of the step ran on the device, so nothing is waited for, and the slot tensors, given their memory
        inside the capture, are let go (new ones are made at the next step)."""
        self.capturing = False
        self._last_d2h = None
        if failed:
            self._staging = []  # not freed: the capture's memory goes with its graph
            self._drop()
            self._slot_store, self._slot_key = [], ()
            self._pending_start = None

    def wait_for_last_swap_out(self, stream: Any) -> None:
        """``stream`` waits for the last step's last swap-out, unless that step was a replay on it."""
        last = self._last_d2h
        if last is not None and not (last is self._end and stream == self._compute):
            stream.wait_event(last)

    def after_replay(self, start: Any, end: Any, last_chunk: dict[torch.Tensor, int], n_chunks: int) -> None:
        """A graph of a step was replayed between ``start`` and ``end`` (recorded on the replaying stream, which the
        graph's last work joins): every per-param event of that step, the next step's wait for its last swap-out and
        step_ms() are ``end``, the events recorded at the capture being the graph's own (Note [graphed step])."""
        self._compute = self._here = self.mod.current_stream()
        self._start, self._end, self._pending_start = start, end, None
        self._last_d2h = end
        ends = [end] * n_chunks
        if self._last is not None and self._last[0] is not last_chunk:
            self._fold_last()
        self._last = _StepEvents(last_chunk, ends, ends, ends)

    def drain(self) -> None:
        """Failure path: the host waits for every copy and update already enqueued. The staging stays
        (the recovery reads the slots of a chunk whose update returned) until release_staging."""
        self._held_in = None  # a swap-in never issued: nothing reads its slot (Note [failure semantics])
        for stream in (self._h2d, self._compute, self._upd, self._d2h):
            if stream is not None:
                stream.synchronize()
        self.pending.clear()  # the host saw every update: nothing is left to wait for

    def _drop(self) -> None:
        self._held_in = None
        self._free_slots(self._staging)
        self._staging = []
        self._staging_stream = None
        self._held = [[] for _ in range(self.nslots)]
        self._held_bytes = 0

    # ----- host side -------------------------------------------------------------------------
    def wait_for_swap_out(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """The host waits for in-flight D2H of these params' states (all if None)."""
        if params is None:
            events = [self._last_d2h]
        else:
            events = list({id(e): e for e in map(self.swap_out_event, params) if e is not None}.values())
        for event in events:
            if event is not None:
                event.synchronize()

    def release_staging(self) -> None:
        """Wait for in-flight swap-outs and drop anything held on the device, a prefetch included
        (no-op if nothing is)."""
        self.wait_for_swap_out()
        self.discard_prefetch()
        self._drop()

    def last_step_events(self) -> tuple[Any, Any]:
        """(entry, last swap-out) events of the last finished step, (None, None) before one: their
        ``elapsed_time`` is ``step_ms()`` without waiting now. Each step records new event objects."""
        return self._start, self._end

    def step_ms(self) -> float | None:
        """Modeled/measured time of the last step, entry to last swap-out (waits for that swap-out)."""
        if self._start is None or self._end is None:
            return None
        # Both: a step whose states are all resident swaps nothing, so its end (on the D2H stream) does not
        # follow its entry (on the compute stream), and elapsed_time needs both finished.
        self._start.synchronize()
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end))

    def _fold_last(self) -> None:
        """Move the last step's per-param events into the dicts (a step of another plan follows)."""
        last, self._last = self._last, None
        for p, k in last.last_chunk.items():
            self._swap_in[p] = last.h2d[k]
            self._update[p] = last.update[k]
            self._swap_out[p] = last.d2h[k]

    def _event(self, p: torch.Tensor, which: str, older: dict[torch.Tensor, Any]) -> Any:
        """p's ``which`` event ("h2d", "update", "d2h") of the last step that swapped it."""
        last = self._last
        if last is not None:
            k = last.last_chunk.get(p)
            if k is not None:
                return getattr(last, which)[k]
        return older.get(p)

    def swap_in_event(self, p: torch.Tensor) -> Any:
        return self._event(p, "h2d", self._swap_in)

    def update_event(self, p: torch.Tensor) -> Any:
        return self._event(p, "update", self._update)

    def swap_out_event(self, p: torch.Tensor) -> Any:
        return self._event(p, "d2h", self._swap_out)


def _others(streams: list[Any], allocating: Any) -> list[Any]:
    """``streams`` less the allocating stream, compared by equality: torch_npu's ``current_stream()`` is
    a new Python object on every call (torch_npu/npu/utils.py:260-287), so ``is`` never matches; and NPU's
    recordStream, unlike CUDA's, does not skip the allocating stream (NPUCachingAllocator.cpp,
    DeviceCachingAllocator::recordStream), so recording it would hold the block until that stream's later
    work is done."""
    return [s for s in streams if s != allocating]
