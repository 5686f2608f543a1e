"""step_graph: a steady swapped step captured once as a device graph and replayed (Note [graphed step] in
swapopt.graphed), on the simulator, which models CUDA's stream capture (device/sim/graphs.py).

Every replayed step is bitwise the unwrapped optimizer's; whatever a replay could not redo (grads at new addresses,
a float lr a scheduler changes, replaced states, a GradScaler, host step counts) leads to a new capture or to the
ordinary step, never to a wrong result; a capture that fails leaves the step to run as usual.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import device
from swapopt import SwapOptimizer, npu, pipeline

O = torch.optim
# Params whole, transposed, channels_last, 0-dim, zero-size, and one a small chunk budget cuts across chunks.
SHAPES = ((64,), (8, 16), (4096,), (7, 9), (2, 3, 4, 5), (), (0, 5), (33,))
CHUNK_MB = 8 / 1024


def _params(seed: int = 0, shapes: tuple = SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    made = [torch.randn(s, generator=gen) for s in shapes]
    made[3] = made[3].t().contiguous().t()
    made[4] = made[4].contiguous(memory_format=torch.channels_last)
    return [torch.nn.Parameter(t.to(torch.get_default_device())) for t in made]


def _set_grads(ps: list[torch.Tensor], rs: list[torch.Tensor], step: int, in_place: bool = True) -> None:
    """The same grads on both sides; ``in_place`` writes them into the grads of the last step, as a training loop's
    backward does into blocks its caching allocator hands out again, so their addresses stay."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p, r in zip(ps, rs):
        g = torch.randn(p.shape, generator=gen).to(p.device)
        r.grad = torch.empty_like(r).copy_(g)  # laid out like its param, as autograd makes it
        if in_place and p.grad is not None:
            p.grad.copy_(g)
        else:
            p.grad = torch.empty_like(p).copy_(g)


def _assert_bitwise(ps, opt, rs, ref) -> None:
    opt.wait_for_swap_out()
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert torch.equal(p.detach().cpu(), r.detach().cpu()), f"param {i}"
    for i, (p, r) in enumerate(zip(ps, rs)):
        for key, want in ref.state[r].items():
            got = opt.state[p][key]
            if isinstance(want, torch.Tensor):
                assert torch.equal(got.cpu(), want.cpu()), f"param {i} state {key!r}"
            else:
                assert got == want, f"param {i} state {key!r}"


def _run(make, steps: int = 6, in_place: bool = True, chunk_mb: float | None = CHUNK_MB, shapes: tuple = SHAPES,
         **knobs):
    """Step ``make``'s optimizer wrapped with step_graph and unwrapped, ``steps`` times; the replays counted."""
    ps, rs = _params(shapes=shapes), _params(shapes=shapes)
    opt = SwapOptimizer(make(ps), chunk_mb=chunk_mb, step_graph=True, **knobs)
    ref = make(rs)
    replays = 0
    for s in range(steps):
        _set_grads(ps, rs, s, in_place)
        before = opt._graphed
        opt.step()
        ref.step()
        replays += before is not None and opt._graphed is before
    _assert_bitwise(ps, opt, rs, ref)
    return opt, replays


CAPTURABLE = {
    "adamw_fused": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_capturable": lambda ps: O.Adam(ps, lr=1e-2, foreach=True, capturable=True),
    "adam_amsgrad_capturable": lambda ps: O.Adam(ps, lr=1e-2, amsgrad=True, foreach=False, capturable=True),
    "adam_tensor_lr": lambda ps: O.Adam(ps, lr=torch.tensor(1e-2), fused=True),
    "sgd_momentum": lambda ps: O.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("name", sorted(CAPTURABLE))
def test_a_steady_step_is_captured_once_and_replayed_bitwise(sim, name: str) -> None:
    if device.get_device() == "npu" and npu.cpu_fallback_kernels(CAPTURABLE[name]([torch.nn.Parameter(torch.ones(1))])):
        # torch_npu has no NPU kernel for it (fused Adam with a tensor lr): its CPU fallback copies each chunk to the
        # host and back synchronously, which no capture can hold. The capture is refused, with a warning; every step
        # runs as usual and stays bitwise.
        with pytest.warns(UserWarning, match="step_graph: the step could not be captured"):
            opt, replays = _run(CAPTURABLE[name])
        assert opt._graph_off is not None and opt._graphed is None and replays == 0
        return
    opt, replays = _run(CAPTURABLE[name])
    # steps 1-2 make and settle the states, step 3 runs steadily, step 4 is captured (and replayed), 5-6 replay
    assert opt._graph_off is None and opt._graphed is not None
    assert replays == 2


def test_a_cut_params_step_count_is_published_in_place(sim) -> None:
    """A param cut across chunks steps a clone of its step count per piece; under step_graph the last piece's
    clone is copied into the param's own tensor, so the state dict holds one tensor for good."""
    ps, rs = _params(), _params()
    opt = SwapOptimizer(CAPTURABLE["adamw_fused"](ps), chunk_mb=CHUNK_MB, step_graph=True)
    ref = CAPTURABLE["adamw_fused"](rs)
    cut = ps[2]  # 4096 elements: cut by an 8 KiB budget
    _set_grads(ps, rs, 0)
    opt.step()
    ref.step()
    first = opt.state[cut]["step"]
    for s in range(1, 5):
        _set_grads(ps, rs, s)
        opt.step()
        ref.step()
    assert opt.state[cut]["step"] is first
    _assert_bitwise(ps, opt, rs, ref)


def test_host_step_counts_are_not_captured(sim) -> None:
    """torch keeps Adam's step count on the host without fused or capturable: the host would advance it at the
    capture only, so the step is not captured; a warning says why, and every step stays bitwise."""
    with pytest.warns(UserWarning, match="cannot be captured: state 'step' is a host tensor"):
        opt, replays = _run(lambda ps: O.AdamW(ps, lr=1e-2, foreach=True))
    assert opt._graphed is None and replays == 0


def test_a_non_elementwise_optimizer_stays_bitwise_without_a_graph(sim) -> None:
    """Adafactor's states are row and column factors, not param-shaped, and its update reads its step count on the
    host (``step_t.item()``): a capture fails there, as on CUDA, a warning says why, and every step is the ordinary
    one, bitwise."""
    make = lambda ps: O.Adafactor(ps, lr=1e-2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt, replays = _run(make, shapes=tuple(s for s in SHAPES if 0 not in s))  # torch's Adafactor: no zero-size
    reasons = [str(w.message) for w in seen if "step_graph" in str(w.message)]
    assert replays == 0 and opt._graphed is None
    assert len(reasons) == 1 and "could not be captured" in reasons[0], reasons


def test_grads_at_new_addresses_make_a_new_capture(sim) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt, replays = _run(CAPTURABLE["adamw_fused"], steps=8, in_place=False)
    assert replays == 0 and opt._captures >= 3
    assert any("captured the step" in str(w.message) for w in seen)


def test_a_float_lr_changed_by_a_scheduler_makes_a_new_capture(sim) -> None:
    ps, rs = _params(), _params()
    opt = SwapOptimizer(CAPTURABLE["adamw_fused"](ps), chunk_mb=CHUNK_MB, step_graph=True)
    ref = CAPTURABLE["adamw_fused"](rs)
    sched = O.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = O.lr_scheduler.StepLR(ref, step_size=3, gamma=0.5)
    graphs = []
    for s in range(9):
        _set_grads(ps, rs, s)
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
        graphs.append(opt._graphed)
    _assert_bitwise(ps, opt, rs, ref)
    live = {id(g) for g in graphs if g is not None}
    assert len(live) >= 2  # a capture per lr value that lasted long enough


def test_replaced_states_drop_the_graph(sim) -> None:
    """load_state_dict puts new state tensors in: the graph, which reads the old ones, is dropped."""
    ps, rs = _params(), _params()
    make = CAPTURABLE["adamw_fused"]
    opt = SwapOptimizer(make(ps), chunk_mb=CHUNK_MB, step_graph=True)
    ref = make(rs)
    for s in range(5):
        _set_grads(ps, rs, s)
        opt.step()
        ref.step()
    assert opt._graphed is not None
    saved, ref_saved = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref.state_dict())
    for s in range(5, 7):
        _set_grads(ps, rs, s)
        opt.step()
        ref.step()
    opt.load_state_dict(saved)
    ref.load_state_dict(ref_saved)
    for s in range(7, 12):
        _set_grads(ps, rs, s)
        opt.step()
        ref.step()
    _assert_bitwise(ps, opt, rs, ref)


def test_offload_gives_the_graphs_memory_back(sim) -> None:
    opt, _ = _run(CAPTURABLE["adamw_fused"])
    assert opt._graphed is not None
    held = sim.memory_reserved()
    opt.offload()
    assert opt._graphed is None
    assert sim.memory_reserved() < held


def test_a_capture_that_fails_leaves_the_step_to_run_as_usual(sim, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in the middle of the capture: nothing ran on the device, so the step runs as usual (bitwise), the
    state dicts are those of before, a warning says why, and no capture is tried again."""
    real = pipeline.StepRun.update_and_swap_out

    def failing(self, k):
        if self.capturing and k == 1:
            raise RuntimeError("injected at chunk 1 of the capture")
        return real(self, k)

    monkeypatch.setattr(pipeline.StepRun, "update_and_swap_out", failing)
    with pytest.warns(UserWarning, match="could not be captured.*injected at chunk 1"):
        opt, replays = _run(CAPTURABLE["adamw_fused"], steps=7)
    assert replays == 0 and opt._graphed is None and opt._graph_off is not None


def test_a_replay_costs_the_host_one_launch(sim) -> None:
    """The replayed step dispatches no op from Python: the device work is the graph's, launched once."""
    from swapopt.bench.counts import count_call

    ps, rs = _params(), _params()
    opt = SwapOptimizer(CAPTURABLE["adamw_fused"](ps), chunk_mb=CHUNK_MB, step_graph=True)
    for s in range(5):
        _set_grads(ps, rs, s)
        opt.step()
    assert opt._graphed is not None
    replay = count_call(opt.step)
    assert replay.aten_ops == 0 and replay.launches == 0 and opt._graphed is not None


@pytest.mark.parametrize("knob", ["prefetch", "overlap_forward"])
def test_step_graph_is_refused_with_knobs_that_spread_the_step(knob: str) -> None:
    with pytest.raises(ValueError, match=f"step_graph cannot be combined with {knob}"):
        SwapOptimizer(O.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=False), step_graph=True, **{knob: True})


def test_the_npu_flavour_captures_with_npu_graphs() -> None:
    """torch_npu names its graph NPUGraph (torch_npu/npu/graphs.py): the device abstraction finds it."""
    import device

    class NPUModule:
        NPUGraph = object

        @staticmethod
        def graph(*args, **kwargs):
            return None

    assert device.graph_api(NPUModule) == (object, NPUModule.graph)
    assert device.graph_api(torch.cpu) is None


def _many_small_params() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """64 params of 64 Ki elements on the device and their twins: few chunks eagerly at 4 requested, more replayed."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(1 << 16, generator=gen).to(torch.get_default_device())) for _ in range(64)]
    return ps, [torch.nn.Parameter(p.detach().clone()) for p in ps]


def test_a_step_graph_plan_is_made_with_a_replays_costs(sim) -> None:
    """Note [replayed costs] (swapopt.costs): a replayed chunk costs the host nothing and the device a node gap per
    launch and event, so where an eager step takes few large chunks to save host time, step_graph takes the smaller
    ones the link wants, and replays them bitwise."""
    from swapopt import costs

    eager, replayed = costs.link_costs("cuda"), costs.link_costs("cuda", replayed=True)
    gap = sim.preset.graph_node_gap_us
    assert replayed.host_chunk_us == pytest.approx((costs.LAUNCHES_PER_CHUNK + costs.EVENT_CALLS_PER_CHUNK) * gap)
    assert (replayed.host_copy_us, replayed.host_tensor_us) == (gap, 0.0)
    assert replayed.host_chunk_us < eager.host_chunk_us / 5
    chunks = {}
    for graph in (False, True):
        ps, rs = _many_small_params()
        # a float lr: torch_npu's fused AdamW takes no tensor one (its CPU fallback cannot be captured)
        opt = SwapOptimizer(O.AdamW(ps, lr=1e-2, fused=True), swap_optimizer_times=4, step_graph=graph)
        ref = O.AdamW(rs, lr=1e-2, fused=True)
        for step in range(5):
            _set_grads(ps, rs, step)
            opt.step()
            ref.step()
        _assert_bitwise(ps, opt, rs, ref)
        assert (opt._graphed is not None) is graph
        chunks[graph] = opt.swap_stats().chunks
    assert chunks[False] == 4 < chunks[True]


def test_steps_that_cannot_be_captured_are_planned_as_eager_ones(sim) -> None:
    """step_graph on an optimizer whose steps a replay could not redo (Adam's step counts on the host): the steps run
    eagerly, with a warning, and from the next step on with an eager step's plan (Note [replayed costs]), bitwise."""
    ps, rs = _many_small_params()
    opt = SwapOptimizer(O.Adam(ps, lr=1e-2, foreach=True), swap_optimizer_times=4, step_graph=True)
    ref = O.Adam(rs, lr=1e-2, foreach=True)
    seen = []
    with pytest.warns(UserWarning, match="cannot be captured"):
        for step in range(4):
            _set_grads(ps, rs, step)
            opt.step()
            ref.step()
            seen.append(opt.swap_stats().chunks)
    _assert_bitwise(ps, opt, rs, ref)
    assert opt._graphed is None
    assert seen[0] > 4 and seen[1:] == [4, 4, 4]  # planned for replays, then, once refused, for eager steps
