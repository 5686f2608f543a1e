"""The stream sanitizer: unordered conflicting accesses raise, ordered ones and disjoint bytes do not."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import device
import simdevice as simulator
from device.sim import StreamRaceError


def _h2d_on(sim, stream, n=1024):
    host = device.pinned_empty(n)
    host.fill_(1.0)
    dst = torch.empty(n)
    stream.wait_stream(sim.default_stream())  # the block is compute's until the side stream waits for it
    with sim.stream(stream):
        dst.copy_(host, non_blocking=True)
    return host, dst


def test_h2d_then_compute_read_without_wait_races(sim):
    side = sim.Stream()
    _, dst = _h2d_on(sim, side)
    with pytest.raises(StreamRaceError) as err:
        dst.sum()
    msg = str(err.value)
    assert "(1024,)" in msg and "compute" in msg and "stream#1" in msg
    assert "aten.sum.default" in msg and "aten.copy_.default" in msg


def test_h2d_then_compute_read_after_wait_event_passes(sim):
    side = sim.Stream()
    _, dst = _h2d_on(sim, side)
    sim.current_stream().wait_event(side.record_event())
    assert dst.sum().item() == 1024.0


@pytest.mark.parametrize("order", ["wait_stream", "event_wait", "synchronize", "stream_synchronize"])
def test_other_orderings_pass(sim, order):
    side = sim.Stream()
    _, dst = _h2d_on(sim, side)
    compute = sim.current_stream()
    if order == "wait_stream":
        compute.wait_stream(side)
    elif order == "event_wait":
        ev = sim.Event()
        ev.record(side)
        ev.wait(compute)
    elif order == "synchronize":
        sim.synchronize()
    else:
        side.synchronize()  # the host waits, and later launches follow the host
    dst.mul_(2)


def test_wait_on_unrelated_event_does_not_order(sim):
    side, other = sim.Stream(), sim.Stream()
    _, dst = _h2d_on(sim, side)
    sim.current_stream().wait_event(other.record_event())
    with pytest.raises(StreamRaceError):
        dst.add_(1)
    sim.synchronize()  # the side stream's work is done before its tensors are freed


def test_event_recorded_before_the_copy_does_not_order(sim):
    side = sim.Stream()
    early = side.record_event()
    _, dst = _h2d_on(sim, side)
    sim.current_stream().wait_event(early)
    with pytest.raises(StreamRaceError):
        dst.neg()
    sim.synchronize()  # the side stream's work is done before its tensors are freed


def _d2h(sim, stream, n=256):
    src = torch.full((n,), 3.0)
    stream.wait_stream(sim.current_stream())
    host = device.pinned_empty(n)
    with sim.stream(stream):
        host.copy_(src, non_blocking=True)
    device.record_stream(src, stream)  # src is freed on return while the copy may still run
    return host


def test_d2h_host_read_before_sync_races(sim):
    host = _d2h(sim, sim.Stream())
    with pytest.raises(StreamRaceError) as err:
        host.sum().item()
    assert "host" in str(err.value) and "stream#1" in str(err.value)
    with pytest.raises(StreamRaceError):
        torch.equal(host, host)  # a host op: touches no device memory


def test_d2h_host_read_after_event_synchronize_passes(sim):
    side = sim.Stream()
    host = _d2h(sim, side)
    ev = side.record_event()
    ev.synchronize()
    assert torch.equal(host, torch.full((256,), 3.0, device="cpu"))
    host.add_(1)  # host writes are fine too


def test_d2h_host_write_before_sync_races(sim):
    host = _d2h(sim, sim.Stream())
    with pytest.raises(StreamRaceError):
        host.zero_()


def test_blocking_d2h_needs_no_sync(sim):
    src = torch.full((8,), 2.0)
    host = device.pinned_empty(8)
    with sim.stream(sim.Stream()):
        sim.current_stream().wait_stream(sim.default_stream())
        host.copy_(src)  # non_blocking=False: the host waits for the copy
    assert host.sum().item() == 16.0


def test_item_makes_the_host_wait(sim):
    side = sim.Stream()
    src = device.pinned_empty(4)
    src.fill_(3.0)
    x = torch.empty(4)
    side.wait_stream(sim.default_stream())
    with sim.stream(side):
        x.copy_(src, non_blocking=True)  # the side stream reads src
        assert x.sum().item() == 12.0  # the host waits for the side stream up to the sum
    assert sim.now_us() == pytest.approx(sim.timeline[-1].end_us)
    src.fill_(0.0)  # so this host write cannot race with the copy
    host = device.pinned_empty(4)
    with sim.stream(side):
        host.copy_(x, non_blocking=True)
    with pytest.raises(StreamRaceError):
        host.mean()  # this D2H is still in flight
    sim.synchronize()  # the side stream's work is done before its tensors are freed


def test_side_stream_overwrite_of_buffer_compute_still_reads_races(sim):
    buf = torch.zeros(512)
    out = buf * 2  # compute reads buf
    side = sim.Stream()
    side.wait_stream(sim.default_stream())  # ordered after the read...
    host = device.pinned_empty(512)
    host.fill_(0.5)
    compute_reads_again = buf + 1  # ...but this read is after the wait
    with sim.stream(side), pytest.raises(StreamRaceError) as err:
        buf.copy_(host, non_blocking=True)
    assert "aten.add.Tensor" in str(err.value) and "writes" in str(err.value)
    assert out.shape == compute_reads_again.shape


def test_side_stream_overwrite_after_wait_passes(sim):
    buf = torch.zeros(512)
    _ = buf * 2
    side = sim.Stream()
    side.wait_stream(sim.default_stream())
    host = device.pinned_empty(512)
    host.fill_(0.5)
    with sim.stream(side):
        buf.copy_(host, non_blocking=True)
    sim.synchronize()  # the side stream's work is done before its tensors are freed


def test_two_streams_reading_do_not_race(sim):
    x = torch.ones(64)
    side = sim.Stream()
    side.wait_stream(sim.default_stream())
    with sim.stream(side):
        a = x * 2
    b = x * 3  # read/read is never a race
    assert a.shape == b.shape
    sim.synchronize()  # the side stream's work is done before its tensors are freed


def test_pageable_h2d_releases_source_at_return(sim):
    src = torch.tensor([1.0, 2.0, 3.0], device="cpu")  # pageable host memory
    dst = torch.empty(3)
    side = sim.Stream()
    side.wait_stream(sim.default_stream())
    with sim.stream(side):
        dst.copy_(src, non_blocking=True)
    src.add_(1)  # the host staged the pageable source before the call returned
    with pytest.raises(StreamRaceError):
        dst.sum()  # but the device write still needs a wait
    sim.synchronize()  # the side stream's work is done before its tensors are freed


def test_foreach_ops_are_tracked(sim):
    side = sim.Stream()
    hosts = [device.pinned_empty(16) for _ in range(3)]
    for h in hosts:
        h.fill_(1.0)
    devs = [torch.empty(16) for _ in range(3)]
    with sim.stream(side):
        side.wait_stream(sim.default_stream())
        torch._foreach_copy_(devs, hosts, non_blocking=True)
    with pytest.raises(StreamRaceError) as err:
        torch._foreach_mul_(devs, 2.0)
    assert "aten._foreach_mul_" in str(err.value)
    sim.current_stream().wait_stream(side)
    torch._foreach_mul_(devs, 2.0)
    assert all(torch.equal(d, torch.full((16,), 2.0)) for d in devs)


def test_out_argument_counts_as_write(sim):
    x = torch.ones(8)
    out = torch.empty(8)
    side = sim.Stream()
    with sim.stream(side):
        side.wait_stream(sim.default_stream())
        torch.add(x, 1, out=out)
    with pytest.raises(StreamRaceError):
        out.sum()
    sim.synchronize()  # the side stream's work is done before its tensors are freed


def test_mixing_device_and_host_tensors_fails_like_cuda(sim):
    host = device.pinned_empty(4)
    host.fill_(1.0)
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="same device"):
        x.add_(host)
    x.add_(torch.tensor(1.0))  # 0-dim CPU scalars are allowed, as on CUDA
    assert torch.equal(x, torch.full((4,), 2.0))


def test_optimizer_cpu_step_scalars_are_host_memory(sim):
    p = torch.nn.Parameter(torch.randn(32))
    opt = torch.optim.AdamW([p], foreach=True)
    for _ in range(3):
        p.grad = torch.randn(32)
        opt.step()
    state = opt.state[p]
    assert device.is_host_tensor(state["step"]) and not device.is_host_tensor(state["exp_avg"])


def test_freed_without_record_stream_is_reported(sim):
    side = sim.Stream()
    staging = torch.empty(128)  # allocated on compute
    side.wait_stream(sim.default_stream())
    host = device.pinned_empty(128)
    host.fill_(1.0)
    with sim.stream(side):
        staging.copy_(host, non_blocking=True)
    del staging  # back to compute's pool while the side-stream copy still runs
    torch.ones(2, device="cpu").add_(1)  # host work allocates nothing on compute: no report...
    with pytest.raises(StreamRaceError, match="record_stream") as err:
        torch.ones(1)  # ...compute's next allocation may get the block, and ones writes it (Note [free and reuse])
    assert err.value.kind == "free" and err.value.earlier_stream == "stream#1"
    assert err.value.earlier_op == "aten.copy_.default" and err.value.op == "aten.ones.default"


def test_freed_block_never_handed_out_again_is_not_reported(sim):
    """CUDA's rule: a free issues no device work, so a block freed while another stream still writes it harms
    nothing until it is handed out again and used; a program that stops there is correct, and nothing is
    reported at a synchronize or when the simulator exits."""
    side = sim.Stream()
    staging = torch.empty(128)
    side.wait_stream(sim.default_stream())
    host = device.pinned_empty(128)
    with sim.stream(side):
        staging.copy_(host, non_blocking=True)
    del staging
    torch.ones(1 << 19)  # a 2 MiB allocation: the large pool never hands out a small block
    sim.synchronize()
    torch.ones(1)  # the synchronize ordered everything: no hazard is left


def test_freed_block_is_safe_once_its_stream_waits_for_the_user(sim):
    """FSDP2's pattern: a block allocated on one stream, used on another, dropped without record_stream;
    the allocating stream waits for the user before it allocates again."""
    side = sim.Stream()
    grad = torch.empty(64)
    side.wait_stream(sim.default_stream())
    with sim.stream(side):
        grad.mul_(2)
    del grad
    sim.default_stream().wait_stream(side)
    torch.ones(1)  # compute allocates after waiting: no race
    sim.synchronize()


def test_synchronize_clears_what_a_free_left_unordered(sim):
    side = sim.Stream()
    staging = torch.empty(64)
    side.wait_stream(sim.default_stream())
    with sim.stream(side):
        staging.mul_(2)
    del staging
    sim.synchronize()  # every use is done
    torch.ones(1)


def test_record_stream_makes_free_safe(sim):
    side = sim.Stream()
    staging = torch.empty(128)
    side.wait_stream(sim.default_stream())
    host = device.pinned_empty(128)
    with sim.stream(side):
        staging.copy_(host, non_blocking=True)
    device.record_stream(staging, side)
    del staging
    torch.ones(1)


def test_sanitize_off_ignores_races(clean_device_env):
    with simulator.activate(sanitize=False) as sim:
        side = sim.Stream()
        _, dst = _h2d_on(sim, side)
        assert dst.sum().item() == 1024.0


def test_record_function_labels_and_is_not_an_access(sim):
    side = sim.Stream()
    _, dst = _h2d_on(sim, side)
    with torch.profiler.record_function("swap-in"):
        with pytest.raises(StreamRaceError, match="swap-in"):
            dst.sum()
        sim.current_stream().wait_stream(side)
        dst.sum()
    assert sim.timeline[-1].label == "swap-in"


# Storage-relative element ranges of two slices of one 1-D storage.
_slices = st.tuples(st.integers(0, 63), st.integers(1, 32), st.integers(0, 63), st.integers(1, 32))


@settings(max_examples=60, deadline=None)
@given(_slices)
def test_views_conflict_exactly_when_bytes_overlap(bounds):
    a0, alen, b0, blen = bounds
    a1, b1 = min(a0 + alen, 96), min(b0 + blen, 96)
    overlap = a0 < b1 and b0 < a1
    with simulator.activate() as sim:
        base = torch.zeros(96)
        host = device.pinned_empty(a1 - a0)
        side = sim.Stream()
        side.wait_stream(sim.default_stream())
        with sim.stream(side):
            base[a0:a1].copy_(host, non_blocking=True)
        if overlap:
            with pytest.raises(StreamRaceError):
                base[b0:b1].sum()
        else:
            base[b0:b1].sum()
        sim.synchronize()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(0, 7))
def test_rows_of_a_matrix_are_independent(rows, cols, pick):
    pick = pick % rows
    with simulator.activate() as sim:
        m = torch.zeros(rows, cols)
        side = sim.Stream()
        side.wait_stream(sim.default_stream())
        with sim.stream(side):
            m[pick].fill_(1.0)
        for r in range(rows):
            if r == pick:
                with pytest.raises(StreamRaceError):
                    m[r].sum()
            else:
                m[r].sum()


def test_host_overwriting_a_pinned_source_before_h2d_completes_races(sim):
    side = sim.Stream()
    host, dst = _h2d_on(sim, side)
    with pytest.raises(StreamRaceError) as err:
        host.fill_(7.0)  # the copy may still be reading it
    assert "host" in str(err.value) and "aten.fill_" in str(err.value)
    side.synchronize()
    host.fill_(7.0)
    assert dst.shape == host.shape


def test_block_allocated_on_compute_needs_a_wait_before_side_stream_use(sim):
    side = sim.Stream()
    host = device.pinned_empty(32)
    staging = torch.empty(32)  # compute's pool: its previous user may still be queued on compute
    with sim.stream(side), pytest.raises(StreamRaceError, match=r"\(allocation\) on compute"):
        staging.copy_(host, non_blocking=True)
    with sim.stream(side):
        own = torch.empty(32)  # allocated on the side stream itself
        own.copy_(host, non_blocking=True)
    device.record_stream(own, side)


def test_race_error_carries_both_accesses(sim):
    sim.stacks = True
    side = sim.Stream()
    _, dst = _h2d_on(sim, side)
    with pytest.raises(StreamRaceError) as err:
        dst.sum()
    e = err.value
    assert e.kind == "access" and e.stream == "compute" and e.earlier_stream == "stream#1"
    assert e.op == "aten.sum.default" and e.earlier_op == "aten.copy_.default"
    assert e.access.write is False and e.earlier.write is True and e.storage is not None
    assert any("_h2d_on" in frame for frame in e.earlier_stack)
    assert "earlier access made at" in str(e) and "_h2d_on" in str(e)
    sim.synchronize()


def test_strided_views_of_one_tensor_are_judged_by_elements(sim):
    x = torch.zeros(64)
    side = sim.Stream()
    side.wait_stream(sim.default_stream())
    with sim.stream(side):
        x[0::2].fill_(1.0)
    x[1::2].fill_(2.0)  # disjoint elements: no race
    with pytest.raises(StreamRaceError):
        x[0::4].fill_(3.0)  # shares elements with the side stream's write
    sim.synchronize()
    assert torch.equal(x[0::2], torch.ones(32)) and torch.equal(x[1::2], torch.full((32,), 2.0))


def test_checkpoint_save_needs_the_swap_out_wait(sim, monkeypatch):
    """Without waiting for in-flight D2H copies, saving the swapped states reads them too early."""
    import io

    from swapopt import SwapOptimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256)) for _ in range(4)]
    opt = SwapOptimizer(torch.optim.AdamW(params), swap_optimizer_times=2)
    for p in params:
        p.grad = torch.randn(256)
    opt.step()
    monkeypatch.setattr(SwapOptimizer, "wait_for_swap_out", lambda self, params=None: None)
    with pytest.raises(StreamRaceError):
        torch.save(opt.state_dict(), io.BytesIO())
    monkeypatch.undo()
    torch.save(opt.state_dict(), io.BytesIO())  # with the wait: clean
    sim.synchronize()
