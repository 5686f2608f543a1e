"""The direct step: a chunk's update as one call of the inner optimizer's functional kernel (Note [direct step]).

swapopt.pipeline steps every chunk with the wrapped optimizer's own ``step``. For torch's Adam family that
costs, per call, the Python of ``Optimizer.step`` and its wrappers and, per tensor, the Python of
``_init_group`` (a dict lookup, several appends and checks per param): 5-15 us per tensor on a GPU host,
paid once per chunk and tensor in every swapped step. Once a chunk's states exist and its state dicts are
the ones its last step left (``pipeline.ChunkInputs.take_states``), everything ``_init_group`` would
gather is known: the lists are built once, kept on the chunk's inputs, and each step hands them, with this
step's grads and the groups' current hyperparameters, to the very functional ``Adam.step`` itself calls.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any, Callable

import torch

from swapopt import internals

# Note [direct step]
# ~~~~~~~~~~~~~~~~~~
# ``torch.optim.Adam.step`` (AdamW inherits it) is, per group: ``_init_group`` (collect params with a grad,
# their grads, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad, and ``step``; create the states
# on a param's first step; raise on a sparse grad, on ``differentiable`` with a step that requires grad, and
# on a tensor lr with foreach and not capturable), then ``torch.optim.adam.adam(...)`` with the group's
# hyperparameters and the optimizer's ``grad_scale``/``found_inf``. A direct step makes that same functional
# call with the same tensors in the same order, so it is bitwise the inner step by construction: the same
# kernels (fused, foreach or for-loop, chosen by the functional from the same flags) over the same lists.
# It is taken only where ``_init_group`` would have nothing else to do or say:
#   * the inner step is torch's own (``Adam.step`` and ``Adam._init_group``, not a subclass's override, not a
#     wrapped step such as fault injection), the step has no keyword arguments;
#   * every tensor it steps has its state dict, with the keys the group's flags ask for, so no state is created:
#     the whole params of a chunk whose dicts are kept (pipeline.ChunkInputs; lists built once), or tensors whose
#     dicts were made this step (pieces of cut params, Note [mixed chunks] in swapopt.pipeline, and the pieces of a
#     chunk whose dicts are not kept; lists built each step, StepRun.step_made), chunks with masters aside;
#   * no group is ``differentiable``, no foreach group has a tensor lr without capturable (torch raises
#     there: the inner step raises it), no param is complex and every grad is present.
# Anything else steps through the inner optimizer as before. Optimizers outside the Adam family have no
# direct step. A fused group copy of one device and dtype skips the functional's grouping pass too (Note [fused
# kernel call] in swapopt.internals).


_ADAM_STEP = internals.unhooked(torch.optim.Adam.step)
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_IS_COMPLEX = operator.attrgetter("is_complex")
_FLAGS = ("amsgrad", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


# The keywords run() passes: torch versions whose functional lacks one (before AdamW became an Adam with
# decoupled_weight_decay) take the inner step instead.
_CALL_KEYWORDS = frozenset({
    "amsgrad", "has_complex", "beta1", "beta2", "lr", "weight_decay", "eps", "maximize", "foreach", "capturable",
    "differentiable", "fused", "grad_scale", "found_inf", "decoupled_weight_decay",
})
_FUNCTIONAL_FITS = _CALL_KEYWORDS <= internals.adam_functional_keywords()


def supported(optimizer: torch.optim.Optimizer, step_fn: Callable[..., Any]) -> bool:
    """The inner step is torch's own Adam step, on a torch whose functional takes run()'s keywords
    (Note [direct step])."""
    return (_FUNCTIONAL_FITS and step_fn is _ADAM_STEP
            and internals.adam_init_group(type(optimizer)) is internals.ADAM_INIT_GROUP)


@dataclass(eq=False)
class _Group:
    params: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    flags: tuple  # the group flags the lists were gathered for
    # fused, every param on one device and of one dtype, every step count a tensor: the fused ops may be called
    # without the functional's grouping pass (Note [fused kernel call] in swapopt.internals)
    one_kind: bool = False


@dataclass(eq=False)
class DirectStep:
    """One chunk's lists, per group copy, as ``Adam._init_group`` would gather them (Note [direct step])."""

    groups: list[_Group]

    @classmethod
    def build(cls, members: list[list[torch.Tensor]], groups: list[dict], chunk_state: dict) -> DirectStep | None:
        """The lists of a chunk whose params are ``members`` (per group copy in ``groups``) with their state
        dicts in ``chunk_state``; None where a direct step cannot stand for the inner one."""
        out = []
        for ps, group in zip(members, groups):
            flags = tuple(map(group.get, _FLAGS))
            if group.get("differentiable"):
                return None
            g = _Group(list(ps), [], [], [], [], flags)
            for p in ps:
                st = chunk_state.get(p)
                if st is None or "step" not in st or "exp_avg" not in st or "exp_avg_sq" not in st:
                    return None
                g.exp_avgs.append(st["exp_avg"])
                g.exp_avg_sqs.append(st["exp_avg_sq"])
                if group["amsgrad"]:
                    if "max_exp_avg_sq" not in st:
                        return None
                    g.max_exp_avg_sqs.append(st["max_exp_avg_sq"])
                g.steps.append(st["step"])
            g.one_kind = bool(
                group.get("fused") and all(map(torch.is_tensor, g.steps))
                and len({(p.device, p.dtype) for p in ps}) == 1
            )
            out.append(g)
        return cls(out)

    def run(
        self, optimizer: torch.optim.Optimizer, groups: list[dict], undo: list | None = None,
        copy_counts: Callable[[], Any] | None = None,
    ) -> bool:  # fmt: skip
        """Step the chunk with the groups' current values; False (nothing done) where the inner step must run
        instead: a flag changed since the lists were gathered, a grad is missing, or torch would raise.
        ``copy_counts`` is called first unless the direct fused calls alone step the chunk, which log their step
        count adds in ``undo`` (Note [undone step counts] in swapopt.internals)."""
        # C-level passes over the tensors (Note [fused kernel call] in swapopt.internals: no Python per tensor)
        for g, group in zip(self.groups, groups):
            if tuple(map(group.get, _FLAGS)) != g.flags:
                return False
            if group["foreach"] and isinstance(group["lr"], torch.Tensor) and not group["capturable"]:
                return False
        dtypes = [set(map(_DTYPE, g.params)) for g in self.groups]
        if any(map(_IS_COMPLEX, chain.from_iterable(dtypes))):
            return False
        grads = [list(map(_GRAD, g.params)) for g in self.groups]
        if any(map(operator.is_, chain.from_iterable(grads), repeat(None))):
            return False
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
        fused = [
            g.one_kind and grad_scale is None and found_inf is None
            and not isinstance(group["lr"], torch.Tensor) and not any(map(torch.is_tensor, group["betas"]))
            and len(ds) == 1  # a param's ``.data`` may have been given another dtype since
            for g, ds, group in zip(self.groups, dtypes, groups)
        ]  # fmt: skip
        if copy_counts is not None and not all(fused):
            copy_counts()
        for g, gs, group, direct_fused in zip(self.groups, grads, groups, fused):
            beta1, beta2 = group["betas"]
            if direct_fused:
                internals.adam_fused_call(
                    g.params, gs, g.exp_avgs, g.exp_avg_sqs, g.max_exp_avg_sqs, g.steps,
                    decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"], lr=group["lr"],
                    beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=group["maximize"], undo=undo,
                )  # fmt: skip
                continue
            internals.adam_functional(
                g.params, gs, g.exp_avgs, g.exp_avg_sqs, g.max_exp_avg_sqs, g.steps,
                amsgrad=group["amsgrad"], has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=False,
                fused=group["fused"], grad_scale=grad_scale, found_inf=found_inf,
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )  # fmt: skip
        return True
