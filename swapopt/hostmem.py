"""The pinned host memory a job needs, worked out before any of it is allocated (HostMemoryError).

A SwapOptimizer keeps its swapped states, and with ``master_weights`` the fp32 masters, in pinned host
memory: 8 bytes a param for Adam's two fp32 moments, 12 with a master. Where the host has less free than
that, allocating it fails minutes into the first step with the driver's out-of-memory error, after
everything before it has run. ``check_layout`` (the wrapper's first step and every re-plan) and
``job_host_bytes`` (the engine's start-up estimate, the verify and bench runs, swapopt.bench.capacity) say
it first, with the knobs that reduce it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import device
from swapopt import hoststate
from swapopt.hoststate import local
from swapopt.masters import LOW_PRECISION

if TYPE_CHECKING:
    from swapopt.layout import HostLayout

GiB = 1 << 30
MiB = 1 << 20


class HostMemoryError(MemoryError):
    """The pinned host memory a job needs exceeds what the host has free; raised before it is allocated.

    ``needed``: bytes still to allocate; ``available``: bytes the host has free; ``total``: the job's pinned
    bytes in all (states and masters, those already held included)."""

    def __init__(self, needed: int, available: int, total: int | None = None, masters: int = 0) -> None:
        self.needed = int(needed)
        self.available = int(available)
        self.total = int(total if total is not None else needed)
        self.masters = int(masters)
        super().__init__(describe(self.needed, self.available, self.total, self.masters))


def fmt(nbytes: int) -> str:
    """Bytes as GiB (MiB below one GiB), with the exact count: both readers of the error need it."""
    unit = f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"
    return f"{unit} ({nbytes:,} bytes)"


def describe(needed: int, available: int, total: int, masters: int = 0) -> str:
    held = total - needed
    what = "optimizer states and fp32 master weights" if masters else "optimizer states"
    lines = [
        f"swapopt: the {what} need {fmt(needed)} of pinned host memory"
        + (f" ({fmt(total)} in all, {fmt(held)} already held)" if held > 0 else "")
        + f", but the host has {fmt(available)} free."
    ]
    knobs = []
    if masters:
        knobs.append(f"master_weights=False ({fmt(masters)} of masters, and their states in the param's "
                     "dtype instead of fp32)")
    knobs.append("a larger resident_mb or resident_mb='auto', without master_weights (states that fit it, or the "
                 "device's spare memory, stay in device memory)")
    knobs.append("more ranks (FSDP shards params, so each rank's host holds 1/N of the states)")
    lines.append("Reduce it with: " + "; ".join(knobs) + "; or free host memory.")
    return " ".join(lines)


def param_bytes(n_params: int, dtype: torch.dtype, master_weights: bool, state_factor: int = 2) -> tuple[int, int]:
    """(state bytes, master bytes) one rank keeps on the host for ``n_params`` params of ``dtype`` under an
    Adam-like optimizer with ``state_factor`` param-shaped states: states in fp32 when a master is kept
    (master_weights and a low-precision dtype), else in the param's dtype; the master in fp32."""
    master = master_weights and dtype in LOW_PRECISION
    step_dtype = torch.float32 if master else dtype
    return n_params * state_factor * step_dtype.itemsize, (n_params * 4 if master else 0)


def resident_bytes_of(resident_mb: float | str) -> int:
    """The bytes a ``resident_mb`` knob keeps off the host for sure: its MiB, or 0 for ``"auto"``, whose share
    follows the device's spare memory and may fall to nothing at any re-plan (the states then come back to
    the host, which must have room for them)."""
    return 0 if isinstance(resident_mb, str) else int(resident_mb * MiB)


def job_host_bytes(
    n_params: int, dtype: torch.dtype = torch.float32, master_weights: bool = False, world: int = 1,
    resident_bytes: int = 0, state_factor: int = 2,
) -> tuple[int, int]:
    """(pinned bytes, of which masters) one rank of a job needs: its 1/``world`` share of the params (FSDP2
    shards them), less what ``resident_bytes`` keeps in device memory; arenas take their size
    (device.host_held_bytes: rounding only where the host allocator still rounds, NPU)."""
    per_rank = -(-int(n_params) // max(int(world), 1))
    states, masters = param_bytes(per_rank, dtype, master_weights, state_factor)
    total = max(states + masters - int(resident_bytes), 0)
    return total, min(masters, total)


def check(needed: int, total: int | None = None, masters: int = 0, available: int | None = None) -> None:
    """Raise HostMemoryError when ``needed`` bytes exceed what the host has free (``available``, or
    device.host_available_bytes(); nothing is checked where that is unknown)."""
    if needed <= 0:
        return
    if available is None:
        available = device.host_available_bytes()
    if available is not None and needed > available:
        raise HostMemoryError(needed, available, total, masters)


def check_layout(layout: HostLayout, params: list[torch.Tensor], groups: list[int]) -> None:
    """Before a plan allocates anything: the pinned bytes it will add (states the first step creates, masters
    not made yet, device states coming back to the host), less what ``resident_mb`` keeps on the device,
    against the host's free memory. States and masters already on the host count toward the total only.
    With ``resident_mb="auto"`` the settings carry the budget measured for this plan (swapopt.resident_auto)."""
    ctx = layout.ctx
    masters = ctx.masters
    new = held = new_masters = 0
    for p, gi in zip(params, groups):
        if p in layout.resident:
            continue
        loc = local(p)
        has_master = masters.get(p) is not None
        master = 4 * loc.numel() if masters.wanted(p) and not has_master else 0
        if layout.has_states(p) or (layout.host.get(p) is None and _host_states(layout, p)):
            held += _held(layout, p)
            new += master
        else:
            nbytes, _ = layout.state_bytes(p, gi)  # a master already made is in it
            if has_master:
                held += 4 * loc.numel()
                nbytes -= 4 * loc.numel()
            new += nbytes + master
        new_masters += master
    if new <= 0:
        return
    resident = int(ctx.settings.resident_mb * MiB)
    new = max(new - resident, 0)
    check(new, held + new, new_masters if new_masters else _all_masters(layout, params))


def _host_states(layout: HostLayout, p: torch.Tensor) -> bool:
    st = layout.state.get(p) or {}
    return any(isinstance(v, torch.Tensor) and v.dim() > 0 and device.is_host_tensor(v) for v in st.values())


def _held(layout: HostLayout, p: torch.Tensor) -> int:
    entry = layout.host.get(p)
    if entry is not None:
        return entry.nbytes
    st: dict[str, Any] = layout.state.get(p) or {}
    # state_nbytes: a low-bit subclass state holds its parts' bytes, not numel x its appearance dtype
    return sum(hoststate.state_nbytes(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _all_masters(layout: HostLayout, params: list[torch.Tensor]) -> int:
    masters = layout.ctx.masters
    return sum(4 * local(p).numel() for p in params if masters.wanted(p))
