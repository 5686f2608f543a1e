"""Graph capture and replay on the simulator (Note [graph capture] in device/sim/graphs.py): a correct program's
replays give bitwise what eager execution gives, in the eager device time for one launch of host time; capture
changes no data; what CUDA refuses during a capture raises with CUDA's wording and invalidates it; memory the capture
took stays reserved until reset; a replay of freed memory fails; the sanitizer judges replays as eager work; the cuda
flavour's torch.cuda.graph routes to the simulator (the npu flavour's torch.npu.graph in a process of its own)."""

from __future__ import annotations

import os
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import cli_zygote
import device
import simdevice as simulator
from device.sim import StreamRaceError, host_time

N = 1 << 20  # 4 MiB a tensor: copies and kernels, not launches, set the device time
CUDA_FLAVOUR = simulator.test_flavour() == "cuda"
CAPTURING = "operation not permitted when stream is capturing"
INVALIDATED = "operation failed due to a previous error during capture"
CAPTURED_EVENT = "operation not permitted on an event last recorded in a capturing stream"
PAGEABLE = "during (CUDA|NPU) graph capture unless the CPU tensor is pinned"


def _state(seed: float) -> dict[str, torch.Tensor]:
    """One program's memory: a device param and its buffer, pinned host memory in and out."""
    host_in = device.pinned_empty(N)
    host_in.copy_(torch.linspace(-1.0, 1.0, N, device="cpu") * seed)
    host_out = device.pinned_empty(N)
    host_out.zero_()
    w = torch.linspace(0.5, 1.5, N)
    return {"w": w, "buf": torch.zeros(N), "host_in": host_in, "host_out": host_out}


def _step(sim, st: dict[str, torch.Tensor], side) -> torch.Tensor:
    """A multi-stream step issued from the current stream: H2D on a side stream, kernels, D2H back on the side
    stream, events between them; every stream joined back before it returns."""
    main = sim.current_stream()
    side.wait_stream(main)
    with sim.stream(side):
        st["buf"].copy_(st["host_in"], non_blocking=True)
    main.wait_stream(side)
    z = st["buf"] * 0.25 + st["w"]
    st["w"].mul_(0.5).add_(z)
    side.wait_stream(main)
    with sim.stream(side):
        st["host_out"].copy_(st["w"], non_blocking=True)
    main.wait_stream(side)
    return z


def test_a_multi_stream_step_replays_bitwise_in_the_eager_device_time_for_one_launch(sim):
    s, side, side2 = sim.Stream(name="capture"), sim.Stream(name="copies"), sim.Stream(name="copies2")
    eager, graphed = _state(1.0), _state(1.0)
    steps, eager_device_us = 3, []
    for _ in range(steps):
        sim.synchronize()
        start = sim.now_us()
        with sim.stream(s):
            z_eager = _step(sim, eager, side)
        eager_host_us = sim.now_us() - start
        sim.synchronize()
        eager_device_us.append(sim.now_us() - start)
    eager_ops = len([op for op in sim.timeline if op.lane != "host"])

    g = sim.CUDAGraph()
    before = {k: v.cpu().clone() for k, v in graphed.items()}
    with sim.graph(g, stream=s):
        assert sim.is_current_stream_capturing() and s.is_capturing()
        z = _step(sim, graphed, side2)
    assert not sim.is_current_stream_capturing()
    for k, v in graphed.items():  # nothing ran: the data are as they were
        assert torch.equal(v.cpu(), before[k]), k
    # The capture's outputs (z, and the temporary before it) came from the graph's pool: live ones are allocated,
    # the pool's bytes reserved.
    assert sim.memory_reserved() - sim.memory_allocated() >= 4 * N

    sim.reset_timeline()
    for _ in range(steps):
        sim.synchronize()
        start = sim.now_us()
        g.replay()
        host_us = sim.now_us() - start
        sim.synchronize()
        device_us = sim.now_us() - start
        nodes = 6  # two copies, three kernels and the D2H copy
        assert host_us == pytest.approx(sim.preset.graph_launch_us + nodes * sim.preset.graph_node_host_us)
        assert host_us < eager_host_us / 4  # one launch, not six
        assert 0.9 * eager_device_us[-1] <= device_us <= 1.02 * eager_device_us[-1]
    for k in ("w", "buf", "host_out"):
        assert torch.equal(graphed[k].cpu(), eager[k].cpu()), k
    assert torch.equal(z.cpu(), z_eager.cpu())  # the static output holds the last replay's result

    # The trace shows the replays on the graph's streams, named after the captured ones, labelled as replayed, the
    # copies on the side stream's.
    ops = [op for op in sim.timeline if op.stream.endswith(f"[{g.name}]")]
    assert len(ops) == steps * nodes and len(ops) <= eager_ops
    assert {op.stream for op in ops} == {f"capture [{g.name}]", f"copies2 [{g.name}]"}
    assert all(op.label == f"{g.name} replay" for op in ops)
    assert {op.lane for op in ops if op.stream.startswith("copies2")} == {"h2d", "d2h"}


def test_replay_host_time_is_the_simulators_own(sim):
    """Everything a replay does in Python is in the simulator's counted frames: a benchmark that subtracts them
    (swapopt/bench/counts.py) counts only the caller's replay() call."""
    x = torch.ones(1024)
    s = sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        for _ in range(20):
            x.mul_(1.5)
    g.replay()  # warm
    calls = host_time.calls()
    g.replay()
    assert host_time.calls() - calls == 1  # one entry: replay() itself


def test_capture_changes_nothing_and_a_static_output_follows_the_replays(sim):
    x = torch.arange(8.0)
    g = sim.CUDAGraph()
    sim.synchronize()
    ops = len(sim.timeline)
    with sim.graph(g):
        y = x * 2  # from the pool, not computed
        x.add_(1)
        empty = torch.empty(8)  # memory, no node
        zeros = torch.zeros(8)  # a kernel: a node
    assert len(sim.timeline) == ops  # nothing ran on the device
    assert torch.equal(x.cpu(), torch.arange(8.0, device="cpu"))
    g.replay()
    assert torch.equal(x.cpu(), torch.arange(8.0, device="cpu") + 1)
    assert torch.equal(y.cpu(), torch.arange(8.0, device="cpu") * 2)
    assert torch.equal(zeros.cpu(), torch.zeros(8, device="cpu")) and empty.shape == (8,)
    g.replay()
    assert torch.equal(y.cpu(), (torch.arange(8.0, device="cpu") + 1) * 2)


def test_capture_must_begin_on_a_side_stream(sim):
    g = sim.CUDAGraph()
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        with sim.graph(g, stream=sim.default_stream()):
            pass
    assert sim.current_stream() is sim.default_stream()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()


def _breaks_capture(sim, body, match: str = CAPTURING, mode: str = "global") -> None:
    """`body` inside a capture raises CUDA's error, and the capture is invalidated: capture_end fails too."""
    s = sim.Stream()
    g = sim.CUDAGraph()
    with pytest.raises(RuntimeError, match=INVALIDATED) as info:
        with sim.graph(g, stream=s, capture_error_mode=mode):
            body(s)
    assert match in str(info.value.__context__), info.value.__context__
    assert not sim.is_current_stream_capturing() and sim.current_stream() is sim.default_stream()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()


def test_synchronizing_or_reading_the_capture_on_the_host_fails_as_on_cuda(sim):
    x = torch.ones(16)
    _breaks_capture(sim, lambda s: sim.synchronize())
    _breaks_capture(sim, lambda s: s.synchronize())
    _breaks_capture(sim, lambda s: s.query())
    _breaks_capture(sim, lambda s: x.sum().item())
    _refused_by_torch(sim, lambda: x.cpu())  # into pageable memory: torch's own check
    _refused_by_torch(sim, lambda: x.tolist())
    other = sim.Stream()
    outside = other.record_event()
    # Waiting for work outside the capture is a potentially unsafe call, which the capture's mode judges.
    _breaks_capture(sim, lambda s: other.synchronize())
    _breaks_capture(sim, lambda s: outside.query())
    y = torch.ones(16)

    def read_elsewhere(s):
        with sim.stream(other):
            y.sum().item()  # a blocking copy on a stream outside the capture

    _breaks_capture(sim, read_elsewhere)
    s = sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s, capture_error_mode="relaxed"):  # allowed in relaxed mode
        other.synchronize()
        outside.synchronize()
        x.add_(1)
    g.replay()
    assert x.sum().item() == 32.0
    g2 = sim.CUDAGraph()
    with sim.graph(g2, stream=s, capture_error_mode="thread_local"):  # allowed from another thread
        thread = threading.Thread(target=lambda: (other.synchronize(), outside.query()))
        thread.start()
        thread.join()
        x.add_(1)
    g2.replay()
    assert x.sum().item() == 48.0
    _breaks_capture(sim, lambda s: other.synchronize(), mode="thread_local")  # but not from its own thread


def _refused_by_torch(sim, body) -> None:
    """torch refuses `body` inside a capture before issuing anything (a copy with pageable memory): the capture
    stays valid, as an H100 showed (torch 2.11)."""
    x = torch.zeros(4)
    s = sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        x.add_(1)
        with pytest.raises(RuntimeError, match=PAGEABLE):
            body()
    g.replay()
    assert x.sum().item() == 4.0


def test_copies_with_pageable_memory_fail_during_capture(sim):
    x = torch.ones(16)
    pageable = torch.ones(16, device="cpu")
    pinned = device.pinned_empty(16)
    _refused_by_torch(sim, lambda: x.copy_(pageable, non_blocking=True))
    _refused_by_torch(sim, lambda: pageable.copy_(x, non_blocking=True))
    _refused_by_torch(sim, lambda: torch.tensor([1.0, 2.0]))  # built on the host, copied from pageable memory
    _breaks_capture(sim, lambda s: x.copy_(pinned))  # pinned but blocking: the host waits for the stream
    s = sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        x.copy_(pinned, non_blocking=True)
        x.add_(torch.tensor(2.0, device="cpu"))  # a host scalar: read at capture, as CUDA bakes it into the node
        pinned.copy_(x, non_blocking=True)
    pinned.fill_(5.0)
    g.replay()
    sim.synchronize()
    assert pinned.tolist() == [7.0] * 16


def test_events_of_a_capture_cannot_be_waited_for_on_the_host(sim):
    def query(s):
        s.record_event().query()

    def timed(s):
        a, b = sim.Event(enable_timing=True), sim.Event(enable_timing=True)
        a.record(s)
        b.record(s)
        a.elapsed_time(b)

    _breaks_capture(sim, query, CAPTURED_EVENT)
    _breaks_capture(sim, lambda s: s.record_event().synchronize(), CAPTURED_EVENT)
    _breaks_capture(sim, timed, CAPTURED_EVENT)
    s = sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        event = s.record_event()
    with pytest.raises(RuntimeError, match="invalid argument"):  # after the capture: a point of the graph, as an
        event.synchronize()  # H100 answers
    with pytest.raises(RuntimeError, match="invalid argument"):
        sim.current_stream().wait_event(event)
    event.record()  # recorded outside a capture: an event again
    assert event.query()


def test_a_capture_cannot_wait_on_work_outside_it(sim):
    x = torch.ones(16)
    x.add_(1)
    outside = sim.current_stream().record_event()
    _breaks_capture(sim, lambda s: s.wait_event(outside), "dependency created on uncaptured work in another stream")
    _breaks_capture(
        sim, lambda s: s.wait_stream(sim.default_stream()), "dependency created on uncaptured work in another stream"
    )
    _breaks_capture(  # the legacy stream joins no capture
        sim, lambda s: sim.default_stream().wait_stream(s), "make the legacy stream depend on a capturing"
    )


def test_a_forked_stream_must_be_joined_before_the_capture_ends(sim):
    x = torch.ones(16)
    s, side = sim.Stream(), sim.Stream()
    g = sim.CUDAGraph()
    with pytest.raises(RuntimeError, match="capturing stream has unjoined work") as info:
        with sim.graph(g, stream=s):
            side.wait_stream(s)  # the fork: side joins the capture
            assert side.is_capturing()
            with sim.stream(side):
                x.add_(1)  # recorded; s never waits for it
    assert "stream#" in str(info.value) and not side.is_capturing()
    assert x.sum().item() == 16.0
    g2 = sim.CUDAGraph()
    with sim.graph(g2, stream=s):
        side.wait_stream(s)
        with sim.stream(side):
            x.add_(1)
        s.wait_stream(side)  # joined back
    g2.replay()
    assert x.sum().item() == 32.0


def test_memory_freed_during_capture_stays_reserved_until_reset(sim):
    """swapopt's staging slot: storage given during the step and taken back at its end (free_storage, then
    alloc_storage at the next step). Captured, the graph keeps the memory the capture gave it, and its replays use
    that, never what the tensor object holds later."""
    nbytes = 4 * N
    p = torch.zeros(N)
    host = device.pinned_empty(N)
    host.fill_(2.0)
    slot = torch.empty(N)
    device.free_storage(slot)
    base = sim.memory_allocated()
    s = sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        device.alloc_storage(slot, nbytes)
        slot.copy_(host, non_blocking=True)
        p.add_(slot)
        device.free_storage(slot)
    assert sim.memory_allocated() == base  # the slot's block went back to the graph's pool ...
    assert sim.memory_reserved() == base + nbytes  # ... which keeps it
    device.alloc_storage(slot, nbytes)  # the program's own use of the slot, between replays
    slot.fill_(-1.0)
    g.replay()
    g.replay()
    assert p.sum().item() == 4.0 * N and slot.sum().item() == -1.0 * N  # the graph's memory, not the slot's
    device.free_storage(slot)
    assert sim.memory_reserved() == base + nbytes
    g.reset()
    assert sim.memory_reserved() == sim.memory_allocated() == base
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()


def test_a_released_pool_goes_back_at_empty_cache_with_the_caching_allocator(clean_device_env):
    with simulator.activate(allocator="caching") as sim:
        x = torch.ones(N)
        s = sim.Stream()
        g = sim.CUDAGraph()
        with sim.graph(g, stream=s):
            x.add_(x * 2)  # a temporary from the pool
        held = sim.memory_reserved()
        sim.empty_cache()
        assert sim.memory_reserved() == held  # the graph holds its pool
        g.replay()
        assert x.sum().item() == 3.0 * N
        sim.empty_cache()
        assert sim.memory_reserved() == held
        del g  # a dropped graph lets go of its pool, as reset() does ...
        assert sim.memory_reserved() == held
        sim.empty_cache()  # ... and the caching allocator gives its free segments back at empty_cache
        assert sim.memory_reserved() == held - 20 * 2**20  # the temporary's 4 MiB came in a 20 MiB segment


def test_a_new_segment_outside_the_capture_is_an_unsafe_call(clean_device_env):
    """The caching allocator's cudaMalloc of a new segment for a stream outside the capture (torch relaxes only the
    capturing stream's): refused in global mode, as an H100 refused it; the capture's own allocations come from its
    pool."""
    with simulator.activate(allocator="caching") as sim:
        other = sim.Stream()

        def allocate_elsewhere(s):
            with sim.stream(other):
                torch.empty(N)

        before = sim.memory_reserved()
        _breaks_capture(sim, allocate_elsewhere)
        assert sim.memory_reserved() == before  # the refused segment was never reserved
        s = sim.Stream()
        g = sim.CUDAGraph()
        with sim.graph(g, stream=s, capture_error_mode="relaxed"):
            y = torch.ones(N)  # the pool's
            with sim.stream(other):
                z = torch.empty(N)  # allowed in relaxed mode
        g.replay()
        assert y.sum().item() == N and z.shape == (N,)


def test_a_replay_of_freed_memory_fails(sim):
    p = torch.zeros(64)
    q = torch.ones(64)
    r = torch.ones(64)
    s = sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        p.add_(q)
        p.add_(r)
    g.replay()
    assert p.sum().item() == 128.0
    device.free_storage(r)
    with pytest.raises(RuntimeError, match="freed since.*stricter than hardware"):
        g.replay()
    device.alloc_storage(r, 64 * 4)
    del q
    with pytest.raises(RuntimeError, match=r"shape \(64,\).*freed since"):
        g.replay()
    assert p.sum().item() == 128.0  # the failed replays ran nothing


def test_a_new_tensor_at_a_captured_address_is_read_as_on_hardware(sim):
    """A graph bakes addresses in: a grad made anew at the address the captured one had (the block CUDA's caching
    allocator gives back) is what a replay reads, as swapopt's step_graph relies on when data_ptr() is unchanged.
    The simulator's device memory is host memory, whose allocator seldom hands the same block back: the captured
    address is pointed at the new grad's block instead, as if it had."""
    p = torch.zeros(64)
    grad = torch.ones(64)
    s = sim.Stream()
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        p.add_(grad)
    (ref,) = [r for r in g._exec.refs if r.ptr == grad.data_ptr()]
    del grad
    grad = torch.full((64,), 2.0)
    ref.ptr = grad.data_ptr()  # the caching allocator's block, given back
    g.replay()
    assert p.sum().item() == 128.0
    del grad
    grad = torch.full((32,), 2.0)  # another size: not the block the graph reads
    ref.ptr = grad.data_ptr()
    with pytest.raises(RuntimeError, match="no allocation of its size holds"):
        g.replay()


def test_the_sanitizer_judges_replays_as_eager_work(sim):
    p = torch.zeros(256)
    grad = torch.ones(256)
    host = device.pinned_empty(256)
    s, other = sim.Stream(), sim.Stream(name="grads")
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        p.add_(grad)
        host.copy_(p, non_blocking=True)
    for _ in range(3):  # grads made on another stream, which the replay's stream waits for: no race
        other.wait_stream(sim.current_stream())
        with sim.stream(other):
            grad.fill_(1.0)
        sim.current_stream().wait_stream(other)
        g.replay()
        sim.current_stream().synchronize()
        assert host[0].item() == p[0].item()
    other.wait_stream(sim.current_stream())
    with sim.stream(other):
        grad.fill_(2.0)
    with pytest.raises(StreamRaceError, match="grads") as info:  # the replay reads grads nothing ordered
        g.replay()
    assert "replay" in str(info.value)
    sim.current_stream().wait_stream(other)
    g.replay()
    with pytest.raises(StreamRaceError):  # the host reads what the replay's D2H may still write
        host.sum()
    sim.synchronize()
    assert host.sum().item() == p.sum().item()


def test_a_fused_adamw_step_replayed_equals_eager_steps_bitwise(sim):
    shapes = [(33, 17), (128,), (5, 4, 3)]

    def make():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
        return params, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)

    grads = [[torch.randn(shape) for shape in shapes] for _ in range(4)]
    eager_params, eager_opt = make()
    for step in range(4):
        for p, gr in zip(eager_params, grads[step]):
            p.grad = gr.clone()
        eager_opt.step()

    params, opt = make()
    for p, gr in zip(params, grads[0]):
        p.grad = gr.clone()
    opt.step()  # warm: the states exist before the capture
    assert all(opt.state[p]["step"].device.type != "cpu" for p in params)
    g = sim.CUDAGraph()
    with sim.graph(g):
        opt.step()
    for step in range(1, 4):
        for p, gr in zip(params, grads[step]):
            p.grad.copy_(gr)
        g.replay()
    for p, q in zip(params, eager_params):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key].cpu(), eager_opt.state[q][key].cpu()), key


@pytest.mark.skipif(not CUDA_FLAVOUR, reason="the cuda flavour's torch.cuda")
def test_torch_cuda_graph_routes_to_the_simulator(clean_device_env):
    saved = torch.cuda.graph, torch.cuda.CUDAGraph
    with simulator.activate() as sim:
        x = torch.ones(8, device="cuda")
        g = torch.cuda.CUDAGraph()
        assert isinstance(g, sim.CUDAGraph)
        assert not torch.cuda.is_current_stream_capturing()
        with torch.cuda.graph(g):
            assert torch.cuda.is_current_stream_capturing()
            x.mul_(3)
        assert x.sum().item() == 8.0
        g.replay()
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=g.pool()):  # a pool shared with g
            x.add_(1)
        g2.replay()
        assert x.sum().item() == 32.0
        handle = torch.cuda.graph_pool_handle()
        g3 = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
            g3.capture_begin(pool=handle)  # on the default stream
        with torch.cuda.graph(g3, pool=handle, stream=torch.cuda.Stream()):
            x.sub_(2)
        g3.replay()
        assert x.sum().item() == 16.0 and g3.pool() == handle
    assert (torch.cuda.graph, torch.cuda.CUDAGraph) == saved


@pytest.mark.skipif(not CUDA_FLAVOUR, reason="this is the npu process")
def test_torch_npu_graph_is_the_simulators_under_the_npu_flavour() -> None:
    """torch names its PrivateUse1 backend once per process: the npu flavour runs in a process of its own."""
    program = textwrap.dedent(
        """
        import torch
        import device.sim as simulator

        with simulator.activate("910b") as sim:
            import torch_npu

            assert torch.npu.NPUGraph is sim.NPUGraph and torch_npu.npu.graph == sim.graph
            x = torch.ones(8, device="npu")
            s = torch.npu.Stream()
            g = torch.npu.NPUGraph()
            with torch.npu.graph(g, stream=s):
                assert torch.npu.is_current_stream_capturing()
                x.mul_(2)
            g.replay()
            torch.npu.synchronize()
            assert x.cpu().tolist() == [2.0] * 8, x
            try:
                with torch.npu.graph(torch.npu.NPUGraph(), stream=s):
                    torch.npu.synchronize()
            except RuntimeError as err:
                assert "NPU error: operation not permitted when stream is capturing" in str(err.__context__)
            else:
                raise AssertionError("synchronize() inside a capture did not fail")
        print("ok")
        """
    )
    root = Path(__file__).parent.parent
    env = {**os.environ, "SWAPOPT_SIM_PRESET": "910b"}
    env.pop("SWAPOPT_DEVICE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    run = cli_zygote.run(["-c", program], cwd=root, env=env, timeout=300)  # forked: the child names the backend
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-3000:] + run.stderr[-3000:]


def test_a_forward_and_backward_pass_replays_to_the_eager_grads(sim):
    """A whole training step's device work captured (warmed up on the capture stream, as torch's docs do): the
    backward's nodes run on the capturing stream, and a replay's grads are bitwise the eager ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(32, 8)
    s = sim.Stream()
    s.wait_stream(sim.current_stream())
    with sim.stream(s):
        model(x).square().mean().backward()  # warm-up: the grads exist before the capture
    sim.current_stream().wait_stream(s)
    g = sim.CUDAGraph()
    with sim.graph(g, stream=s):
        model.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        loss.backward()
    x.copy_(torch.randn(32, 8, device="cpu"))  # a new batch in the captured input
    g.replay()
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    eager.load_state_dict(model.state_dict())
    eager_loss = eager(x).square().mean()
    eager_loss.backward()
    assert torch.equal(loss.cpu(), eager_loss.detach().cpu())
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad.cpu(), q.grad.cpu())
