"""Graph capture and replay on the simulated device (CUDA graphs; torch_npu's NPU graphs): Graphs, the part of
SimDevice that records a capturing stream's work instead of running it and judges what CUDA refuses during a
capture, and SimGraph, the torch.cuda.CUDAGraph / torch.npu.NPUGraph-like object that replays what it recorded.

Note [graph capture]
CUDA records the work issued between capture_begin and capture_end to the capturing stream, and to every stream
that joins the capture by waiting on an event recorded on a capturing stream during it, as the nodes of a graph,
and runs none of it: device memory does not change while a stream captures. A replay launches the whole graph in
one host call, after the launching stream's earlier work and before its later work. The simulator models it so:
- Capture (Graphs._capture_op, which Dispatch._stream_op hands every op of a capturing stream): the op is judged as
  CUDA judges it (anything that would make the host wait, a host read of device memory: "operation not permitted
  when stream is capturing"; a copy between the device and pageable host memory: torch's own refusal, which leaves
  the capture valid), then recorded: the callable the op would have run, its arguments with each tensor replaced
  by a reference to the memory it names (storage, offset, sizes, strides), and what the timeline prices it at. A
  host scalar a device kernel reads at launch (a 0-dim CPU tensor, a fused optimizer's host lr) is copied now: CUDA
  bakes it into the node. New outputs take their sizes from the op's meta kernel (an output sized by data is
  refused) and their memory from the graph's private pool (device.sim.memory.PrivatePool), as does every device
  allocation on a capturing stream (torch.empty, alloc_storage). The op is not run, not checked by the sanitizer
  and not timed; the host pays its launch, as it pays any launch. Work on other streams, and on the host, runs as
  usual.
- Streams and events: an event recorded on a capturing stream marks a point of the graph; a stream that waits on
  it joins the capture (a fork; not the default stream, CUDA's legacy stream: cudaErrorStreamCaptureImplicit), one
  already capturing gains an edge. capture_end refuses a joined stream whose work the origin stream has not waited
  for (cudaErrorStreamCaptureUnjoined: a capture-local vector clock per stream tells). Each with CUDA's wording:
  waiting, inside a capture, on an event recorded outside it fails (cudaErrorStreamCaptureIsolation); so do
  synchronizing or querying a capturing stream or the device, a host read or a blocking copy on a capturing stream
  (cudaErrorStreamCaptureUnsupported, whatever the capture's mode), and using an event last recorded during a
  capture (query, synchronize, elapsed_time: cudaErrorCapturedEvent; once the capture ended, "invalid argument").
  A host wait for a stream or an event outside the capture, and the caching allocator's new segment for a stream
  outside it (a cudaMalloc torch does not relax), are what CUDA calls potentially unsafe calls: refused while a
  capture in "global" mode is underway (any thread), or one in "thread_local" mode on the thread that began it;
  "relaxed" allows them. An error during a capture invalidates it, and capture_end then fails too
  (cudaErrorStreamCaptureInvalidated). An H100 answered each of these so (torch 2.11.0+cu130, 2026-11-27).
- Replay (SimGraph.replay): each memory the graph references is looked up first, so that a replay that cannot run
  fails before any node does. A graph bakes in addresses: memory that existed before the capture (params, grads,
  states, pinned buffers) is read at the address it had, which must still be that allocation's or, once it was
  freed, a new allocation's of the same size and kind at the same address (a grad made anew each step in the block
  the caching allocator gives back: what swapopt's step_graph checks with data_ptr() before replaying). Memory no
  allocation holds any more (a tensor dropped, free_storage, moved by alloc_storage or a resize) raises, where a GPU
  would silently read or write freed memory (the simulator is stricter than hardware here). Memory the capture
  allocated is the graph's for its life: while the tensor that got it still holds it, replays use it (a static
  output the program reads after a replay); once that storage was freed or given new memory (free_storage /
  alloc_storage, as swapopt does with its staging slots between steps), the graph's own bytes of the same size,
  never what the tensor object holds at replay time. The nodes then run in capture order on the CPU tensors, each
  on a stream of the graph's own (one per captured stream, named after it: "stream#2 [cudagraph#1]"), with the
  captured events between them, after an event of the launching stream and before one it waits on at the end: the
  sanitizer sees every read and write of a replay on those streams, ordered after what the launching stream waited
  for and nothing else, as eager work on them would be (a graph's launches are ordered after each other, as CUDA
  orders a graph's launches). New outputs are computed and copied into their pool memory (a copy: bitwise the eager
  result).
- Time: the host pays graph_launch_us, plus graph_node_host_us per node (preset), once per replay instead of
  launch_us per op; the device places each node on the timeline as it places an eager op, issued no sooner than
  graph_node_gap_us after the previous node of its stream, so a replay's copies and kernels overlap as they did
  eagerly. A replayed op's label names the graph ("cudagraph#1 replay: <profiler range>").
- Memory: what a capture allocates counts as allocated while it lives, and what the pool grew to stays reserved
  (memory_reserved, memory_stats, mem_get_info) until every graph holding the pool is reset or dropped; then the
  pool's free bytes go back (exact accounting: at once; the caching allocator: at empty_cache).
- A backward pass captured: a node no forward op tagged with its stream, which the simulator runs on the default
  stream (Note [streams inside a backward pass]), runs on its predecessor's capturing stream during a capture, as
  CUDA's engine would run it on its forward's stream (StreamOrdering._node_stream).
Not modeled: other potentially unsafe calls (a pinned host allocation, say), a graph launched into a capture (a
child graph), two graphs sharing a pool aliasing each other's memory (each graph's own bytes are its own), a pool
block freed and reused within one capture racing with its earlier use, pinned host memory a capture allocates
counted once its tensor dies (the graph keeps bytes of its own), cudaGraphExecUpdate and conditional nodes.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from device.sim.accesses import DEVICE, HOST_MEM, PAGEABLE, PINNED_OUT, op_lane
from device.sim.accesses import Arg as _Arg
from device.sim.accesses import StorageInfo as _Storage
from device.sim.host_time import counted_methods
from device.sim.memory import OutOfMemoryError, PrivatePool
from device.sim.streams import SimEvent, SimStream, canonical

if TYPE_CHECKING:
    from device.sim.plans import _Plan

# What CUDA reports (cudaGetErrorString) and the code's name, per rule a capture breaks.
_ERRORS = {
    "unsupported": ("operation not permitted when stream is capturing", "cudaErrorStreamCaptureUnsupported"),
    "invalidated": ("operation failed due to a previous error during capture", "cudaErrorStreamCaptureInvalidated"),
    "merge": ("operation would result in a merge of separate capture sequences", "cudaErrorStreamCaptureMerge"),
    "unjoined": ("capturing stream has unjoined work", "cudaErrorStreamCaptureUnjoined"),
    "isolation": ("dependency created on uncaptured work in another stream", "cudaErrorStreamCaptureIsolation"),
    "captured_event": (
        "operation not permitted on an event last recorded in a capturing stream", "cudaErrorCapturedEvent"
    ),
    "wrong_thread": (
        "attempt to terminate a thread-local capture sequence from another thread", "cudaErrorStreamCaptureWrongThread"
    ),
    "implicit": (
        "operation would make the legacy stream depend on a capturing blocking stream", "cudaErrorStreamCaptureImplicit"
    ),
    "invalid_value": ("invalid argument", "cudaErrorInvalidValue"),
}
# torch's own check before a copy between the device and pageable host memory during a capture (a RuntimeError that
# leaves the capture valid, as an H100 run showed: torch 2.11.0+cu130, 2026-11-27).
_PAGEABLE_COPY = (
    "Cannot copy between CPU and {device} tensors during {device} graph capture unless the CPU tensor is pinned. "
    "Please use tensor.pin_memory() or allocate the tensor with pin_memory=True."
)
# torch >= 2.8 raises CUDA runtime errors as torch.AcceleratorError, a RuntimeError.
_AcceleratorError: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_CPU = torch.device("cpu")

# A capture's entries, in the order the host issued them.
_OP, _RECORD, _WAIT = 0, 1, 2
# A recorded tensor argument: memory the graph references, a host value copied at capture, or a tensor an op only
# looks at (its sizes: zeros_like's template), which any memory of its sizes stands for.
_REF, _CONST, _SHAPE = 0, 1, 2


class _SizedByData(Exception):
    """A recorded op whose output's size depends on data (a boolean mask's index): the host must read it."""


class _Slot:
    """Where a recorded op's arguments take a tensor: the index of that tensor among the op's."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _template(value: Any, leaves: list[torch.Tensor], roles: list[str], role: str) -> Any:
    """`value` with each tensor replaced by a _Slot (the tensors, and the role of the argument that holds them, in
    `leaves` and `roles`)."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        roles.append(role)
        return _Slot(len(leaves) - 1)
    if isinstance(value, (list, tuple)) and value:
        items = [_template(v, leaves, roles, role) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _fill(value: Any, values: list[torch.Tensor]) -> Any:
    """A template with its slots filled from `values`."""
    kind = type(value)
    if kind is _Slot:
        return values[value.index]
    if kind is list:
        return [_fill(v, values) for v in value]
    if kind is tuple:
        return tuple([_fill(v, values) for v in value])
    if kind is dict:
        return {k: _fill(v, values) for k, v in value.items()}
    return value


def _flatten(value: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of an op's return value, in order."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _flatten(v, found)
    return found


def _map(value: Any, fn: Any) -> Any:
    """`value` with each tensor replaced by fn(tensor) (lists and tuples kept)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [_map(v, fn) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _aliased_return(func: Any, args: tuple, kwargs: dict) -> Any:
    """What an op that makes no new tensor returns: the arguments its schema says its returns alias (add_ returns
    self), or None for an op that returns nothing (_fused_adamw_)."""
    schema = func._schema
    if not schema.returns:
        return None
    values = []
    for ret in schema.returns:
        found = None
        alias = ret.alias_info
        if alias is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
                    found = args[i] if i < len(args) else kwargs.get(arg.name)
                    break
        values.append(found)
    return values[0] if len(values) == 1 else tuple(values)


def _live_by_address(sim: Any) -> dict[int, tuple[Any, _Storage]]:
    """Every live storage the simulator tracks, by the address its memory starts at (a replay's look-up of memory
    freed since its capture: Note [graph capture])."""
    found = {}
    storages = sim._storages
    for ref, key, _ in list(sim._finalizers.values()):
        storage = ref()
        info = storages.get(key)
        if storage is not None and info is not None and storage.nbytes():
            found[storage.data_ptr()] = (storage, info)
    return found


class _Ref:
    """Memory a graph references: a storage (weakly: the graph does not keep a program's tensors alive) as it was
    at capture, and whether the capture allocated it (the graph's own then)."""

    __slots__ = ("info", "made", "nbytes", "ptr", "scratch", "storage", "what")

    def __init__(self, storage: Any, info: _Storage, made: bool, what: str) -> None:
        self.storage = weakref.ref(storage)
        self.info = info  # the registration it had: free_storage / alloc_storage or a death makes a new one or none
        self.ptr = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self.made = made
        self.what = what
        self.scratch: tuple[Any, _Storage] | None = None  # the graph's own bytes once the capture's storage is gone


class _Node:
    """One recorded op: what it runs, on which captured stream, on which memory, and its price on the timeline."""

    __slots__ = ("checks", "flops", "fn", "label", "lane", "leaves", "name", "nbytes", "outputs", "template")

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)


class _Capture:
    """A capture underway: its streams (the origin and those that joined), what it recorded, and its pool."""

    def __init__(self, graph: SimGraph, origin: SimStream, pool: PrivatePool, mode: str) -> None:
        self.graph = graph
        self.origin = origin
        self.streams: dict[int, SimStream] = {origin.actor: origin}
        self.pool = pool
        self.mode = mode
        self.thread = threading.get_ident()
        self.error: str | None = None  # why it was invalidated
        self.ended = False
        self.entries: list[tuple[int, int, Any]] = []  # (_OP, actor, _Node) / (_RECORD or _WAIT, actor, event number)
        # Capture-local vector clocks, for the unjoined check: per stream, the ops of each stream it is ordered after.
        self.vc: dict[int, dict[int, int]] = {origin.actor: {origin.actor: 0}}
        self.counts: dict[int, int] = {origin.actor: 0}  # ops recorded per stream
        self.event_clocks: list[dict[int, int]] = []  # per event recorded during the capture, its stream's clock
        self.made: set[_Storage] = set()  # device (and pinned) memory the capture allocated
        self.refs: list[_Ref] = []
        self.ref_index: dict[int, int] = {}  # id(StorageInfo) -> index in refs
        self.specs: list[tuple] = []  # (kind, ref index or constant, dtype, offset, sizes, strides)
        self.spec_index: dict[tuple, int] = {}
        self.nodes = 0

    def add_op(self, actor: int, node: _Node) -> None:
        self.entries.append((_OP, actor, node))
        self.counts[actor] += 1
        self.vc[actor][actor] = self.counts[actor]
        self.nodes += 1


class _Exec:
    """A captured graph, ready to replay: its entries on streams and events of its own."""

    def __init__(self, sim: Any, graph: SimGraph, capture: _Capture) -> None:
        self.streams = {
            actor: sim.Stream(name=f"{stream.name} [{graph.name}]") for actor, stream in capture.streams.items()
        }
        events = [sim.Event() for _ in capture.event_clocks]
        self.entries = [
            (kind, self.streams[actor], x if kind == _OP else events[x]) for kind, actor, x in capture.entries
        ]
        self.origin = self.streams[capture.origin.actor]
        self.refs = capture.refs
        self.specs = capture.specs
        self.nodes = capture.nodes
        self.start, self.end = sim.Event(), sim.Event()
        self.name = graph.name

    def resolve(self, sim: Any, ref: _Ref, addresses: dict[int, tuple[Any, _Storage]]) -> tuple[Any, _Storage]:
        """The storage a replay uses for `ref` and the record the sanitizer keeps its accesses in (Note [graph
        capture]): the storage itself while it is the allocation the capture saw; else, for memory the capture
        allocated, the graph's own bytes; for memory from before the capture, the allocation of its size and kind at
        its address now, or an error. `addresses`: live storages by address, filled on first need."""
        storage = ref.storage()
        if storage is not None and sim._storages.get(storage._cdata) is ref.info and storage.data_ptr() == ref.ptr:
            return storage, ref.info
        if not ref.made:
            if not addresses:
                addresses.update(_live_by_address(sim))
            found = addresses.get(ref.ptr)
            if found is not None and found[1].kind == ref.info.kind and found[0].nbytes() == ref.nbytes:
                ref.storage, ref.info = weakref.ref(found[0]), found[1]  # the graph's address is this allocation's now
                return found
            raise RuntimeError(
                f"{self.name}.replay(): {ref.what} was captured at an address no allocation of its size holds any "
                "more: its memory was freed since (the tensor dropped, free_storage, moved by alloc_storage or a "
                "resize). A GPU would replay into that address and silently read or write freed memory, or memory now "
                "someone else's; the simulator is stricter than hardware here and refuses. Keep the tensor and its "
                "memory while the graph is replayed (a tensor of the same size made anew at the same address, "
                "data_ptr() equal, is read as the graph's, as on hardware), or capture again."
            )
        if ref.scratch is None:
            with _disable_current_modes():
                backing = torch.UntypedStorage(ref.nbytes)
            sim._uid += 1
            ref.scratch = (backing, _Storage(sim._uid, ref.info.kind, ref.nbytes, self.origin.actor))
        return ref.scratch

    def views(self, storages: list[tuple[Any, _Storage]]) -> list[torch.Tensor]:
        """One CPU tensor per recorded tensor argument, over the memory this replay uses."""
        views = []
        for kind, x, dtype, offset, size, stride in self.specs:
            if kind == _REF:
                views.append(torch.empty(0, dtype=dtype, device=_CPU).set_(storages[x][0], offset, size, stride))
            elif kind == _CONST:
                views.append(x)
            else:
                views.append(torch.empty_strided(size, stride, dtype=dtype, device=_CPU))
        return views

    def replay(self, sim: Any, stream: SimStream) -> None:
        paused = gc.isenabled()
        if paused:  # Note [garbage collection inside an op]: a replay makes a few objects per tensor of every node
            gc.disable()
        try:
            self._replay(sim, stream)
        finally:
            if paused:
                gc.enable()

    def _replay(self, sim: Any, stream: SimStream) -> None:
        addresses: dict[int, tuple[Any, _Storage]] = {}
        storages = [self.resolve(sim, ref, addresses) for ref in self.refs]  # before anything runs
        timeline = sim._timeline
        preset = sim.preset
        timeline.charge_python()  # the program's Python before the launch ("measured" clock)
        timeline.host_us += preset.graph_launch_us
        # The graph's joins and edges are the device's, issued by the one launch: the host pays no event calls.
        sim._record(self.start, stream, by_host=False)
        sim._stream_wait(self.origin, self.start, by_host=False)
        first = timeline.host_us
        gap = preset.graph_node_gap_us
        issued: dict[int, float] = {}
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            views = self.views(storages)
            for kind, s, x in self.entries:
                if kind == _OP:
                    at = issued.get(s.actor)
                    issued[s.actor] = at = first if at is None else at + gap
                    self._run(sim, x, s, views, storages, at)
                elif kind == _RECORD:
                    sim._record(x, s, by_host=False)
                else:
                    sim._stream_wait(s, x, by_host=False)
        # every joined stream was joined back into the origin (capture_end)
        sim._record(self.end, self.origin, by_host=False)
        sim._stream_wait(stream, self.end, by_host=False)
        timeline.host_us += preset.graph_node_host_us * self.nodes

    @staticmethod
    def _run(sim: Any, node: _Node, s: SimStream, views: list[torch.Tensor], storages: list, at: float) -> None:
        """One node of a replay on its stream `s`: checked, run, placed on the timeline issued at `at`."""
        clocks = sim._clocks
        clocks.merge(s.actor, clocks._vc[sim._host()])  # launched by the host: after everything it did before
        epoch = clocks.tick(s.actor)
        labels = sim._labels
        labels.append(node.label)
        try:
            if sim.sanitize and node.checks:
                sim._check_and_log(node.name, [
                    (_Arg(views[i], storages[r][0], storages[r][1], role), s.actor, epoch) for i, r, role in node.checks
                ])  # fmt: skip
            args, kwargs = _fill(node.template, [views[i] for i in node.leaves])
            out = node.fn(*args, **kwargs)
            if node.outputs:
                made = _flatten(out, [])
                for leaf, i in node.outputs:
                    if made[leaf].shape != views[i].shape:  # an output sized by data that no meta kernel told
                        raise RuntimeError(
                            f"{node.name} in a replay made an output of shape {tuple(made[leaf].shape)} where the "
                            f"capture allocated {tuple(views[i].shape)}: an op whose output size depends on data "
                            "cannot be replayed from a graph"
                        )
                    views[i].copy_(made[leaf])
            timed = sim._timeline.launch(
                s.name, s.tail_us, node.lane, node.nbytes, node.name, node.label, node.flops, issued_us=at
            )
            s.tail_us = timed.end_us
        finally:
            labels.pop()


@counted_methods("__init__", "capture_begin", "capture_end", "replay", "reset", "pool", "instantiate")
class SimGraph:
    """A graph of the simulated device, as torch.cuda.CUDAGraph (torch.npu.NPUGraph). Created through
    `SimDevice.CUDAGraph()` (or `NPUGraph()`, the same class); Note [graph capture]."""

    _sim: Any

    def __init__(self, keep_graph: bool = False) -> None:
        sim = self._sim
        sim._graph_ids += 1
        self.name = f"{'npugraph' if sim.flavour == 'npu' else 'cudagraph'}#{sim._graph_ids}"
        self._kind = type(self).__name__  # CUDAGraph / NPUGraph, as torch's messages name it
        self._capture: _Capture | None = None
        self._exec: _Exec | None = None
        self._pool_id: tuple[int, int] | None = None
        # The pool this graph holds, until reset() or its death (then released: Graphs._release_pools).
        self._held: list[PrivatePool] = []
        weakref.finalize(self, sim._release_pools, self._held).atexit = False

    def __repr__(self) -> str:
        state = "capturing" if self._capture else "captured" if self._exec else "empty"
        return f"<sim {self._kind} {self.name} {state}>"

    def capture_begin(
        self, pool: Any = None, capture_error_mode: str = "global", check_input_liveness: bool = False
    ) -> None:
        """Begin capturing the current stream's work (check_input_liveness: the simulator always checks, at every
        replay, that memory from before the capture is still alive)."""
        sim = self._sim
        with sim._lock:
            if self._exec is not None or self._capture is not None:
                raise RuntimeError(
                    f"This {self._kind} instance already owns a captured graph. To capture a new graph, create a new "
                    "instance."
                )
            if capture_error_mode not in CAPTURE_ERROR_MODES:
                raise RuntimeError(
                    f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got "
                    f"{capture_error_mode}"
                )
            stream = sim._current()
            if stream.actor == sim._default.actor:  # cudaStreamBeginCapture refuses the legacy stream
                device = "NPU" if sim.flavour == "npu" else "CUDA"
                raise RuntimeError(
                    f"{device} graphs must be captured on a non-default stream. (However, after capture, it's ok to "
                    "replay them on the default stream.)"
                )
            if stream.actor in sim._captures:
                raise sim._graph_error("unsupported", f"capture_begin on {stream.name}, which is already capturing")
            sim._release_pools(self._held)  # a failed capture's pool, if any: this capture takes its own
            self._pool_id = tuple(pool) if pool is not None else sim._new_pool_id()
            private = sim._graph_pools.get(self._pool_id)
            if private is None:
                private = sim._graph_pools[self._pool_id] = PrivatePool(self._pool_id)
            private.users += 1
            self._held.append(private)
            self._capture = _Capture(self, stream, private, capture_error_mode)
            sim._captures[stream.actor] = self._capture

    def capture_end(self) -> None:
        """End the capture (on the stream it began on); the graph can then be replayed."""
        sim = self._sim
        with sim._lock:
            capture = self._capture
            if capture is None:
                raise RuntimeError(f"{self._kind}::capture_end: {self.name} is not capturing")
            stream = sim._current()
            if stream.actor != capture.origin.actor:
                raise RuntimeError("Capture must end on the same stream it began on.")
            if capture.mode != "relaxed" and threading.get_ident() != capture.thread:
                raise sim._graph_error("wrong_thread", f"{self.name}'s capture began on another thread")
            for actor in capture.streams:  # the capture ends, whatever it holds
                sim._captures.pop(actor, None)
            capture.ended = True
            self._capture = None
            if capture.error is not None:
                raise sim._graph_error("invalidated", f"{self.name}'s capture failed earlier: {capture.error}")
            origin = capture.vc[capture.origin.actor]
            unjoined = [
                s.name for actor, s in capture.streams.items()
                if actor != capture.origin.actor and origin.get(actor, 0) < capture.counts[actor]
            ]  # fmt: skip
            if unjoined:
                raise sim._graph_error(
                    "unjoined",
                    f"{', '.join(unjoined)} joined {self.name}'s capture and issued work that {capture.origin.name} "
                    f"did not wait for before capture_end; record an event there and make {capture.origin.name} wait "
                    "on it (or wait_stream) before the capture ends",
                )
            self._exec = _Exec(sim, self, capture)
            if not capture.nodes:
                device = "NPU" if sim.flavour == "npu" else "CUDA"
                warnings.warn(
                    f"The {device} Graph is empty. This usually means that the graph was attempted to be captured on "
                    "wrong device or stream.",
                    stacklevel=3,  # the caller of capture_end, past host_time's counted wrapper
                )

    def instantiate(self) -> None:
        """capture_end instantiates the graph already (keep_graph=False, torch's default)."""

    def replay(self) -> None:
        """Launch the captured work on the current stream (Note [graph capture])."""
        sim = self._sim
        with sim._lock:
            if self._exec is None:
                raise RuntimeError(f"Called {self._kind}::replay without a preceding successful capture.")
            stream = sim._current()
            if stream.actor in sim._captures:
                raise RuntimeError(
                    f"{self.name}.replay() on {stream.name}, which is capturing: the simulator does not model a graph "
                    "launched into a capture (a child graph node)"
                )
            self._exec.replay(sim, stream)
        sim._raise_pending()

    def reset(self) -> None:
        """Drop the captured graph; its pool goes back once no graph holds it (Note [graph capture])."""
        sim = self._sim
        with sim._lock:
            if self._capture is not None:
                raise RuntimeError(f"{self.name}.reset() while it captures: end the capture first")
            self._exec = None
            sim._release_pools(self._held)

    def pool(self) -> tuple[int, int]:
        """The id of this graph's memory pool, for another capture to share (capture_begin(pool=...))."""
        if self._pool_id is None or (self._exec is None and self._capture is None):
            raise RuntimeError(f"Called {self._kind}::pool() without a preceding successful capture.")
        return self._pool_id


@counted_methods("__enter__", "__exit__")
class _GraphContext:
    """torch.cuda.graph(g, pool, stream, capture_error_mode): synchronize, empty the cache, make the capture stream
    current, capture the block into g; then end the capture and give the previous stream back."""

    def __init__(self, sim: Any, graph: SimGraph, pool: Any, stream: SimStream | None, capture_error_mode: str) -> None:
        self._sim = sim
        self.cuda_graph = graph
        self.pool: tuple = () if pool is None else (pool,)
        self.capture_stream = canonical(stream) if stream is not None else sim._graph_capture_stream()
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        sim = self._sim
        sim.synchronize()
        sim.empty_cache()  # the device's and the pinned host cache, as torch.cuda.graph empties both
        self.capture_stream.__enter__()
        try:
            self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self.capture_stream.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.cuda_graph.capture_end()
        finally:
            self.capture_stream.__exit__(*exc)


@counted_methods("graph", "is_current_stream_capturing", "graph_pool_handle")
class Graphs:
    """SimDevice's graphs (Note [graph capture]). Mixed into SimDevice (device/sim/device.py), whose __init__ calls
    _init_graphs; the hooks in Dispatch._stream_op, StreamOrdering (_record, _stream_wait, synchronize), SimStream,
    SimEvent, Storages._register and OutsideDispatch call the methods here while a stream captures."""

    _captures: dict[int, _Capture]

    def _init_graphs(self) -> None:
        self._captures = {}  # capturing stream's actor -> its capture (the origin and every stream that joined)
        self._graph_pools: dict[tuple[int, int], PrivatePool] = {}  # pool id -> the pool graphs hold
        self._graph_ids = 0
        self._pool_ids = 0
        self._graph_stream: SimStream | None = None
        # Per-instance classes, as Stream and Event, so that `isinstance(g, dev.CUDAGraph)` works.
        self.CUDAGraph = type("NPUGraph" if self.flavour == "npu" else "CUDAGraph", (SimGraph,), {"_sim": self})
        self.NPUGraph = self.CUDAGraph

    # ---- the torch.cuda-like surface ----

    def graph(
        self,
        cuda_graph: SimGraph,
        pool: Any = None,
        stream: SimStream | None = None,
        capture_error_mode: str = "global",
        enable_annotations: bool = False,
        check_input_liveness: bool = False,
        auto_dispatch_capture: bool = False,
    ) -> _GraphContext:
        """As torch.cuda.graph (torch_npu's torch.npu.graph): a context manager that captures its block into
        `cuda_graph`. enable_annotations and auto_dispatch_capture (torch_npu's) change nothing here;
        check_input_liveness is what every replay checks anyway (Note [graph capture])."""
        return _GraphContext(self, cuda_graph, pool, stream, capture_error_mode)

    def is_current_stream_capturing(self) -> bool:
        """Whether a capture records the current stream's work (an invalidated capture still does, until it ends)."""
        return self._current().actor in self._captures

    def graph_pool_handle(self) -> tuple[int, int]:
        """An id for a private pool that captures may share (capture_begin(pool=...))."""
        self._pool_ids += 1
        return (0, self._pool_ids)

    def _new_pool_id(self) -> tuple[int, int]:
        self._pool_ids += 1
        return (self._pool_ids, 0)

    def _graph_capture_stream(self) -> SimStream:
        """The side stream torch.cuda.graph captures on when given none (torch makes one per process)."""
        if self._graph_stream is None:
            self._graph_stream = self.Stream(name="graph capture")
        return self._graph_stream

    def _release_pools(self, held: list[PrivatePool]) -> None:
        """A graph lets go of its pool (reset, or the graph died): with no graph left holding it, its memory goes
        back (DeviceMemory.release_pool)."""
        with self._lock:
            while held:
                pool = held.pop()
                pool.users -= 1
                if pool.users > 0:
                    continue
                if self._graph_pools.get(pool.id) is pool:
                    del self._graph_pools[pool.id]
                for mem in self._mems.values():
                    mem.release_pool(pool)

    # ---- what a capture refuses ----

    def _pageable_copy(self, what: str, stream: SimStream) -> RuntimeError:
        """torch's refusal of a copy between the device and pageable host memory on a capturing stream (the capture
        stays valid: torch checks before it issues anything)."""
        device = "NPU" if self.flavour == "npu" else "CUDA"
        capture = self._captures[stream.actor]
        return RuntimeError(
            _PAGEABLE_COPY.format(device=device) + f"\n(simulated: {what} on {stream.name}, which "
            f"{capture.graph.name} is capturing)"
        )

    def _graph_error(self, kind: str, why: str) -> RuntimeError:
        """CUDA's error for `kind` (torch_npu's device name on the npu flavour), and what the simulator saw."""
        text, code = _ERRORS[kind]
        device = "NPU" if self.flavour == "npu" else "CUDA"
        return _AcceleratorError(f"{device} error: {text}\n(simulated {code}: {why})")

    def _invalidate(self, capture: _Capture | None, kind: str, why: str) -> RuntimeError:
        """An invalid operation during `capture`: it is invalidated (its capture_end fails) and the error returned."""
        if capture is not None and capture.error is None and not capture.ended:
            capture.error = f"{_ERRORS[kind][1]}: {why}"
        return self._graph_error(kind, why)

    def _capture_sync(self, stream: SimStream | None, what: str) -> None:
        """The host would wait for `stream` (None: the whole device). Invalid while `stream` captures, or while any
        stream does for the device (CUDA: a handle that encompasses a capture), whatever the capture's mode: the work
        it would wait for is recorded, not run. Waiting for a stream that does not capture is a potentially unsafe
        call (_capture_unsafe)."""
        if stream is None:
            captures = list({id(c): c for c in self._captures.values()}.values())
            if not captures:
                return
            for capture in captures:
                self._invalidate(capture, "unsupported", f"{what} while {capture.graph.name} captures")
            names = ", ".join(f"{c.origin.name} ({c.graph.name})" for c in captures)
            raise self._graph_error("unsupported", f"{what} waits for the whole device while {names} captures")
        capture = self._captures.get(stream.actor)
        if capture is not None:
            raise self._invalidate(
                capture, "unsupported",
                f"{what} on {stream.name}, which {capture.graph.name} is capturing: its work is recorded, not run, and "
                "the host cannot wait for it",
            )  # fmt: skip
        self._capture_unsafe(f"{what} on {stream.name}")

    def _capture_unsafe(self, what: str) -> None:
        """A potentially unsafe call (CUDA's word: one that may synchronize; here a host wait for a stream or event
        outside any capture, or a new segment for one) while streams capture: refused, and the capture invalidated,
        where a capture's mode
        prohibits it on this thread ("global": every thread, "thread_local": the thread that began it, "relaxed":
        none), as cudaStreamCaptureMode decides."""
        if not self._captures:
            return
        me = threading.get_ident()
        prohibiting = [
            c for c in {id(c): c for c in self._captures.values()}.values()
            if c.mode == "global" or (c.mode == "thread_local" and c.thread == me)
        ]  # fmt: skip
        if not prohibiting:
            return
        for capture in prohibiting:
            self._invalidate(capture, "unsupported", f"{what} during the capture")
        capture = prohibiting[0]
        raise self._graph_error(
            "unsupported",
            f"{what} while {capture.graph.name} captures in {capture.mode!r} mode, which prohibits potentially unsafe "
            "calls " + ("from every thread" if capture.mode == "global" else "from the thread that began it")
            + " (capture_error_mode='relaxed' allows it)",
        )

    def _captured_event(self, event: SimEvent, what: str) -> None:
        """An event used where only work that runs can be (query, synchronize, elapsed_time, a wait after its capture
        ended): refused if last recorded on a capturing stream; one recorded outside a capture may be waited for on
        the host where the captures' modes allow it (_capture_unsafe)."""
        if event.captured is None:
            if what != "Event.elapsed_time()":  # reads two recorded times: no wait
                self._capture_unsafe(what)
            return
        capture, _ = event.captured
        if capture.ended:  # the graph's now: CUDA no longer knows it as an event (an H100 run: "invalid argument")
            raise self._graph_error(
                "invalid_value",
                f"{what} of an event last recorded during {capture.graph.name}'s capture, which has ended: it marks a "
                "point of the graph, which no eager work reaches; record it again outside a capture",
            )
        raise self._invalidate(
            capture, "captured_event",
            f"{what} of an event last recorded during {capture.graph.name}'s capture: it marks a point of the graph, "
            "which no eager work reaches; record it again outside a capture",
        )  # fmt: skip

    # ---- events and waits of capturing streams (StreamOrdering._record, _stream_wait) ----

    def _capture_record(self, event: SimEvent, stream: SimStream) -> None:
        capture = self._captures[stream.actor]
        if capture.error is not None:
            raise self._graph_error("invalidated", f"an event recorded on {stream.name} after: {capture.error}")
        number = len(capture.event_clocks)
        capture.event_clocks.append(dict(capture.vc[stream.actor]))
        capture.entries.append((_RECORD, stream.actor, number))
        event.captured = (capture, number)
        event.clock, event.time_us = None, None  # no eager work is behind it

    def _capture_wait(self, stream: SimStream, event: SimEvent) -> None:
        """`stream` waits on `event`, one of them part of a capture: a fork (the stream joins the event's capture), an
        edge of the graph, or an error."""
        own = self._captures.get(stream.actor)
        if event.captured is None:  # an eager event, and `stream` captures
            if event.clock is None:
                return  # never recorded: nothing to wait for, as on CUDA
            raise self._invalidate(
                own, "isolation",
                f"{stream.name}, which {own.graph.name} is capturing, waits on an event recorded outside the capture; "
                "order the capture after earlier work before capture_begin instead",
            )  # fmt: skip
        source, number = event.captured
        if source.ended:
            if own is not None:
                self._invalidate(own, "invalid_value", f"{stream.name} waits on an event of an ended capture")
            self._captured_event(event, f"{stream.name}.wait_event()")
        if own is not None and own is not source:
            self._invalidate(source, "merge", "two captures joined")
            raise self._invalidate(
                own, "merge", f"{stream.name} ({own.graph.name}) waits on an event of {source.graph.name}'s capture"
            )
        if source.error is not None:
            raise self._graph_error(
                "invalidated", f"{stream.name} waits on an event of a failed capture: {source.error}"
            )
        clock = source.event_clocks[number]
        if own is None and stream.actor == self._default.actor:
            # torch's default stream is CUDA's legacy stream, which no capture takes in (its implicit
            # synchronization with every other stream would make it depend on the capture)
            raise self._invalidate(
                source, "implicit",
                f"the default stream waits on an event of {source.graph.name}'s capture: the default (legacy) stream "
                "cannot join a capture; fork a side stream instead",
            )  # fmt: skip
        if own is None:  # a fork: the stream joins the capture
            source.streams[stream.actor] = stream
            self._captures[stream.actor] = source
            source.vc[stream.actor] = dict(clock)
            source.counts[stream.actor] = 0
        else:
            mine = source.vc[stream.actor]
            for actor, count in clock.items():
                if mine.get(actor, 0) < count:
                    mine[actor] = count
        source.entries.append((_WAIT, stream.actor, number))

    # ---- ops of capturing streams (Dispatch._stream_op) ----

    def _capture_op(
        self,
        func: Any,
        plan: _Plan,
        args: tuple,
        kwargs: dict,
        tensor_args: list[_Arg],
        accesses: list[_Arg],
        has_device: bool,
        place: int,
        stream: SimStream,
    ) -> Any:
        """Record a device op of a capturing stream (Note [graph capture]); return what it returns, its new tensors
        allocated from the graph's pool and left unwritten."""
        capture = self._captures[stream.actor]
        op = plan.op
        name = op.name
        if capture.error is not None:
            raise self._graph_error("invalidated", f"{name} on {stream.name} after: {capture.error}")
        if op.copy or op.local_scalar:
            lane, blocking, staged = op_lane(func, op, args, kwargs, accesses, place >= 0)
        else:
            lane, blocking, staged = "compute", op.sync or op.value_return, False
        if self.flavour == "npu" and op.copy and lane in ("h2d", "d2h") and not all(
            a.tensor.is_contiguous() for a in accesses
        ):
            blocking = True  # torch_npu waits for a non-contiguous host<->device copy (Dispatch._stream_op)
        if op.copy and not op.local_scalar and (
            any(a.pageable for a in accesses) or (op.new_outputs and place < 0 and place != PINNED_OUT)
        ):  # from or into pageable memory (.cpu(), tolist(), torch.tensor(data, device=...))
            raise self._pageable_copy(name, stream)
        why = None
        if op.local_scalar or op.value_return:
            why = "reads a device value on the host"
        elif blocking or staged:
            why = "makes the host wait for it (a copy without non_blocking=True, or an output sized by data)"
        elif place < 0 and place != PINNED_OUT and op.new_outputs:
            why = "makes a pageable host tensor from device data"
        if why is not None:
            raise self._invalidate(
                capture, "unsupported", f"{name} on {stream.name}, which {capture.graph.name} is capturing, {why}"
            )
        if not op.alloc_only:  # the host still issues it, as it issues any launch
            timeline = self._timeline
            if timeline.host_clock == "measured":
                timeline.charge_python(len(tensor_args))
            timeline.host_us += timeline.issue_us(len(tensor_args))

        role_of: dict[Any, str] = {}
        for position, arg_name, role in op.roles:
            role_of[position] = role_of[arg_name] = role
        leaves: list[torch.Tensor] = []
        roles: list[str] = []
        targs = tuple([_template(a, leaves, roles, role_of.get(i, "r")) for i, a in enumerate(args)])
        tkwargs = {k: _template(v, leaves, roles, role_of.get(k, "r")) for k, v in kwargs.items()}
        checks: list[tuple[int, int, str]] = []
        slots = [self._capture_spec(capture, t, role, op.copy, name, stream, checks) for t, role in zip(leaves, roles)]

        if any(plan.fresh):
            try:
                out, new = self._capture_outputs(plan, func, args, kwargs)
            except _SizedByData:
                raise self._invalidate(
                    capture, "unsupported",
                    f"{name} on {stream.name}, which {capture.graph.name} is capturing, makes an output sized by data, "
                    "which the host must read",
                ) from None
        else:
            out, new = _aliased_return(func, args, kwargs), []
        created = []
        try:
            for t in new:
                storage = t.untyped_storage()
                if place >= 0:  # from the graph's pool: Storages._register
                    info = self._register(storage, DEVICE, stream.actor, index=place)
                else:  # pinned host memory (.to("cpu", non_blocking=True))
                    info = self._register(storage, HOST_MEM)
                    capture.made.add(info)
                created.append(storage)
        except OutOfMemoryError:  # the op's outputs are dropped, as if the allocation had failed
            for storage in created:
                self._forget(storage)
            raise
        if op.alloc_only:
            return out  # memory and no kernel: nothing to replay
        flat = _flatten(out, []) if new else []
        outputs = []
        for t in new:
            spec = self._capture_spec(capture, t, "o", op.copy, name, stream, checks)
            outputs.append((next(i for i, o in enumerate(flat) if o is t), spec))
        if lane == "compute":
            nbytes = sum(a.tensor.nbytes * (2 if a.role == "w" else 1) for a in accesses)
        else:
            nbytes = sum(a.tensor.nbytes for a in accesses if a.writes)
        nbytes += sum(t.nbytes for t in new)
        labels = self._labels
        label = f"{capture.graph.name} replay" + (f": {labels[-1]}" if labels else "")
        flops = plan.flops(func, args, kwargs) if plan.flops is not None and lane == "compute" else None
        capture.add_op(stream.actor, _Node(
            fn=(plan.kernel if has_device else None) or plan.call, name=name, label=label,
            template=(targs, tkwargs), leaves=tuple(slots), checks=tuple(checks), outputs=tuple(outputs), lane=lane,
            nbytes=nbytes, flops=flops,
        ))  # fmt: skip
        return out

    def _capture_spec(
        self,
        capture: _Capture,
        t: torch.Tensor,
        role: str,
        copy: bool,
        name: str,
        stream: SimStream,
        checks: list[tuple[int, int, str]],
    ) -> int:
        """The index in capture.specs of what a recorded op's tensor argument stands for at replay; its access goes
        to `checks` (spec, ref, role) when the replay is to check it."""
        if t.layout is not torch.strided:
            raise RuntimeError(f"{name}: the simulator does not capture ops on {t.layout} tensors into a graph")
        size, stride, dtype = tuple(t.size()), tuple(t.stride()), t.dtype
        if role == "v":  # only its sizes are read
            return self._intern(capture, (_SHAPE, None, dtype, 0, size, stride))
        storage = t.untyped_storage()
        info = self._storages.get(storage._cdata)
        if info is None and self._host_starts:
            t, storage, info = self._alias(t, storage)  # Note [aliases of host memory]
        if info is None or info.kind == PAGEABLE or (info.kind == HOST_MEM and not copy):
            # A host tensor a kernel takes (copies from pageable memory were refused): a scalar read at launch.
            if t.numel() != 1:  # one torch copies to the device first (CPU indices): from pageable memory
                raise self._pageable_copy(f"{name} (a host tensor of shape {tuple(t.shape)})", stream)
            with _disable_current_modes():
                value = t.clone()
            capture.specs.append((_CONST, value, dtype, 0, size, stride))
            return len(capture.specs) - 1
        key = id(info)
        ref = capture.ref_index.get(key)
        if ref is None:
            made = info in capture.made
            kind = "device" if info.kind == DEVICE else "pinned host"
            what = (
                f"a {kind} tensor of shape {tuple(t.shape)} (storage #{info.uid}, {info.nbytes} bytes) that {name} uses"
                + (" (allocated by the capture)" if made else ", allocated before the capture,")
            )
            capture.refs.append(_Ref(storage, info, made, what))
            ref = capture.ref_index[key] = len(capture.refs) - 1
        spec = self._intern(capture, (_REF, ref, dtype, t.storage_offset(), size, stride))
        checks.append((spec, ref, role))
        return spec

    @staticmethod
    def _intern(capture: _Capture, spec: tuple) -> int:
        index = capture.spec_index.get(spec)
        if index is None:
            capture.specs.append(spec)
            index = capture.spec_index[spec] = len(capture.specs) - 1
        return index

    @staticmethod
    def _capture_outputs(plan: _Plan, func: Any, args: tuple, kwargs: dict) -> tuple[Any, list[torch.Tensor]]:
        """What a recorded op returns, without running it: its meta kernel's outputs as uninitialized CPU tensors of
        the same sizes and strides (an output that aliases an argument is that argument), and those new tensors. An
        op without a meta kernel runs on copies of its arguments instead, which leaves the program's memory alone."""
        memo: dict[int, torch.Tensor] = {}

        def stand_in(device: str) -> Any:
            def make(x: torch.Tensor) -> torch.Tensor:
                if device == "meta":
                    m = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
                else:
                    m = x.clone()
                memo[id(m)] = x
                return m

            return make

        new: list[torch.Tensor] = []
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            try:
                make = stand_in("meta")
                margs = _map(args, make)
                mkwargs = {k: _map(v, make) for k, v in kwargs.items()}
                if "device" in mkwargs:
                    mkwargs["device"] = torch.device("meta")
                made = plan.call(*margs, **mkwargs)
                meta = True
            except Exception as err:  # noqa: BLE001 - any op without a meta kernel: run on copies instead
                if "nonzero" in str(err):  # torch's meta kernels say so for an output sized by data
                    raise _SizedByData from None
                memo.clear()
                make = stand_in("cpu")
                made = plan.call(*_map(args, make), **{k: _map(v, make) for k, v in kwargs.items()})
                meta = False

            def real(m: torch.Tensor) -> torch.Tensor:
                found = memo.get(id(m))
                if found is not None:
                    return found  # aliases an argument
                t = torch.empty_strided(m.size(), m.stride(), dtype=m.dtype, device=_CPU) if meta else m
                new.append(t)
                return t

            out = _map(made, real)
        return out, new
