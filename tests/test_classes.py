"""Class form: SwapAdamW / SwapAdam / swap_class(X) build X from params and swap its states, bitwise like X."""

from __future__ import annotations

import inspect

import pytest
import torch
from dist_utils import assert_host_states

import swapopt
from swapopt import SwapAdam, SwapAdamW, SwapOptimizer, swap_class

O = torch.optim


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((300,), (7, 33), ())]


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad()


def _same(a_params, a_opt, b_params, b_opt) -> None:
    for a, b in zip(a_params, b_params):
        assert torch.equal(a, b)
    if isinstance(a_opt, SwapOptimizer):
        a_opt.wait_for_swap_out()
    for a, b in zip(a_params, b_params):
        sa, sb = a_opt.state[a], b_opt.state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            # swapped states live on the host, the plain optimizer's on the device: compare host copies
            assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


@pytest.mark.parametrize(
    ("cls", "inner", "kwargs"),
    [
        (SwapAdamW, O.AdamW, dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, foreach=True)),
        (SwapAdam, O.Adam, dict(lr=1e-2, amsgrad=True, foreach=False)),
        (swap_class(O.SGD), O.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
        (swap_class(O.RMSprop), O.RMSprop, dict(lr=1e-3, centered=True)),
    ],
)
def test_class_form_is_bitwise_the_inner_optimizer_and_swaps(sim, cls, inner, kwargs):
    params, ref_params = _params(), _params()
    opt = cls(params, swap_optimizer_times=2, **kwargs)
    ref = inner(ref_params, **kwargs)
    assert isinstance(opt, SwapOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert type(opt.optimizer) is inner and opt.swap_optimizer_times == 2
    _run(opt, params, 3)
    _run(ref, ref_params, 3)
    _same(params, opt, ref_params, ref)
    assert opt.swap_stats().h2d_bytes > 0  # states really streamed through the (simulated) device
    assert_host_states(opt)


def test_positional_args_groups_and_knobs_reach_their_places(sim):
    a, b = _params()[:2]
    opt = SwapAdamW([{"params": [a]}, {"params": [b], "lr": 0.5}], 0.25, (0.5, 0.6),
                    swap_optimizer_times=3, chunk_mb=1.0, slots=2, resident_mb=0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.5]
    assert opt.param_groups[0]["betas"] == (0.5, 0.6)
    assert (opt.swap_optimizer_times, opt.chunk_mb, opt.operate.slots, opt.resident_mb) == (3, 1.0, 2, 0.5)
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state


def test_signature_shows_inner_arguments_then_swap_knobs():
    names = list(inspect.signature(SwapAdamW).parameters)
    inner = [n for n in inspect.signature(O.AdamW).parameters]
    assert names == inner + [
        "swap_optimizer_times", "chunk_mb", "slots", "resident_mb", "per_param", "overlap_forward", "prefetch",
        "master_weights", "step_graph",
    ]
    assert inspect.signature(SwapAdamW).parameters["slots"].kind is inspect.Parameter.KEYWORD_ONLY


def test_one_class_per_optimizer_and_exported():
    assert swap_class(O.AdamW) is SwapAdamW and swap_class(O.Adam) is SwapAdam
    assert swap_class(O.SGD) is swap_class(O.SGD) and swap_class(O.SGD).__name__ == "SwapSGD"
    assert swapopt.SwapAdamW is SwapAdamW and {"SwapAdamW", "SwapAdam", "swap_class"} <= set(swapopt.__all__)


def test_refusals_and_bad_knobs():
    with pytest.raises(ValueError, match="LBFGS cannot be swapped"):
        swap_class(O.LBFGS)
    with pytest.raises(ValueError, match="already swaps"):
        swap_class(SwapAdamW)
    with pytest.raises(TypeError, match="Optimizer subclass"):
        swap_class(torch.nn.Linear)
    with pytest.raises(ValueError, match="swap_optimizer_times"):
        SwapAdamW(_params(), lr=1e-3, swap_optimizer_times=0)
    with pytest.raises(ValueError, match="differentiable=True"):
        SwapAdamW(_params(), differentiable=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentum'"):
        SwapAdamW(_params(), momentum=0.9)  # the inner optimizer's own argument check


def test_state_dict_round_trip_between_class_form_and_plain(sim):
    params, ref_params = _params(), _params()
    opt, ref = SwapAdamW(params, lr=1e-2, swap_optimizer_times=2), O.AdamW(ref_params, lr=1e-2)
    _run(opt, params, 2)
    _run(ref, ref_params, 2)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = SwapAdamW(fresh_params, lr=1e-2, swap_optimizer_times=3)
    fresh.load_state_dict(ref.state_dict())
    _run(fresh, fresh_params, 2, seed=2)
    _run(ref, ref_params, 2, seed=2)
    _same(fresh_params, fresh, ref_params, ref)


def test_generated_class_pickles_by_name(sim):
    """pickle finds a class by module and name: swap_class(X) instances copy into a fresh process."""
    import pickle

    params = _params()
    opt = swap_class(O.SGD)(params, lr=1e-2, momentum=0.9, swap_optimizer_times=2)
    _run(opt, params, 2)
    assert swapopt.classes.SwapSGD is swap_class(O.SGD)
    copy = pickle.loads(pickle.dumps(opt))
    assert type(copy) is type(opt)
    for p, q in zip(opt.param_groups[0]["params"], copy.param_groups[0]["params"]):
        assert torch.equal(opt.state[p]["momentum_buffer"], copy.state[q]["momentum_buffer"])
    with pytest.raises(AttributeError):
        swapopt.classes.SwapNotAnOptimizer


def test_prefetch_knob_reaches_the_optimizer(sim):
    model = torch.nn.Linear(4, 4)
    assert SwapAdamW(model.parameters(), prefetch=True).prefetch_enabled
    assert not SwapAdamW(model.parameters()).prefetch_enabled
