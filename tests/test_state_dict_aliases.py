"""A state dict taken before a step and read after it (Note [state dict aliases] in swapopt/checkpoint.py):
`sd = opt.state_dict(); opt.step(); torch.save(sd, f)` holds that step's values, as torch's own optimizer's
state dict does, with the sanitizer watching the host memory the state dict aliases."""

from __future__ import annotations

import io

import pytest
import torch
from dist_utils import adamw, copy_model, forward_backward, make_model, train

from device.sim import StreamRaceError
from swapopt import SwapOptimizer, checkpoint


def saved(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu")


def assert_states_equal(got: dict, want: dict) -> None:
    """Bitwise-equal states, compared on the host (a plain optimizer's live on the device)."""
    assert got.keys() == want.keys()
    for i in want:
        assert got[i].keys() == want[i].keys()
        for k, v in want[i].items():
            assert torch.equal(got[i][k].cpu(), v.cpu()), f"param {i} {k}"


def pair(steps: int = 2, **kw):
    """A SwapOptimizer and a plain AdamW over two copies of one model, both stepped ``steps`` times."""
    ref = make_model()
    plain = adamw(ref)
    model = copy_model(ref)
    opt = SwapOptimizer(adamw(model), swap_optimizer_times=3, **kw)
    if kw.get("overlap_forward"):
        opt.attach(model)
    train(ref, plain, steps)
    train(model, opt, steps)
    return model, opt, ref, plain


def test_save_before_the_next_step_holds_the_last_steps_values(sim):
    model, opt, ref, plain = pair()
    sd = opt.state_dict()
    want = saved(plain.state_dict())
    got = saved(sd)  # read before the step: nothing writes the host states
    train(model, opt, 1, start=2)
    assert_states_equal(got["state"], want["state"])


@pytest.mark.parametrize("knobs", [{}, {"overlap_forward": True}], ids=["plain", "overlap_forward"])
def test_state_dict_taken_before_a_step_and_saved_after_it_holds_that_steps_values(sim, knobs):
    model, opt, ref, plain = pair(**knobs)
    sd = opt.state_dict()
    train(model, opt, 1, start=2)  # the step's swap-outs write the memory sd aliases
    train(ref, plain, 1, start=2)
    got = saved(sd)  # the sanitizer would raise here if the step had left its swap-outs in flight
    assert_states_equal(got["state"], saved(plain.state_dict())["state"])
    assert got["state"][0]["step"].item() == 3


def test_a_view_of_a_state_dict_tensor_keeps_the_step_waiting(sim):
    model, opt, ref, plain = pair()
    view = opt.state_dict()["state"][0]["exp_avg"][1:3]  # the state dict itself is dropped
    train(model, opt, 1, start=2)
    train(ref, plain, 1, start=2)
    assert view.tolist() == plain.state[next(iter(ref.parameters()))]["exp_avg"][1:3].tolist()


def test_without_the_wait_the_sanitizer_sees_the_read_through_the_aliases(sim, monkeypatch):
    """The aliases have storages of their own (numpy()/from_numpy); the race is still seen, on the memory."""
    model, opt, _, _ = pair()
    sd = opt.state_dict()
    monkeypatch.setattr(checkpoint, "after_step", lambda opt: None)
    train(model, opt, 1, start=2)
    with pytest.raises(StreamRaceError) as err:
        torch.save(sd, io.BytesIO())
    assert err.value.op == "torch.save" and err.value.earlier_op == "aten.copy_.default"
    sim.synchronize()


def test_a_step_with_no_state_dict_alive_does_not_wait(sim):
    model, opt, _, _ = pair()
    sd = opt.state_dict()
    del sd
    # Held across the step: fetching opt.state after it would wait (Note [reading states] in swapopt/optimizer.py).
    state = next(iter(opt.state.values()))
    forward_backward(model, 2)
    opt.step()
    with pytest.raises(StreamRaceError):  # the swap-outs are still in flight: reading needs the wait
        torch.save(state["exp_avg"], io.BytesIO())
    opt.wait_for_swap_out()
    torch.save(state["exp_avg"], io.BytesIO())


def test_state_dict_tensors_alias_the_host_states_without_a_copy(sim):
    model, opt, _, _ = pair()
    host_before = sim.host_memory_allocated()
    sd = opt.state_dict()
    assert sim.host_memory_allocated() == host_before
    for p, (i, st) in zip(model.parameters(), sd["state"].items()):
        for k, v in st.items():
            if k != "step":
                live = opt.state[p][k]
                assert v.data_ptr() == live.data_ptr() and v.is_pinned()
                # its own storage, of exactly its bytes: torch.save writes only those
                assert v.untyped_storage().nbytes() == live.nbytes
