"""Loading state dicts the way torch does: older formats upgraded by the optimizer's own __setstate__,
state dicts the optimizer cannot step with refused at load (naming param and key), loads that fail
changing nothing, and torch.save / torch.load(weights_only=True) round trips."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from dist_utils import assert_same_state, copy_model, host_states, make_model, snapshot, swap, train
from loguru import logger

import device
import simdevice as simulator
from swapopt import SwapOptimizer, checkpoint

INNERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1.0),  # averaging starts at once: ``ax`` matters
}
# Param-group keys added after the formats these checkpoints mimic; each class's __setstate__ fills them.
NEWER_GROUP_KEYS = ("foreach", "maximize", "differentiable", "fused", "capturable", "decoupled_weight_decay")


def old_format(sd: dict) -> dict:
    """``sd`` as an older torch wrote it: Python-number ``step`` (and ASGD ``eta``/``mu``), groups without
    the keys added since."""
    sd = copy.deepcopy(sd)
    for st in sd["state"].values():
        for key in ("step", "eta", "mu"):
            if key in st:
                st[key] = st[key].item()
    for group in sd["param_groups"]:
        for key in NEWER_GROUP_KEYS:
            group.pop(key, None)
    return sd


def to_device(sd: dict) -> dict:
    """``sd`` with its non-scalar tensors in device memory, as torch's own load would put them on an
    accelerator (on the simulator ``.to(param.device)`` cannot move them)."""
    dev = device.torch_device()

    def move(v):
        if isinstance(v, torch.Tensor) and v.dim():
            return torch.empty(v.shape, dtype=v.dtype, device=dev).copy_(v)
        return v

    return {"state": {i: {k: move(v) for k, v in s.items()} for i, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def plain_checkpoint(make_inner, steps: int = 3):
    """A checkpoint of a plain run made before the simulator starts (ordinary host memory)."""
    ref = make_model()
    plain = make_inner(ref.parameters())
    train(ref, plain, steps)
    return ref, plain.state_dict()


def load_both(ref0, make_inner, sd: dict):
    """Copies of ``ref0`` with ``sd`` loaded into a plain optimizer (from device memory, as torch would) and
    into a SwapOptimizer: (ref, plain, model, opt). Call with the simulator active."""
    ref, model = copy_model(ref0), copy_model(ref0)
    plain = make_inner(ref.parameters())
    plain.load_state_dict(to_device(sd))
    opt = SwapOptimizer(make_inner(model.parameters()), swap_optimizer_times=3)
    opt.load_state_dict(sd)
    return ref, plain, model, opt


@pytest.mark.parametrize("name", list(INNERS))
def test_older_checkpoint_loads_like_torch_and_steps_bitwise(name):
    make_inner = INNERS[name]
    ref0, sd = plain_checkpoint(make_inner)
    old = old_format(sd)
    with simulator.activate("h100", sanitize=True):
        ref, plain, model, opt = load_both(ref0, make_inner, old)
        # What torch's own load gives (tensor step, filled group keys), swapped states in pinned host memory.
        assert_same_state(snapshot(ref, plain), snapshot(model, opt))
        steps = [s["step"] for s in opt.state.values() if "step" in s]
        assert all(isinstance(t, torch.Tensor) for t in steps) and len(steps) == (0 if name == "sgd" else 4)
        assert all(device.is_host_tensor(t) and t.is_pinned() for t in host_states(opt) if t.dim())
        train(ref, plain, 3, start=3)
        train(model, opt, 3, start=3)
        assert_same_state(snapshot(ref, plain), snapshot(model, opt))
        assert all(s["step"].item() == 6 for s in opt.state.values() if "step" in s)  # the count goes on


def test_xtuner_style_none_state_loads_and_continues_bitwise():
    """XTuner saves ``max_exp_avg_sq: None`` for AdamW without amsgrad; torch loads and keeps it."""
    make_inner = INNERS["adamw"]
    ref0, sd = plain_checkpoint(make_inner)
    for st in sd["state"].values():
        st["max_exp_avg_sq"] = None
    with simulator.activate("h100", sanitize=True):
        ref, plain, model, opt = load_both(ref0, make_inner, sd)
        train(ref, plain, 2, start=3)
        train(model, opt, 2, start=3)
        want, got = snapshot(ref, plain), snapshot(model, opt)
        for snap in (want, got):  # kept as None, as torch keeps it
            assert all(s.pop("max_exp_avg_sq", 0) is None for s in snap["state"].values())
        assert_same_state(want, got)


def test_sgd_states_the_step_does_without_load():
    """SGD reads its momentum buffer with .get(): an empty state or a None buffer is valid (a fresh start)."""
    make_inner = INNERS["sgd"]
    ref0, sd = plain_checkpoint(make_inner)
    sd["state"][0] = {}
    sd["state"][1] = {"momentum_buffer": None}
    with simulator.activate("h100", sanitize=True):
        ref, plain, model, opt = load_both(ref0, make_inner, sd)
        train(ref, plain, 2, start=3)
        train(model, opt, 2, start=3)
        assert_same_state(snapshot(ref, plain), snapshot(model, opt))


def _break(sd: dict, what: str) -> dict:
    sd = copy.deepcopy(sd)
    if what == "missing-key":
        del sd["state"][1]["exp_avg_sq"]
    elif what == "step-shape":
        sd["state"][0]["step"] = torch.tensor([3.0])
    elif what == "none-moment":
        sd["state"][3]["exp_avg"] = None
    elif what == "meta":
        sd["state"][2]["exp_avg"] = torch.empty(sd["state"][2]["exp_avg"].shape, device="meta")
    return sd


BROKEN = {
    "missing-key": r"param 1, state 'exp_avg_sq': missing",
    "step-shape": r"param 0, state 'step': shape \(1,\)",
    "none-moment": r"param 3, state 'exp_avg': None",
    "meta": r"param 2, state 'exp_avg': .*meta",
}


@pytest.mark.parametrize("fresh", [False, True], ids=["with-state", "no-state"])
@pytest.mark.parametrize("what", list(BROKEN))
def test_state_dict_the_optimizer_cannot_step_with_is_refused_at_load(sim, what, fresh):
    model = make_model()
    opt = swap(model)
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5  # valid entries come first; none of it may land
    if fresh:  # nothing to write into: every state would go to a new host tensor
        model = copy_model(model)
        opt = swap(model)
    before = snapshot(model, opt)
    ptrs = [t.data_ptr() for t in host_states(opt)]
    with pytest.raises(ValueError, match=BROKEN[what]):
        opt.load_state_dict(_break(sd, what))
    assert_same_state(before, snapshot(model, opt))
    assert [t.data_ptr() for t in host_states(opt)] == ptrs
    assert opt.param_groups[0]["lr"] == 1e-2
    # Still usable: the good state dict loads and training goes on.
    opt.load_state_dict(sd)
    train(model, opt, 1, start=2)


def test_failure_while_copying_changes_nothing(sim, monkeypatch):
    """A failure after every check (here a new pinned tensor cannot be allocated) leaves states and groups
    as they were: new host tensors are filled before the existing ones are written."""
    model = make_model()
    opt = swap(model)
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    model2 = copy_model(model)
    opt2 = swap(model2)
    train(model2, opt2, 1)
    for p in list(model2.parameters())[2:]:  # params 0-1 are loaded in place, 2-3 into new host tensors
        del opt2.state[p]
    before = snapshot(model2, opt2)
    real = checkpoint.hoststate.new_host_like
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) < 3:
            return real(*args, **kwargs)
        raise RuntimeError("pinned allocation failed")

    monkeypatch.setattr(checkpoint.hoststate, "new_host_like", failing)
    with pytest.raises(RuntimeError, match="pinned allocation failed"):
        opt2.load_state_dict(sd)
    assert len(calls) == 3
    assert_same_state(before, snapshot(model2, opt2))
    assert opt2.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("name", ["adamw", "asgd"])
def test_torch_save_weights_only_round_trip_resumes_bitwise(sim, name):
    make_inner = INNERS[name]
    model = make_model()
    opt = SwapOptimizer(make_inner(model.parameters()), swap_optimizer_times=3)
    train(model, opt, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    model2 = copy_model(model)
    opt2 = SwapOptimizer(make_inner(model2.parameters()), swap_optimizer_times=2)
    opt2.load_state_dict(loaded)
    assert_same_state(snapshot(model, opt), snapshot(model2, opt2))
    train(model, opt, 2, start=2)
    train(model2, opt2, 2, start=2)
    assert_same_state(snapshot(model, opt), snapshot(model2, opt2))


def test_factored_state_of_the_wrong_shape_is_refused(sim):
    """Adafactor's row/column factors are shaped unlike the param: the probe maps each of their dims to the
    param's, so a factor of another shape is refused too, not only param-shaped moments."""
    model = make_model()
    opt = SwapOptimizer(torch.optim.Adafactor(model.parameters(), lr=1e-2, foreach=False), swap_optimizer_times=3)
    train(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    assert tuple(sd["state"][0]["row_var"].shape) == (24, 1)
    sd["state"][0]["row_var"] = torch.zeros(16, 1)
    with pytest.raises(ValueError, match=r"param 0, state 'row_var': shape \(16, 1\).* keeps shape \(24, 1\)"):
        opt.load_state_dict(sd)


def test_interrupt_while_writing_existing_host_states_says_what_changed(sim, monkeypatch):
    """In-place writes into the existing host states come last and were all tried on one element; an
    interrupt among them is still possible, and the ERROR names what was written."""
    model = make_model()
    opt = swap(model)
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    real, calls = checkpoint._same_tensor, []

    def interrupted(a, b):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(checkpoint, "_same_tensor", interrupted)
    messages: list[str] = []
    logger.enable("swapopt")
    sink = logger.add(lambda m: messages.append(str(m)), level="ERROR")
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.load_state_dict(sd)
    finally:
        logger.remove(sink)
        logger.disable("swapopt")
    assert len(messages) == 1
    assert "loaded: [(0, 'exp_avg'), (0, 'exp_avg_sq')]; param 1 state 'exp_avg' may be partly written" in messages[0]
    assert opt.param_groups[0]["lr"] == 1e-2
