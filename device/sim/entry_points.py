"""Torch entry points the simulator answers for while one is active.

A TorchDispatchMode sees aten ops on the thread that pushed it, and nothing else. These wrappers cover
what it cannot see, so that the simulator judges those paths as CUDA would:
- `Tensor.record_stream(sim_stream)`: torch's parser accepts only its own Stream type;
- host reads that bypass the dispatcher: `tolist()`, `numpy()`, `__array__`, DLPack (`torch.save` is
  covered by the serialization tagger below);
- `Tensor.cuda()` / `Module.cuda()` and `.to("cuda")`: the simulated device stands in for CUDA (the cuda flavour,
  or the npu flavour once torch_npu.contrib.transfer_to_npu is imported), and torch.cuda's functions answer for it;
- `t.data = device_tensor` and Module._apply's choice to keep a Parameter (Note [module moves]);
- threads started while active run under the simulator as host threads of their own (start and join
  order them);
- async collectives run on a collectives stream until `work.wait()`.
Installed with the first active simulator and removed with the last, except the serialization tagger,
which is registered once (torch has no way to unregister one) and does nothing while none is active.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import torch

from device.sim import npu_ops
from device.sim.active import active as _sim
from device.sim.tensor import SimTensor

_SAVED: dict[tuple[Any, str], Any] = {}
_REGISTERED: list[bool] = []

# Storages saved from simulated device memory carry this location tag, so that torch.load under an
# active simulator restores them as device memory (as a checkpoint of CUDA tensors loads on CUDA).
# Without a simulator they load as CPU storages; `map_location="cpu"` loads them anywhere.
SIM_LOCATION = "swapopt_sim"

_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all_single", "all_to_all",
)  # fmt: skip


_INHERITED = object()  # the attribute came from a base class: delete ours to restore it


def _patch(owner: Any, name: str, make: Any) -> None:
    own = name in vars(owner)
    original = vars(owner)[name] if own else getattr(owner, name)
    _SAVED[(owner, name)] = original if own else _INHERITED
    setattr(owner, name, make(original))


def _read_wrapper(what: str):
    def make(original):
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            sim = _sim()
            if sim is not None:
                if what == "Tensor.tolist" and type(self) is SimTensor:
                    return self.cpu().tolist()  # torch refuses subclasses; on a device: a blocking D2H copy
                sim._host_read(self, what)
            return original(self, *args, **kwargs)

        return wrapper

    return make


def _record_stream(original):
    @functools.wraps(original)
    def record_stream(self, stream):
        sim = _sim()
        if sim is not None and isinstance(stream, sim.Stream):
            sim.record_stream(self, stream)
            return None
        return original(self, stream)

    return record_stream


def _is_cuda(target: Any) -> bool:
    if isinstance(target, str):
        return target.split(":")[0] == "cuda"
    return isinstance(target, torch.device) and target.type == "cuda"


def routes_cuda(sim: Any) -> bool:
    """Whether "cuda" names this simulator's device: the cuda flavour, or the npu flavour
    once torch_npu.contrib.transfer_to_npu was imported (device.sim.npu_ops)."""
    return sim is not None and (sim.flavour == "cuda" or npu_ops.cuda_to_npu())


def _routed(sim: Any, target: Any) -> Any:
    """A "cuda" device argument as the simulator's own device (same index); others unchanged."""
    if _is_cuda(target):
        return sim.torch_device(torch.device(target).index)
    return target


def _routed_to_args(sim: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`.to(...)` arguments of a tensor or module with a "cuda" device routed (see _routed)."""
    if args:
        args = (_routed(sim, args[0]), *args[1:])
    if "device" in kwargs:
        kwargs = {**kwargs, "device": _routed(sim, kwargs["device"])}
    return args, kwargs


def _tensor_cuda(original):
    @functools.wraps(original)
    def cuda(self, device=None, non_blocking=False, **kwargs):
        sim = _sim()
        if routes_cuda(sim):
            index = None if device is None else torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index
            return self.to(sim.torch_device(index), non_blocking=non_blocking, **kwargs)
        return original(self, device, non_blocking, **kwargs)

    return cuda


def _tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        sim = _sim()
        if routes_cuda(sim):
            args, kwargs = _routed_to_args(sim, args, kwargs)
        return original(self, *args, **kwargs)

    return to


def _data_property(original):
    """`t.data = device_tensor` for a host tensor `t` (FSDP2 moving a CPU-built model onto its mesh's device,
    user code moving a param by hand) works on CUDA: the param becomes a device tensor in place. A host
    tensor cannot take a SimTensor's data in place (torch refuses set_data between the two tensor types), so
    the param swaps its whole tensor with a device one (torch.utils.swap_tensors, as Module._apply does for
    wrapper subclasses): the same Python object, now on the device, requires_grad kept."""

    def set_data(self, value):
        try:
            original.__set__(self, value)
        except RuntimeError as err:
            if not (isinstance(value, SimTensor) and type(self) is not SimTensor and "incompatible tensor type" in str(err)):
                raise
            moved = value.detach()
            if isinstance(self, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=self.requires_grad)
            else:
                moved.requires_grad_(self.requires_grad)
            torch.utils.swap_tensors(self, moved)

    return property(original.__get__, set_data, doc=original.__doc__)


# Note [module moves]
# Module._apply (to, cuda, cpu, half, to_empty...) keeps each Parameter object and changes its data in place
# (`param.data = new`) when torch._has_compatible_shallow_copy_type says the two tensors may share a TensorImpl
# type, which holds between dense CPU and CUDA tensors (TensorImpl::has_compatible_shallow_copy_type) and not
# for meta ones, and not at all once torch.__future__.set_overwrite_module_params_on_conversion(True); otherwise
# it makes new Parameters (an optimizer built before `to_empty` on a meta-built module keeps the meta ones).
# It also keeps the objects, swapping their contents, for every result that is a traceable wrapper subclass,
# which a SimTensor is. So while a simulator is active, the choice for a move to or from simulated device
# memory is made as for CUDA memory: Module._apply's view of is_traceable_wrapper_subclass answers whether CUDA
# would keep the Parameter, and the swap it then does is how a kept one changes its data here.
_APPLY = threading.local()  # the (tensor, result) of the last move of the Module._apply running on this thread


def _dense(t: torch.Tensor) -> bool:
    """A tensor a CUDA build counts as dense CPU or CUDA memory (the simulated device standing in for CUDA)."""
    return t.layout is torch.strided and (type(t) is SimTensor or (t.device.type == "cpu" and not t.is_meta))


def _cuda_keeps(tensor: torch.Tensor, applied: torch.Tensor) -> bool:
    """Whether Module._apply on CUDA would keep the Parameter `tensor` when its move gives `applied`."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return True
    return _dense(tensor) and _dense(applied) and not torch.__future__.get_overwrite_module_params_on_conversion()


def _module_apply(original):
    @functools.wraps(original)
    def _apply(self, fn, *args, **kwargs):
        sim = _sim()
        if sim is None or getattr(fn, "_swapopt_sim_move", False):
            return original(self, fn, *args, **kwargs)

        def move(t):
            out = fn(t)
            _APPLY.last = (t, out)
            return out

        move._swapopt_sim_move = True
        try:
            return original(self, move, *args, **kwargs)
        finally:
            _APPLY.last = None

    return _apply


def _module_wrapper_check(original):
    def is_traceable_wrapper_subclass(t):
        last = getattr(_APPLY, "last", None)
        if last is not None and last[1] is t and (type(t) is SimTensor or type(last[0]) is SimTensor):
            return _cuda_keeps(*last)
        return original(t)

    return is_traceable_wrapper_subclass


def _module_cuda(original):
    @functools.wraps(original)
    def cuda(self, device=None):
        sim = _sim()
        if routes_cuda(sim):
            return self._apply(lambda t: t.cuda(device))
        return original(self, device)

    return cuda


def _module_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        sim = _sim()
        if routes_cuda(sim):
            args, kwargs = _routed_to_args(sim, args, kwargs)
        return original(self, *args, **kwargs)

    return to


def _thread_start(original):
    @functools.wraps(original)
    def start(self):
        sim = _sim()
        if sim is not None and not getattr(self, "_swapopt_sim_actor", None):
            actor = sim._fork()
            self._swapopt_sim_actor = (sim, actor)
            run = self.run

            def run_simulated():
                with sim._thread(actor):
                    run()

            self.run = run_simulated
        return original(self)

    return start


def _thread_join(original):
    @functools.wraps(original)
    def join(self, timeout=None):
        original(self, timeout)
        tagged = getattr(self, "_swapopt_sim_actor", None)
        if tagged is not None and not self.is_alive():
            sim, actor = tagged
            sim._joined(actor)

    return join


class _SimWork:
    """The Work of an async collective: `wait()` orders the caller's current stream after the collective."""

    def __init__(self, work: Any, sim: Any, event: Any) -> None:
        self._work, self._sim, self._event = work, sim, event

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._work.wait(*args, **kwargs)
        self._sim.current_stream().wait_event(self._event)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _collective(original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        sim = _sim()
        if sim is None or not kwargs.get("async_op"):
            return original(*args, **kwargs)
        caller = sim.current_stream()
        comm = sim._comm_stream()
        comm.wait_stream(caller)  # a collective is enqueued after the caller's prior work
        with sim.stream(comm):
            work = original(*args, **kwargs)
            event = comm.record_event()
        return _SimWork(work, sim, event) if work is not None else None

    return collective


def _tag(storage: Any) -> str | None:
    sim = _sim()
    if sim is None or storage.device.type != "cpu":
        return None
    storage = getattr(storage, "_untyped_storage", storage)
    return SIM_LOCATION if sim._saved(storage) else None


def _restore(storage: Any, location: str) -> Any:
    if location != SIM_LOCATION:
        return None
    sim = _sim()
    if sim is not None:
        sim._loaded(getattr(storage, "_untyped_storage", storage))
    return storage


def register_serialization() -> None:
    """Teach torch.save / torch.load about simulated device memory (once per process)."""
    if not _REGISTERED:
        torch.serialization.register_package(-1, _tag, _restore)
        _REGISTERED.append(True)


def install() -> None:
    """Wrap the entry points (idempotent)."""
    register_serialization()
    if _SAVED:
        return
    T = torch.Tensor
    for name, what in (("tolist", "Tensor.tolist"), ("numpy", "Tensor.numpy"), ("__array__", "Tensor.__array__"),
                       ("__dlpack__", "Tensor.__dlpack__")):  # fmt: skip
        _patch(T, name, _read_wrapper(what))
    _patch(T, "record_stream", _record_stream)
    _patch(T, "cuda", _tensor_cuda)
    _patch(T, "to", _tensor_to)
    _patch(T, "data", _data_property)
    _patch(torch.nn.Module, "cuda", _module_cuda)
    _patch(torch.nn.Module, "to", _module_to)
    _patch(torch.nn.Module, "_apply", _module_apply)  # Note [module moves]
    _patch(torch.nn.modules.module, "is_traceable_wrapper_subclass", _module_wrapper_check)
    _patch(threading.Thread, "start", _thread_start)
    _patch(threading.Thread, "join", _thread_join)
    if torch.distributed.is_available():
        import torch.distributed.distributed_c10d as c10d

        for name in _COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            _patch(c10d, name, _collective)
            if getattr(torch.distributed, name, None) is original:
                _patch(torch.distributed, name, lambda _o, wrapped=getattr(c10d, name): wrapped)


# torch.cuda's functions and classes the cuda flavour presents (what libraries call directly).
# torch.cuda.is_available() stays False: no tensor is cuda-typed (Note [simulated device type]), and torch's
# own code that checks it and then compares device types (DCP's loaders, say) must not take the CUDA path.
_CUDA_SURFACE = (
    "device_count", "current_device", "set_device", "synchronize",
    "Stream", "Event", "current_stream", "default_stream", "stream", "set_stream", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "empty_cache",
    "mem_get_info", "memory_stats", "get_device_name", "get_device_properties", "is_bf16_supported",
    "manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "initial_seed", "seed", "seed_all",
    "CUDAGraph", "graph", "is_current_stream_capturing", "graph_pool_handle",  # Note [graph capture] (graphs.py)
)  # fmt: skip
_CUDA_SAVED: dict[str, Any] = {}


_ACCELERATOR_SAVED: list[Any] = []


def _framework_accelerator(original):
    """torch.accelerator.current_accelerator as the cuda flavour presents it. Frameworks resolve their device
    from it once, at import (XTuner v1: `current_accelerator().type` must be cpu, cuda or npu), and then use
    torch.cuda and "cuda" device strings, which the simulator answers for: to them it says `cuda`. torch's own
    modules keep the registered backend's answer (`sim`, the type simulated tensors report): they look up process
    group backends, rng state and streams by the device type of the tensors they hold."""

    @functools.wraps(original)
    def current_accelerator(check_available: bool = False) -> torch.device | None:
        out = original(check_available)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if out is None or caller == "torch" or caller.startswith("torch."):
            return out
        return torch.device("cuda")

    return current_accelerator


def present_cuda(sim: Any) -> None:
    """Make torch.cuda (and, on the cuda flavour, torch.accelerator's device type, for frameworks) answer for
    `sim` (a simulator that routes "cuda": routes_cuda), or give them back (None)."""
    cuda = torch.cuda
    if sim is None:
        for name, original in _CUDA_SAVED.items():
            setattr(cuda, name, original)
        _CUDA_SAVED.clear()
        if _ACCELERATOR_SAVED:
            torch.accelerator.current_accelerator = _ACCELERATOR_SAVED.pop()
        return
    if not _ACCELERATOR_SAVED and sim.flavour == "cuda":  # the npu flavour's backend is already named npu
        _ACCELERATOR_SAVED.append(torch.accelerator.current_accelerator)
        torch.accelerator.current_accelerator = _framework_accelerator(_ACCELERATOR_SAVED[0])
    for name in (*_CUDA_SURFACE, "_lazy_init"):
        if name not in _CUDA_SAVED:
            _CUDA_SAVED[name] = getattr(cuda, name, None)
    for name in _CUDA_SURFACE:
        setattr(cuda, name, getattr(sim, name))
    cuda._lazy_init = lambda: None  # a CPU-only torch raises here for device="cuda" arguments


def uninstall() -> None:
    """Restore every wrapped entry point."""
    for (owner, name), original in reversed(list(_SAVED.items())):
        if original is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _SAVED.clear()


def _present_active() -> None:
    """torch_npu.contrib.transfer_to_npu was imported: torch.cuda answers for the active simulator from now on."""
    sim = _sim()
    if routes_cuda(sim):
        present_cuda(sim)


npu_ops.on_cuda_to_npu(_present_active)
