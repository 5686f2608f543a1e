"""Allocation, free, record_stream and block reuse under the caching allocator's rules."""

from __future__ import annotations

import torch

from . import OK, RACE, program
from .common import N, h2d, pinned, side_stream

G = "allocator"


@program(G, RACE, op="aten.fill_.Scalar", earlier="aten.empty.memory_format (allocation)")
def block_from_compute_used_on_side_without_wait(sim):
    x = torch.empty(N)  # its last user on compute may still be queued
    side = sim.Stream()
    with sim.stream(side):
        x.fill_(1.0)


@program(G, OK)
def block_from_compute_used_on_side_after_wait(sim):
    x = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        x.fill_(1.0)
    sim.current_stream().wait_stream(side)
    x.sum()


@program(G, RACE, op="aten.fill_.Scalar", free="aten.copy_.default")
def free_while_side_stream_uses_it(sim):
    staging = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        staging.copy_(pinned(), non_blocking=True)
    del staging  # back to compute's pool while the copy runs...
    torch.empty(N).fill_(0.0)  # ...compute's next allocation may get it and writes it (Note [free and reuse])


@program(G, RACE, op="aten.ones.default", free="aten.copy_.default")
def free_while_side_stream_uses_it_then_factory_writes(sim):
    staging = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        staging.copy_(pinned(), non_blocking=True)
    del staging
    torch.ones(2 * N)  # a factory that writes what it allocates: a larger block of the same pool may include it


@program(G, RACE, op="aten.copy_.default", free="aten.copy_.default")
def reused_block_handed_to_a_third_stream_before_the_old_use_is_ordered(sim):
    staging = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        staging.copy_(pinned(), non_blocking=True)
    del staging
    y = torch.empty(N)  # may be staging's block
    other = sim.Stream()
    other.wait_stream(sim.current_stream())  # follows compute's allocation, but not side's copy
    with sim.stream(other):
        y.copy_(pinned(), non_blocking=True)


@program(G, OK)
def free_while_side_stream_uses_it_and_no_reuse(sim):
    """CUDA's rule: freeing a block another stream still uses is harmless until the block is handed out again
    (the free itself issues no device work), so a program that never allocates on compute again is safe."""
    staging = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        staging.copy_(pinned(), non_blocking=True)
    del staging
    side.synchronize()


@program(G, OK)
def free_while_side_stream_uses_it_new_block_used_after_wait(sim):
    staging = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        staging.copy_(pinned(), non_blocking=True)
    del staging
    y = torch.empty(N)  # may be staging's block: nothing uses it yet
    sim.current_stream().wait_stream(side)
    y.fill_(1.0)


@program(G, OK)
def free_while_side_stream_uses_it_then_other_pool(sim):
    """A freed small block (at most 1 MiB) is handed out only to small requests, a large one to large ones."""
    staging = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        staging.copy_(pinned(), non_blocking=True)
    del staging
    torch.ones(1 << 19)  # 2 MiB: the large pool
    sim.synchronize()


@program(G, OK)
def free_while_side_stream_uses_it_then_side_allocates(sim):
    """The block goes back to compute's pool: the side stream's own allocations never get it."""
    staging = torch.empty(N)
    side = side_stream(sim)
    with sim.stream(side):
        staging.copy_(pinned(), non_blocking=True)
    del staging
    with sim.stream(side):
        torch.ones(N)
    sim.synchronize()


@program(G, OK)
def free_after_device_record_stream(sim):
    import device

    side = sim.Stream()
    host, staging = h2d(sim, side)
    device.record_stream(staging, side)
    del staging
    sim.synchronize()


@program(G, OK)
def free_after_tensor_record_stream(sim):
    side = sim.Stream()
    host, staging = h2d(sim, side)
    staging.record_stream(side)
    del staging
    sim.synchronize()


@program(G, OK)
def free_after_compute_waits_for_side(sim):
    side = sim.Stream()
    host, staging = h2d(sim, side)
    sim.current_stream().wait_stream(side)
    del staging
    sim.synchronize()


@program(G, OK)
def free_after_host_synchronize(sim):
    side = sim.Stream()
    host, staging = h2d(sim, side)
    sim.synchronize()
    del staging


@program(G, OK)
def block_allocated_and_freed_on_side(sim):
    side = sim.Stream()
    host = pinned()
    with sim.stream(side):
        staging = torch.empty(N)
        staging.copy_(host, non_blocking=True)
        staging.mul_(2)
        del staging
    sim.synchronize()


@program(G, RACE, op="aten.sum.default", earlier="aten.ones.default")
def block_allocated_on_side_read_on_compute(sim):
    side = sim.Stream()
    with sim.stream(side):
        x = torch.ones(N)
    x.sum()


@program(G, OK)
def per_iteration_staging_with_record_stream(sim):
    side = sim.Stream()
    host = pinned()
    outs = []
    for _ in range(3):
        staging = torch.empty(N)
        side.wait_stream(sim.current_stream())
        with sim.stream(side):
            staging.copy_(host, non_blocking=True)
        sim.current_stream().wait_stream(side)
        outs.append(staging * 2)
        staging.record_stream(side)
        del staging
    sim.synchronize()


@program(G, RACE, op="aten.fill_.Scalar", earlier="(allocation)")
def resized_block_used_on_side_without_wait(sim):
    x = torch.empty(0)
    x.resize_(N)
    side = sim.Stream()
    with sim.stream(side):
        x.fill_(2.0)
