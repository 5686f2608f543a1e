"""Which optimizers SwapOptimizer may step chunk by chunk.

SwapOptimizer runs the wrapped optimizer once per chunk, on that chunk's params only, with a per-chunk
copy of each param group. That is exact only for per-param optimizers: the update of a param reads that
param, its grad, its own state and the group's hyperparameters, nothing else, and the step writes no
group-level value. torch's own optimizers (torch.optim) are per-param; an optimizer that takes a global
norm over ``group["params"]`` or counts steps in ``group["step"]`` (LAMB-style) is not, and would be
silently wrong. Third-party optimizers are therefore refused unless the user vouches for them with
``SwapOptimizer(..., per_param=True)`` or ``register_per_param(cls)``.

Element-wise optimizers (every non-scalar state shaped like the param, each element's update reading
only that element) may also have one param split across chunks.
"""

from __future__ import annotations

import torch

# torch.optim optimizers whose params may be cut into flat pieces (see the module docstring).
TORCH_ELEMENTWISE = (
    "Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adadelta",
)

_registered: dict[type, bool] = {}  # class -> element-wise

# Third-party optimizers known to be per-param, by (module of the class whose step runs, its name), matched
# without importing them. torchao's low-bit Adams step each param from its grad, its own state and the group's
# hyperparameters (torchao/optim/adam.py, _AdamBase.step); not element-wise: their states are quantized per
# block of elements (Note [subclass states] in swapopt.subclass_state), so a param is never split.
_KNOWN_STEPS = {("torchao.optim.adam", "_AdamBase")}
_KNOWN_CLASSES = {
    ("torchao.optim.adam", name) for name in ("Adam8bit", "Adam4bit", "AdamFp8", "AdamW8bit", "AdamW4bit", "AdamWFp8")
}

# Third-party optimizers that cannot be swapped, whatever the user vouches, and why.
_REFUSED = {
    ("torchao.optim.cpu_offload", "CPUOffloadOptimizer"): (
        "torchao's CPUOffloadOptimizer cannot be swapped: its states are not per-param states of its own (it keeps "
        "one inner optimizer per param over pinned host copies of the params, steps them on the CPU and copies the "
        "params back itself), so there is nothing for SwapOptimizer to stream; use it alone, or swap a low-bit "
        "optimizer (torchao.optim.AdamW8bit, AdamW4bit, AdamWFp8) with SwapOptimizer"
    ),
}


def register_per_param(cls: type, *, elementwise: bool = False) -> type:
    """Declare that ``cls`` (a torch.optim.Optimizer subclass) updates each param from that param, its
    grad, its own state and its group's hyperparameters only, and writes no group-level value during
    step. ``elementwise=True`` also declares every non-scalar state shaped like its param and each
    element's update independent of the others, so params may be split across chunks. Returns ``cls``
    (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_per_param takes a torch.optim.Optimizer subclass, got {cls!r}")
    _registered[cls] = bool(elementwise)
    return cls


def _step_owner(cls: type) -> type | None:
    """The class in cls's MRO that defines the step actually run."""
    return next((c for c in cls.__mro__ if "step" in vars(c)), None)


def _torch_builtin(cls: type) -> bool:
    owner = _step_owner(cls)
    return (
        owner is not None
        and owner is not torch.optim.Optimizer
        and (owner.__module__ == "torch.optim" or owner.__module__.startswith("torch.optim."))
        and getattr(torch.optim, owner.__name__, None) is owner
    )


def _known(cls: type) -> bool:
    # Once an instance exists the owner is the class itself (Optimizer.__init__ sets its hook wrapper of the
    # step on the instance's class); before, the listed base whose step it inherits.
    owner = _step_owner(cls)
    if owner is None:
        return False
    return (owner.__module__, owner.__name__) in _KNOWN_CLASSES or (
        (owner.__module__, owner.__name__) in _KNOWN_STEPS and (cls.__module__, cls.__name__) in _KNOWN_CLASSES
    )


def is_per_param(cls: type) -> bool:
    """Known to be per-param: registered, its step is one of torch.optim's own optimizers' steps, or one of the
    third-party steps listed above."""
    return cls in _registered or _torch_builtin(cls) or _known(cls)


def refusal(cls: type) -> str | None:
    """Why ``cls`` cannot be swapped even if vouched for; None when nothing known stands in the way."""
    return next((_REFUSED[key] for key in ((c.__module__, c.__name__) for c in cls.__mro__) if key in _REFUSED), None)


def is_elementwise(cls: type) -> bool:
    """Known to allow splitting one param across chunks."""
    if cls in _registered:
        return _registered[cls]
    owner = _step_owner(cls)
    return _torch_builtin(cls) and owner is not None and owner.__name__ in TORCH_ELEMENTWISE
