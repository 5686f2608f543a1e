"""torchao's low-bit optimizers (AdamW8bit, AdamW4bit, AdamWFp8) swapped part by part (Note [subclass states] in
swapopt.subclass_state): bitwise to the same optimizer with its states on the device, through a failing step,
state_dict / torch.save, DCP and offload, moving exactly the bytes of the subclass states' parts.

torchao compiles its per-param update with torch.compile; compiled code cannot run on the simulated device, so
these tests run with ``torch.compiler.set_stance("force_eager")`` (torch's switch that makes every torch.compile
call run eagerly; torchao 0.18 has none of its own), the swapped optimizer and its reference alike.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from stepping import Boom, fail_on_call, step_reference_as_failed

import device
from swapopt import SwapOptimizer, subclass_state

optim = pytest.importorskip("torchao.optim", reason="torchao is not installed")

KINDS = {"8bit": optim.AdamW8bit, "4bit": optim.AdamW4bit, "fp8": optim.AdamWFp8}
# torchao quantizes a state only for params of at least 4096 elements (a multiple of its block size): the
# (100,) and (7, 9) params keep plain fp32 states, so a step mixes both kinds. One quantized param, as small
# as that allows: each quantization is some 30 indexing ops, slow on the simulator.
SHAPES = ((64, 64), (100,), (7, 9))


@pytest.fixture(autouse=True)
def _eager():
    with torch.compiler.set_stance("force_eager"):
        yield


def _grads(i: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _step(opt, ps, i: int) -> None:
    for p, g in zip(ps, _grads(i)):
        p.grad = g.to(p.device)
    opt.step()


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device.torch_device())) for s in SHAPES]


def _flat(value) -> list[torch.Tensor]:
    """A state as the plain tensors holding its data, on the host (a subclass: its parts, never dequantized)."""
    if subclass_state.is_subclass_state(value):
        return [t.cpu() for _, t in subclass_state.parts(value)]
    return [value.cpu()]


def _flat_on_device(value) -> list[torch.Tensor]:
    return [t for _, t in subclass_state.parts(value)]


def _assert_same(ps, opt, rs, ref) -> None:
    opt.wait_for_swap_out()
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert torch.equal(p.detach().cpu(), r.detach().cpu()), f"param {i}"
        assert set(opt.state.get(p, {})) == set(ref.state.get(r, {})), f"param {i} keys"
        for key, want in ref.state.get(r, {}).items():
            got = opt.state[p][key]
            assert type(got) is type(want) or not subclass_state.is_subclass_state(want), (i, key, type(got))
            a, b = _flat(got), _flat(want)
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"param {i} state {key}"


def _pair(kind: str, **knobs):
    ps, rs = _params(), _params()
    make = KINDS[kind]
    return ps, SwapOptimizer(make(ps, lr=1e-2), **{"swap_optimizer_times": 2, **knobs}), rs, make(rs, lr=1e-2)


def _swapped_bytes(opt, ps) -> int:
    """Bytes of every swapped state: a subclass state's parts, a plain state's own."""
    return sum(
        subclass_state.nbytes(v) if subclass_state.is_subclass_state(v) else v.nbytes
        for p in ps for k, v in opt.state[p].items() if k != "step"
    )


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_steps_bitwise_to_itself_resident_moving_the_parts_bytes(sim, kind):
    ps, opt, rs, ref = _pair(kind)
    for i in range(3):
        _step(opt, ps, i)
        _step(ref, rs, i)
        stats = opt.swap_stats()
        nbytes = _swapped_bytes(opt, ps)
        # Step 1 creates the states on the device and swaps them out; from then on each moves both ways.
        assert (stats.h2d_bytes, stats.d2h_bytes) == ((0 if i == 0 else nbytes), nbytes), i
    _assert_same(ps, opt, rs, ref)
    assert stats.chunks == 2
    quantized = [opt.state[p]["exp_avg"] for p in ps if p.numel() >= 4096]
    assert len(quantized) == 1
    for value in quantized + [opt.state[p]["exp_avg_sq"] for p in ps if p.numel() >= 4096]:
        # kept as the subclass, every part in pinned host memory, far fewer bytes than fp32 moments
        assert subclass_state.is_subclass_state(value) and type(value).__module__.startswith("torchao")
        assert all(device.is_host_tensor(t) and t.is_pinned() for _, t in subclass_state.parts(value))
        assert subclass_state.nbytes(value) < value.numel() * 4 / 2
    # The link moves the parts: 8-bit codes are one byte a param, 4-bit half a byte (plus scales and qmap).
    codes = dict(subclass_state.parts(quantized[0]))["codes"]
    assert codes.element_size() * codes.numel() == {"8bit": 4096, "4bit": 2048, "fp8": 4096}[kind]


def test_first_step_plans_with_the_sizes_the_low_bit_states_have(sim):
    # The first step plans before any state exists, from a probe: one over a meta param of each param's own shape
    # (hoststate.sized_probe), which sees the quantized states torchao makes only for params of 4096 elements
    # or more. So the first step's plan is the later steps' (the same plan, sizes and parts counted alike), and
    # its swap-outs move the bytes every later step moves each way.
    ps, opt, _, _ = _pair("8bit")
    _step(opt, ps, 0)
    first_plan, first_sizes = opt._layout.prepared.plan, opt._layout.plan_cache[0]
    first_d2h = opt.swap_stats().d2h_bytes
    nbytes = _swapped_bytes(opt, ps)
    for i in range(1, 3):
        _step(opt, ps, i)
        assert opt._layout.prepared.plan is first_plan and opt._layout.plan_cache[0] == first_sizes, i
        stats = opt.swap_stats()
        assert stats.h2d_bytes == stats.d2h_bytes == first_d2h == nbytes, i
    # the quantized param's planned bytes are its states' parts (codes, scale, qmap of two moments), not fp32's
    assert first_sizes[0][0].state_bytes == subclass_state.nbytes(opt.state[ps[0]]["exp_avg"]) * 2 == 10368


# fail_step 0: while the states are being created; 1: steady state
@pytest.mark.parametrize(("kind", "fail_step"), [("8bit", 1), ("4bit", 0), ("fp8", 1)])
def test_failure_in_a_chunk_leaves_each_param_stepped_or_untouched(sim, kind, fail_step):
    ps, opt, rs, ref = _pair(kind)
    for i in range(fail_step + 2):
        if i != fail_step:
            _step(opt, ps, i)
            _step(ref, rs, i)
            continue
        restore = fail_on_call(opt, 1)
        with pytest.raises(Boom):
            _step(opt, ps, i)
        restore()
        for r, g in zip(rs, _grads(i)):
            r.grad = g.to(r.device)
        step_reference_as_failed(opt, ref, rs, chunks_done=1)
        _assert_same(ps, opt, rs, ref)
    _assert_same(ps, opt, rs, ref)


def test_failure_after_a_chunks_update_completes_that_chunk(sim):
    # The swap-out of chunk 0 (the quantized param) raises after its update: the failure path copies its
    # states out itself, part by part, so chunk 0 is stepped and chunk 1 untouched.
    ps, opt, rs, ref = _pair("8bit")
    _step(opt, ps, 0)
    _step(ref, rs, 0)
    real = opt.operate.swap_out

    def swap_out(k, copies, hold=()):
        if k == 0:
            raise Boom("swap-out of chunk 0")
        return real(k, copies, hold)

    opt.operate.swap_out = swap_out
    with pytest.raises(Boom):
        _step(opt, ps, 1)
    opt.operate.swap_out = real
    plan = opt._layout.prepared.plan
    assert len(plan.chunks) == 2 and [pc.index for pc in plan.chunks[0].pieces] == [0]
    for r, g in zip(rs, _grads(1)):
        r.grad = g.to(r.device)
    step_reference_as_failed(opt, ref, rs, chunks_done=1)
    _assert_same(ps, opt, rs, ref)
    _step(opt, ps, 2)
    _step(ref, rs, 2)
    _assert_same(ps, opt, rs, ref)


def _resume(kind: str, saved: list[torch.Tensor]) -> tuple[list[torch.nn.Parameter], SwapOptimizer]:
    """A fresh swapped optimizer over copies of the saved params, that has stepped elsewhere (so loading
    writes into host states it has)."""
    qs = [torch.nn.Parameter(p.clone()) for p in saved]
    opt = SwapOptimizer(KINDS[kind](qs, lr=1e-2), swap_optimizer_times=2)
    _step(opt, qs, 99)
    for q, p in zip(qs, saved):
        q.data.copy_(p)
    return qs, opt


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_dict_torch_save_and_dcp_resume_bitwise(sim, kind, tmp_path):
    import torch.distributed.checkpoint as dcp

    ps, opt, rs, ref = _pair(kind)
    for i in range(2):
        _step(opt, ps, i)
        _step(ref, rs, i)
    saved = [p.detach().clone() for p in ps]
    sd = opt.state_dict()
    assert type(sd["state"][0]["exp_avg"]) is type(ref.state[rs[0]]["exp_avg"])  # not dequantized
    buf = io.BytesIO()
    torch.save(sd, buf)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"optim": sd}, checkpoint_id=tmp_path)
    _step(ref, rs, 2)

    # torch.save / torch.load, into an optimizer without states: new pinned subclass states
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    qs = [torch.nn.Parameter(p.clone()) for p in saved]
    resumed = SwapOptimizer(KINDS[kind](qs, lr=1e-2), swap_optimizer_times=2)
    resumed.load_state_dict(loaded)
    value = resumed.state[qs[0]]["exp_avg"]
    assert subclass_state.is_subclass_state(value)
    assert all(device.is_host_tensor(t) and t.is_pinned() for _, t in subclass_state.parts(value))
    _step(resumed, qs, 2)
    _assert_same(qs, resumed, rs, ref)

    # load_state_dict into host states that exist writes them in place, part by part
    qs, resumed = _resume(kind, saved)
    before = [t.data_ptr() for _, t in subclass_state.parts(resumed.state[qs[0]]["exp_avg"])]
    resumed.load_state_dict(loaded)
    assert [t.data_ptr() for _, t in subclass_state.parts(resumed.state[qs[0]]["exp_avg"])] == before
    _step(resumed, qs, 2)
    _assert_same(qs, resumed, rs, ref)

    # DCP (one process): loaded into the state dict's aliases of the host states, then load_state_dict
    qs, resumed = _resume(kind, saved)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        sd = {"optim": resumed.state_dict()}
        dcp.load(sd, checkpoint_id=tmp_path)
    resumed.load_state_dict(sd["optim"])
    _step(resumed, qs, 2)
    _assert_same(qs, resumed, rs, ref)


def test_offload_and_onload_keep_resident_subclass_states_exact(sim):
    # resident_mb keeps the first params' states on the device; offload moves them into host memory part by
    # part (as subclasses, not dequantized) and the next step makes them resident again.
    # 11000 bytes: the quantized param's states (10368 bytes) and the (7, 9) param's plain ones (504) fit, the
    # (100,) param's (800) do not. Step 1 plans with those sizes (hoststate.sized_probe), so both are resident
    # from the start.
    ps, opt, rs, ref = _pair("8bit", resident_mb=11000 / 2**20)
    for i in range(2):
        _step(opt, ps, i)
        _step(ref, rs, i)
    resident = [p for p in ps if not device.is_host_tensor(opt.state[p]["exp_avg"])]
    assert resident == [ps[0], ps[2]]
    assert all(not device.is_host_tensor(t) for t in _flat_on_device(opt.state[ps[0]]["exp_avg"]))
    _assert_same(ps, opt, rs, ref)
    opt.offload()
    for p in ps:
        for key in ("exp_avg", "exp_avg_sq"):
            value = opt.state[p][key]
            assert device.is_host_tensor(value) and all(device.is_host_tensor(t) for t in _flat(value))
            assert subclass_state.is_subclass_state(value) == (p.numel() >= 4096)
    opt.onload()
    for i in range(2, 3):
        _step(opt, ps, i)
        _step(ref, rs, i)
    _assert_same(ps, opt, rs, ref)
    assert any(not device.is_host_tensor(opt.state[p]["exp_avg"]) for p in ps)


@pytest.mark.filterwarnings("ignore:swapopt. prefetch holds")  # four params: a chunk is a large share
def test_prefetch_streams_the_parts_in_ahead(sim):
    # (torchao's optimizers cannot be copied on their own: deepcopy finds no clone for their states, and a
    # pickle, Optimizer.__getstate__, leaves out their block_size and is_adamw; so neither can a SwapOptimizer
    # over one.)
    ps, opt, rs, ref = _pair("4bit", swap_optimizer_times=3, slots=2)
    for i in range(2):  # the first step creates the states, the second plans with their sizes
        _step(opt, ps, i)
        _step(ref, rs, i)
    assert opt.prefetch()  # the first chunks' parts stream in ahead of the step
    _step(opt, ps, 2)
    _step(ref, rs, 2)
    assert opt.swap_stats().h2d_bytes == _swapped_bytes(opt, ps)  # each part counted once
    _assert_same(ps, opt, rs, ref)


def test_overlap_forward_steps_bitwise(sim):
    ps, opt, rs, ref = _pair("fp8", overlap_forward=True)
    opt.attach(torch.nn.ParameterList(ps))
    for i in range(3):
        _step(opt, ps, i)
        _step(ref, rs, i)
    opt.wait_for_update()
    _assert_same(ps, opt, rs, ref)


def test_cpu_offload_optimizer_is_refused_with_the_reason(sim):
    from swapopt.bench.torchao_peer import on_simulator

    with on_simulator():  # torchao picks its device by torch.cuda.is_available(), which the simulator keeps False
        inner = optim.CPUOffloadOptimizer(_params()[:1], torch.optim.AdamW, fused=True)
    with pytest.raises(ValueError, match="CPUOffloadOptimizer cannot be swapped: its states are not per-param"):
        SwapOptimizer(inner)
    with pytest.raises(ValueError, match="not per-param"):
        SwapOptimizer(inner, per_param=True)


def test_master_weights_is_the_recipe_over_low_bit_states(sim):
    # master_weights: bf16 params stepped through fp32 masters, as the recipe steps AdamW8bit over fp32 masters
    # on the device and rounds them into the params; the link moves each master (4 bytes a param) and the
    # states' parts.
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=g) for s in SHAPES]
    ps = [torch.nn.Parameter(b.to(torch.bfloat16).to(device.torch_device())) for b in base]
    rs = [torch.nn.Parameter(b.to(torch.bfloat16).to(device.torch_device())) for b in base]
    masters = [r.detach().float() for r in rs]
    ref = optim.AdamW8bit(masters, lr=1e-2)
    opt = SwapOptimizer(optim.AdamW8bit(ps, lr=1e-2), master_weights=True, swap_optimizer_times=2)
    for i in range(2):
        for p, r, m, grad in zip(ps, rs, masters, _grads(i)):
            p.grad = r.grad = grad.to(torch.bfloat16).to(p.device)
            m.grad = r.grad.float()
        opt.step()
        ref.step()
        for r, m in zip(rs, masters):
            r.detach().copy_(m)
    opt.wait_for_swap_out()
    for i, (p, r, m) in enumerate(zip(ps, rs, masters)):
        assert torch.equal(p.detach().cpu(), r.detach().cpu()), i
        for key, want in ref.state[m].items():
            a, b = _flat(opt.state[p][key]), _flat(want)
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (i, key)
    assert subclass_state.is_subclass_state(opt.state[ps[0]]["exp_avg"])
    numel = sum(p.numel() for p in ps)
    assert opt.swap_stats().h2d_bytes == opt.swap_stats().d2h_bytes == 4 * numel + _swapped_bytes(opt, ps)


def test_a_dtensor_low_bit_state_is_taken_apart_through_its_local_subclass(pg):
    # FSDP2 params make torchao wrap each state in a DTensor over its local subclass: its parts are the local
    # subclass's, and it is rebuilt (host copies, slot views) as a DTensor of the same layout over the rebuilt
    # subclass. Swapped end to end, with DCP on 1 and 2 ranks: tests/test_lowbit_dcp.py.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from swapopt import hoststate

    state = optim.AdamW8bit._subclass_zeros(torch.ones(64, 64, device=device.torch_device()), True, 256)
    mesh = init_device_mesh(device.torch_device().type, (1,))
    wrapped = DTensor.from_local(state, mesh, [Shard(0)], run_check=False)
    assert subclass_state.is_subclass_state(wrapped)
    assert [a for a, _ in subclass_state.parts(wrapped)] == ["codes", "scale", "qmap"]
    assert subclass_state.nbytes(wrapped) == subclass_state.nbytes(state) == 4096 + 16 * 4 + 256 * 4
    host = hoststate.pinned_empty_like(wrapped)
    assert isinstance(host, DTensor) and host.placements == wrapped.placements and host.shape == wrapped.shape
    assert type(hoststate.local(host)) is type(state) and subclass_state.same_parts(host, wrapped)
    assert all(device.is_host_tensor(t) and t.is_pinned() for _, t in subclass_state.parts(host))
    copied = hoststate.pinned_copy(wrapped)
    assert all(torch.equal(a.cpu(), b) for (_, a), (_, b) in zip(subclass_state.parts(wrapped), subclass_state.parts(copied)))
    # a DTensor state for a plain param (or the other way round) is refused at load, before anything changes
    p = torch.nn.Parameter(torch.zeros(64, 64, device=device.torch_device()))
    opt = SwapOptimizer(optim.AdamW8bit([p], lr=1e-2))
    sd = opt.state_dict()
    sd["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": wrapped, "exp_avg_sq": wrapped}}
    refusal = "param 0, state .exp_avg.: a OptimState8bit state in a DTensor for a param that is not one; load it through"
    with pytest.raises(ValueError, match=refusal):
        opt.load_state_dict(sd)
    assert not opt.state


def test_a_qmap_shared_by_two_states_loads_and_steps_bitwise(sim):
    # torchao makes a qmap per state; a state dict whose states share one (built by hand, or by a tool that
    # dedups equal tensors) gives each state a copy of its own when loaded: the step only reads the qmap.
    rs = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]
    ref = optim.AdamW8bit(rs, lr=1e-2)
    for r in rs:
        r.grad = torch.randn(64, 64)
    ref.step()
    ps = [torch.nn.Parameter(r.detach().clone()) for r in rs]
    sd = ref.state_dict()
    first, second = sd["state"][0]["exp_avg"], sd["state"][1]["exp_avg"]
    assert first.qmap is not second.qmap and torch.equal(first.qmap, second.qmap)  # torchao: one per state
    sd["state"][1]["exp_avg"] = subclass_state.rebuild(second, {"qmap": first.qmap})  # now shared
    opt = SwapOptimizer(optim.AdamW8bit(ps, lr=1e-2))
    opt.load_state_dict(sd)
    ref.load_state_dict(sd)
    qmaps = [opt.state[p]["exp_avg"].qmap for p in ps]
    assert qmaps[0].data_ptr() != qmaps[1].data_ptr()
    for _ in range(2):
        for p, r in zip(ps, rs):
            p.grad = torch.randn(64, 64)
            r.grad = p.grad.clone()
        opt.step()
        ref.step()
    _assert_same(ps, opt, rs, ref)


def test_the_quick_bench_has_the_low_bit_rows():
    # Unless --strategies names some: on a device every strategy runs at the run's sizes, the 8-bit rows included;
    # on the simulator they run apart at SIM_LOWBIT_SIZE (eager torchao costs minutes there at 0.1B), and not at
    # all when --sizes asks for sizes.
    from swapopt.bench.__main__ import parse_args, run_strategies
    from swapopt.bench.strategies import (
        ALL_STRATEGIES,
        LOWBIT_STRATEGIES,
        SIM_LOWBIT_SIZE,
    )

    strategies, apart = run_strategies(parse_args([]), simulated=False)
    assert strategies == list(ALL_STRATEGIES) and set(LOWBIT_STRATEGIES) <= set(strategies) and apart == []
    strategies, apart = run_strategies(parse_args([]), simulated=True)
    assert not set(LOWBIT_STRATEGIES) & set(strategies) and "swapopt" in strategies and apart == [SIM_LOWBIT_SIZE]
    assert run_strategies(parse_args(["--sizes", "0.001"]), simulated=True)[1] == []
    named = parse_args(["--strategies", "resident,swapopt-8bit"])
    assert run_strategies(named, simulated=True) == (["resident", "swapopt-8bit"], [])
