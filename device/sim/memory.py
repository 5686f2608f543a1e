"""Device memory accounting of the simulator: exact bytes, or a model of PyTorch's CUDA caching allocator.

"exact" counts each live device storage at its byte size; reserved memory equals allocated memory.
"caching" follows the rules of c10/cuda/CUDACachingAllocator.cpp that decide what `memory_allocated`,
`memory_reserved` and out-of-memory report:
- block sizes are rounded up to 512 bytes (kMinBlockSize);
- blocks of at most 1 MiB (kSmallSize) come from 2 MiB segments (kSmallBuffer); larger ones below 10 MiB
  (kMinLargeAlloc) from 20 MiB segments (kLargeBuffer); larger still from segments rounded up to 2 MiB
  (kRoundLarge);
- freed blocks stay reserved (cached) for reuse within their pool; `empty_cache()` releases the segments
  no live block uses;
- a request that the cache cannot serve reserves a new segment; when that would pass the capacity, the
  cache is released first (as the allocator frees cached blocks and retries), and only then is it an
  out-of-memory error;
- a block freed after `record_stream` stays allocated until the recorded streams' work has finished.
Fragmentation is not modeled: a segment's free bytes serve any request of its pool that they cover.

A graph capture allocates from a private pool (PrivatePool; Note [graph capture] in device/sim/graphs.py): its
blocks count as allocated while they live, and the bytes the pool has held at most stay reserved after they are
freed, until no graph holds the pool (released: at once with exact accounting, at empty_cache with the caching
allocator, which releases a released pool's free segments as torch does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# What running past a device's capacity raises, as torch.cuda does.
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

KB, MB = 1024, 1024 * 1024
MIN_BLOCK = 512
SMALL_SIZE = 1 * MB
SMALL_BUFFER = 2 * MB
MIN_LARGE_ALLOC = 10 * MB
LARGE_BUFFER = 20 * MB
ROUND_LARGE = 2 * MB


def fmt_bytes(n: float) -> str:
    """Bytes as GiB or MiB, for messages."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def pool_of(nbytes: int) -> str:
    """The pool of the caching allocator a request of ``nbytes`` is served from: "small" (blocks of at most
    kSmallSize, from 2 MiB segments) or "large". A freed block is handed out again only within its pool,
    in CUDA's allocator and in torch_npu's alike (get_pool in CUDACachingAllocator.cpp, NPUCachingAllocator.cpp)."""
    return "small" if _round_up(nbytes, MIN_BLOCK) <= SMALL_SIZE else "large"


@dataclass(eq=False)
class Segment:
    """A reservation from the device; blocks are carved from it (fragmentation is not modeled)."""

    size: int
    pool: str
    used: int = 0


@dataclass(eq=False)
class PrivatePool:
    """A graph's private memory pool (torch's MempoolId_t): what captures into it allocate, on one device. Its
    blocks are never handed to allocations outside a capture into it, so the bytes it has grown to stay reserved
    while a graph holds it: the graph's replays use them."""

    id: tuple[int, int]
    live: int = 0  # bytes of its blocks in use
    held: int = 0  # bytes it reserves (the most its blocks have needed at once, rounded up as the allocator does)
    users: int = 0  # graphs that captured into it and have not been reset or dropped
    released: bool = False  # no graph holds it: its free bytes go back (DeviceMemory.release_pool)


@dataclass(frozen=True)
class Block:
    size: int
    segment: Segment | None = None
    pool: PrivatePool | None = None  # a graph's private pool it was allocated from (None: the device's own)


@dataclass
class DeviceMemory:
    """Allocated / reserved bytes and their peaks against a capacity."""

    capacity: int
    caching: bool = False
    allocated: int = 0
    peak_allocated: int = 0
    reserved: int = 0
    peak_reserved: int = 0
    segments: list[Segment] = field(default_factory=list)
    deferred: list[tuple[float, Block]] = field(default_factory=list)  # (ready at modeled us, block)
    pools: list[PrivatePool] = field(default_factory=list)  # graphs' private pools holding bytes here
    pool_live: int = 0  # bytes of live blocks of private pools (part of allocated)
    pool_held: int = 0  # bytes private pools reserve (part of reserved)

    def block_size(self, nbytes: int) -> int:
        """Bytes a request of `nbytes` holds."""
        if not self.caching or nbytes == 0:
            return nbytes
        return _round_up(nbytes, MIN_BLOCK)

    @staticmethod
    def _pool(size: int) -> str:
        return pool_of(size)

    @staticmethod
    def segment_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return _round_up(size, ROUND_LARGE)

    def _cached_fit(self, size: int) -> Segment | None:
        pool = self._pool(size)
        return next((seg for seg in self.segments if seg.pool == pool and seg.size - seg.used >= size), None)

    def _releasable(self) -> int:
        unused = sum(seg.size for seg in self.segments if seg.used == 0)
        return unused + sum(pool.held - pool.live for pool in self.pools if pool.released)

    def _exact_reserved(self) -> None:
        """Exact accounting: reserved is every live block, plus what private pools hold beyond their live blocks."""
        self.reserved = self.allocated - self.pool_live + self.pool_held

    def fits(self, nbytes: int) -> bool:
        """Whether a request can be served now (after releasing unused segments if need be)."""
        size = self.block_size(nbytes)
        if not self.caching:  # reserved: live blocks and what graphs' private pools hold beyond theirs
            return self.reserved + size <= self.capacity
        if size == 0 or self._cached_fit(size) is not None:
            return True
        return self._segment_fits(self.segment_size(size))

    def _segment_fits(self, new: int) -> bool:
        """Whether a new segment of `new` bytes can be reserved (after releasing unused segments if need be)."""
        return self.reserved - self._releasable() + new <= self.capacity

    def allocate(self, nbytes: int, pool: PrivatePool | None = None) -> Block | None:
        """Take a block for `nbytes`, or None when the device is out of memory (the checks of `fits`, made once);
        from a graph's private pool when `pool` is given."""
        size = self.block_size(nbytes)
        if pool is not None:
            return self._pool_allocate(size, pool)
        segment = None
        if not self.caching:
            if self.reserved + size > self.capacity:
                return None
        elif size:
            segment = self._cached_fit(size)
            if segment is None:
                new = self.segment_size(size)
                if not self._segment_fits(new):
                    return None
                if self.reserved + new > self.capacity:
                    self.empty_cache()
                segment = Segment(new, self._pool(size))
                self.segments.append(segment)
                self.reserved += new
            segment.used += size
        self.allocated += size
        if not self.caching:
            self._exact_reserved()
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return Block(size, segment)

    def _pool_allocate(self, size: int, pool: PrivatePool) -> Block | None:
        """A block of `size` bytes from a private pool: from the bytes it holds and no block uses (a capture reuses
        what it freed, as the allocator's private pool does), else the pool grows by what it lacks (exact) or by a
        new segment (caching), which must fit the device as any reservation must."""
        free = pool.held - pool.live
        if size > free:
            grow = self.segment_size(size) if self.caching else size - free
            if self.reserved + grow > self.capacity:
                if not (self.caching and self.reserved - self._releasable() + grow <= self.capacity):
                    return None
                self.empty_cache()
            pool.held += grow
            self.pool_held += grow
            if self.caching:
                self.reserved += grow
            if pool not in self.pools:
                self.pools.append(pool)
        pool.live += size
        self.pool_live += size
        self.allocated += size
        if not self.caching:
            self._exact_reserved()
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return Block(size, None, pool)

    def free(self, block: Block) -> None:
        self.allocated -= block.size
        pool = block.pool
        if pool is not None:
            # The block goes back to its graph's pool: still reserved, unless no graph holds the pool any more.
            pool.live -= block.size
            self.pool_live -= block.size
            if pool.released and not self.caching:
                self._shrink(pool, pool.held - pool.live)
        elif block.segment is not None:
            block.segment.used -= block.size
        if not self.caching:
            self._exact_reserved()

    def undo(self, block: Block) -> None:
        """Take back an allocation that was refused after it was made: the block and, if it was the only block of its
        segment, the segment (its reservation never happened)."""
        self.free(block)
        segment = block.segment
        if segment is not None and segment.used == 0 and segment in self.segments:
            self.segments.remove(segment)
            self.reserved -= segment.size

    def _shrink(self, pool: PrivatePool, nbytes: int) -> None:
        """`nbytes` a private pool holds go back to the device."""
        if nbytes <= 0:
            return
        pool.held -= nbytes
        self.pool_held -= nbytes
        if self.caching:
            self.reserved -= nbytes
        else:
            self._exact_reserved()
        if pool.held == 0 and pool.released:
            self.pools.remove(pool)

    def release_pool(self, pool: PrivatePool) -> None:
        """No graph holds `pool` any more (reset, dropped): its free bytes go back, with exact accounting at once,
        with the caching allocator at the next empty_cache (or an allocation that needs the room), as torch frees a
        released pool's segments; its live blocks go back as they are freed."""
        pool.released = True
        if pool not in self.pools:
            return
        if not self.caching:
            self._shrink(pool, pool.held - pool.live)

    def free_after(self, block: Block, ready_us: float) -> None:
        """A block freed after record_stream: it stays allocated until the recorded streams are done."""
        self.deferred.append((ready_us, block))

    def process_deferred(self, now_us: float) -> None:
        """Release deferred blocks whose recorded streams have finished by modeled time `now_us`."""
        if self.deferred:
            ready = [block for at, block in self.deferred if at <= now_us]
            self.deferred = [(at, block) for at, block in self.deferred if at > now_us]
            for block in ready:
                self.free(block)

    def empty_cache(self) -> None:
        """Release segments no live block uses (blocks in use and deferred frees keep theirs), and the free bytes of
        private pools no graph holds any more (a pool a graph holds keeps its bytes)."""
        if self.caching:
            self.reserved -= sum(seg.size for seg in self.segments if seg.used == 0)
            self.segments = [seg for seg in self.segments if seg.used]
            for pool in [p for p in self.pools if p.released]:
                self._shrink(pool, pool.held - pool.live)

    def reset_peaks(self) -> None:
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
