"""The flat chunk update: a chunk of torch's Adam family stepped as one flat tensor (Note [flat chunk update]).

The direct step (swapopt.direct) hands torch's functional one list entry per param: the functional and
its kernel still do per-tensor work on the host (grouping by device and dtype, building the kernel's
tensor lists), once per param and step. Where a chunk's states lie key by key in its slot (every
exp_avg of the chunk, then every exp_avg_sq, ...: swapopt.layout lays out regions and arenas so), each
state key of the chunk is one flat tensor. Gathering the chunk's grads and params into a flat scratch
buffer (one multi-tensor copy each) lets one functional call over one-element lists step the whole
chunk, and one multi-tensor copy writes the params back.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import device
from swapopt import hoststate, internals

# Note [flat chunk update]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Adam and AdamW are element-wise: element j of a param's update reads element j of its grad and of each
# state, the group's hyperparameters and the param's step count, nothing else. So the update of a chunk
# whose params share one group's hyperparameters and one step count is, element for element, the update of
# the concatenation of its params, grads and states, in any order, as long as each state element sits
# where its param and grad elements sit. The flat update makes that concatenation:
#   * states: swapopt.layout lays out a chunk's regions key by key (each key's pieces back to back, in
#     piece order), and the arenas in the same order, so the chunk's ``exp_avg`` views are one stretch of
#     the slot (likewise ``exp_avg_sq``, ``max_exp_avg_sq``), read as one flat tensor per key, and the
#     chunk still moves in one copy each way where its arena run is contiguous;
#   * params and grads: per param a view of a flat scratch buffer with the geometry (shape, strides,
#     offset from the start of the key's stretch) of that param's state views, so memory positions pair as
#     they do in the states; one ``_foreach_copy_`` gathers the grads, one the params;
#   * one call of the functional ``Adam.step`` calls (``torch.optim.adam.adam``, the same foreach/fused/
#     capturable flags, grad_scale and found_inf) over one-element lists, with the first param's step
#     tensor; the others then copy its value (what each would hold: the same count, stepped the same way,
#     found_inf's undo included); one ``_foreach_copy_`` writes the params back.
# Bitwise to the per-tensor step because every kernel involved computes each element from that element
# alone and the scalars (step, lr, betas, ...) are the same for every param. It is taken only where that
# holds and nothing else would differ, on top of the direct step's own conditions (Note [direct step]):
# one set of hyperparameters across the chunk's group copies (checked every step: a scheduler may change
# one group only), every param a plain (not DTensor) real tensor of one dtype and device, its grad of that
# dtype, every state of that dtype and the param's shape, each key's views back to back with the same
# geometry across keys, and one step count across the chunk (read once, when the lists are gathered from
# the kept state dicts; from then on every update of the chunk steps all of them alike, and a new state
# dict or a replaced step tensor gathers afresh). Anything else takes the direct or the inner step. The
# scratch buffer (params and grads of the largest flat chunk) is given memory on the update's stream for
# the step and freed at its end, as the slots are (Note [persistent slots] in swapopt.operate), so the
# views made of it are made once. A failure inside the flat update is a failure inside the inner update
# (Note [failure semantics]): the params are written back last, all at once.

# Off by default: measured on the simulator's host model (a launch and each tensor an op takes cost host time,
# calibrated on the H100), the flat update costs a chunk four more launches (two gathers, the step counts' copy,
# the write-back) and as many tensors in its multi-tensor copies (three lists of the chunk's params, two of its
# steps) as the direct step hands the fused kernel (five lists) and the step add (one): tiny10k at 64 chunks took
# 1.56 x the bound with it, 513 launches, against 1.19 x and 257 with the direct step
# (bench/results/sim-h100-2026-11-26-layouts-host.md). On the H100 itself (2026-11-27, the layout bench at 100 M
# params, bench/results/cuda-h100-2026-11-27-host.md) it was slower than the direct step in 7 of 8 rows (moe at 64
# chunks: 49.4 ms against 26.4; fsdp256 at 16: 7.9 against 5.3), and bitwise there (tests/cuda/test_cuda_flat.py).
# So the direct step stays the default; ENABLED turns the flat update on (the tests do).
ENABLED = False

# Where each element lands in the flat tensor matters to CPU kernels, and so to the simulator, which runs them:
# they compute a tensor in vector blocks with a scalar tail, and cut a large one between threads, and the scalar
# code rounds differently from the vector code (contracted multiply-adds). A param's tail, in the middle of the
# flat tensor, would take the vector code. CUDA's element-wise and fused kernels compute every element with the
# same code wherever it sits. So on any device but CUDA (the simulator and NPUs included, whose kernels are not
# known to be position-free) the flat update is taken only where no element changes code: every param a whole
# number of CPU_BLOCK elements (two of the widest vectors of the narrowest dtype, ATen's unrolled vector loop),
# the chunk small enough to run on one thread (CPU_SERIAL, ATen's grain size).
CPU_BLOCK = 64
CPU_SERIAL = 32768


def position_free(dev: torch.device, numels: list[int]) -> bool:
    """Stepping these params (of ``numels`` elements each) flat on ``dev`` computes every element as stepping
    them one by one does (see CPU_BLOCK)."""
    if dev.type == "cuda" and not device.is_simulated():
        return True
    return all(n % CPU_BLOCK == 0 for n in numels) and sum(numels) <= CPU_SERIAL


_GRAD = operator.attrgetter("grad")
_STRIDE = torch.Tensor.stride
_FLAGS = ("amsgrad", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
_ALIGN = 64  # bytes: the grads' half of the scratch starts on a cache line


def _same_hyper(a: dict, b: dict) -> bool:
    """Two group copies with the same hyperparameters (params aside): the very same tensors, equal others."""
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        if key == "params":
            continue
        other = b[key]
        if value is other:
            continue
        if torch.is_tensor(value) or torch.is_tensor(other) or value != other:
            return False
    return True


def _dense_from(t: torch.Tensor) -> int | None:
    """Byte address where the dense tensor ``t`` starts (its lowest element); None where it is not dense
    or has a negative stride."""
    if not hoststate.is_dense(t):
        return None
    return t.data_ptr()


@dataclass(eq=False)
class FlatStep:
    """One chunk's flat tensors and the lists its flat update copies through (Note [flat chunk update])."""

    params: list[torch.Tensor]
    steps: list[torch.Tensor]
    states: list[torch.Tensor]  # flat exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad)
    geometry: list[tuple[tuple[int, ...], tuple[int, ...], int]]  # per param: shape, strides, element offset
    numel: int
    dtype: torch.dtype
    flags: tuple
    strides: list[tuple[int, ...]]  # the params' strides: a grad laid out otherwise takes the per-tensor path
    views: dict[int, tuple] = field(default_factory=dict)  # id(scratch) -> (scratch, flat p, flat g, p views, g views)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch this chunk needs: its params' elements, then (aligned) its grads'."""
        return self._grad_offset() + self.numel * self.dtype.itemsize

    def _grad_offset(self) -> int:
        return -(-self.numel * self.dtype.itemsize // _ALIGN) * _ALIGN

    @classmethod
    def build(cls, targets: list[torch.Tensor], groups: list[dict], chunk_state: dict) -> FlatStep | None:
        """The flat tensors of a chunk whose params are ``targets`` (whole params, piece order) stepped with
        the group copies ``groups``, its state dicts in ``chunk_state``; None where the flat update cannot
        stand for the per-tensor one (Note [flat chunk update])."""
        if not targets or not groups:
            return None
        g0 = groups[0]
        if g0.get("differentiable") or not all(_same_hyper(g0, g) for g in groups[1:]):
            return None
        first = targets[0]
        dtype, dev = first.dtype, first.device
        if dtype.is_complex or not dtype.is_floating_point:
            return None
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g0["amsgrad"] else ())
        for t in targets:
            if hoststate.is_dtensor(t) or t.dtype != dtype or t.device != dev:
                return None
        if not position_free(dev, [t.numel() for t in targets]):
            return None
        dicts = [chunk_state.get(t) for t in targets]
        if any(d is None or "step" not in d for d in dicts):
            return None
        size = dtype.itemsize
        flats: list[torch.Tensor] = []
        geometry: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        for n, key in enumerate(keys):
            views = [d.get(key) for d in dicts]
            start = None
            pos = None
            for i, (t, v) in enumerate(zip(targets, views)):
                if not isinstance(v, torch.Tensor) or hoststate.is_dtensor(v) or v.dtype != dtype or v.device != dev:
                    return None
                if v.shape != t.shape or v.stride() != t.stride():  # laid out as the param (fused pairs by address)
                    return None
                at = _dense_from(v)
                if at is None:
                    return None
                if start is None:
                    start = pos = at
                if at != pos:  # not right after the last: the key's views are no one stretch
                    return None
                pos = at + v.numel() * size
                offset = (at - start) // size
                if n == 0:
                    geometry.append((tuple(v.shape), tuple(v.stride()), offset))
                elif geometry[i] != (tuple(v.shape), tuple(v.stride()), offset):
                    return None
            total = (pos - start) // size
            flats.append(views[0].as_strided((total,), (1,), views[0].storage_offset()))
        steps = [d["step"] for d in dicts]
        s0 = steps[0]
        if not all(isinstance(s, torch.Tensor) and s.dtype == s0.dtype and s.device == s0.device
                   and s.shape == s0.shape for s in steps):  # fmt: skip
            return None
        if len(steps) > 1:
            stacked = torch.stack(steps)
            if not torch.equal(stacked, s0.expand_as(stacked)):  # one read per gathering (Note [flat chunk update])
                return None
        flags = tuple(g0.get(k) for k in _FLAGS)
        strides = [t.stride() for t in targets]
        return cls(list(targets), steps, flats, geometry, flats[0].numel(), dtype, flags, strides)

    def _views(self, scratch: torch.Tensor) -> tuple:
        """Flat param and grad tensors and the per-param views of ``scratch``, made once per scratch tensor."""
        made = self.views.get(id(scratch))
        if made is not None and made[0] is scratch:
            return made
        size = self.dtype.itemsize
        p = scratch[: self.numel * size].view(self.dtype)
        off = self._grad_offset()
        g = scratch[off : off + self.numel * size].view(self.dtype)
        pv = [p.as_strided(shape, stride, offset) for shape, stride, offset in self.geometry]
        base = g.storage_offset()  # as_strided's offset counts from the storage, not from the view
        gv = [g.as_strided(shape, stride, base + offset) for shape, stride, offset in self.geometry]
        self.views.clear()  # a new scratch tensor: the old one's views are of no more use
        made = self.views[id(scratch)] = (scratch, p, g, pv, gv)
        return made

    def run(self, optimizer: torch.optim.Optimizer, groups: list[dict],
            scratch: Callable[[int], torch.Tensor]) -> bool:  # fmt: skip
        """Step the chunk flat with the groups' current values, ``scratch(nbytes)`` giving the step's scratch
        buffer; False (nothing done) where the direct or inner step must run instead."""
        g0 = groups[0]
        if tuple(g0.get(k) for k in _FLAGS) != self.flags:
            return False
        if len(groups) > 1 and not all(_same_hyper(g0, g) for g in groups[1:]):
            return False
        if g0["foreach"] and torch.is_tensor(g0["lr"]) and not g0["capturable"]:
            return False  # torch raises there: the inner step raises it
        grads = list(map(_GRAD, self.params))
        dtype = self.dtype
        if any(g is None or g.dtype != dtype or g.is_sparse for g in grads):
            return False
        # torch's fused kernel pairs a grad's elements with the param's by address, the others by index: laid
        # out alike, both pair the same elements, as the flat copies do
        if list(map(_STRIDE, grads)) != self.strides:
            return False
        _, p, g, pv, gv = self._views(scratch(self.scratch_bytes))
        beta1, beta2 = g0["betas"]
        maxes = [self.states[2]] if g0["amsgrad"] else []
        with torch.no_grad():
            torch._foreach_copy_(gv, grads)
            torch._foreach_copy_(pv, self.params)
            internals.adam_functional(
                [p], [g], [self.states[0]], [self.states[1]], maxes, self.steps[:1],
                amsgrad=g0["amsgrad"], has_complex=False, beta1=beta1, beta2=beta2, lr=g0["lr"],
                weight_decay=g0["weight_decay"], eps=g0["eps"], maximize=g0["maximize"],
                foreach=g0["foreach"], capturable=g0["capturable"], differentiable=False,
                fused=g0["fused"], grad_scale=getattr(optimizer, "grad_scale", None),
                found_inf=getattr(optimizer, "found_inf", None),
                decoupled_weight_decay=g0["decoupled_weight_decay"],
            )  # fmt: skip
            if len(self.steps) > 1:
                torch._foreach_copy_(self.steps[1:], [self.steps[0]] * (len(self.steps) - 1))
            torch._foreach_copy_(self.params, pv)
        return True
