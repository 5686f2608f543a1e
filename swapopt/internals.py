"""Every use swapopt makes of private torch internals, each with the reason it is needed.

torch.optim offers no public way to step an optimizer over a subset of its params, to replay its hooks
once for a step made of many inner steps, or to tell an LR scheduler or GradScaler about a step taken
through a wrapper. Keeping these uses in one module means a torch upgrade that renames one of them
breaks here, with the reason next to it, instead of somewhere in the pipeline.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

# Note [profiler ranges]: torch.profiler.record_function costs about 12 us of host time per range even
# when no profiler records (it dispatches an op to open a handle and one to close it). A step opens
# three ranges per chunk: at 64 chunks of a 291-tensor model that is 8 us per param, more than the rest of
# the step's own Python. torch has no public way to ask whether a profiler is recording;
# ``torch.autograd._profiler_enabled`` is the flag torch's profilers set (kineto and legacy), read in
# 0.2 us, so swapopt opens its ranges only while one records (or the simulator labels its timeline
# with them, swapopt.operate.step_range).
def profiler_recording() -> bool:
    """Whether a torch profiler is recording now (Note [profiler ranges])."""
    return torch.autograd._profiler_enabled()


# Note [raw step]: Optimizer.__init__ wraps the class's step in a profiler/hook wrapper (marked
# ``hooked``, the original kept as ``__wrapped__``). SwapOptimizer calls the inner step once per chunk
# and once per probe; through the wrapper every call would fire the global step hooks and the inner's
# own hooks once per chunk instead of once per step.
def unhooked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A step function without Optimizer's hook/profiler wrapper (Note [raw step])."""
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "hooked", False) else fn


def raw_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The class's step without Optimizer's hook/profiler wrapper (Note [raw step])."""
    return unhooked(type(optimizer).step)


# Note [hook replay]: since the inner step runs raw (Note [raw step]), the hooks a user registered on
# the inner optimizer (``register_step_pre_hook``/``register_step_post_hook``) are held in the private
# ordered dicts ``_optimizer_step_pre_hooks``/``_optimizer_step_post_hooks``; swapopt runs them once per
# wrapper step, with the inner optimizer as the hooked object, exactly as torch's wrapper would.
def run_step_pre_hooks(inner: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inner optimizer's own step pre-hooks, once per step (Note [hook replay])."""
    for hook in inner._optimizer_step_pre_hooks.values():
        result = hook(inner, args, kwargs)
        if result is not None:
            args, kwargs = result
    return args, kwargs


def run_step_post_hooks(inner: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """The inner optimizer's own step post-hooks, once per step (Note [hook replay])."""
    for hook in inner._optimizer_step_post_hooks.values():
        hook(inner, args, kwargs)


def mark_scheduler_step(inner: torch.optim.Optimizer) -> None:
    """An LR scheduler built on the inner optimizer patches its ``step`` (``_wrapped_by_lr_sched``) to set
    ``_opt_called``, and warns when scheduler.step() comes first. The raw inner step never goes through
    that patch, so the flag is set here, once per wrapper step."""
    if hasattr(getattr(inner, "step", None), "_wrapped_by_lr_sched"):
        inner._opt_called = True


# GradScaler reads ``_step_supports_amp_scaling`` from the optimizer it is given (the wrapper): fused
# optimizers unscale inside their kernel, so the scaler hands them ``grad_scale``/``found_inf`` as
# attributes of the optimizer instead of unscaling grads itself. The wrapper answers for the inner one
# and lends it those attributes for the duration of the step.
AMP_ATTRIBUTES = ("grad_scale", "found_inf")


def supports_amp_scaling(inner: torch.optim.Optimizer) -> bool:
    return bool(getattr(inner, "_step_supports_amp_scaling", False))


@contextmanager
def lend_amp_attributes(wrapper: Any, inner: torch.optim.Optimizer) -> Iterator[None]:
    """The GradScaler attributes set on ``wrapper`` are visible on ``inner`` while the step runs."""
    amp = {k: getattr(wrapper, k) for k in AMP_ATTRIBUTES if hasattr(wrapper, k)}
    for k, v in amp.items():
        setattr(inner, k, v)
    try:
        yield
    finally:
        for k in amp:
            delattr(inner, k)


# GradScaler.unscale_ (torch/amp/grad_scaler.py) unscales with the private kernel below, which multiplies
# each finite element by the inverse scale and flags non-finite ones, and computes that inverse in double
# precision. The master-weights step (Note [master weights] in swapopt.masters) unscales the fp32 grads of
# the masters itself, so it calls the same kernel with the same inverse: bitwise what the scaler would do.
def inverse_scale(grad_scale: torch.Tensor) -> torch.Tensor:
    """The inverse scale GradScaler.unscale_ multiplies grads by."""
    return grad_scale.double().reciprocal().float()


def amp_unscale_(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> None:
    """Unscale ``grads`` in place as GradScaler.unscale_ does (its found_inf is the scaler's business: the
    flags raised here go to a scratch tensor)."""
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        g = g.to_local() if hasattr(g, "to_local") else g
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), tensors in by_device.items():
        found = torch.zeros(1, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(dev))


# Note [grad_scaler kwarg]: torch_npu's GradScaler steps an optimizer that claims
# ``_step_supports_amp_scaling`` as ``optimizer.step(..., grad_scaler=self)`` and neither unscales nor
# checks for infs itself (torch_npu/npu/amp/grad_scaler.py:375-382). Upstream torch, given that kwarg,
# leaves the same work to the optimizer. The optimizer then does what upstream's scaler does for a fused
# optimizer (torch/amp/grad_scaler.py, GradScaler.step): check the grads for infs through the scaler's
# private per-optimizer state (``_per_optimizer_states``, ``_check_inf_per_device``, ``_get_scale_async``)
# and hand ``grad_scale``/``found_inf`` to the kernel; or, for a kernel that ignores them, unscale in
# Python and skip the step on an inf, as the scaler's own ``_maybe_opt_step`` would.
@contextmanager
def scaler_attributes(opt: Any, scaler: Any) -> Iterator[None]:
    """``opt.grad_scale``/``opt.found_inf`` as ``scaler`` would set them for a fused step, for the block
    (Note [grad_scaler kwarg])."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(opt)]
    if state["stage"] is OptState.READY:
        scaler._check_inf_per_device(opt)
    scale = scaler._get_scale_async()
    found = state["found_inf_per_device"].values()
    opt.found_inf = sum(t.to(scale.device, non_blocking=True) for t in found)
    # As upstream: the product with a grad_scale the caller set already, none when the grads are unscaled.
    if state["stage"] is OptState.UNSCALED:
        opt.grad_scale = getattr(opt, "grad_scale", None)
    else:
        opt.grad_scale = scale * getattr(opt, "grad_scale", 1)
    try:
        yield
    finally:
        del opt.grad_scale
        del opt.found_inf


def scaler_unscale_found_inf(opt: Any, scaler: Any) -> bool:
    """Unscale ``opt``'s grads through ``scaler`` (unless done already) and say whether any holds an inf or
    NaN, reading the flags on the host as the scaler's ``_maybe_opt_step`` does (Note [grad_scaler kwarg])."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(opt)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(opt)
    return bool(sum(v.item() for v in state["found_inf_per_device"].values()))


# torch_npu narrows the devices whose foreach kernels torch.optim defaults to by replacing this private
# function (torch_npu/utils/_optim.py in v2.6.0/v2.7.1): "npu" is listed only on Ascend 910B/910_9x with
# CANN >= 8.0. It is the one place that says whether foreach=None means foreach on this machine.
def foreach_devices() -> list[str]:
    """The device types torch.optim's foreach=None default takes foreach kernels on."""
    return list(sys.modules["torch.optim.optimizer"]._get_foreach_kernels_supported_devices())


@contextmanager
def stepping_subset(inner: torch.optim.Optimizer, groups: list[dict], state: Any) -> Iterator[None]:
    """The inner optimizer sees ``groups`` (copies of its param groups over a chunk's pieces) and
    ``state`` (the pieces' states: device views into the slot) for one raw step. torch.optim offers no
    way to step a subset of params; optimizers read ``self.param_groups`` and ``self.state`` in step, so
    both are swapped in and the shared objects put back whatever the step does."""
    own_groups, own_state = inner.param_groups, inner.state
    inner.param_groups, inner.state = groups, state
    try:
        yield
    finally:
        inner.param_groups, inner.state = own_groups, own_state


# The state-dict hooks torch.optim.Optimizer.state_dict/load_state_dict run live in private ordered
# dicts. swapopt.checkpoint builds the state dict itself (waiting for swap-outs, re-viewing arena
# states), so it runs the wrapper's registered hooks at the points torch would.
def state_dict_hooks(opt: torch.optim.Optimizer, kind: str) -> list[Callable[..., Any]]:
    """``kind``: state_dict_pre, state_dict_post, load_state_dict_pre or load_state_dict_post."""
    return list(getattr(opt, f"_optimizer_{kind}_hooks").values())


def dtensor_local(t: Any) -> torch.Tensor:
    """A DTensor's local shard without an autograd edge: ``to_local()`` on a param records a view in the
    autograd graph (and may wait on pending collectives), while host copies and state views need the
    plain local tensor, which DTensor keeps as ``_local_tensor``."""
    return t._local_tensor


def dtensor_over(local: torch.Tensor, ref: Any) -> Any:
    """A DTensor over ``local`` as it is, wherever it lives, with ``ref``'s mesh, placements, global shape and
    stride. DTensor.from_local would copy a host shard onto the mesh's device type; FSDP2's CPU offload
    builds its host-sharded params the same way (DTensor over a DTensorSpec)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(ref.device_mesh, tuple(ref.placements),
                       tensor_meta=TensorMeta(ref.shape, ref.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)


# torch._foreach_* are the documented-by-use multi-tensor kernels torch.optim itself relies on: one
# launch per device and dtype instead of one per tensor, which keeps the failure path's snapshot of the
# step's scalar states (step counts) and their restore to one copy each.
def foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dst, src)


# Note [op counting]: the main job's start-up estimate counts the aten ops of one step on the meta device
# (swapopt.engine.preflight), because on a CPU-backed device a small model's step costs its op count
# times the host cost of an op far more than its FLOPs. torch's only hook that sees every aten op is a
# dispatch mode, and TorchDispatchMode lives in the private torch.utils._python_dispatch.
@contextmanager
def counting_ops() -> Iterator[list[int]]:
    """``with counting_ops() as n:`` counts the aten ops dispatched in the block into ``n[0]``
    (Note [op counting])."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = [0]

    class _Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            count[0] += 1
            return func(*args, **(kwargs or {}))

    with _Counter():
        yield count


# Note [direct step] (swapopt.direct): torch.optim.Adam.step is _init_group (private: it gathers each param's
# grad and states into lists) followed by the functional torch.optim.adam.adam over those lists. A direct
# step keeps the lists a chunk's _init_group would gather and makes the same functional call itself; it
# checks that the optimizer's _init_group is Adam's own, so that a subclass overriding it steps as before.
def adam_functional(*args: Any, **kwargs: Any) -> None:
    """torch.optim.adam.adam, the functional Adam.step calls (Note [direct step])."""
    return sys.modules["torch.optim.adam"].adam(*args, **kwargs)


# Note [fused kernel call] (swapopt.direct): with ``fused=True`` the functional ends in torch.optim.adam._fused_adam,
# which groups its lists by the params' device and dtype (``Optimizer._group_tensors_by_device_and_dtype``, a C++
# pass that costs the host 2-3 us a tensor, as much as the kernel's own host work) and then, per group: adds 1 to
# the step counts (one ``torch._foreach_add_``), calls the private fused op (``torch._fused_adamw_`` with
# decoupled weight decay, else ``torch._fused_adam_``) over the group's lists, and, with a ``found_inf``,
# subtracts it from the step counts. Where every param is on one device and of one dtype there is one group, the
# lists as given, so those ops called directly are that call without the grouping pass. swapopt.direct does so
# only there, and only with no ``grad_scale``/``found_inf``, a float lr and float betas (the functional's
# conversions of those are left to it), with the functional's own check that every step count is a tensor.
# torch 2.6-2.13 keep that recipe and those ops' signatures.
def adam_fused_call(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *,
    decoupled_weight_decay: bool, amsgrad: bool, lr: float, beta1: float, beta2: float, weight_decay: float,
    eps: float, maximize: bool, undo: list | None = None,
) -> None:
    """What torch.optim.adam._fused_adam does for lists of one device and dtype, with no grad_scale or found_inf
    (Note [fused kernel call]). Its step count add is taken back where the kernel call raises, and logged in
    ``undo`` (Note [undone step counts])."""
    if not params:
        return
    # [counts, added], logged and marked before the add (Note [undone step counts])
    entry = [steps, True]
    if undo is not None:
        undo.append(entry)
    try:
        torch._foreach_add_(steps, 1)
        kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
        kernel(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=amsgrad, lr=lr, beta1=beta1,
            beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=maximize, grad_scale=None, found_inf=None,
        )  # fmt: skip
    except BaseException:
        if entry[1]:
            torch._foreach_sub_(steps, 1)
            entry[1] = False
        raise


# Note [undone step counts]: the failure path puts the step counts of a chunk whose update raised back to their
# values before it (Note [failure semantics] in swapopt.recovery). Most updates change them in code that is not
# swapopt's (the inner optimizer, torch's functional), so a copy of them is stacked before the update (Note
# [snapshot batches] in swapopt.pipeline): 0.7 us of an H100 host's time per count (torch.stack of 10,000 0-dim
# CUDA tensors: 7.1 ms, bench/results/cuda-h100-2026-11-27-host-probe.json), every step. The direct fused call
# (adam_fused_call) is swapopt's own: its only change to the counts is one ``torch._foreach_add_(steps, 1)``, which
# it takes back itself where the kernel call after it raises, and which it logs in the chunk's ``undo`` list
# otherwise, so that the failure path subtracts the 1 again (undo_step_adds). A chunk stepped by those calls alone
# takes no copy (DirectStep.run calls its ``copy_counts`` only before other calls). The add is marked as made before
# it is called: it is one C call that either adds to every count or raises before changing any (its arguments were
# checked when the lists were gathered), and an interrupt that arrives during it is raised once it has returned,
# before any Python statement after it could record it. The subtraction gives back the very value for counts below 2**24 (a float32 count's
# integers are exact up to there, where the unwrapped optimizer's own count stops advancing).
def undo_step_adds(undo: list) -> None:
    """Subtract the logged step count adds (Note [undone step counts]) that were made and not taken back."""
    for entry in undo:
        if entry[1]:
            torch._foreach_sub_(entry[0], 1)
            entry[1] = False


def adam_functional_keywords() -> frozenset[str]:
    """The keyword parameters of torch.optim.adam.adam in this torch (they changed across 2.6-2.13)."""
    return frozenset(inspect.signature(sys.modules["torch.optim.adam"].adam).parameters)


def adam_init_group(cls: type) -> Any:
    """The _init_group a class of the Adam family runs, without wrappers (Note [direct step]): importing
    torch._dynamo wraps every torch optimizer's _init_group in a dynamo-disable wrapper (keeping the function
    as ``__wrapped__``), which changes nothing that it does."""
    fn = getattr(cls, "_init_group", None)
    return None if fn is None else inspect.unwrap(fn)


ADAM_INIT_GROUP = inspect.unwrap(torch.optim.Adam._init_group)
