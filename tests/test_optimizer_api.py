"""The torch.optim.Optimizer surface of SwapOptimizer, refusals, knobs, hooks, stats, profiler, DTensor."""

from __future__ import annotations

import pytest
import torch
from loguru import logger

import device
import simdevice as simulator
from swapopt import SwapConfig, SwapOptimizer
from swapopt.optimizer import SwapStats

O = torch.optim


@pytest.fixture
def logs():
    messages: list[tuple[str, str]] = []
    handle = logger.add(lambda m: messages.append((m.record["level"].name, m.record["message"])), level="DEBUG")
    logger.enable("swapopt")
    yield messages
    logger.remove(handle)
    logger.disable("swapopt")


def _step_all(opt, params, n=1):
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()


def test_shares_groups_state_defaults(sim):
    params = [torch.nn.Parameter(torch.randn(10)) for _ in range(3)]
    inner = O.AdamW(params[:2], lr=1e-3)
    opt = SwapOptimizer(inner)
    assert opt.optimizer is inner
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    opt.add_param_group({"params": [params[2]], "lr": 5e-4})
    assert len(inner.param_groups) == 2 and opt.param_groups[1]["lr"] == 5e-4
    _step_all(opt, params, 2)
    opt.wait_for_swap_out()
    assert set(inner.state) == set(params)
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros(10)) for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


class _NotAnOptimizer:
    param_groups: list = []


def _flat_buffer_optimizer():
    class FlatAdam(O.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-3})

        def step(self, closure=None):
            return None

    flat = torch.zeros(20)
    return FlatAdam([torch.nn.Parameter(flat[:10]), torch.nn.Parameter(flat[10:])])


def _npu_fused():
    cls = type("NpuFusedAdamW", (O.AdamW,), {"__module__": "torch_npu.optim.npu_fused_adamw"})
    return cls([torch.nn.Parameter(torch.randn(4))])


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: _NotAnOptimizer(), TypeError, "torch.optim.Optimizer"),
        (lambda: O.LBFGS([torch.nn.Parameter(torch.randn(4))]), ValueError, "LBFGS"),
        (lambda: O.SparseAdam([torch.nn.Parameter(torch.randn(4))]), ValueError, "SparseAdam"),
        (lambda: O.Adam([torch.nn.Parameter(torch.randn(4))], differentiable=True), ValueError, "differentiable=False"),
        (_npu_fused, ValueError, "flat fused buffer"),
        (_flat_buffer_optimizer, ValueError, "views of one flat buffer"),
        (lambda: SwapOptimizer(O.SGD([torch.nn.Parameter(torch.randn(4))])), ValueError, "already a SwapOptimizer"),
    ],
)
def test_refused_optimizers(make, exc, words):
    with pytest.raises(exc, match=words):
        SwapOptimizer(make())


@pytest.mark.parametrize(
    "kw, knob",
    [
        ({"swap_optimizer_times": 0}, "swap_optimizer_times"),
        ({"slots": 0}, "slots"),
        ({"chunk_mb": -1.0}, "chunk_mb"),
        ({"chunk_mb": 0.0}, "chunk_mb"),
        ({"resident_mb": -0.5}, "resident_mb"),
    ],
)
def test_bad_knobs(kw, knob):
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=knob):
        SwapOptimizer(O.AdamW([p]), **kw)
    with pytest.raises(ValueError, match=knob):
        SwapConfig(swap_optimizer=True, **kw)


def test_config_wrap():
    p = torch.nn.Parameter(torch.randn(4))
    inner = O.AdamW([p])
    assert SwapConfig().wrap(inner) is inner
    wrapped = SwapConfig(swap_optimizer=True, swap_optimizer_times=4, slots=2, chunk_mb=1.0).wrap(inner)
    assert isinstance(wrapped, SwapOptimizer) and wrapped.optimizer is inner
    assert (wrapped.swap_optimizer_times, wrapped.operate.slots, wrapped.chunk_mb) == (4, 2, 1.0)
    assert SwapConfig(swap_optimizer=True).wrap(wrapped) is wrapped
    with pytest.raises(ValueError):
        SwapConfig(swap_optimizer=True, unknown_knob=1)


def test_cpu_steps_in_place_and_logs_once(clean_device_env, logs):
    clean_device_env.setenv("SWAPOPT_DEVICE", "cpu")
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(30)) for _ in range(2)]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = SwapOptimizer(O.AdamW(ps, lr=1e-2)), O.AdamW(rs, lr=1e-2)
    with pytest.warns(UserWarning, match="no accelerator or simulator is active") as caught:
        for _ in range(3):
            for p, r in zip(ps, rs):
                p.grad = r.grad = torch.randn(30)
            opt.step()
            ref.step()
    assert all(torch.equal(p, r) for p, r in zip(ps, rs))
    assert torch.equal(opt.state[ps[0]]["exp_avg"], ref.state[rs[0]]["exp_avg"])
    assert sum("in place" in m for _, m in logs) == 1
    ours = [w for w in caught if "in place" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # said once, pointing at the caller of step()


def test_step_hooks_run_once_per_step(sim):
    params = [torch.nn.Parameter(torch.randn(600)) for _ in range(3)]
    inner = O.AdamW(params, lr=1e-3)
    calls = []
    inner.register_step_pre_hook(lambda o, a, k: calls.append("inner_pre"))
    inner.register_step_post_hook(lambda o, a, k: calls.append("inner_post"))
    opt = SwapOptimizer(inner, swap_optimizer_times=8)
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global"))
    try:
        _step_all(opt, params)
    finally:
        handle.remove()
    assert opt.swap_stats().chunks > 1
    assert sorted(calls) == sorted(["global", "pre", "inner_pre", "inner_post", "post"])


def test_scheduler_built_on_inner_optimizer(sim):
    import warnings

    params = [torch.nn.Parameter(torch.randn(10))]
    inner = O.SGD(params, lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = SwapOptimizer(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        _step_all(opt, params)
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_swap_stats_logs_and_profiler_ranges(sim, logs):
    params = [torch.nn.Parameter(torch.randn(600)) for _ in range(4)]
    opt = SwapOptimizer(O.AdamW(params, lr=1e-3), swap_optimizer_times=4)
    assert opt.swap_stats() == SwapStats()
    _step_all(opt, params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step_all(opt, params)
    names = {e.name for e in prof.events()}
    for k in range(4):
        assert {f"swapopt.swap_in[{k}]", f"swapopt.update[{k}]", f"swapopt.swap_out[{k}]"} <= names
    stats = opt.swap_stats()
    state_bytes = 4 * 600 * 8
    assert (stats.h2d_bytes, stats.d2h_bytes, stats.chunks, stats.steps) == (state_bytes, state_bytes, 4, 2)
    assert 3 * state_bytes // 4 <= stats.peak_staging_bytes <= 3 * (state_bytes // 4 + 64 * 2)
    assert stats.step_ms is not None and stats.step_ms > state_bytes / (sim.preset.h2d_gbps * 1e6)
    summaries = [(lvl, m) for lvl, m in logs if m.startswith("swapopt step")]
    assert [lvl for lvl, _ in summaries] == ["INFO"]  # the first step only: swap_stats() has every step's


def test_wait_for_swap_out_orders_host_reads(sim):
    params = [torch.nn.Parameter(torch.randn(600)) for _ in range(4)]
    opt = SwapOptimizer(O.AdamW(params, lr=1e-3), swap_optimizer_times=4)
    _step_all(opt, params, 1)
    # Fetching opt.state waits (Note [reading states]); a dict held across the step reads the arena directly.
    held = opt.state[params[-1]]
    _step_all(opt, params, 1)
    with pytest.raises(simulator.StreamRaceError):
        held["exp_avg"].sum()  # the last chunk's D2H is still in flight
    events = [opt.operate.swap_out_event(p) for p in params]
    assert all(e is not None for e in events) and len({id(e) for e in events}) == 4  # one chunk each
    assert opt.operate.swap_in_event(params[0]) is not None and opt.operate.update_event(params[0]) is not None
    opt.wait_for_swap_out([params[-1]])
    assert events[-1].query()
    held["exp_avg"].sum()
    opt.wait_for_swap_out()
    assert all(device.is_host_tensor(opt.state[p]["exp_avg_sq"]) for p in params)


def test_per_param_events_are_the_last_step_that_swapped_each_param(sim):
    """A step of the same plan replaces every param's events; a param the last step did not swap (no grad: another
    plan) keeps those of the step that last did."""
    params = [torch.nn.Parameter(torch.randn(600)) for _ in range(4)]
    opt = SwapOptimizer(O.AdamW(params, lr=1e-3), swap_optimizer_times=4)
    op = opt.operate

    def events(p):
        return op.swap_in_event(p), op.update_event(p), op.swap_out_event(p)

    _step_all(opt, params, 2)  # the first step has no states to swap in
    first = [events(p) for p in params]
    assert all(e is not None for es in first for e in es)
    _step_all(opt, params, 1)  # the same plan
    second = [events(p) for p in params]
    assert all(a is not b for x, y in zip(first, second) for a, b in zip(x, y))
    for p in params[:3]:
        p.grad = torch.randn(p.shape)
    params[3].grad = None
    opt.step()  # another plan, without the last param
    third = [events(p) for p in params]
    assert third[3] == second[3]
    assert all(a is not b for x, y in zip(second[:3], third[:3]) for a, b in zip(x, y))
    _step_all(opt, params, 1)  # back to a plan with all four
    fourth = [events(p) for p in params]
    assert all(a is not b for x, y in zip(third, fourth) for a, b in zip(x, y))
    opt.wait_for_swap_out(params[3:])
    assert fourth[3][2].query()


def test_state_moved_to_device_is_rehomed(sim):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(50)) for _ in range(2)]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = SwapOptimizer(O.Adam(ps, lr=1e-2), swap_optimizer_times=2), O.Adam(rs, lr=1e-2)
    for step in range(3):
        for p, r in zip(ps, rs):
            g = torch.randn(50)
            p.grad, r.grad = g.clone(), g.clone()
        if step == 2:  # an engine moved a state to the device behind the optimizer's back
            opt.wait_for_swap_out()
            host = opt.state[ps[0]]["exp_avg"]
            on_device = torch.empty(host.shape, device=device.torch_device())
            on_device.copy_(host)
            opt.state[ps[0]]["exp_avg"] = on_device
            with pytest.warns(UserWarning, match=r"'exp_avg' was found in device memory.*SwapSingleDeviceStrategy"):
                opt.step()
        else:
            opt.step()
        ref.step()
    opt.wait_for_swap_out()
    assert opt.state[ps[0]]["exp_avg"] is host  # copied back into the pinned tensor it came from
    for p, r in zip(ps, rs):
        assert torch.equal(p.detach(), r.detach())
        assert torch.equal(opt.state[p]["exp_avg"].cpu(), ref.state[r]["exp_avg"].cpu())  # host vs device


def test_states_built_at_construction_move_to_host(sim):
    p = torch.nn.Parameter(torch.randn(20))
    inner = O.Adagrad([p], lr=1e-2, initial_accumulator_value=0.5)
    assert not device.is_host_tensor(inner.state[p]["sum"])
    opt = SwapOptimizer(inner)
    assert device.is_host_tensor(opt.state[p]["sum"])


def test_state_dict_round_trip_is_host_and_resumes(sim):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(700)) for _ in range(3)]
    opt = SwapOptimizer(O.AdamW(ps, lr=1e-2), swap_optimizer_times=3)
    _step_all(opt, ps, 2)
    sd = opt.state_dict()
    assert all(device.is_host_tensor(v) for s in sd["state"].values() for v in s.values() if isinstance(v, torch.Tensor))
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = SwapOptimizer(O.AdamW(qs, lr=1e-2), swap_optimizer_times=3)
    opt2.load_state_dict(sd)
    assert opt2.state is opt2.optimizer.state and opt2.param_groups is opt2.optimizer.param_groups
    for p, q in zip(ps, qs):
        g = torch.randn(700)
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    opt.wait_for_swap_out()
    opt2.wait_for_swap_out()
    for p, q in zip(ps, qs):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
    opt.offload()
    opt.onload()
    _step_all(opt, ps)


def test_dtensor_params_single_rank(sim):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh(device.torch_device().type, (1,))  # the params' device: they swap
        torch.manual_seed(0)
        full = [torch.randn(1100), torch.randn(12, 5)]
        ps = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
        rs = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
        opt = SwapOptimizer(O.AdamW(ps, lr=1e-2, foreach=True), swap_optimizer_times=3)
        ref = O.AdamW(rs, lr=1e-2, foreach=True)
        for _ in range(3):
            for p, r in zip(ps, rs):
                g = torch.randn(p.shape)
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
                r.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            opt.step()
            ref.step()
        opt.wait_for_swap_out()
        assert opt.swap_stats().steps == 3
        for p, r in zip(ps, rs):
            st = opt.state[p]["exp_avg"]
            assert isinstance(st, DTensor) and st.placements == p.placements and st.shape == p.shape
            assert device.is_host_tensor(st)
            assert torch.equal(p.to_local(), r.to_local())
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][k].to_local(), ref.state[r][k].to_local().cpu())  # host vs device
    finally:
        if own_group:
            dist.destroy_process_group()


class _Lamb(O.Optimizer):
    """LAMB-style: a trust ratio from the global grad norm over group["params"], a group-level step."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in group["params"] if p.grad is not None))
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                st = self.state[p]
                st.setdefault("exp_avg", torch.zeros_like(p)).lerp_(p.grad, 0.1)
                p.add_(st["exp_avg"] / (norm + 1e-6), alpha=-group["lr"])


def test_cross_param_optimizer_refused_unless_opted_in(sim):
    ps = [torch.nn.Parameter(torch.randn(300)) for _ in range(3)]
    with pytest.raises(ValueError, match=r"not known to be a per-param optimizer.*per_param=True"):
        SwapOptimizer(_Lamb(ps))
    # opted in: its group-level write is still caught, naming the key, on the first chunk
    opt = SwapOptimizer(_Lamb(ps), per_param=True, swap_optimizer_times=3)
    with pytest.raises(RuntimeError, match=r"wrote param_groups\[0\]\['step'\]"):
        _step_all(opt, ps)


class _Momentum(O.Optimizer):
    """A third-party per-param optimizer (not registered)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    st = self.state[p]
                    st["mom"] = st.get("mom", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                    p.sub_(st["mom"], alpha=group["lr"])


def test_register_per_param(sim):
    import swapopt

    class Plain(_Momentum):
        """A class of its own, so registering it leaves _Momentum unregistered."""

    ps = [torch.nn.Parameter(torch.randn(50)) for _ in range(3)]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    with pytest.raises(ValueError, match="register_per_param"):
        SwapOptimizer(Plain(ps))
    assert swapopt.register_per_param(Plain) is Plain
    opt, ref = SwapOptimizer(Plain(ps), swap_optimizer_times=3), Plain(rs)
    for _ in range(3):
        for p, r in zip(ps, rs):
            p.grad = r.grad = torch.randn(50)
        opt.step()
        ref.step()
    opt.wait_for_swap_out()
    assert all(torch.equal(p, r) for p, r in zip(ps, rs))
    assert all(sim.is_host(opt.state[p]["mom"]) for p in ps)


def test_sparse_grads_name_the_alternative(sim):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = SwapOptimizer(O.Adam(emb.parameters()))
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="SparseAdam unwrapped"):
        opt.step()


def test_host_params_step_in_place_and_meta_gets_torchs_error(sim):
    dev_p = torch.nn.Parameter(torch.randn(100))
    host_p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0], device="cpu"))  # host memory, asked for by name
    assert sim.is_host(host_p) and not sim.is_host(dev_p)
    rs = [torch.nn.Parameter(dev_p.detach().clone()), torch.nn.Parameter(host_p.detach().clone())]
    opt, ref = SwapOptimizer(O.AdamW([dev_p, host_p], lr=0.1)), O.AdamW(rs, lr=0.1)
    for _ in range(3):
        gs = [torch.randn(100), torch.tensor([0.5, -1.0, 2.0], device="cpu")]  # a host param's grad is on the host
        for p, r, g in zip((dev_p, host_p), rs, gs):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    opt.wait_for_swap_out()
    assert torch.equal(dev_p, rs[0]) and torch.equal(host_p, rs[1])
    assert torch.equal(opt.state[host_p]["exp_avg"], ref.state[rs[1]]["exp_avg"])
    meta = torch.nn.Parameter(torch.empty(4, device="meta"))
    meta.grad = torch.empty(4, device="meta")
    opt2 = SwapOptimizer(O.SGD([meta], lr=0.1, momentum=0.9))
    ref_meta = torch.nn.Parameter(torch.empty(4, device="meta"))
    ref_meta.grad = torch.empty(4, device="meta")
    try:
        O.SGD([ref_meta], lr=0.1, momentum=0.9).step()
        torch_error = None
    except Exception as exc:  # noqa: BLE001 - whatever torch says is the reference
        torch_error = exc
    if torch_error is None:
        opt2.step()  # torch accepts meta params: so do we, in place
    else:
        with pytest.raises(type(torch_error)) as got:
            opt2.step()
        assert "Cannot copy out of meta tensor" not in str(got.value)


def test_swap_stats_after_a_failed_step(sim):
    ps = [torch.nn.Parameter(torch.randn(1000)) for _ in range(2)]
    opt = SwapOptimizer(O.AdamW(ps, lr=1e-2), swap_optimizer_times=2)
    _step_all(opt, ps)
    good = opt.swap_stats()
    assert not good.failed and good.step_ms and good.last_error is None
    real = opt._step_fn

    def boom(o, **kw):
        raise ValueError("injected")

    opt._step_fn = boom
    for p in ps:
        p.grad = torch.randn(1000)
    with pytest.raises(ValueError):
        opt.step()
    opt._step_fn = real
    bad = opt.swap_stats()
    assert bad.failed and "injected" in bad.last_error
    # the last successful step's counters, its own start and end events (never paired across steps)
    assert bad.model_copy(update={"failed": False, "last_error": None}) == good
    _step_all(opt, ps)
    assert not opt.swap_stats().failed and opt.swap_stats().steps == 2


def test_opted_in_wrapper_copies_stay_opted_in(sim):
    import copy

    ps = [torch.nn.Parameter(torch.randn(40)) for _ in range(2)]
    opt = SwapOptimizer(_Momentum(ps), per_param=True, swap_optimizer_times=2)
    _step_all(opt, ps)
    twin = copy.deepcopy(opt)
    assert twin.per_param and isinstance(twin.optimizer, _Momentum)
    _step_all(twin, twin.optimizer.param_groups[0]["params"])


def test_per_param_reaches_the_wrapper_from_config_and_class_form(sim):
    from swapopt import swap_class

    ps = [torch.nn.Parameter(torch.randn(40)) for _ in range(2)]
    with pytest.raises(ValueError, match="per_param=True"):
        SwapConfig(swap_optimizer=True).wrap(_Momentum(ps))
    assert SwapConfig(swap_optimizer=True, per_param=True).wrap(_Momentum(ps)).per_param
    with pytest.raises(ValueError, match="per_param=True"):
        swap_class(_Momentum)(ps, lr=0.1)
    opt = swap_class(_Momentum)(ps, lr=0.1, per_param=True, swap_optimizer_times=2)
    assert opt.per_param and isinstance(opt.optimizer, _Momentum)
    _step_all(opt, ps)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_copy_that_raises_leaves_the_host_on_its_stream(overlap):
    """Note [stream switches]: the engine issues each chunk's copies by setting the copy stream and setting the
    stream it was on back; a copy that raises must not leave the caller on the copy stream, in the step's block
    or inside the update's (where, with overlap, the update stream is the one to go back to)."""

    class Refuses:
        def copy_(self, *args, **kwargs):
            raise RuntimeError("refused")

    with simulator.activate() as sim:
        p = torch.nn.Parameter(torch.randn(64))
        opt = SwapOptimizer(torch.optim.AdamW([p], fused=True), overlap_forward=overlap)
        if overlap:
            opt.attach(torch.nn.ParameterList([p]))
        p.grad = torch.randn(64)
        opt.step()
        opt.wait_for_update()
        op = opt.operate
        caller = sim.current_stream()
        op.begin(1, 256, device.torch_device())
        with pytest.raises(RuntimeError, match="refused"):
            op._copies_on(op.d2h_stream, [(Refuses(), None)])
        assert sim.current_stream() == caller
        with op.updating(None):
            inside = sim.current_stream()
            assert (inside == op.update_stream) and (overlap or inside == caller)
            with pytest.raises(RuntimeError, match="refused"):
                op._copies_on(op.h2d_stream, [(Refuses(), None)])
            assert sim.current_stream() == inside
        assert sim.current_stream() == caller
        op.release_staging()
