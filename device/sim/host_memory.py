"""The simulated host's RAM as the pinned host allocators see it: a capacity, their rounding, their cache.

Measured on an H100 host (torch 2.11, bench/results/cuda-h100-2026-11-26-pinned.txt): ``torch.empty(n, pin_memory=True)``
takes the next power of two of ``n`` in host RAM (5 GiB + 4 KiB takes 8 GiB: torch's CachingHostAllocator
asks cudaHostAlloc for ``c10::llvm::PowerOf2Ceil(n)``), keeps a freed block for reuse by a request of the
same rounded size until ``empty_cache``, and pins at about 1.5-2 GiB/s on one thread. torch_npu's default
host allocator rounds the same way (device.npu_pinned_bytes, which also knows its expandable setting).

Memory a program allocates itself and registers with the driver (cudaHostRegister: swapopt's arenas,
device.host_empty) is counted at its true size, rounded to whole pages, and returned at once when freed.

An allocation past the capacity fails as the driver fails it: on the cuda flavour a RuntimeError
(torch.AcceleratorError where torch has it) whose message starts ``CUDA error: out of memory``, as
cudaHostAlloc's failure surfaces in torch; on the npu flavour the same with ``NPU error``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

PAGE = 4096
MiB = 1 << 20
ENV = "SWAPOPT_SIM_HOST_MB"

# torch >= 2.8 raises torch.AcceleratorError (a RuntimeError) for CUDA runtime errors such as cudaHostAlloc's
# failure (the hardware log master-6.5b-oom.log shows it); older torch raised RuntimeError itself.
# Threads that register host memory at once (device.pin_host on a 16-CPU host): assumed 8, each at the
# preset's pin_gbps; not measured yet (python -m swapopt.verify reports the rate it reaches).
REGISTER_THREADS = 8

HostOutOfMemory: type[RuntimeError] = getattr(__import__("torch"), "AcceleratorError", RuntimeError)


def power_of_two(nbytes: int) -> int:
    """Host bytes torch's CUDA caching host allocator takes for a request of ``nbytes`` (PowerOf2Ceil)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def npu_pinned_bytes(nbytes: int, conf: str | None = None) -> int:
    """Host bytes torch_npu's pinned host allocator takes for a request of ``nbytes``. By default it rounds up
    to a power of two (v2.6.0 csrc/core/npu/CachingHostAllocator.cpp:138 ``PowerOf2Ceil``; v2.7.1 keeps
    upstream's CachingHostAllocatorImpl, which rounds the same way), so a pinned buffer just over a power of
    two takes almost twice its size. ``PYTORCH_NPU_ALLOC_CONF=pin_memory_expandable_segments:True``
    (``conf``; the environment when None) selects the expandable host allocator, which rounds
    ``nbytes + 32`` up to 512 bytes instead (v2.7.1 CachingHostAllocator.cpp:947-955)."""
    if nbytes <= 0:
        return 0
    conf = os.environ.get("PYTORCH_NPU_ALLOC_CONF", "") if conf is None else conf
    if "pin_memory_expandable_segments:true" in conf.replace(" ", "").lower():
        return max(512, -(-(nbytes + 32) // 512) * 512)
    return 1 << (nbytes - 1).bit_length()


def page_rounded(nbytes: int) -> int:
    """Host bytes of memory allocated and registered by the program: whole pages."""
    return 0 if nbytes <= 0 else -(-int(nbytes) // PAGE) * PAGE


def capacity_from_env(default: int) -> int:
    """SWAPOPT_SIM_HOST_MB (MiB of host RAM) when set, else ``default`` (the preset's host_capacity_bytes)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return int(default)
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of MiB") from None
    if mb <= 0:
        raise ValueError(f"{ENV}={raw!r} must be a positive number of MiB")
    return int(mb * MiB)


@dataclass
class HostMemory:
    """Pinned host memory of one simulated host against ``capacity``. ``rounding`` gives the bytes a pinned
    allocation of n bytes takes (power_of_two on the cuda flavour, device.npu_pinned_bytes on npu)."""

    capacity: int
    rounding: Callable[[int], int]
    flavour: str = "cuda"
    pin_gbps: float = 1.66  # pinning rate of one thread (preset pin_gbps)
    allocated: int = 0  # bytes of live pinned blocks and registered ranges
    cached: int = 0  # bytes of freed pinned blocks the caching allocator keeps
    peak: int = 0  # most bytes held (allocated + cached) at once
    registered: int = 0  # bytes of live registered ranges (part of allocated)
    _free_blocks: dict[int, int] = field(default_factory=dict)  # rounded size -> cached free blocks of it

    @property
    def held(self) -> int:
        """Host RAM the pinned allocators and registrations hold now."""
        return self.allocated + self.cached

    def available(self) -> int:
        return max(self.capacity - self.held, 0)

    def _take(self, cost: int, what: str) -> None:
        if self.held + cost > self.capacity:
            raise HostOutOfMemory(
                f"{'CUDA' if self.flavour == 'cuda' else 'NPU'} error: out of memory (simulated host: {what} of "
                f"{cost / MiB:,.1f} MiB with {self.held / MiB:,.1f} MiB of {self.capacity / MiB:,.1f} MiB held; "
                f"{ENV} sets the simulated host RAM)"
            )
        self.allocated += cost
        self.peak = max(self.peak, self.held)

    def pin(self, nbytes: int) -> tuple[int, bool]:
        """A pinned allocation of ``nbytes`` through the caching host allocator: the bytes it takes, and
        whether they are new (False: a cached free block of the same rounded size was reused)."""
        cost = self.rounding(nbytes)
        if self._free_blocks.get(cost):
            self._free_blocks[cost] -= 1
            self.cached -= cost
            self.allocated += cost
            return cost, False
        self._take(cost, "pinned allocation")
        return cost, True

    def unpin(self, cost: int) -> None:
        """A pinned block of ``cost`` bytes is freed: the caching allocator keeps it."""
        self.allocated -= cost
        self.cached += cost
        self._free_blocks[cost] = self._free_blocks.get(cost, 0) + 1

    def register(self, nbytes: int) -> int:
        """Memory the program allocated, registered: counted at its true size (whole pages)."""
        cost = page_rounded(nbytes)
        self._take(cost, "registered host memory")
        self.registered += cost
        return cost

    def unregister(self, cost: int) -> None:
        self.allocated -= cost
        self.registered -= cost

    def empty_cache(self) -> None:
        """The caching allocator gives its free blocks back (torch.cuda.empty_cache frees cached host blocks)."""
        self.cached = 0
        self._free_blocks.clear()

    def reset_peak(self) -> None:
        self.peak = self.held

    def pin_us(self, nbytes: int, threads: int = 1) -> float:
        """Modeled host time to pin ``nbytes`` with ``threads`` threads (preset pin_gbps per thread)."""
        return nbytes / (self.pin_gbps * 1e3 * max(int(threads), 1))
