"""Structural counters of one optimizer step: aten ops, kernel launches, copies each way, host CPU time.

Step time alone hides why a step is slow; these counts show it. A launch is an aten op that makes the
device do work: a copy or a compute kernel touching device memory. Views, metadata changes and bare
allocations are not launches, and neither are ops that only touch host memory. Copies are sorted by
direction: host to device (H2D), device to host (D2H, including `.item()`-style scalar reads).

Counting runs in a dispatch mode above the device's own (the simulator's mode on CPU CI, none on
CUDA or NPU), so the same code counts on the simulator and on a real device. The mode costs host
time, so host CPU time is measured on a separate, uncounted step.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel
from torch.utils._python_dispatch import TorchDispatchMode

import device
from device.sim import host_time
from device.sim.ops import op_info, tensors
from device.sim.tensor import SimTensor

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


class StepCounts(BaseModel):
    """What one call (typically one optimizer step) dispatched."""

    aten_ops: int = 0  # every aten op, views and allocations included
    dispatched: int = 0  # every op this mode saw: aten ops and others (profiler ranges, c10d)
    launches: int = 0  # copies and compute kernels that touch device memory
    h2d_copies: int = 0
    d2h_copies: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    # CPU seconds of the calling thread: over the whole call, inside launched ops (below this mode: on
    # the simulator that is the device's own work, done by the host), inside every aten op, and in this
    # mode's bookkeeping.
    cpu_s: float = 0.0
    launch_cpu_s: float = 0.0
    op_cpu_s: float = 0.0
    counting_cpu_s: float = 0.0
    # ... and inside the simulator's own frames (device.host_time) or this mode's, counted once, with
    # the number of such outermost frames entered
    outside_host_s: float = 0.0
    outside_calls: int = 0
    tensor_args: int = 0  # tensors handed to the ops this mode saw, list members included
    # On the simulator: the event records and stream waits made (SimDevice.runtime_calls), C++ calls into the
    # runtime on a device, whose host time is then in its Python figure and on the simulator is the preset's
    # event_us each (python_ms in swapopt.bench.layout_run). 0 on a device: there they are in cpu_s already.
    runtime_calls: int = 0

    def own_host_s(self, device_work_on_host: bool) -> float:
        """The call's own host work: its CPU time less this counter's cost and, when the device's work
        runs on the host (the simulator), less the time inside launched ops."""
        own = self.cpu_s - self.counting_cpu_s - self.dispatched * _mode_entry_seconds()
        if device_work_on_host:
            own -= self.launch_cpu_s
        return max(own, 0.0)

    def python_host_s(self) -> float:
        """The call's Python host work: its CPU time outside every aten op and every simulator frame (its
        dispatch and function modes, streams, events), less this counter's cost. That is the work of the
        Python that issues the ops, the figure that carries over to a GPU or NPU, where those frames are
        C++ calls of a few microseconds (not counted here)."""
        own = self.cpu_s - self.outside_host_s - self.dispatched * _mode_entry_seconds()
        own -= self.outside_calls * host_time.frame_entry_us() * 1e-6  # what a frame's entry costs outside it
        own -= self.tensor_args * _tensor_arg_seconds()  # Note [counting a tensor list costs per tensor]
        return max(own, 0.0)


def _fresh_outputs(func: Any, out: Any) -> list[torch.Tensor]:
    """Returned tensors that alias no input: what the op created."""
    returns = func._schema.returns
    values = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
    found: list[torch.Tensor] = []
    for ret, value in zip(returns, values):
        if ret.alias_info is None:
            found.extend(tensors(value))
    return found


def _on_device(t: torch.Tensor) -> bool:
    # Meta and sparse tensors are never device memory a kernel of this step touches.
    return t.layout is torch.strided and t.device.type != "meta" and not device.is_host_tensor(t)


class LaunchCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (see the module docstring for what counts as what)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = StepCounts()

    def __enter__(self) -> LaunchCounter:
        # The simulator must be active below this mode, so the ops it sees are already classified.
        mod = device.get_torch_device_module()
        self._runtime = getattr(mod, "runtime_calls", None)  # the simulator's
        self._runtime_from = self._runtime() if self._runtime is not None else 0
        self._start = time.thread_time()
        self._outside, self._calls = host_time.seconds(), host_time.calls()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.counts.cpu_s += time.thread_time() - self._start
        self.counts.outside_host_s += host_time.seconds() - self._outside
        self.counts.outside_calls += host_time.calls() - self._calls
        if self._runtime is not None:
            self.counts.runtime_calls += self._runtime() - self._runtime_from

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in types:
            # Simulated device tensors are the device's own tensors (the simulator's mode below runs them).
            if t is not SimTensor and t.__torch_dispatch__ is not _PLAIN_DISPATCH:
                return NotImplemented  # tensor subclasses (DTensor) come back as their local ops
        host_time.enter()  # an op from C++ (no simulator frame above it) is outside Python work too
        self.counts.dispatched += 1
        try:
            start = time.thread_time()
            out = func(*args, **kwargs)
            done = time.thread_time()
            if func.namespace == "aten":
                self.counts.op_cpu_s += done - start
                if self._classify(func, args, kwargs, out):
                    self.counts.launch_cpu_s += done - start
            self.counts.tensor_args += _tensor_count(args) + _tensor_count(kwargs.values())
            self.counts.counting_cpu_s += time.thread_time() - done
        finally:
            host_time.leave()
        return out

    def _classify(self, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        """Count one op; True when it is a launch."""
        c = self.counts
        c.aten_ops += 1
        op = op_info(func)
        if op.alloc_only:
            return False
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        for position, name, role in op.roles:
            if role == "v":
                continue
            value = args[position] if position < len(args) else kwargs.get(name)
            (reads if role == "r" else writes).extend(tensors(value))
        writes += _fresh_outputs(func, out)
        if not reads and not writes:
            return False  # a view or a metadata change
        read_dev = [_on_device(t) for t in reads]
        write_dev = [_on_device(t) for t in writes]
        if not any(read_dev) and not any(write_dev):
            return False  # host-only work
        c.launches += 1
        if op.local_scalar:
            c.d2h_copies += 1
            c.d2h_bytes += sum(t.element_size() for t in reads)
        elif op.copy:
            nbytes = sum(t.nbytes for t in writes)
            if any(not d for d in read_dev) and any(write_dev):
                c.h2d_copies += 1
                c.h2d_bytes += nbytes
            elif any(read_dev) and any(not d for d in write_dev):
                c.d2h_copies += 1
                c.d2h_bytes += nbytes
        return True


def _tensor_count(values: Any) -> int:
    return sum(len(tensors(v)) for v in values)


# Note [counting a tensor list costs per tensor]
# To reach this mode, torch turns each op's arguments from C++ values into Python objects one tensor at a time
# (the dispatcher's Python key), and on the simulator each simulated tensor also takes the Python argument
# parser's slow path for tensor subclasses; a run on a device without the counter pays neither. For an op
# over a few tensors this is part of the per-op entry cost calibrated below; for a multi-tensor op (fused
# AdamW over 10,000 params, a multi-tensor copy) it is 0.4 us (plain tensors) to 1.3 us (simulated ones) per
# tensor on this machine, so a step that hands 50,000 tensors to fused AdamW would carry 20-65 ms of the
# counter's and the simulator's own work as its "Python" time. It is calibrated per tensor on the current
# device's tensors (_tensor_arg_seconds) and taken off, on a device as on the simulator. What stays is what a
# run pays: torch parsing the call's tensors as plain tensors (measured apart, on a call torch refuses right
# after parsing) and the Python that builds the lists.


def _outside_per_call(xs: list[torch.Tensor], ys: list[torch.Tensor], counted: bool) -> float:
    """CPU seconds of one `_foreach_mul_(xs, ys)` outside the op and every simulator frame: counted, the
    least of a few; plain, a call torch refuses before running anything (ys one longer than xs)."""
    runs = []
    for _ in range(5):
        if counted:
            with LaunchCounter() as counter:
                for _ in range(10):
                    torch._foreach_mul_(xs, ys)
            c = counter.counts
            runs.append((c.cpu_s - c.outside_host_s) / 10)
        else:
            start = time.thread_time()
            for _ in range(10):
                try:
                    torch._foreach_mul_(xs, ys)
                except RuntimeError:
                    pass
            runs.append((time.thread_time() - start) / 10)
    return min(runs)


@functools.cache
def _tensor_arg_seconds() -> float:
    """CPU time the counter (and on the simulator, the simulated tensors) add per tensor argument of an op
    (Note [counting a tensor list costs per tensor]): the growth of a counted foreach op's time outside the op
    from 2 x 32 to 2 x 1024 tensors of the current device, per tensor added, less the same growth of a plain
    call's parsing of as many plain tensors."""
    small, large = 32, 1024
    mod = device.get_torch_device_module()
    where = device.torch_device()
    with mod.untagged() if hasattr(mod, "untagged") else contextlib.nullcontext():
        lists = {n: ([torch.zeros(1, device=where) for _ in range(n)], [torch.ones(1, device=where) for _ in range(n)])
                 for n in (small, large)}
        _outside_per_call(*lists[small], counted=True)  # warm-up
        counted = _outside_per_call(*lists[large], counted=True) - _outside_per_call(*lists[small], counted=True)
    plain = {n: [torch.empty(1, device="meta") for _ in range(n)] for n in (small, large)}
    parsed = (_outside_per_call(plain[large], plain[large] + plain[large][:1], counted=False)
              - _outside_per_call(plain[small], plain[small] + plain[small][:1], counted=False))
    return max((counted - parsed) / (2 * (large - small)), 0.0)


@functools.cache
def _mode_entry_seconds() -> float:
    """CPU time a counted op costs beyond what the counter measures itself: entering the mode and
    reading the clock. Calibrated once on view ops, which do no work of their own."""
    x = torch.empty(64, device="meta")
    n = 2000

    def views() -> None:
        for _ in range(n):
            x.view(-1)

    plain = host_cpu_seconds(views)
    with LaunchCounter() as counter:
        views()
    extra = counter.counts.cpu_s - counter.counts.counting_cpu_s - plain
    return max(extra / n, 0.0)


def count_call(fn: Callable[[], Any]) -> StepCounts:
    """Run `fn` once under a LaunchCounter and return what it dispatched. The garbage collector is off
    meanwhile (as timeit does): a collection pass triggered inside would be counted as the call's host time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with LaunchCounter() as counter:
            fn()
    finally:
        if enabled:
            gc.enable()
    return counter.counts


def host_cpu_seconds(fn: Callable[[], Any]) -> float:
    """CPU time of the calling thread over one call of `fn`: the host work it costs, whatever the device
    does meanwhile. The thread's, not the process's: idle intra-op worker threads spin and would be
    counted as work."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def pinned_host_bytes(tensors_: list[torch.Tensor]) -> int:
    """Bytes of host memory behind these tensors, each storage counted once (views of one arena are one)."""
    seen: dict[int, int] = {}
    for t in tensors_:
        if t.dim() == 0 or not device.is_host_tensor(t):
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
