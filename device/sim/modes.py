"""The modes a simulator pushes while active: a TorchDispatchMode that hands every aten op to it, and a
TorchFunctionMode that records on each autograd node the stream its forward op ran on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from device.sim.active import active
from device.sim.host_time import counted

if TYPE_CHECKING:
    from device.sim.device import SimDevice
    from device.sim.streams import SimStream


_UNLOCKED = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


class _SimMode(TorchDispatchMode):
    def __init__(self, sim: SimDevice) -> None:
        super().__init__()
        self.sim = sim

    @counted
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if active() is not self.sim:  # an outer simulator while an inner one is active
            return func(*args, **kwargs)
        if func.namespace in _UNLOCKED:
            # Collectives may block until another thread (a gloo worker, a peer rank's progress) runs:
            # holding the lock across them could deadlock.
            return self.sim._dispatch(func, types, args, kwargs)
        with self.sim._lock:  # threads share the simulator's clocks, logs and memory model
            if not self.sim.typed or torch._C._current_autograd_node() is None:
                return self.sim._dispatch(func, types, args, kwargs)
            try:
                return self.sim._dispatch(func, types, args, kwargs)
            except Exception as err:  # Note [backward on the caller's thread]
                return self.sim._deferred(err, func, args, kwargs)


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
# backends). So while a typed simulator is active, autograd runs on the calling thread
# (torch.autograd.set_multithreading_enabled(False)): the caller's current stream and host actor are the
# backward's, as the streams of backward ops come from their forward ops anyway. And an error inside
# the pass is kept, the op run plainly, and the error raised when backward() returns, so it still fails
# the call that caused it. An error of torch's own kernel inside the pass cannot be kept (there is no
# output to go on with): it still ends the process.
_BACKWARD = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


class _StreamTagMode(TorchFunctionMode):
    """Remembers, on each autograd node made while a non-default stream is current, that stream: PyTorch runs
    a backward op on the stream of its forward op."""

    def __init__(self, sim: SimDevice) -> None:
        super().__init__()
        self.sim = sim

    @counted
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _BACKWARD and active() is self.sim:
            try:
                out = func(*args, **(kwargs or {}))
            finally:
                self.sim._raise_pending()  # an error deferred inside the pass, Note [backward on the caller's thread]
            return out
        out = func(*args, **(kwargs or {}))
        sim = self.sim
        if torch.is_grad_enabled() and active() is sim:
            stream = sim.current_stream()
            if stream is not sim._default:
                _tag_outputs(out, stream)
        return out
