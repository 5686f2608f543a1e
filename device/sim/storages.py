"""Device memory and pinned host memory as the simulated device accounts them: Storages, the part of SimDevice
that tracks every storage it has seen (StorageInfo: device, pinned host or pageable host memory), counts device
blocks against the capacity of each device (device.sim.memory: exact or the caching allocator's model) and pinned
host memory against the host's RAM (device.sim.host_memory), frees them when their storages die, and serves the
torch.cuda-like memory queries."""

from __future__ import annotations

import atexit
import bisect
import math
import threading
import weakref
from typing import Any

import torch

from device.sim.accesses import DEVICE, HOST_MEM, PAGEABLE
from device.sim.accesses import Arg as _Arg
from device.sim.accesses import StorageInfo as _Storage
from device.sim.host_memory import (
    REGISTER_THREADS,
    HostMemory,
    npu_pinned_bytes,
    power_of_two,
)
from device.sim.host_time import counted_methods
from device.sim.memory import Block, DeviceMemory, OutOfMemoryError, fmt_bytes
from device.sim.ops import arg_value
from device.sim.sanitizer import HOST, Access
from device.sim.streams import SimStream

_ref = weakref.ref
# Set at exit, before the interpreter finalizes: storages that die after it free nothing (Storages._storage_died).
_EXITING: list[bool] = []
atexit.register(_EXITING.append, True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (its memory), or t itself."""
    local = getattr(t, "_local_tensor", None)  # DTensor
    return local if isinstance(local, torch.Tensor) else t


# Host work of the simulator's own bookkeeping, which a device does not do: device.host_time counts it.
@counted_methods(
    "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "is_host", "pinned_empty",
    "record_stream", "free_storage", "alloc_storage",
)
class Storages:
    """SimDevice's storages and memory. Mixed into SimDevice (device/sim/device.py), whose __init__ makes the
    state used here (_storages, _mems, host_mem, _lock, _late_frees, ...)."""

    # Set by SimDevice.__init__.
    _storages: dict[int, _Storage]
    _finalizers: dict[int, tuple[weakref.ref, int, int]]  # id of a storage's reference -> (it, key, uid)
    _mems: dict[int, DeviceMemory]
    host_mem: HostMemory
    _lock: threading.RLock
    _captures: dict[int, Any]  # capturing stream's actor -> its capture (device.sim.graphs)

    def _mem_of(self, index: int) -> DeviceMemory:
        mem = self._mems.get(index)
        if mem is None:
            mem = self._mems[index] = DeviceMemory(self.capacity_bytes, caching=self._caching)
        return mem

    @property
    def _mem(self) -> DeviceMemory:
        return self._mem_of(self.current_device())

    def _memory(self, device: Any = None) -> DeviceMemory:
        if self._held:
            self._release_collectives()  # what only the simulator holds is no longer allocated
        if self._late_frees:
            with self._lock:
                self._drain_frees()
        index = self._index(device)
        mem = self._mem_of(self.current_device() if index is None else index)
        mem.process_deferred(self._timeline.host_us)
        return mem

    def memory_allocated(self, device: Any = None) -> int:
        return self._memory(device).allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._memory(device).peak_allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._memory(device).reset_peaks()
        self._peak_host = self._live_host

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_reserved(self, device: Any = None) -> int:
        """Bytes held in segments (allocator="caching"); equal to memory_allocated with exact accounting."""
        return self._memory(device).reserved

    def max_memory_reserved(self, device: Any = None) -> int:
        return self._memory(device).peak_reserved

    def empty_cache(self) -> None:
        for index in list(self._mems):
            self._memory(index).empty_cache()
        self.host_mem.empty_cache()  # torch.cuda.empty_cache also frees the caching host allocator's free blocks

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return max(self.capacity_bytes - self._memory(device).reserved, 0), self.capacity_bytes

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        """As torch.cuda's: the allocator refuses to hold more than ``fraction`` of the device's memory (out of
        memory past it); mem_get_info still reports the whole device, as CUDA's does."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self._memory(device).capacity = int(fraction * self.capacity_bytes)

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        return self._memory(device).capacity / self.capacity_bytes

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        mem = self._memory(device)
        return {
            "allocated_bytes.all.current": mem.allocated,
            "allocated_bytes.all.peak": mem.peak_allocated,
            "reserved_bytes.all.current": mem.reserved,
            "reserved_bytes.all.peak": mem.peak_reserved,
        }

    def is_host(self, t: torch.Tensor) -> bool:
        """Host memory (pinned or pageable): every cpu tensor; device memory is a SimTensor's."""
        return local_tensor(t).device.type == "cpu"

    def pinned_empty(self, size: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A CPU tensor registered as pinned host memory (not counted as device memory), taken from the host
        as the caching host allocator takes it (rounded, _host_cost)."""
        self._host_alloc += 1
        try:
            t = torch.empty(size, dtype=dtype, device="cpu")
        finally:
            self._host_alloc -= 1
        storage = t.untyped_storage()
        if self._lookup(storage) is None:  # allocated where the mode does not see it (another thread)
            self._register(storage, HOST_MEM)
        return t

    def registered_empty(self, nbytes: int, threads: int = REGISTER_THREADS, pin: bool = True) -> torch.Tensor:
        """``nbytes`` of host memory the program allocates itself and registers (cudaHostRegister; what
        device.host_empty does on hardware): pinned like pinned_empty's and counted at its true size in whole
        pages from the start (its pages are written before it is pinned); pinning it costs modeled host time
        at ``threads`` times the preset's rate, now or, with ``pin=False``, at pin_registered."""
        with self._lock:
            self._registering = max(int(threads), 1) if pin else -1
            try:
                t = self.pinned_empty((int(nbytes),), torch.uint8)
            finally:
                self._registering = 0
        if not pin:
            self._unpinned[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    def pin_registered(self, buffers: list[torch.Tensor], threads: int = REGISTER_THREADS) -> None:
        """Register registered_empty(..., pin=False) buffers: the modeled time of pinning their bytes."""
        nbytes = sum(self._unpinned.pop(b.untyped_storage()._cdata, 0) for b in buffers)
        if nbytes:
            self._timeline.host_us += self.host_mem.pin_us(nbytes, threads)

    def _pinned_rounding(self, nbytes: int) -> int:
        """Host bytes a pinned allocation of ``nbytes`` takes: the cuda flavour rounds up to a power of two as
        torch's CachingHostAllocator does, the npu flavour as torch_npu's (device.npu_pinned_bytes, under
        PYTORCH_NPU_ALLOC_CONF as it is at allocation)."""
        if self.flavour != "npu":
            return power_of_two(nbytes)
        return npu_pinned_bytes(nbytes)

    def _host_cost(self, info: _Storage) -> int:
        """Host bytes a pinned allocation takes (``host_mem``: rounded and cached as the caching host
        allocator does, or at its true size while registered_empty allocates); kept until the free. Past the
        host's capacity it fails as the driver does, and the storage is then not counted as pinned. Pinning
        new bytes costs host time at the preset's pin_gbps per thread."""
        try:
            if self._registering:
                cost, fresh = self.host_mem.register(info.nbytes), True
                self._registered.add(info.uid)
            else:
                cost, fresh = self.host_mem.pin(info.nbytes)
        except RuntimeError:
            info.kind = PAGEABLE  # nothing was pinned: its free gives nothing back
            raise
        self._host_costs[info.uid] = cost
        if fresh and cost and self._registering >= 0:
            self._timeline.host_us += self.host_mem.pin_us(cost, self._registering or 1)
        return cost

    def _host_release(self, info: _Storage) -> int:
        """A pinned storage died: the bytes it took leave the host's count (registered memory) or go to the
        caching allocator's free blocks (pinned memory, until empty_cache)."""
        cost = self._host_costs.pop(info.uid, 0)
        if info.uid in self._registered:
            self._registered.discard(info.uid)
            self.host_mem.unregister(cost)
        else:
            self.host_mem.unpin(cost)
        return cost

    def host_memory_allocated(self) -> int:
        """Live bytes of pinned host memory (pinned_empty, pin_memory=True, Tensor.pin_memory(), registered_empty),
        as the host allocator takes them (rounded, _host_cost; registered memory at its true size)."""
        return self._live_host

    def max_host_memory_allocated(self) -> int:
        return self._peak_host

    def host_memory_reserved(self) -> int:
        """Host RAM held for pinned memory: live allocations plus the free blocks the caching allocator keeps."""
        return self.host_mem.held

    def max_host_memory_reserved(self) -> int:
        return self.host_mem.peak

    def host_available(self) -> int:
        """Host RAM not held for pinned memory (the simulated host's capacity less host_memory_reserved)."""
        return self.host_mem.available()

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        """Like Tensor.record_stream: freeing t's storage is safe with respect to work queued on `stream`."""
        info = self._lookup(local_tensor(t).untyped_storage())
        if info is None:
            return
        if stream.actor == info.alloc_actor and self.flavour == "npu":
            # CUDA's allocator skips the allocating stream; NPU's records it like any other
            # (torch_npu NPUCachingAllocator.cpp DeviceCachingAllocator::recordStream just inserts into
            # stream_uses), so the block waits for that stream's queued work before reuse. Counted, so
            # that tests can tell a library that records it.
            self.self_stream_records += 1
        info.recorded.add(stream.actor)

    def free_storage(self, t: torch.Tensor) -> None:
        """Like ``untyped_storage().resize_(0)`` on a device tensor: its block is freed as if the tensor
        died (record_stream and the free check apply), while the tensor and its views stay, pointing at
        no memory until alloc_storage."""
        storage = local_tensor(t).untyped_storage()
        with self._lock:
            info = self._lookup(storage)
            if info is not None:
                self._first_uid[storage._cdata] = info.uid
                self._free(storage._cdata, info.uid, dead=False)
                self._drain_frees()
            with torch.utils._python_dispatch._disable_current_modes():
                storage.resize_(0)
        self._raise_pending()

    def alloc_storage(self, t: torch.Tensor, nbytes: int) -> None:
        """Like ``untyped_storage().resize_(nbytes)`` on a tensor freed by free_storage: a new device block,
        allocated on the current stream, under the storage's first id (its finalizer frees the block when
        the storage dies)."""
        storage = local_tensor(t).untyped_storage()
        with self._lock:
            if self._lookup(storage) is not None:
                raise RuntimeError("alloc_storage: the tensor still has its memory; free_storage it first")
            first = self._first_uid.get(storage._cdata)
            stream = self._current()
            with torch.utils._python_dispatch._disable_current_modes():
                storage.resize_(nbytes)
            try:
                info = self._register(storage, DEVICE, stream.actor, uid=first)
            except OutOfMemoryError:
                with torch.utils._python_dispatch._disable_current_modes():
                    storage.resize_(0)
                raise
            self._allocated(info, stream)

    def _allocated(self, info: _Storage, stream: SimStream) -> None:
        """A device block registered outside an op (already accounted): its allocation-stream record (none for a
        capture's, whose accesses are its graph's replays': Note [graph capture])."""
        if self.sanitize and info.nbytes and not (self._captures and stream.actor in self._captures):
            host = self._host()
            self._clocks.merge_actor(stream.actor, host)
            epoch = self._clocks.tick(stream.actor)
            acc = Access(0, info.nbytes, True, stream.actor, epoch, "(allocation)", self._label(), (info.nbytes,))
            info.log.add(acc, self._clocks)

    def _lookup(self, storage: Any) -> _Storage | None:
        return self._storages.get(storage._cdata)

    def _register(
        self, storage: Any, kind: str, actor: int = HOST, uid: int | None = None, index: int | None = None
    ) -> _Storage:
        """Track a storage from now on; ``uid``: a storage alloc_storage gives memory again, which keeps its
        first id and finalizer; ``index``: the device of device memory (the current one by default)."""
        key = storage._cdata
        if uid is None:
            self._uid += 1
        info = _Storage(uid or self._uid, kind, storage.nbytes(), actor)
        self._storages[key] = info
        if kind == DEVICE:
            info.index = self.current_device() if index is None else index
            # _memory(info.index), written out without its index checks: this runs for every new device tensor
            if self._held:
                self._release_collectives()
            if self._late_frees:
                with self._lock:
                    self._drain_frees()
            mem = self._mems.get(info.index)
            if mem is None:
                mem = self._mem_of(info.index)
            if mem.deferred:
                mem.process_deferred(self._timeline.host_us)
            capture = self._captures.get(actor) if self._captures else None
            if capture is not None:  # Note [graph capture]: a capturing stream allocates from its graph's pool
                block = mem.allocate(info.nbytes, capture.pool)
            else:
                reserved = mem.reserved
                block = mem.allocate(info.nbytes)
                if self._captures and mem.caching and block is not None and mem.reserved > reserved:
                    # A new segment for a stream outside the captures: a cudaMalloc that torch does not relax, a
                    # potentially unsafe call while a capture is underway (Note [graph capture]).
                    try:
                        self._capture_unsafe(f"a new {fmt_bytes(mem.reserved - reserved)} segment (cudaMalloc)")
                    except RuntimeError:
                        mem.undo(block)
                        del self._storages[key]
                        raise
            if block is None:
                del self._storages[key]
                raise self._oom(info.nbytes, info.index)
            info.block = block
            if capture is not None:
                capture.made.add(info)
            elif self._hazards and self.sanitize:
                self._check_reuse(actor, info)
        if uid is not None:
            return info
        # weakref.finalize, for less: a reference whose callback frees the block when the storage dies, kept
        # (with what it frees) until then. finalize's own bookkeeping cost microseconds per new tensor.
        ref = _ref(storage, self._storage_died)
        self._finalizers[id(ref)] = (ref, key, info.uid)
        if kind == HOST_MEM:
            self._live_host += self._host_cost(info)
            self._peak_host = max(self._peak_host, self._live_host)
            self._index_host(storage, key)
        return info

    def _forget(self, storage: Any) -> None:
        info = self._storages.pop(storage._cdata, None)
        if info is not None and info.kind == DEVICE:
            self._mem_of(info.index).free(info.block)

    def _storage_died(self, ref: weakref.ref, _exiting: list[bool] = _EXITING) -> None:
        """A registered storage died (the callback of its reference, see _register). Not once the interpreter
        exits (as weakref.finalize(..., atexit=False)): by then the memory model is read no more, and module
        globals may already be gone (hence the flag as a default argument)."""
        if _exiting:
            return
        _, key, uid = self._finalizers.pop(id(ref))
        # Finalizers run on whatever thread drops the last reference, gloo's worker threads included, possibly while
        # another thread holds the lock and waits for that very worker: never block here.
        if self._lock.acquire(blocking=False):
            try:
                self._free(key, uid)
                if self._late_frees:
                    self._drain_frees()
            finally:
                self._lock.release()
        else:
            self._late_frees.append((key, uid))

    def _drain_frees(self) -> None:
        """Frees that arrived while another thread held the lock (call with the lock held)."""
        while self._late_frees:
            self._free(*self._late_frees.pop(0))

    def _free(self, key: int, uid: int, dead: bool = True) -> None:
        """The block of storage ``key`` (id ``uid``) is freed: the storage died (its finalizer) or, ``dead``
        False, free_storage gave its memory back."""
        if dead and self._first_uid.get(key) == uid:
            del self._first_uid[key]
        info = self._storages.get(key)
        if info is None or info.uid != uid:
            return
        del self._storages[key]
        if info.kind == HOST_MEM:
            self._live_host -= self._host_release(info)
            self._unindex_host(key)
        if info.kind != DEVICE:
            return
        # The caching allocator reuses a block freed after record_stream only once the recorded streams'
        # queued work is done; until then it still counts as allocated. (Exact accounting: live storages.)
        ready = 0.0
        mem = self._mem_of(info.index)
        if mem.caching:
            ready = max((s.tail_us for a in info.recorded if (s := self._streams.get(a)) is not None), default=0.0)
        if ready > self._timeline.host_us:
            mem.free_after(info.block, ready)
        else:
            mem.free(info.block)
        # A private pool's block goes to no allocation outside its graph's captures: no hazard (Note [free and reuse]).
        if self.sanitize and info.block.pool is None:
            self._check_free(info)

    def _oom(self, need: int, index: int | None = None) -> OutOfMemoryError:
        index = self.current_device() if index is None else index
        mem = self._mem_of(index)
        free = max(self.capacity_bytes - mem.reserved, 0)
        return OutOfMemoryError(
            f"Simulated {self.preset.name} out of memory. Tried to allocate {fmt_bytes(need)}. Device {index} has a "
            f"total capacity of {fmt_bytes(self.capacity_bytes)} of which {fmt_bytes(free)} is free. "
            f"{fmt_bytes(mem.allocated)} is allocated by live tensors and {fmt_bytes(mem.reserved - mem.allocated)} "
            f"is reserved but unallocated."
        )

    def _index_host(self, storage: Any, key: int) -> None:
        """Note [aliases of host memory]: a live pinned storage, found by address from now on."""
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or start in self._host_spans:
            return
        bisect.insort(self._host_starts, start)
        self._host_spans[start] = (start + nbytes, weakref.ref(storage), key)
        self._host_at[key] = start

    def _unindex_host(self, key: int) -> None:
        start = self._host_at.pop(key, None)
        if start is None or self._host_spans.get(start, (0, None, None))[2] != key:
            return
        del self._host_spans[start]
        del self._host_starts[bisect.bisect_left(self._host_starts, start)]

    def _refresh_sizes(self, tensor_args: list[_Arg]) -> None:
        """Pick up storages resized by an op (resize_) or behind the dispatcher (storage.resize_)."""
        for a in tensor_args:
            info = a.info
            if info is not None and info.kind == DEVICE:
                nbytes = a.storage.nbytes()
                if nbytes != info.nbytes:
                    # A resize takes a new block, copies and frees the old one: the peak holds both.
                    mem = self._mem_of(info.index)
                    block = mem.allocate(nbytes, info.block.pool)  # a graph's block stays in its pool
                    mem.free(info.block)
                    if block is None:  # resized behind the dispatcher: past capacity, report it now
                        info.block, info.nbytes = Block(0), 0
                        raise self._oom(nbytes, info.index)
                    grew, info.block, info.nbytes = nbytes > info.nbytes, block, nbytes
                    if grew and self.sanitize:  # a fresh block: safe on the stream that resized it only
                        self._allocated(info, self._current())

    def _check_resize(self, func: Any, args: tuple, kwargs: dict, tensor_args: list[_Arg]) -> None:
        """resize_ of a device tensor beyond what fits raises before resizing, like the allocator."""
        size = arg_value(func, args, kwargs, "size")
        if not tensor_args or not isinstance(size, (list, tuple)):
            return
        a = tensor_args[0]
        if a.info is None or a.info.kind != DEVICE:
            return
        need = (a.tensor.storage_offset() + math.prod(size)) * a.tensor.element_size()
        if need > a.info.nbytes and not self._memory().fits(need):
            raise self._oom(need)
