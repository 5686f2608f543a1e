"""Programs that are correct on CUDA and once failed under the simulator (found running torchao and XTuner on it),
each next to the incorrect twin that must still fail: pinned host tensors shaped like device tensors, a
backward hook's copy on the hook's own stream, and integer histc."""

from __future__ import annotations

import pytest
import torch

from device.sim import StreamRaceError

# ----- pin_memory=True for a host tensor made from a device tensor ------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda t: torch.empty_like(t, device="cpu", pin_memory=True),
        lambda t: torch.zeros_like(t, device="cpu", pin_memory=True),
        lambda t: t.new_empty(t.shape, device="cpu", pin_memory=True),
    ],
    ids=["empty_like", "zeros_like", "new_empty"],
)
def test_pinned_host_tensor_shaped_like_a_device_tensor(sim, make):
    t = torch.randn(16, 8, dtype=torch.bfloat16)
    before = sim.host_memory_allocated()
    host = make(t)
    assert host.device.type == "cpu" and host.is_pinned()
    assert host.shape == t.shape and host.dtype == t.dtype
    assert sim.host_memory_allocated() == before + host.nbytes  # counted as pinned host memory
    # It is host memory a non-blocking D2H can land in, and the host reads it once the copy is done.
    host.copy_(t, non_blocking=True)
    sim.synchronize()
    assert torch.equal(host, t.cpu())


@pytest.mark.parametrize(
    "pin",
    [
        lambda t, sim: t.pin_memory(),
        lambda t, sim: torch.empty_like(t, pin_memory=True),  # the device tensor's device: not the host
        lambda t, sim: torch.empty(4, device=sim.torch_device(), pin_memory=True),
    ],
    ids=["pin_memory", "empty_like_on_device", "empty_on_device"],
)
def test_pinning_device_memory_is_refused(sim, pin):
    t = torch.randn(4)
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        pin(t, sim)


def test_device_to_pinned_copy_is_a_d2h_the_host_must_wait_for(sim):
    t = torch.randn(256)
    host = torch.ops.aten._to_copy(t, device="cpu", pin_memory=True, non_blocking=True)
    assert host.is_pinned()
    assert sim.timeline[-1].lane == "d2h"
    with pytest.raises(StreamRaceError):
        host.tolist()  # the copy may still be in flight


def test_device_to_pinned_copy_read_after_synchronize(sim):
    t = torch.randn(256)
    host = torch.ops.aten._to_copy(t, device="cpu", pin_memory=True, non_blocking=True)
    sim.synchronize()
    assert host.tolist() == t.cpu().tolist()


# ----- a backward hook's stream ------------------------------------------------------------------------------


def _offload_grad_in_hook(sim, *, wait: bool, set_stream: bool = False):
    """w's gradient copied to pinned memory on a side stream by its post-accumulate-grad hook, as torchao's
    CPU offload optimizer does. Returns (the copy's target, the side stream, the streams the hook saw)."""
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    side = sim.Stream()
    target = torch.empty(64, 64, device="cpu", pin_memory=True)
    seen = []

    def hook(p):
        seen.append(sim.current_stream())
        if wait:
            side.wait_stream(sim.current_stream())
        if set_stream:  # set and never restored: the engine gives the node's stream back after the node
            sim.set_stream(side)
            seen.append(sim.current_stream())
            target.copy_(p.grad, non_blocking=True)
            return
        with sim.stream(side):
            seen.append(sim.current_stream())
            target.copy_(p.grad, non_blocking=True)
        seen.append(sim.current_stream())

    w.register_post_accumulate_grad_hook(hook)
    (x @ w).sum().backward()
    return w, target, side, seen


def test_copy_in_a_backward_hook_runs_on_the_hooks_stream(sim):
    w, target, side, seen = _offload_grad_in_hook(sim, wait=True)
    compute = sim.default_stream()
    # Inside the hook the node's stream is current, then the hook's own stream, then the node's again.
    assert seen == [compute, side, compute]
    copies = [op for op in sim.timeline if op.name == "aten.copy_.default"]
    assert [(op.stream, op.lane) for op in copies] == [(side.name, "d2h")]
    assert sim.current_stream() == compute  # backward() leaves the caller's stream current
    side.synchronize()
    assert torch.equal(target, w.grad.cpu())


def test_copy_in_a_backward_hook_without_waiting_races(sim):
    # The side stream does not wait for the stream that wrote the gradient: a race on hardware.
    with pytest.raises(StreamRaceError) as err:
        _offload_grad_in_hook(sim, wait=False)
    assert err.value.op == "aten.copy_.default" and err.value.stream != "compute"


def test_host_read_of_a_hooks_copy_before_its_stream_is_done_races(sim):
    _, target, _, _ = _offload_grad_in_hook(sim, wait=True)
    # The engine syncs the caller's stream with the backward streams, not with a hook's own stream.
    sim.current_stream().synchronize()
    with pytest.raises(StreamRaceError):
        target.tolist()


def test_a_stream_a_hook_sets_ends_with_its_node(sim):
    w, target, side, seen = _offload_grad_in_hook(sim, wait=True, set_stream=True)
    assert seen == [sim.default_stream(), side]
    assert sim.current_stream() == sim.default_stream()  # not the hook's stream after backward()
    side.synchronize()
    assert torch.equal(target, w.grad.cpu())


def test_later_backward_ops_keep_their_forward_stream_after_a_hook_sets_one(sim):
    w1 = torch.randn(32, 32, requires_grad=True)
    w2 = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32)
    side = sim.Stream()

    def hook(p):
        side.wait_stream(sim.current_stream())
        sim.set_stream(side)  # never restored
        p.grad.sum()

    w2.register_post_accumulate_grad_hook(hook)
    ((x @ w1) @ w2).sum().backward()
    hook_op = max(i for i, op in enumerate(sim.timeline) if op.stream == side.name)
    later = [op for op in sim.timeline[hook_op + 1 :] if op.name == "aten.mm.default"]
    assert later and all(op.stream == "compute" for op in later)  # w1's gradient, after w2's hook
    assert w1.grad is not None


def test_a_hook_sees_its_nodes_forward_stream_as_current(sim):
    # CUDA makes a node's stream current while it runs: for a forward run on a side stream, that side stream.
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    side = sim.Stream()
    side.wait_stream(sim.current_stream())
    with sim.stream(side):
        loss = (x @ w).sum()
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(sim.current_stream()))
    sim.current_stream().wait_stream(side)
    loss.backward()
    assert seen == [side]
    assert sim.current_stream() == sim.default_stream()


def test_a_hooks_node_stream_is_ordered_after_the_gradients_producer(sim):
    # w is first used on a side stream (its AccumulateGrad runs there) through a view, which launches nothing;
    # its gradient is made on compute. The engine orders the side stream after compute before the node and
    # its hook run, so a hook stream that waits for the hook's current stream may read the gradient.
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    side, s = sim.Stream(), sim.Stream()
    side.wait_stream(sim.current_stream())
    with sim.stream(side):
        y = w.view(16, 16)
    sim.current_stream().wait_stream(side)
    loss = (x @ y).sum()
    target = torch.empty(16, 16, device="cpu", pin_memory=True)
    seen = []

    def hook(p):
        seen.append(sim.current_stream())
        s.wait_stream(sim.current_stream())
        with sim.stream(s):
            target.copy_(p.grad, non_blocking=True)

    w.register_post_accumulate_grad_hook(hook)
    loss.backward()
    assert seen == [side]
    s.synchronize()
    assert torch.equal(target, w.grad.cpu())


# ----- integer histc -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_histc_of_an_integer_tensor(sim, dtype):
    values = torch.randint(0, 100, (1000,), generator=torch.Generator().manual_seed(0), device="cpu").to(dtype)
    t = values.to(sim.torch_device())
    hist = torch.histc(t, bins=7)
    assert sim.timeline[-1].name == "aten.histc.default" and sim.timeline[-1].lane == "compute"
    assert hist.device == t.device and hist.dtype == dtype
    # Integer values are exact in float64: the same bins as histc of a float copy.
    expected = torch.histc(values.double(), bins=7).to(dtype)
    assert hist.tolist() == expected.tolist()


def test_histc_of_an_integer_tensor_with_bounds_and_out(sim):
    t = torch.tensor([-3, 0, 1, 5, 5, 9, 10, 12])
    # Bounds are truncated to integers, values outside them skipped, the top edge in the last bin.
    assert torch.histc(t, bins=3, min=0, max=10).tolist() == [2, 2, 2]
    assert torch.histc(t, bins=3, min=0.9, max=10.5).tolist() == [2, 2, 2]
    out = torch.empty(0, dtype=torch.int64)
    torch.histc(t, bins=4, out=out)
    assert out.shape == (4,) and out.tolist() == [2, 1, 2, 3]  # range [-3, 12]: bin (v + 3) * 4 // 15


def test_histc_of_a_constant_integer_tensor(sim):
    assert torch.histc(torch.full((5,), 7), bins=2).tolist() == [0, 5]  # range widened to [6, 8]
    # uint8 0 - 1 wraps to 255 in CUDA's kernel, so the widened range is empty there too.
    with pytest.raises(RuntimeError, match="max must be larger than min"):
        torch.histc(torch.zeros(3, dtype=torch.uint8), bins=2)


def test_histc_of_a_float_tensor_is_unchanged(sim):
    t = torch.tensor([0.5, 1.5, 2.5, 2.75])
    hist = torch.histc(t, bins=3, min=0, max=3)
    assert hist.dtype == torch.float32 and hist.tolist() == [1.0, 1.0, 2.0]
