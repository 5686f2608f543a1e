"""The torch.cuda-like surface of SimDevice."""

from __future__ import annotations

import pytest
import torch

import device
import simdevice as simulator


def test_module_surface(sim):
    count = simulator.device_count()  # SWAPOPT_SIM_DEVICES, as CUDA_VISIBLE_DEVICES limits CUDA's
    assert sim.is_available() and sim.device_count() == count and sim.current_device() == 0
    sim.set_device(count - 1)
    assert sim.current_device() == count - 1
    sim.set_device(0)
    with pytest.raises(ValueError):  # torch.cuda.set_device refuses the host, as it does any non-cuda device
        sim.set_device(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        sim.set_device(count)
    assert sim.current_device() == 0
    assert sim.default_stream() is sim.current_stream()
    assert sim.default_stream().name == "compute"
    s = sim.Stream()
    assert isinstance(s, sim.Stream) and isinstance(s, simulator.SimStream) and s.name == "stream#1"
    assert sim.Stream(name="h2d").name == "h2d" and sim.Stream().name == "stream#3"
    e = sim.Event(enable_timing=True)
    assert isinstance(e, sim.Event) and e.query()  # an unrecorded event is complete
    e.synchronize()
    sim.empty_cache()
    assert sim.get_device_name() == "sim:h100"
    assert sim.get_device_properties().total_memory == sim.mem_get_info()[1]
    assert sim.memory_stats()["allocated_bytes.all.current"] == 0


def test_stream_contexts_restore(sim):
    s1, s2 = sim.Stream(), sim.Stream()
    with sim.stream(s1):
        assert sim.current_stream() is s1
        with s2:
            assert sim.current_stream() is s2
        assert sim.current_stream() is s1
        with sim.stream(None):
            assert sim.current_stream() is s1
    assert sim.current_stream() is sim.default_stream()
    with pytest.raises(KeyError):
        with sim.stream(s1):
            raise KeyError
    assert sim.current_stream() is sim.default_stream()


def test_query_reports_modeled_completion(sim):
    s = sim.Stream()
    host = device.pinned_empty(1 << 20)
    dev = torch.empty(1 << 20)
    s.wait_stream(sim.default_stream())
    with sim.stream(s):
        dev.copy_(host, non_blocking=True)
    done = s.record_event()
    assert not done.query() and not s.query()  # each poll costs host time...
    while not done.query():
        pass  # ...so polling terminates
    assert sim.now_us() >= done.time_us
    sim.current_stream().wait_event(done)
    dev.add_(1)  # ordered by the wait, no race
    assert s.query()


def test_successful_query_orders_the_host(sim):
    s = sim.Stream()
    src = torch.full((8,), 5.0)
    s.wait_stream(sim.default_stream())
    host = device.pinned_empty(8)
    with sim.stream(s):
        host.copy_(src, non_blocking=True)
    device.record_stream(src, s)
    event = s.record_event()
    while not event.query():
        pass
    assert torch.equal(host, torch.full((8,), 5.0, device="cpu"))


def test_wait_on_unrecorded_event_is_a_no_op(sim):
    s = sim.Stream()
    s.wait_event(sim.Event())
    with pytest.raises(RuntimeError, match="recorded"):
        sim.Event(enable_timing=True).elapsed_time(sim.Event(enable_timing=True))


def test_synchronize_orders_everything(sim):
    streams = [sim.Stream() for _ in range(3)]
    hosts = [device.pinned_empty(16) for _ in streams]
    srcs = [torch.full((16,), float(i)) for i in range(3)]
    for s, h, src in zip(streams, hosts, srcs):
        s.wait_stream(sim.default_stream())
        with sim.stream(s):
            h.copy_(src, non_blocking=True)
    sim.synchronize()
    assert sim.now_us() == pytest.approx(max(op.end_us for op in sim.timeline))
    for i, h in enumerate(hosts):
        assert torch.equal(h, torch.full((16,), float(i), device="cpu"))
    for src in srcs:
        src.zero_()  # every stream is done with the sources


@pytest.mark.parametrize("fused", [False, True])
def test_load_state_dict_places_states_as_cuda_would(sim, fused):
    """torch casts loaded states to param.device, except a plain optimizer's `step`, which stays on the host."""
    import io

    p = torch.nn.Parameter(torch.randn(8))
    opt = torch.optim.AdamW([p], fused=fused)
    p.grad = torch.randn(8)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    host_state = torch.load(buf, map_location="cpu")  # host tensors, as a CPU copy of a checkpoint
    assert all(sim.is_host(t) for t in host_state["state"][0].values())
    twin = torch.nn.Parameter(p.detach().clone())
    other = torch.optim.AdamW([twin], fused=fused)
    other.load_state_dict(host_state)
    state = other.state[twin]
    assert not sim.is_host(state["exp_avg"]) and not sim.is_host(state["exp_avg_sq"])
    assert sim.is_host(state["step"]) is (not fused)
    twin.grad = p.grad.clone()
    other.step()
    opt.step()
    assert torch.equal(twin, p)
    sim.synchronize()


def test_cuda_moves_host_tensors_and_modules(sim):
    """.cuda() / .to("cuda") (the cuda flavour) or .npu() / .to("npu") (the npu flavour) copy host tensors and
    modules to the simulated device."""
    name = sim.flavour  # the device type the code names: "cuda" or "npu"
    before = torch.tensor([1.0, 2.0, 3.0, 4.0], device="cpu")  # pageable host memory
    assert sim.is_host(before)
    moved = getattr(before, name)()
    assert not sim.is_host(moved) and torch.equal(moved.cpu(), before)
    assert getattr(moved, name)() is moved and not sim.is_host(before.to(name))
    layer = torch.nn.Linear(2, 2, device="cpu")
    layer.weight.data = torch.tensor([[1.0, 0.0], [0.0, 1.0]], device="cpu")  # host weights, as before .cuda()
    assert sim.is_host(layer.weight)
    assert getattr(layer, name)() is layer and not sim.is_host(layer.weight)
    assert torch.equal(layer.weight, torch.eye(2))


def test_deepcopy_of_a_device_tensor_is_device_memory(sim):
    """copy.deepcopy of device tensors (a state_dict's, say) gives device tensors, as on CUDA: its memory is the
    simulator's device memory, counted as such, and a copy into it from a device tensor is no host-to-device copy;
    views of one storage stay views of one copy, values and grads come along."""
    import copy

    base = torch.arange(12.0).reshape(3, 4)
    leaf = torch.randn(5, requires_grad=True)
    leaf.grad = torch.ones(5)
    views = {"row": base[1], "col": base[:, 2], "whole": base, "leaf": leaf}
    before = sim.memory_allocated()
    copied = copy.deepcopy(views)
    assert sim.memory_allocated() > before
    assert all(not sim.is_host(t) for t in copied.values()) and not sim.is_host(copied["leaf"].grad)
    assert copied["row"].untyped_storage().data_ptr() == copied["whole"].untyped_storage().data_ptr()
    assert copied["whole"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert copied["col"].stride() == (4,) and copied["row"].storage_offset() == 4
    assert torch.equal(copied["col"], base[:, 2]) and torch.equal(copied["leaf"].grad, leaf.grad)
    assert copied["leaf"].requires_grad and copied["leaf"].is_leaf
    copied["row"].add_(100)
    assert torch.equal(copied["whole"][1], base[1] + 100) and torch.equal(base[1], torch.arange(4.0, 8.0))
    sim.reset_timeline()
    torch._foreach_copy_([copied["row"]], [base[0]])
    assert [op.lane for op in sim.timeline] == ["compute"]
