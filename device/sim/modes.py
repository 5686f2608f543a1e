"""The modes a simulator pushes while active: a TorchDispatchMode that hands every aten op to it, and a
TorchFunctionMode that records on each autograd node the stream its forward op ran on."""

from __future__ import annotations

import functools
import gc
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from device.sim import host_time, signals
from device.sim.active import _ACTIVE, active
from device.sim.entry_points import _routed, routes_cuda
from device.sim.frames import skip_dynamo
from device.sim.plans import _PLANS, _plan

if TYPE_CHECKING:
    from device.sim.device import SimDevice
    from device.sim.streams import SimStream


_UNLOCKED = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})

_thread_time = time.thread_time
_counters = host_time._local
_OWED, _deliver_owed = signals.OWED, signals.deliver_owed  # Note [signals inside simulated ops]
_autograd_node = torch._C._current_autograd_node
_gc_isenabled, _gc_disable, _gc_enable = gc.isenabled, gc.disable, gc.enable


# Note [garbage collection inside an op]
# An op over many tensors (a foreach or fused optimizer kernel over thousands) makes several tracked Python objects
# per tensor while the simulator checks and records it (accesses, log records), and the collector's thresholds
# count them: it would run its young generations hundreds of times inside one such op, and the full collection
# (every live object, the program's included) several times, at more than the rest of the op's cost. So the
# collector is paused while the simulator handles an op (if it was on): what the op made is collected with the
# program's objects after it. Cycles the program dropped are collected as before, only not in the middle of an op.


def _sim_dispatch(self: _SimMode, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    """_SimMode.__torch_dispatch__. Its CPU time is the simulator's (host_time.counted, written out: this runs for
    every op)."""
    counters = _counters
    if counters.depth == 0:
        counters.start = _thread_time()
        counters.calls += 1
    counters.depth += 1
    try:
        kwargs = kwargs or {}
        sim = self.sim
        if not _ACTIVE or _ACTIVE[-1] is not sim:  # an outer simulator while an inner one is active (active())
            return func(*args, **kwargs)
        namespace = (_PLANS.get(id(func)) or _plan(func)).namespace  # func.namespace is a Python property
        if namespace in _UNLOCKED:
            # Collectives may block until another thread (a gloo worker, a peer rank's progress) runs:
            # holding the lock across them could deadlock.
            out = sim._dispatch(func, types, args, kwargs)
            if namespace != "_dtensor":
                sim._hold_collective(args, kwargs, out)  # Note [collective tensors at exit]
            return out
        with sim._lock:  # threads share the simulator's clocks, logs and memory model
            paused = _gc_isenabled()
            if paused:  # Note [garbage collection inside an op]
                _gc_disable()
            try:
                if _autograd_node() is None:
                    return sim._dispatch(func, types, args, kwargs)
                try:
                    return sim._dispatch(func, types, args, kwargs)
                except Exception as err:  # Note [backward on the caller's thread]
                    return sim._deferred(err, func, args, kwargs)
            finally:
                if paused:
                    _gc_enable()
    finally:
        counters.depth -= 1
        if counters.depth == 0:
            counters.total += _thread_time() - counters.start
            if _OWED:  # a Ctrl-C noted inside the op, handed over as it returns (Note [signals inside simulated ops])
                _deliver_owed()


_SKIPS_DYNAMO = skip_dynamo(_sim_dispatch.__code__)


class _SimMode(TorchDispatchMode):
    def __init__(self, sim: SimDevice) -> None:
        super().__init__()
        self.sim = sim

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Whether torch should wrap __torch_dispatch__ to keep Dynamo out of it: not where skip_dynamo did.
        return not _SKIPS_DYNAMO

    __torch_dispatch__ = _sim_dispatch


# Key in an autograd Node's metadata: the stream its forward op ran on (absent: the default stream).
_STREAM_TAG = "swapopt_sim_stream"


def _tag_outputs(out: Any, stream: SimStream) -> None:
    for t in out if isinstance(out, (tuple, list)) else (out,):
        node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if node is None:
            continue
        node.metadata.setdefault(_STREAM_TAG, stream)
        # A leaf's gradient accumulator is created with the first op that uses the leaf: same stream.
        for nxt, _ in node.next_functions:
            if nxt is not None and type(nxt).__name__ == "AccumulateGrad":
                nxt.metadata.setdefault(_STREAM_TAG, stream)


# Note [backward on the caller's thread]
# torch runs the backward of accelerator tensors on a worker thread per device, and there an exception
# that leaves a dispatch mode (a race, an out-of-memory, a device mix the simulator reports) ends the
# process in std::terminate instead of reaching backward()'s caller (torch 2.13, Python PrivateUse1
# backends). So while a simulator is active, autograd runs on the calling thread
# (torch.autograd.set_multithreading_enabled(False)): the caller's current stream and host actor are the
# backward's, as the streams of backward ops come from their forward ops anyway. And an error inside
# the pass is kept, the op run plainly, and the error raised when backward() returns, so it still fails
# the call that caused it. An error of torch's own kernel inside the pass cannot be kept (there is no
# output to go on with): it still ends the process.
# A Python hook on a tensor is the same case (torch leaves the hook's error set while it unwinds through
# the pass's stream guard, whose Python device type query then fails where it may not throw): hooks
# registered while the simulator is active keep their errors the same way. Hooks on autograd nodes
# (grad_fn.register_hook, Module full backward hooks) cannot be wrapped from Python and still end the process.
# A signal is the same case: on hardware the backward pass is C++ that waits with the GIL released, so
# Python's SIGINT handler runs (and KeyboardInterrupt is raised) only once backward() returns; here the
# pass runs Python (the dispatch mode), where the handler would raise mid-pass and end the process. So the
# pass gates SIGINT, as every simulated op does (Note [signals inside simulated ops] in device/sim/signals.py):
# a Ctrl-C during it reaches the handler when backward() returns.

# Note [streams inside a backward pass]
# An op runs on the stream current on its thread when it is issued. During a backward pass, CUDA's engine
# makes each node's stream (that of its forward op) current while the node runs, its hooks included: the
# node's own ops run there, and so does a hook's code, which sees that stream as current_stream(). A hook
# that enters a stream context (`with torch.cuda.stream(s)`) or calls set_stream makes its stream current
# for the rest of that node, and ops it issues there run on it, ordered only by the waits the hook makes;
# the engine's guard gives the node's stream back when the node returns. The simulator keeps the node
# that set a thread's stream (SimDevice.set_stream / stream) and honours the setting while that node runs;
# backward() restores the caller's stream when it returns.
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
_TENSOR_HOOKS = (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)


def _errors_kept(hook: Any, sim: SimDevice) -> Any:
    """`hook`, with an error it raises inside a pass on `sim` kept for backward() to raise when it returns."""

    @functools.wraps(hook)
    def run(*args: Any) -> Any:
        try:
            return hook(*args)
        except Exception as err:
            if active() is not sim or torch._C._current_autograd_node() is None:
                raise
            sim._keep(err)
            return None

    return run


class _StreamTagMode(TorchFunctionMode):
    """Remembers, on each autograd node made while a non-default stream is current, that stream: PyTorch runs
    a backward op on the stream of its forward op."""

    def __init__(self, sim: SimDevice) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # host_time.counted, written out (this runs for every torch function and Tensor method while active).
        counters = _counters
        if counters.depth == 0:
            counters.start = _thread_time()
            counters.calls += 1
        counters.depth += 1
        try:
            sim = self.sim
            if func in _BACKWARD and active() is sim:
                with signals.gated(), sim._backward_call():
                    try:
                        out = func(*args, **(kwargs or {}))
                    finally:
                        sim._raise_pending()  # an error deferred inside the pass, Note [backward on the caller's thread]
                return out
            if func in _TENSOR_HOOKS and active() is sim and len(args) == 2:
                args = (args[0], _errors_kept(args[1], sim))
            if kwargs and "device" in kwargs and routes_cuda(sim):
                # A factory given device="cuda" (`torch.tensor(0, device="cuda")`, as frameworks write) makes its
                # tensor on the simulated device, as `.to("cuda")` does (device.sim.entry_points).
                kwargs = {**kwargs, "device": _routed(sim, kwargs["device"])}
            out = func(*args, **(kwargs or {}))
            if torch.is_grad_enabled() and _ACTIVE and _ACTIVE[-1] is sim:
                node = _autograd_node()  # sim._current(), written out
                stream = sim._node_stream(node) if node is not None else (sim._tls.current or sim._default)
                if stream is not sim._default:
                    _tag_outputs(out, stream)
            return out
        finally:
            counters.depth -= 1
            if counters.depth == 0:
                counters.total += _thread_time() - counters.start
                if _OWED:  # a Ctrl-C noted inside the op, handed over as it returns (Note [signals inside simulated ops])
                    _deliver_owed()
