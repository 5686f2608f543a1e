"""Forward pre-hooks that let the next forward run under the optimizer's streamed update.

With ``overlap_forward`` on, SwapOptimizerOperate issues every update on its own stream and leaves one
"updated" event per stepped param pending. The hooks registered here make the stream that is about to
use a module's params wait for those params' events only, just before the module's forward: layer 0
runs while the states of later layers are still streaming through the device.

Plain modules wait for the params they own directly (``recurse=False``), read when the hook fires, so
params replaced after ``attach`` are still covered, plus the params of every submodule whose own forward
has not been seen running in this mode (training flag, grad mode): a parent may read a child's params
without calling it (``nn.MultiheadAttention`` reads ``out_proj``'s, a fused inference path reads all of
its layer's), and until a child has run on its own nothing says its hook will fire before that read. An FSDP2 unit (``fully_shard``) reads its params
through an all-gather issued in FSDP's own pre-forward hook, on FSDP's copy-in stream, which waits for
the current stream only once per forward (at the root); so its hook is prepended (it runs before
FSDP's), covers every param the unit manages plus those of the units it explicitly prefetches, and
makes both the current stream and the copy-in stream wait. Attach after ``fully_shard``: a hook found
on a module that became an FSDP unit later raises, since it would run after the all-gather.

``order`` ranks the attached models' params in module registration order, which is forward order for
the usual stacks: the step streams them in that order (not in param-group order, which may put every
layer's biases after all the weights), so the first layers' updates land first.

``after_forward`` (the ``prefetch`` knob) is a forward hook on the attached root model itself: it runs
once the whole forward is issued, and starts the next step's first swap-ins under the backward.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn

from swapopt.operate import SwapOptimizerOperate


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return None
    return FSDPModule


def _fsdp_state(module: nn.Module) -> Any:
    return module._get_fsdp_state()  # type: ignore[operator]


def _fsdp_params(state: Any) -> list[torch.Tensor]:
    """The sharded params (what the optimizer steps) of every param group of one FSDP2 state."""
    return [fp.sharded_param for group in getattr(state, "_fsdp_param_groups", ()) for fp in group.fsdp_params]


class ForwardWaits:
    """The forward pre-hooks of one SwapOptimizer; ``attach`` is idempotent per module."""

    def __init__(self, operate: SwapOptimizerOperate) -> None:
        self.operate = operate
        self._hooked: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        # per (training, grad enabled): modules whose forward pre-hook has fired in that mode
        self._seen: dict[tuple[bool, bool], weakref.WeakSet[nn.Module]] = {}
        self.attached = False
        self._rank: dict[torch.Tensor, int] = {}  # param -> position in the attached models' registration order
        self._order_cache: tuple | None = None  # (params list, len(_rank), result) of the last order()
        self._roots: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()  # after_forward hooks

    def unattached(self, params: Iterable[torch.Tensor]) -> int:
        """How many of ``params`` belong to no attached model (as of its attach)."""
        return sum(1 for p in params if p not in self._rank)

    def attach(self, model: nn.Module, after_forward: Callable[[nn.Module, Any, Any], None] | None = None) -> None:
        """Hook every module of ``model``; ``after_forward``: also a forward hook on ``model`` itself
        (once per model)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach takes the nn.Module the optimizer's params belong to, got {type(model).__name__}")
        if after_forward is not None and model not in self._roots:
            self._roots[model] = model.register_forward_hook(after_forward)
        fsdp_cls = _fsdp_module_class()
        for p in model.parameters():
            self._rank.setdefault(p, len(self._rank))
        for module in model.modules():
            if module in self._hooked:
                continue
            fsdp = fsdp_cls is not None and isinstance(module, fsdp_cls)
            hook = self._fsdp_hook() if fsdp else self._plain_hook(fsdp_cls)
            self._hooked[module] = module.register_forward_pre_hook(hook, prepend=fsdp)
        self.attached = True

    def order(self, params: list[torch.Tensor], groups: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """``params`` (with their group indices) in the attached models' registration order; params of no
        attached model keep their relative order after them. The same ``params`` list (the optimizer's active
        params on a cache hit) gets the same result lists while no model is attached, so the plan's cache
        sees the same lists too."""
        if not self._rank:
            return params, groups
        last = len(self._rank)
        hit = self._order_cache
        if hit is not None and hit[0] is params and hit[1] == last:
            return hit[2]
        pairs = sorted(zip(params, groups), key=lambda pg: self._rank.get(pg[0], last))
        out = [p for p, _ in pairs], [g for _, g in pairs]
        self._order_cache = (params, last, out)
        return out

    def detach(self) -> None:
        """Remove every hook (the optimizer no longer orders forwards after its updates)."""
        for handle in [*self._hooked.values(), *self._roots.values()]:
            handle.remove()
        self._hooked = weakref.WeakKeyDictionary()
        self._roots = weakref.WeakKeyDictionary()
        self.attached = False

    def _plain_hook(self, fsdp_cls: type | None) -> Callable[[nn.Module, Any], None]:
        operate = self.operate
        seen_by_mode = self._seen

        def wait_for_own_params(module: nn.Module, args: Any) -> None:
            mode = (module.training, torch.is_grad_enabled())
            seen = seen_by_mode.get(mode)
            if seen is None:
                seen = seen_by_mode[mode] = weakref.WeakSet()
            seen.add(module)
            if not operate.pending:
                return
            if fsdp_cls is not None and isinstance(module, fsdp_cls):
                raise RuntimeError(
                    f"{type(module).__name__} became an FSDP unit (fully_shard) after opt.attach(model): its "
                    "all-gather would read params the optimizer is still updating; call opt.attach(model) "
                    "after fully_shard"
                )
            params = list(module.parameters(recurse=False))
            stack = list(module.children())
            while stack:  # submodules that may be read without running their own forward
                child = stack.pop()
                if child not in seen:
                    params += child.parameters(recurse=False)
                    stack += child.children()
            operate.wait_for_update(params)

        return wait_for_own_params

    def _fsdp_hook(self) -> Callable[[nn.Module, Any], None]:
        operate = self.operate

        def wait_for_unit_params(module: nn.Module, args: Any) -> None:
            if not operate.pending:
                return
            state = _fsdp_state(module)
            params: list[torch.Tensor] = _fsdp_params(state)
            for target in getattr(state, "_states_to_forward_prefetch", ()):
                params += _fsdp_params(target)
            params = [p for p in params if p in operate.pending]
            if not params:
                return
            events = [operate.pending[p] for p in params]
            copy_in = getattr(getattr(state, "_comm_ctx", None), "all_gather_copy_in_stream", None)
            current = operate.mod.current_stream()
            # FSDP's copy-in stream is a stream of this device only on a real accelerator; elsewhere
            # (the simulator, CPU) FSDP's collectives run on the current stream.
            if copy_in is not None and isinstance(copy_in, type(current)) and copy_in != current:
                for event in _unique(events):
                    copy_in.wait_event(event)
            operate.wait_for_update(params, stream=current)

        return wait_for_unit_params


def _unique(events: Iterable[Any]) -> list[Any]:
    return list({id(e): e for e in events}.values())
