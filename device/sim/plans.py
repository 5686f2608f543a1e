"""What the simulated device's dispatch (device/sim/dispatch.py) asks of an aten op on every call, worked out once
per op: _Plan, looked up by the op's id in _PLANS."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from device.sim import kernels
from device.sim.costs import flops_counter
from device.sim.ops import OpInfo, fresh_returns, op_info
from device.sim.tensor import _META_INPLACE, _MIX_FREE, is_fused_optimizer


class _Plan(NamedTuple):
    """What Dispatch asks of an op on every call, worked out once per op (an op's schema and packet are rebuilt
    or looked up on every access)."""

    op: OpInfo
    packet: Any
    namespace: str  # "aten", "profiler", "c10d", ...
    profiler: bool  # a profiler range op (record_function)
    fused: bool  # a fused optimizer kernel (device.sim.tensor._FUSED_OPTIMIZERS)
    same_device: bool  # CUDA's one-device rule applies (not fused, not a copy, not in _MIX_FREE)
    pins: bool  # is_pinned or _pin_memory
    has_out: bool  # takes an out= argument
    kernel: Any  # the simulator's own kernel for device tensors (device.sim.kernels.device_kernel), or None
    npu_kind: str | None  # how the npu flavour runs it (device.sim.kernels.npu_kind)
    fresh: tuple[bool, ...]  # per return: aliases no input (device.sim.ops.fresh_outputs)
    flops: Any  # what counts its FLOPs, for an op priced by arithmetic as well as bytes (costs.flops_counter), or None
    view: bool  # only looks at its tensors and allocates nothing: a view or metadata op (Dispatch._view_op)
    call: Any  # what runs the op: its C++ callable (OpOverload.__call__ is one more Python frame per op)
    func: Any  # the op itself: kept alive, so that its id stays its own while _PLANS holds the plan


# id(op) -> its _Plan. Keyed by id: an OpOverload hashes in Python (torch/_ops.py), a cost on every op.
_PLANS: dict[int, _Plan] = {}


def _plan(func: Any) -> _Plan:
    plan = _PLANS.get(id(func))
    if plan is None:
        plan = _PLANS[id(func)] = _make_plan(func)
    return plan


def _make_plan(func: Any) -> _Plan:
    op = op_info(func)
    packet = func.overloadpacket
    fused = is_fused_optimizer(func)
    pins = packet is torch.ops.aten.is_pinned or packet is torch.ops.aten._pin_memory
    has_out = any(role == "o" for _, _, role in op.roles)
    kernel = kernels.device_kernel(func)
    npu_kind = kernels.npu_kind(func)
    profiler = func.namespace == "profiler"
    # Arguments that place or pin new tensors take _device_dispatch's own branches.
    placing = any(a.name in ("device", "pin_memory", "non_blocking") for a in func._schema.arguments)
    view = (
        not profiler and not fused and not pins and not has_out and not placing and kernel is None and npu_kind is None
        and not op.new_outputs and not op.resize and not op.copy and packet not in _META_INPLACE
        and func.namespace == "aten" and all(role == "v" for _, _, role in op.roles)
    )  # fmt: skip
    return _Plan(
        op=op,
        packet=packet,
        namespace=func.namespace,
        profiler=profiler,
        fused=fused,
        same_device=not (fused or packet in _MIX_FREE or op.copy),
        pins=pins,
        has_out=has_out,
        kernel=kernel,
        npu_kind=npu_kind,
        fresh=fresh_returns(func),
        flops=flops_counter(func),
        view=view,
        call=func._op if type(func) is torch._ops.OpOverload else func,
        func=func,
    )
