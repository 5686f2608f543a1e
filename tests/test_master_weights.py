"""master_weights=True: bitwise the mixed-precision recipe of Note [master weights] (swapopt.masters), run
resident by hand, with the masters and states off the device between steps (simulator, sanitizer on)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import device
import simdevice as simulator
from swapopt import SwapConfig, SwapOptimizer, npu, swap_class
from swapopt.masters import MASTER_KEY
from stepping import Boom, assert_same, fail_on_call
O = torch.optim
LOW = (torch.bfloat16, torch.float16)


class Recipe:
    """The recipe, resident: fp32 masters (``p.float()``, p's layout) stepped by the plain optimizer with
    ``master.grad = p.grad.float()``, then ``p.copy_(master)``. fp32 params are their own masters."""

    def __init__(self, build, params: list[torch.Tensor]) -> None:
        self.params = params
        self.masters = [p.detach().float() if p.dtype in LOW else p for p in params]
        self.opt = build(self.masters)

    def step(self, scaler: torch.amp.GradScaler | None = None) -> None:
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        if scaler is None:
            self.opt.step()
        else:
            scaler.step(self.opt)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)

    def state_dict(self) -> dict:
        """The plain optimizer's state dict with each master under MASTER_KEY: what the wrapper saves."""
        sd = self.opt.state_dict()
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if m is not p:
                sd["state"].setdefault(i, {})[MASTER_KEY] = m
        return sd


def _same_grads(ps, rs, gen) -> None:
    for p, r in zip(ps, rs):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad, r.grad = torch.empty_like(p).copy_(g), torch.empty_like(r).copy_(g)


def _check(ps, opt, rs, recipe, where: str) -> None:
    opt.wait_for_swap_out()
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert_same(p, r, f"{where}: param {i}")
    assert_same(opt.state_dict(), recipe.state_dict(), f"{where}: state_dict")


# ----- a model: clipping, GradScaler, overlap and prefetch ------------------------------------------------
def _mlp(dtype: torch.dtype, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 6)).to(dtype)


MAKERS = {
    "adamw_fused": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_forloop": lambda ps: O.Adam(ps, lr=1e-2, foreach=False),
    "sgd_momentum": lambda ps: O.SGD(ps, lr=1e-2, momentum=0.9),
}


def _train(make, dtype, steps, *, scaler_for=None, clip=None, inf_at=None, times=4, recipe_kernel_scales=True,
           **knobs):
    """Train a swapped model and its twin under the recipe on the same batches; returns both models and
    optimizers. ``scaler_for``: a GradScaler per run; ``inf_at``: a step whose first grad gets an inf."""
    model, twin = _mlp(dtype), _mlp(dtype)
    opt = SwapOptimizer(make(model.parameters()), swap_optimizer_times=times, master_weights=True, **knobs)
    if knobs.get("overlap_forward") or knobs.get("prefetch"):
        opt.attach(model)
    recipe = Recipe(make, list(twin.parameters()))
    if not recipe_kernel_scales:  # the kernel ignores grad_scale here: the recipe's scaler unscales in Python
        recipe.opt._step_supports_amp_scaling = False
    scalers = (scaler_for(), scaler_for()) if scaler_for is not None else (None, None)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 24, generator=gen).to(dtype)
        for m, scaler in zip((model, twin), scalers):
            m.zero_grad(set_to_none=True)
            loss = m(x).float().pow(2).mean()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if step == inf_at:
                next(m.parameters()).grad.view(-1)[0] = float("inf")
            if clip is not None:
                nn.utils.clip_grad_norm_(m.parameters(), clip)
        if scalers[0] is not None:
            scalers[0].step(opt)
            recipe.step(scalers[1])
            for s in scalers:
                s.update()
        else:
            opt.step()
            recipe.step()
        opt.wait_for_update()
    return model, opt, twin, recipe


def _assert_models_equal(model, opt, twin, recipe):
    _check(list(model.parameters()), opt, list(twin.parameters()), recipe, "model")


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_bf16_with_clipping_matches_the_recipe(name):
    with simulator.activate():
        _assert_models_equal(*_train(MAKERS[name], torch.bfloat16, 5, clip=0.05))


@pytest.mark.parametrize("name", ["adamw_fused", "adamw_foreach", "adam_forloop"])
def test_fp16_with_grad_scaler_matches_the_recipe_and_skips_inf_steps(name):
    with simulator.activate():
        # the simulated device's own type: GradScaler("cuda") asks torch.cuda.is_available(), False here
        kind = device.torch_device().type
        scaler = lambda: torch.amp.GradScaler(kind, init_scale=2.0**10, growth_interval=2)  # noqa: E731
        assert scaler().is_enabled()
        # on the npu flavour fused AdamW's kernel ignores grad_scale (swapopt.npu): unscaled in Python there
        on_npu = device.get_device() == "npu" and npu.ignores_amp_scaling(MAKERS[name]([nn.Parameter(torch.ones(1))]))
        kernel_scales = name == "adamw_fused" and not on_npu
        model, opt, twin, recipe = _train(MAKERS[name], torch.float16, 6, scaler_for=scaler, inf_at=2,
                                          recipe_kernel_scales=kernel_scales)  # fmt: skip
        assert opt._step_supports_amp_scaling  # GradScaler would refuse to unscale fp16 grads itself
        # the inf step is skipped: by the step itself, or inside the fused kernel (which still swaps)
        assert opt.swap_stats().steps == (6 if kernel_scales else 5)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        _assert_models_equal(model, opt, twin, recipe)


@pytest.mark.parametrize("knobs", [{"overlap_forward": True}, {"prefetch": True, "times": 12}, {"chunk_mb": 1.5 / 1024}],
                         ids=["overlap_forward", "prefetch", "split"])  # fmt: skip
def test_overlap_prefetch_and_split_params_match_the_recipe(knobs):
    with simulator.activate():
        model, opt, twin, recipe = _train(MAKERS["adamw_foreach"], torch.bfloat16, 5, **knobs)
        if "chunk_mb" in knobs:
            assert any(pc.start > 0 for c in opt._layout.prepared.plan.chunks for pc in c.pieces)  # really split
        _assert_models_equal(model, opt, twin, recipe)


def test_class_form_and_config_take_the_knob():
    with simulator.activate():
        model = _mlp(torch.bfloat16)
        opt = swap_class(O.AdamW)(model.parameters(), lr=1e-3, master_weights=True)
        assert opt.master_weights and opt.settings.master_weights
        cfg = SwapConfig(swap_optimizer=True, master_weights=True)
        assert cfg.wrap(O.AdamW(_mlp(torch.bfloat16).parameters())).master_weights
        with pytest.raises(ValueError, match="master_weights=True with resident_mb"):
            SwapOptimizer(O.AdamW(_mlp(torch.bfloat16).parameters()), master_weights=True, resident_mb=1)


# ----- memory ------------------------------------------------------------------------------------------
def test_nothing_fp32_on_the_device_between_steps_and_peak_within_the_cap():
    with simulator.activate() as dev:
        params = [nn.Parameter(torch.randn(64, 64).to(torch.bfloat16)) for _ in range(8)]
        opt = SwapOptimizer(O.AdamW(params, lr=1e-3, foreach=True), swap_optimizer_times=16, master_weights=True)
        pbytes = sum(p.numel() * p.element_size() for p in params)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape).to(torch.bfloat16)
            base = dev.memory_allocated()
            dev.reset_peak_memory_stats()
            opt.step()
            chunk = opt._layout.prepared.plan.max_chunk_bytes
            extra = dev.max_memory_allocated() - base
            assert extra <= (opt.operate.slots + 1) * chunk, f"step {step}: {extra} > 4 x {chunk}"
            opt.release_staging()
            opt.wait_for_swap_out()
            # params and grads (bf16) and the step counts: no master, no moment, no staging
            steps = sum(v.untyped_storage().nbytes() for st in opt.state.values() for k, v in st.items()
                        if k == "step" and not device.is_host_tensor(v))  # fmt: skip
            assert dev.memory_allocated() == 2 * pbytes + steps
        # 12 bytes a param in host memory: the master and two fp32 moments
        numel = sum(p.numel() for p in params)
        assert opt.swap_stats().pinned_requested_bytes == 12 * numel
        stats = opt.swap_stats()
        assert stats.h2d_bytes == stats.d2h_bytes == 12 * numel


# ----- checkpoints and failures --------------------------------------------------------------------------
def test_load_without_masters_makes_them_from_the_params_and_says_so_once():
    with simulator.activate():
        model, twin = _mlp(torch.bfloat16), _mlp(torch.bfloat16)
        plain = SwapOptimizer(O.AdamW(model.parameters(), lr=1e-2))  # states in bf16, no masters
        for p in model.parameters():
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
        plain.step()
        sd = plain.state_dict()
        opt = SwapOptimizer(O.AdamW(twin.parameters(), lr=1e-2), master_weights=True)
        twin.load_state_dict(model.state_dict())
        with pytest.warns(UserWarning, match="no fp32 master for 6 low-precision param"):
            opt.load_state_dict(sd)
        # the loaded bf16 moments are upcast into fp32 host states
        assert all(v.dtype == torch.float32 for st in opt.state.values() for k, v in st.items() if k != "step")
        for p in twin.parameters():
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        masters = opt.state_dict()["state"]
        for i, p in enumerate(twin.parameters()):
            assert masters[i][MASTER_KEY].dtype == torch.float32


def test_loading_masters_into_an_optimizer_without_them_is_refused():
    with simulator.activate():
        model, opt, _, _ = _train(MAKERS["adamw_foreach"], torch.bfloat16, 2)
        other = SwapOptimizer(O.AdamW(_mlp(torch.bfloat16).parameters(), lr=1e-2, foreach=True))
        with pytest.raises(ValueError, match="master_weights is off"):
            other.load_state_dict(opt.state_dict())


def test_deepcopy_keeps_the_masters():
    with simulator.activate():
        model, opt, twin, recipe = _train(MAKERS["adamw_foreach"], torch.bfloat16, 2)
        both = copy.deepcopy((model, opt))
        model2, opt2 = both
        assert_same(opt2.state_dict(), opt.state_dict(), "copy")


def test_a_failing_step_leaves_each_param_and_its_master_stepped_or_untouched():
    with simulator.activate():
        model, opt, twin, recipe = _train(MAKERS["adamw_foreach"], torch.bfloat16, 2)
        before = [p.detach().clone() for p in model.parameters()]
        saved = copy.deepcopy(opt.state_dict())
        gen = torch.Generator().manual_seed(9)
        _same_grads(list(model.parameters()), list(twin.parameters()), gen)
        restore = fail_on_call(opt, 1)  # the second chunk's update raises
        with pytest.raises(Boom):
            opt.step()
        restore()
        recipe.step()
        opt.wait_for_swap_out()
        after = opt.state_dict()["state"]
        want = recipe.state_dict()["state"]
        stepped = untouched = 0
        for i, (p, old, r) in enumerate(zip(model.parameters(), before, twin.parameters())):
            if torch.equal(p.detach(), r.detach()):
                stepped += 1
                assert_same(after[i], want[i], f"param {i} stepped")
            else:
                untouched += 1
                assert torch.equal(p.detach(), old), f"param {i} neither stepped nor untouched"
                assert_same(after[i], saved["state"][i], f"param {i} untouched")
        assert stepped and untouched
        # the optimizer stays usable
        opt.step()


def test_without_an_accelerator_the_masters_step_in_place_as_the_recipe():
    # no simulator: plain CPU, where the optimizer steps in place; the masters still follow the recipe
    assert device.get_device() == "cpu"
    with pytest.warns(UserWarning, match="no accelerator"):
        model, opt, twin, recipe = _train(MAKERS["adamw_foreach"], torch.bfloat16, 3, clip=0.05)
    assert opt.swap_stats().steps == 0  # nothing swapped
    _assert_models_equal(model, opt, twin, recipe)


def test_states_and_masters_stay_where_the_first_step_put_them():
    # the first step creates the states in the room laid out for them beside the masters: no later step
    # moves anything on the host (a re-layout would copy every master and state once more)
    with simulator.activate():
        params = [nn.Parameter(torch.randn(64, 48).to(torch.bfloat16)) for _ in range(6)]
        opt = SwapOptimizer(O.AdamW(params, lr=1e-3, foreach=True), swap_optimizer_times=3, master_weights=True)

        def addresses():
            opt.wait_for_swap_out()
            sd = opt.state_dict()["state"]
            return [(k, v.data_ptr()) for i in sorted(sd) for k, v in sd[i].items() if k != "step"]

        seen = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape).to(torch.bfloat16)
            opt.step()
            seen.append([ptr for _, ptr in addresses()])
        assert len(seen[0]) == 3 * len(params)  # two moments and the master of each
        assert seen[0] == seen[1] == seen[2]
        assert len(opt._layout.arenas) <= 3  # one arena per chunk
