"""overlap_forward: the updates stream under the next forward, with bitwise the same results, every access
ordered (sanitizer on), and the modeled timeline showing the next forward start before the update ends."""

from __future__ import annotations

import pytest
import torch
from stepping import (
    Boom,
    adamw,
    assert_matches_reference,
    attached_pair,
    fail_on_call,
    mlp,
    same_grads,
    step_reference_as_failed,
)
from torch import nn

from device.sim import StreamRaceError
from swapopt import SwapAdamW, SwapConfig, SwapOptimizer

STEPS = 4
CHUNKS = 4


def _three_steps(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Three steps of the width-32 mlp on seeded inputs: zero_grad, forward, backward, step."""
    torch.manual_seed(1)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()


def _train(kind: str, wrap: str, steps: int = STEPS, scaler: bool = False) -> tuple[list[torch.Tensor], list]:
    """Losses and final params of a short loop: zero_grad(set_to_none) -> forward -> backward -> clip ->
    (GradScaler-like attributes) -> step -> scheduler; ``wrap``: "none" | "off" | "on"."""
    model = mlp()
    inner = adamw(kind, model.parameters())
    if wrap == "none":
        opt: torch.optim.Optimizer = inner
    else:
        opt = SwapOptimizer(inner, swap_optimizer_times=CHUNKS, overlap_forward=wrap == "on")
        opt.attach(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    torch.manual_seed(1)
    data = [(torch.randn(8, 32), torch.randn(8, 4)) for _ in range(steps)]
    scale = torch.full((), 4.0)  # device tensors, as GradScaler keeps them (a literal is host memory)
    losses = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.detach().clone())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if scaler:  # as GradScaler hands them to a fused optimizer, then changes the scale in place
            opt.grad_scale = scale
            opt.found_inf = torch.full((), 1.0 if i == 1 else 0.0)
        opt.step()
        if scaler:
            del opt.grad_scale, opt.found_inf
            scale.mul_(2.0)  # scaler.update(): in place on the compute stream, right after step()
        sched.step()
    if isinstance(opt, SwapOptimizer):
        opt.wait_for_update()
        opt.wait_for_swap_out()
    return [l.clone() for l in losses], [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "scaler"])
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_losses_and_params_bitwise_equal_on_and_off(sim, kind, scaler):
    if scaler and kind != "fused":
        pytest.skip("grad_scale / found_inf are handed to fused optimizers only")
    ref = _train(kind, "none", scaler=scaler)
    off = _train(kind, "off", scaler=scaler)
    on = _train(kind, "on", scaler=scaler)
    for run in (off, on):
        assert all(torch.equal(a, b) for a, b in zip(run[0], ref[0]))
        assert all(torch.equal(a, b) for a, b in zip(run[1], ref[1]))
    assert not torch.equal(ref[1][0], mlp()[0].weight)  # the loop did train


def test_transformer_layers_bitwise_equal_on_and_off(sim):
    def run(overlap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(
            *(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True) for _ in range(2))
        )
        opt = SwapAdamW(model.parameters(), lr=1e-2, foreach=True, swap_optimizer_times=3, overlap_forward=overlap)
        opt.attach(model)
        torch.manual_seed(1)
        out = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(2, 5, 16)).square().mean()
            out.append(loss.detach().clone())
            loss.backward()
            opt.step()
        opt.wait_for_update()
        return out + [p.detach().clone() for p in model.parameters()]

    on, off = run(True), run(False)
    assert len(on) == len(off) and all(torch.equal(a, b) for a, b in zip(on, off))


def _stepped(sim, overlap: bool, width: int = 256, depth: int = 4, chunks: int = CHUNKS):
    """A model and its optimizer right after step() of a second training iteration."""
    model = mlp(width=width, depth=depth)
    opt = SwapOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), swap_optimizer_times=chunks, overlap_forward=overlap
    )
    opt.attach(model)
    x = torch.randn(8, width)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    return model, opt, x


def test_reading_a_param_after_step_without_wait_for_update_is_a_race(sim):
    model, opt, _ = _stepped(sim, overlap=True)
    with pytest.raises(StreamRaceError) as err:
        model[0].weight.sum()  # e.g. an EMA or a param norm, outside any module's forward
    assert "swapopt.update" in str(err.value)
    sim.synchronize()


def test_reading_a_param_after_wait_for_update_is_clean(sim):
    reference, ref_opt, _ = _stepped(sim, overlap=False)  # step() returned with every update done
    expected = [p.detach().clone() for p in reference.parameters()]
    ref_opt.wait_for_swap_out()
    model, opt, x = _stepped(sim, overlap=True)
    opt.wait_for_update([model[0].weight])
    first = model[0].weight.detach().clone()  # read once only this param's update is waited for
    opt.wait_for_update()  # all the others
    # What the reads see is the updated params, bitwise those of a run without overlap.
    assert torch.equal(first, expected[0])
    assert all(torch.equal(p.detach(), e) for p, e in zip(model.parameters(), expected))
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()  # nothing pending any more: the hooks have nothing to wait for
    opt.step()
    opt.wait_for_update()
    opt.wait_for_swap_out()


def test_zero_grad_in_place_and_state_dict_are_ordered_after_the_update(sim):
    model, opt, x = _stepped(sim, overlap=True)
    opt.zero_grad(set_to_none=False)  # writes the grads the update reads: waits for it first
    sd = opt.state_dict()
    assert len(sd["state"]) == len(list(model.parameters()))
    model(x).sum().backward()
    opt.step()
    opt.offload()
    assert not opt.operate.pending


def test_missing_attach_is_a_clear_error_at_the_first_step(sim):
    model = mlp()
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=True)
    model(torch.randn(2, 32)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"opt\.attach\(model\)"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing was stepped
    opt.attach(model)
    opt.attach(model)  # idempotent
    opt.step()
    opt.wait_for_update()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_config_and_class_forms_pass_the_knob(sim):
    model = mlp()
    opt = SwapConfig(swap_optimizer=True, overlap_forward=True).wrap(torch.optim.AdamW(model.parameters()))
    assert isinstance(opt, SwapOptimizer) and opt.overlap_forward
    assert SwapAdamW(model.parameters(), overlap_forward=True).overlap_forward
    assert not SwapConfig().overlap_forward


def _span(ops, prefix: str) -> tuple[float, float]:
    mine = [op for op in ops if op.label and op.label.startswith(prefix)]
    assert mine, f"no op labelled {prefix!r}"
    return min(op.start_us for op in mine), max(op.end_us for op in mine)


@pytest.mark.parametrize("overlap", [True, False], ids=["on", "off"])
def test_timeline_next_forward_starts_under_the_last_update(sim, overlap):
    # wide enough that the step is bound by its copies, not by the host launching its kernels
    model, opt, x = _stepped(sim, overlap=overlap, width=1024)
    sim.synchronize()
    sim.reset_timeline()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.profiler.record_function("next.forward"):
        model(x)
    ops = sim.timeline
    last = opt.swap_stats().chunks - 1
    _, update_end = _span(ops, f"swapopt.update[{last}]")
    forward_start, forward_end = _span(ops, "next.forward")
    if overlap:
        assert forward_start < update_end, (forward_start, update_end)
    else:
        assert forward_start >= update_end
    sim.synchronize()


def test_peak_extra_memory_of_the_step_stays_within_slots_plus_one_chunks(sim):
    slots = 3
    model = mlp(width=128)
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters(), foreach=True), swap_optimizer_times=8, slots=slots, overlap_forward=True)
    opt.attach(model)
    x = torch.randn(8, 128)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        base = sim.memory_allocated()
        sim.reset_peak_memory_stats()
        opt.step()
        chunk = opt._layout.prepared.plan.max_chunk_bytes
        extra = sim.max_memory_allocated() - base
        assert 0 < extra <= (slots + 1) * chunk, f"{extra} > {slots + 1} x {chunk}"
    opt.wait_for_update()


def test_failing_step_drains_the_update_stream_and_keeps_completed_chunks(sim):
    ps, rs, opt, ref = attached_pair(overlap_forward=True)
    for step in range(4):
        same_grads(ps, rs)
        if step != 2:
            opt.step()
            ref.step()
            continue
        restore = fail_on_call(opt, 1)  # the update of chunk 1 of the failing step
        with pytest.raises(Boom):
            opt.step()
        restore()
        assert not opt.operate.pending  # the host waited for every update already issued
        step_reference_as_failed(opt, ref, rs, chunks_done=1)
    assert_matches_reference(opt, ps, ref, rs)


def test_resident_params_are_updated_on_the_update_stream_too(sim):
    def run(overlap: bool) -> list[torch.Tensor]:
        model = mlp()
        # 0.02 MiB keeps a few params' states resident: they are stepped before the chunks
        opt = SwapOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
            swap_optimizer_times=CHUNKS, resident_mb=0.02, overlap_forward=overlap,
        )  # fmt: skip
        opt.attach(model)
        _three_steps(model, opt)
        assert opt._layout.prepared.resident, "some params stay resident"
        if overlap:
            assert all(p in opt.operate.pending for p in opt._layout.prepared.resident)
        opt.wait_for_update()
        return [p.detach().clone() for p in model.parameters()]

    on, off = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_updates_stream_in_registration_order_not_group_order(sim):
    def run(overlap: bool):
        model = mlp()
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        opt = SwapOptimizer(torch.optim.AdamW(groups, lr=1e-2, foreach=True), swap_optimizer_times=CHUNKS, overlap_forward=overlap)
        opt.attach(model)
        _three_steps(model, opt)
        opt.wait_for_update()
        first = {opt._layout.prepared.params[pc.index] for pc in opt._layout.prepared.plan.chunks[0].pieces}
        return first, model, [p.detach().clone() for p in model.parameters()]

    first, model, on = run(True)
    assert model[0].weight in first and model[0].bias in first  # layer 0 complete in the first chunk
    _, _, off = run(False)
    assert all(torch.equal(a, b) for a, b in zip(on, off))
