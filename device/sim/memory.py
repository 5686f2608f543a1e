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


@dataclass(frozen=True)
class Block:
    size: int
    segment: Segment | None = None


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
        return sum(seg.size for seg in self.segments if seg.used == 0)

    def fits(self, nbytes: int) -> bool:
        """Whether a request can be served now (after releasing unused segments if need be)."""
        size = self.block_size(nbytes)
        if not self.caching:
            return self.allocated + size <= self.capacity
        if size == 0 or self._cached_fit(size) is not None:
            return True
        return self._segment_fits(self.segment_size(size))

    def _segment_fits(self, new: int) -> bool:
        """Whether a new segment of `new` bytes can be reserved (after releasing unused segments if need be)."""
        return self.reserved - self._releasable() + new <= self.capacity

    def allocate(self, nbytes: int) -> Block | None:
        """Take a block for `nbytes`, or None when the device is out of memory (the checks of `fits`, made once)."""
        size = self.block_size(nbytes)
        segment = None
        if not self.caching:
            if self.allocated + size > self.capacity:
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
            self.reserved = self.allocated
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return Block(size, segment)

    def free(self, block: Block) -> None:
        self.allocated -= block.size
        if block.segment is not None:
            block.segment.used -= block.size
        if not self.caching:
            self.reserved = self.allocated

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
        """Release segments no live block uses (blocks in use and deferred frees keep theirs)."""
        if self.caching:
            self.reserved -= self._releasable()
            self.segments = [seg for seg in self.segments if seg.used]

    def reset_peaks(self) -> None:
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
