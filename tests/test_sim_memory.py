"""Memory accounting of the simulated device: exact live bytes, peak, capacity, host memory excluded."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import device
import simdevice as simulator


def test_allocation_free_and_peak_are_exact(sim):
    assert sim.memory_allocated() == 0
    a = torch.empty(1000)  # 4000 bytes
    b = torch.zeros(10, 10, dtype=torch.float64)  # 800 bytes
    assert sim.memory_allocated() == 4800
    c = a.view(10, 100)[2:5]  # views allocate nothing
    assert sim.memory_allocated() == 4800
    del a
    assert sim.memory_allocated() == 4800  # c still holds the storage
    del c
    assert sim.memory_allocated() == 800
    assert sim.max_memory_allocated() == 4800
    sim.reset_peak_memory_stats()
    assert sim.max_memory_allocated() == 800
    d = b * 2
    assert sim.max_memory_allocated() == 1600 and d.dtype == torch.float64
    assert sim.memory_reserved() == sim.memory_allocated()
    free, total = sim.mem_get_info()
    assert total == sim.preset.capacity_bytes and free == total - 1600


def test_pinned_and_pageable_memory_are_not_device_memory(sim):
    pinned = device.pinned_empty((256, 4), torch.bfloat16)
    literal = torch.tensor([1.0, 2.0], device="cpu")  # pageable host memory
    assert sim.memory_allocated() == 0
    assert sim.is_host(pinned) and sim.is_host(literal)
    copy = torch.empty(256, 4, dtype=torch.bfloat16)
    copy.copy_(pinned, non_blocking=True)
    assert sim.memory_allocated() == 2048


def test_tensors_from_before_activation_are_pageable(clean_device_env):
    before = torch.ones(16)
    with simulator.activate() as sim:
        assert sim.is_host(before)
        moved = torch.empty(16)
        moved.copy_(before)
        assert not sim.is_host(moved) and sim.memory_allocated() == 64
        derived = before * 2  # a host computation stays on the host
        assert sim.is_host(derived) and sim.memory_allocated() == 64


def test_capacity_raises_out_of_memory_before_allocating(clean_device_env):
    with simulator.activate(capacity_bytes=10_000) as sim:
        keep = torch.empty(2000)  # 8000 bytes
        with pytest.raises(torch.OutOfMemoryError, match="out of memory") as err:
            torch.zeros(1000)
        assert "Tried to allocate" in str(err.value)
        assert sim.OutOfMemoryError is torch.OutOfMemoryError
        assert sim.memory_allocated() == 8000 and sim.max_memory_allocated() == 8000
        with pytest.raises(torch.OutOfMemoryError):
            keep * 2  # output checked after the op, then dropped
        assert sim.memory_allocated() == 8000 and sim.max_memory_allocated() == 8000
        big_host = device.pinned_empty(100_000)  # host memory is not limited by device capacity
        del keep
        ok = torch.zeros(2500)
        assert sim.memory_allocated() == 10_000 and big_host.numel() == 100_000 and ok.numel() == 2500


def test_resize_is_accounted(sim):
    t = torch.empty(10)
    t.resize_(100)
    assert sim.memory_allocated() == 400
    t.untyped_storage().resize_(0)  # behind the dispatcher, as FSDP2 frees unsharded parameters
    t.resize_(0)
    assert sim.memory_allocated() == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([torch.float32, torch.float16, torch.int64])), max_size=8))
def test_live_bytes_match_sum_of_storages(sizes):
    with simulator.activate() as sim:
        tensors = [torch.empty(n, dtype=dtype) for n, dtype in sizes]
        assert sim.memory_allocated() == sum(t.untyped_storage().nbytes() for t in tensors)
        peak = sim.memory_allocated()
        tensors = tensors[::2]
        assert sim.memory_allocated() == sum(t.untyped_storage().nbytes() for t in tensors)
        assert sim.max_memory_allocated() == peak


def test_pin_memory_paths_give_host_memory(sim):
    a = torch.empty(100, device="cpu", pin_memory=True)
    literal = torch.tensor([1.0, 2.0, 3.0], device="cpu")
    b = literal.pin_memory()
    assert a.is_pinned() and b.is_pinned() and not literal.is_pinned()
    assert sim.is_host(a) and sim.is_host(b) and torch.equal(b, literal)
    assert sim.memory_allocated() == 0
    # as torch's caching host allocator takes them: each rounded up to a power of two (device/sim/host_memory.py)
    assert sim.host_memory_allocated() == 512 + 16 == sim.max_host_memory_allocated()
    pinned = device.pinned_empty(25)
    assert pinned.is_pinned() and sim.host_memory_allocated() == 656
    del a
    assert sim.host_memory_allocated() == 144 and sim.max_host_memory_allocated() == 656
    assert sim.host_memory_reserved() == 656  # the freed block stays with the caching allocator ...
    sim.empty_cache()
    assert sim.host_memory_reserved() == 144  # ... until empty_cache
    # Device memory cannot be pinned, as on CUDA; a host copy of it can.
    made = torch.ones(4)
    assert not sim.is_host(made) and not made.is_pinned()
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        made.pin_memory()
    pinned_copy = made.cpu().pin_memory()
    assert sim.is_host(pinned_copy) and pinned_copy.is_pinned()
    assert torch.equal(pinned_copy, made.cpu())


def test_resize_peak_holds_old_and_new_block(sim):
    t = torch.empty(1000)  # 4000 B
    sim.reset_peak_memory_stats()
    t.resize_(2000)  # 8000 B: a new block, a copy, the old block freed
    assert sim.memory_allocated() == 8000
    assert sim.max_memory_allocated() == 12_000


def test_resize_past_capacity_raises_before_resizing(clean_device_env):
    with simulator.activate(capacity_bytes=10_000) as sim:
        t = torch.empty(1000)
        with pytest.raises(torch.OutOfMemoryError):
            t.resize_(3000)
        assert t.numel() == 1000 and sim.memory_allocated() == 4000


MiB = 1 << 20


def test_caching_allocator_rounds_small_blocks_and_reserves_segments(clean_device_env):
    with simulator.activate(allocator="caching") as sim:
        a = torch.empty(1)  # 4 B -> one 512 B block from a 2 MiB small segment
        assert sim.memory_allocated() == 512 and sim.memory_reserved() == 2 * MiB
        b = torch.empty(3 * MiB // 4)  # 3 MiB -> a 20 MiB large segment
        assert sim.memory_allocated() == 512 + 3 * MiB and sim.memory_reserved() == 22 * MiB
        c = torch.empty(25 * MiB // 4)  # 25 MiB -> its own segment rounded to 2 MiB: 26 MiB
        assert sim.memory_reserved() == 48 * MiB
        del b, c  # freed blocks stay reserved for reuse
        assert sim.memory_allocated() == 512 and sim.memory_reserved() == 48 * MiB
        d = torch.empty(3 * MiB // 4)  # served from the cache: nothing new reserved
        assert sim.memory_reserved() == 48 * MiB
        del d
        sim.empty_cache()
        assert sim.memory_reserved() == 2 * MiB and sim.mem_get_info()[0] == sim.capacity_bytes - 2 * MiB
        assert sim.max_memory_reserved() == 48 * MiB
        del a


def test_caching_allocator_judges_out_of_memory_on_reserved(clean_device_env):
    with simulator.activate(capacity_bytes=40 * MiB, allocator="caching") as sim:
        keep = torch.empty(3 * MiB // 4)  # a 20 MiB segment
        with pytest.raises(torch.OutOfMemoryError, match="reserved"):
            torch.empty(22 * MiB // 4)  # 22 MiB segment: 42 MiB reserved > 40 MiB
        small = torch.empty(16 * MiB // 4)  # fits the cached rest of the 20 MiB segment
        assert sim.memory_reserved() == 20 * MiB
        del keep, small
        big = torch.empty(36 * MiB // 4)  # the cache is released first, then 36 MiB fits
        assert sim.memory_reserved() == 36 * MiB and big.numel()


def test_record_stream_defers_reuse_until_the_stream_is_done(clean_device_env):
    with simulator.activate(allocator="caching") as sim:
        side = sim.Stream()
        host = device.pinned_empty(MiB)
        staging = torch.empty(MiB)  # 4 MiB block
        side.wait_stream(sim.default_stream())
        with sim.stream(side):
            staging.copy_(host, non_blocking=True)  # ~76 us on the link
        staging.record_stream(side)
        del staging
        assert sim.memory_allocated() == 4 * MiB  # still held: the copy is queued
        side.synchronize()
        assert sim.memory_allocated() == 0


def test_threads_allocations_are_counted(sim):
    import threading

    held = []
    # torch's default device is per thread (as on CUDA): the worker names the device
    worker = threading.Thread(target=lambda: held.append(torch.empty(256, device=sim.torch_device())))
    worker.start()
    worker.join()
    assert sim.memory_allocated() == 1024 and not sim.is_host(held[0])


def test_free_storage_keeps_the_views_and_alloc_storage_gives_them_memory_again(sim):
    # Note [persistent slots] (swapopt.operate): a slot keeps its views across steps, not its memory.
    slot = torch.empty(4096, dtype=torch.uint8)
    view = slot[1024:2048].view(torch.float32)
    assert sim.memory_allocated() == 4096
    device.free_storage(slot)
    assert sim.memory_allocated() == 0 and sim.max_memory_allocated() == 4096
    with pytest.raises(RuntimeError, match="free_storage gave back"):
        view.fill_(1.0)  # use after free: an error, never a read of unowned memory
    device.alloc_storage(slot, 4096)
    assert sim.memory_allocated() == 4096 and not sim.is_host(view)
    view.fill_(2.0)
    assert torch.equal(slot[1024:1028], torch.tensor([0, 0, 0, 64], dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="free_storage it first"):
        device.alloc_storage(slot, 4096)
    del slot, view
    assert sim.memory_allocated() == 0  # the storage died with its memory: freed once


def test_free_storage_needs_record_stream_for_other_streams(sim):
    slot = torch.empty(256)
    side = sim.Stream()
    side.wait_stream(sim.current_stream())
    with sim.stream(side):
        slot.add_(1.0)
    device.free_storage(slot)  # back to compute's pool while `side` still writes it
    assert slot.untyped_storage().nbytes() == 0
    torch.empty(8)  # compute's next allocation may get that block: harmless while nothing uses it...
    with pytest.raises(simulator.StreamRaceError) as err:
        torch.empty(8).fill_(0.0)  # ...and a race once compute writes it (Note [free and reuse])
    assert err.value.kind == "free" and err.value.op == "aten.fill_.Scalar"
    del err  # its traceback holds the new tensor
    device.alloc_storage(slot, 1024)
    side.wait_stream(sim.current_stream())
    with sim.stream(side):
        slot.add_(1.0)
    device.record_stream(slot, side)
    device.free_storage(slot)  # ordered by record_stream, as Tensor.record_stream before a free
    assert sim.memory_allocated() == 0


def test_alloc_storage_past_capacity_raises_and_leaves_it_freed(clean_device_env):
    with simulator.activate(capacity_bytes=8192) as sim:
        slot = torch.empty(4096, dtype=torch.uint8)
        device.free_storage(slot)
        hog = torch.empty(6144, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError):
            device.alloc_storage(slot, 4096)
        assert sim.memory_allocated() == 6144 and slot.untyped_storage().nbytes() == 0
        del hog
        device.alloc_storage(slot, 4096)
        assert sim.memory_allocated() == 4096
