"""Proof that a benchmark row did the work it is timed for: the bytes its step moved each way, and that it
changed every param.

A strategy whose step moves nothing (torchao's CPUOffloadOptimizer stepped without a backward: its grads reach
the host only in backward hooks) runs fast and updates nothing; its time is no figure. So after a row's timed
steps the benchmark runs one more step under :class:`Traffic`, which counts every copy between host and device
memory at the aten level (``copy_``, ``_to_copy``: what ``Tensor.copy_`` and ``.to`` dispatch to, whoever
issues them: swapopt, a reference schedule, torchao's hooks), and compares each param with a host snapshot
taken before that step. :func:`prove` returns a :class:`Proof`; ``Proof.error`` says why the row is an error.

The counter is a TorchDispatchMode, so it sees ops on the device and on the simulator alike; it costs host time
per op, which is why it wraps the proof step only, never a timed one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import BaseModel
from torch.utils._python_dispatch import TorchDispatchMode

import device

_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten.copy.default, torch.ops.aten._to_copy.default}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Traffic(TorchDispatchMode):
    """Counts bytes copied host to device (``h2d_bytes``) and device to host (``d2h_bytes``) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _COPIES:
            # copy_(dst, src) writes its first argument; copy(self, src) and _to_copy(src) return the destination.
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
            elif func is torch.ops.aten.copy.default:
                dst, src = out, args[1]
            else:
                dst, src = out, args[0]
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
                src_host, dst_host = device.is_host_tensor(src), device.is_host_tensor(dst)
                if src_host and not dst_host:
                    self.h2d_bytes += _nbytes(dst)
                elif dst_host and not src_host:
                    self.d2h_bytes += _nbytes(dst)
        return out


class Proof(BaseModel):
    """What one step of a row moved and changed, against what it must move."""

    h2d_bytes: int
    d2h_bytes: int
    need_h2d_bytes: int  # what the strategy must move host to device in a step (its state bytes, for a swap)
    need_d2h_bytes: int
    params_changed: int
    params_total: int

    @property
    def error(self) -> str | None:
        """Why this row is no figure, or None."""
        why = []
        if self.h2d_bytes < self.need_h2d_bytes:
            why.append(f"moved {self.h2d_bytes:,} bytes host to device, fewer than the {self.need_h2d_bytes:,} it must")
        if self.d2h_bytes < self.need_d2h_bytes:
            why.append(f"moved {self.d2h_bytes:,} bytes device to host, fewer than the {self.need_d2h_bytes:,} it must")
        if self.params_changed < self.params_total:
            why.append(f"left {self.params_total - self.params_changed} of {self.params_total} params unchanged")
        return "; ".join(why) or None

    def summary(self) -> str:
        return (f"one step moved {self.h2d_bytes:,} B in, {self.d2h_bytes:,} B out (needs {self.need_h2d_bytes:,} / "
                f"{self.need_d2h_bytes:,}); {self.params_changed}/{self.params_total} params changed")


def host_snapshot(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``'s values, read after the copy is done."""
    h = device.pinned_empty(tuple(t.shape), dtype=t.dtype) if device.is_simulated() else torch.empty(
        t.shape, dtype=t.dtype, device="cpu")
    h.copy_(t.detach())  # blocking
    return h


def prove(step: Callable[[], None], params: Sequence[torch.Tensor], need: tuple[int, int]) -> Proof:
    """Run ``step`` (one step and its drain) under the copy counter; count the params it changed."""
    mod = device.get_torch_device_module()
    mod.synchronize()
    before = [host_snapshot(p) for p in params]
    with Traffic() as traffic:
        step()
        mod.synchronize()
    changed = sum(not torch.equal(b, host_snapshot(p)) for b, p in zip(before, params))
    return Proof(h2d_bytes=traffic.h2d_bytes, d2h_bytes=traffic.d2h_bytes, need_h2d_bytes=need[0],
                 need_d2h_bytes=need[1], params_changed=changed, params_total=len(params))
