"""What reaches the simulated device's memory outside the dispatcher, as SimDevice judges it: OutsideDispatch, the
part that checks host reads made without an aten op (tolist, numpy, DLPack, torch.save; device/sim/entry_points.py
wraps them), finds pinned memory reached through an alias of its own (Note [aliases of host memory]), restores
storages torch.load brings back from device memory, and holds a collective's tensors until no C++ holder of theirs
is left (Note [collective tensors at exit])."""

from __future__ import annotations

import bisect
import threading
from typing import Any

import torch

from device.sim.accesses import DEVICE, HOST_MEM
from device.sim.accesses import Arg as _Arg
from device.sim.accesses import StorageInfo as _Storage
from device.sim.ops import byte_range
from device.sim.tensor import SimTensor

# Note [collective tensors at exit]
# A gloo worker thread drops its references to a collective's tensors only after the caller's wait() has
# returned. If the program has dropped them by then, the worker's is the last reference, and releasing a
# tensor whose Python object C++ now owns (torch keeps it, and the simulator's finalizers on its storages)
# takes the GIL on that worker. A thread that takes the GIL after the interpreter began finalizing is
# stopped with pthread_exit, whose forced unwind crosses a noexcept frame (TensorImpl::decref_pyobject):
# std::terminate, "terminate called without an active exception", after a correct program's last line.
# So the simulator holds every tensor a collective took or returned (c10d ops through its dispatch mode)
# until the use counts of the tensor and of its storage say no C++ holder is left (a work may hold a view
# of it): the worker's release is then never the last reference (it takes no GIL), and the last one is
# dropped on a thread that runs Python (the next op's dispatch, or a memory query). Host memory the
# simulator first sees while collectives run (temporaries gloo made and ops in its wait() touch, which the
# simulator then registers) is held the same way. Tensors a C++ object still holds at exit (a view's base,
# an autograd node) stay held until the interpreter itself frees them on the main thread; leaving an
# activate() block lets go of all of them. Last, at exit (an atexit hook, which runs before the interpreter
# begins finalizing), a process that ran collectives gives up the GIL for a moment (_settle_collectives), so
# that a worker still letting go of something the simulator does not hold does it then.

# Note [aliases of host memory]
# A tensor can reach a pinned storage's memory through a storage of its own: numpy() and torch.from_numpy,
# torch.frombuffer, DLPack, UntypedStorage over the same address. CUDA judges memory, not storage objects:
# a D2H copy into pinned memory races any host read of those bytes, whatever tensor makes it. So live pinned
# storages are indexed by address (_index_host), and a tensor of an untracked storage whose bytes lie inside
# one (_alias) is checked as the view of that storage it is: dispatched ops (_run), tolist / numpy / DLPack
# (_host_read) and torch.save (_saved). Reads through a numpy array itself (numpy code, not torch) are not
# seen: numpy() is checked as a read of the whole tensor when it is called.


def _collect_tensors(value: Any, found: list[torch.Tensor]) -> None:
    """Tensors in ``value`` (nested lists, tuples and dicts; c10d ops take Tensor[][])."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_tensors(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_tensors(v, found)


class OutsideDispatch:
    """SimDevice's checks of what the dispatcher does not see. Mixed into SimDevice (device/sim/device.py),
    whose __init__ makes the state used here (_held, _held_lock, _collectives, _host_starts, _host_spans)."""

    # Set by SimDevice.__init__.
    _held: dict[int, tuple[torch.Tensor, torch.Tensor, Any]]
    _held_lock: threading.Lock
    _collectives: bool
    _host_starts: list[int]
    _storages: dict[int, _Storage]

    def _host_read(self, t: torch.Tensor, what: str) -> None:
        """tolist(), numpy(), DLPack, torch.save: the host reads t's bytes without an aten op.
        A device tensor is read by a blocking copy on the current stream, as CUDA does."""
        with self._lock:
            self._host_read_locked(t, what)

    def _host_read_locked(self, t: torch.Tensor, what: str) -> None:
        if not self.sanitize or t.device.type != "cpu" or t.layout is not torch.strided:
            return
        storage = t.untyped_storage()
        info = self._lookup(storage)
        if info is None:
            t, storage, info = self._alias(t, storage)  # Note [aliases of host memory]
        if info is None:
            return
        arg = _Arg(t, storage, info, "r")
        if info.kind == DEVICE:
            stream = self._current()
            if self._captures:  # a blocking read on a capturing stream (Note [graph capture])
                self._capture_sync(stream, what)
            host = self._host()
            self._clocks.merge_actor(stream.actor, host)
            self._check_and_log(what, [(arg, stream.actor, self._clocks.tick(stream.actor))])
            self._clocks.merge_actor(host, stream.actor)
            self._timeline.wait_host(stream.tail_us)
        else:
            host = self._host()
            self._check_and_log(what, [(arg, host, self._clocks.tick(host))])

    def _is_pinned(self, t: torch.Tensor) -> bool:
        """Tensor.is_pinned(): pinned memory, through an alias too (CUDA asks the host allocator by address)."""
        storage = t.untyped_storage()
        info = self._lookup(storage)
        if info is None:
            info = self._alias(t, storage)[2]
        return info is not None and info.kind == HOST_MEM

    def _alias(self, t: torch.Tensor, storage: Any) -> tuple[torch.Tensor, Any, _Storage | None]:
        """Note [aliases of host memory]: (t, storage, None) for memory of no tracked storage; for a tensor
        whose storage is not tracked but whose bytes lie in a live pinned storage, that storage and t as a view
        of it (the same elements), so that its accesses are judged on the memory they touch."""
        starts = self._host_starts
        if not starts or t.layout is not torch.strided or t.device.type != "cpu":
            return t, storage, None
        try:
            ptr = storage.data_ptr()
        except RuntimeError:  # a wrapper subclass's storage holds no memory of its own
            return t, storage, None
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return t, storage, None
        start = starts[i]
        end, ref, key = self._host_spans[start]
        rng = byte_range(t)
        if ptr >= end or rng is None:
            return t, storage, None
        base = ref()
        info = self._storages.get(key)
        delta = ptr - start
        if (
            base is None or info is None or ptr + rng[1] > end
            or base.data_ptr() != start or start + base.nbytes() != end  # moved (share_memory_) or resized
        ):
            return t, storage, None
        itemsize = t.element_size()
        with torch.utils._python_dispatch._disable_current_modes():
            if delta % itemsize == 0:
                view = torch.empty(0, dtype=t.dtype, device="cpu").set_(
                    base, t.storage_offset() + delta // itemsize, t.shape, t.stride()
                )
            else:  # bytes not aligned to its dtype in the pinned storage: the same bytes, element by element
                view = torch.empty(0, dtype=torch.uint8, device="cpu").set_(
                    base, t.storage_offset() * itemsize + delta, (*t.shape, itemsize),
                    (*(s * itemsize for s in t.stride()), 1),
                )
        return view, base, info

    def _hold_collective(self, args: tuple, kwargs: dict, out: Any) -> None:
        """Note [collective tensors at exit]: keep the tensors a collective took or returned (for a SimTensor,
        the wrapper, which keeps the CPU tensor the backend got) until no C++ holder of theirs is left."""
        self._collectives = True
        found: list[torch.Tensor] = []
        for value in (*args, *kwargs.values(), out):
            _collect_tensors(value, found)
        for t in found:
            self._hold(t)

    def _hold(self, t: torch.Tensor) -> None:
        inner = t._elem if type(t) is SimTensor else t
        if inner.layout is not torch.strided:
            return
        storage = inner.untyped_storage()  # its Python object: C++'s last release of it would take the GIL
        with self._held_lock:
            self._held[id(inner)] = (t, inner, storage)

    def _release_collectives(self, everything: bool = False) -> None:
        """Let go of the held tensors nothing but this simulator still holds (``everything``: all of them);
        each is freed, if nothing else holds it, here on this thread."""
        use_count = torch._C._storage_Use_Count
        with self._held_lock:
            # Nothing else holds the tensor, and its storage only it and the storage's own Python object (a
            # view a collective's work made of it would be one more).
            done = [
                key for key, (_, inner, storage) in self._held.items()
                if everything or (inner._use_count() <= 1 and use_count(storage._cdata) <= 2)
            ]
            dropped = [self._held.pop(key) for key in done]
        del dropped  # outside the lock: a free runs the storage's finalizer

    def _loaded(self, storage: Any) -> None:
        """A storage torch.load restored from a checkpoint saved from device memory: device memory again."""
        if self._lookup(storage) is None:
            stream = self._current()
            self._allocated(self._register(storage, DEVICE, stream.actor), stream)

    def _saved(self, storage: Any) -> bool:
        """torch.save reads a whole storage on the host; whether it is device memory (saved as such)."""
        info = self._lookup(storage)
        if info is None and not self._host_starts:
            return False
        with torch.utils._python_dispatch._disable_current_modes():
            t = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)
        self._host_read(t, "torch.save")  # of a storage aliasing pinned memory too (Note [aliases of host memory])
        return info is not None and info.kind == DEVICE
