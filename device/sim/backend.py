"""The simulated accelerator's place in torch: a PrivateUse1 backend registered from Python.

Note [simulated device type]
A simulated device tensor must say where it lives (`t.device.type`, an index), copy on `.to()`/`.cpu()`,
refuse to mix with host tensors, and take torch's own device-type branches (fused/foreach support
lists, autocast, GradScaler). Two ways exist on a CPU-only torch:
- a C++ PrivateUse1 backend with an allocator and kernels (torch_npu's way; PyTorch's
  open_registration_extension): a compiler in CI and a second copy of every kernel;
- a wrapper tensor subclass over CPU storage (as FakeTensor carries a device over meta storage) on a
  PrivateUse1 backend that torch lets Python register (`torch._C._acc`: hooks and a device guard, which
  the autograd engine needs for any non-CPU device; torch >= 2.9).
We take the second: the real kernels run on the CPU tensors inside (`SimTensor._elem`, bitwise the same
numbers), and the simulator's dispatch mode sees every op first. Its cost is one Python frame per op,
which the simulator's dispatch mode already paid (bench/results/sim-overhead-*).

The device type cannot be `cuda`: torch refuses to rename PrivateUse1 to an in-tree name, and a
`cuda`-typed tensor cannot enter autograd on a CPU-only build (the engine takes its streams from CUDA's
hooks, which only libtorch_cuda registers, before any extension could load). So the flavours are:
- `npu` (preset 910b): the backend is named `npu`, as torch_npu names it; `torch.npu` and an importable
  `torch_npu` module present the simulator. It also behaves where torch_npu differs from CUDA: op-plugin's
  fused optimizer kernels (device.sim.kernels), torch_npu's GradScaler (`torch.npu.amp`, device.sim.npu_amp),
  a new stream object from every current_stream()/default_stream(), recordStream that does not skip the
  allocating stream, pinned host allocations rounded up to a power of two, non-contiguous host<->device
  copies that block the host, and Event.elapsed_time that synchronizes the device (device.sim.device);
- `cuda` (preset h100): the backend is named `sim`; `torch.cuda`'s functions, `.cuda()`, `.to("cuda")` and
  `device="cuda"` route to the simulated device (device/sim/entry_points.py), so code written for CUDA
  runs unchanged, while `t.device.type` says `sim`.
PrivateUse1 takes one name per process: a process simulates one flavour.
"""

from __future__ import annotations

import functools
import importlib.machinery
import itertools
import sys
import types
from typing import Any

import torch

from device.sim import kernels, npu_amp, npu_ops
from device.sim.active import active
from device.sim.tensor import SimTensor, plain_dispatch

FLAVOURS = ("cuda", "npu")
# The PrivateUse1 name each flavour registers (see the Note above for why cuda's is not "cuda").
BACKEND_NAMES = {"cuda": "sim", "npu": "npu"}

_REGISTERED: list[str] = []  # the flavour registered in this process


def registered_flavour() -> str | None:
    return _REGISTERED[0] if _REGISTERED else None


def backend_name(flavour: str | None = None) -> str:
    """The device type simulated tensors report: "sim" (cuda flavour) or "npu"."""
    return BACKEND_NAMES[flavour or registered_flavour() or "cuda"]


def supported() -> bool:
    """Whether this torch lets Python register a PrivateUse1 backend (torch._C._acc)."""
    acc = getattr(torch._C, "_acc", None)
    return acc is not None and hasattr(acc, "register_python_privateuseone_device_guard")


class _Hooks(getattr(getattr(torch._C, "_acc", None), "PrivateUse1Hooks", object)):  # type: ignore[misc]
    """What torch asks a PrivateUse1 backend at run time (the autograd engine, pin_memory, is_available)."""

    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_PRIVATE_USE1 = torch._C._autograd.DeviceType.PrivateUse1


class _Guard(getattr(getattr(torch._C, "_acc", None), "DeviceGuard", object)):  # type: ignore[misc]
    # Asked from C++ for every device and stream guard the autograd engine takes (about two per op of a
    # backward pass). A constant's iterator method answers it without a Python frame: pybind11 calls whatever
    # `type_` the instance has, and takes anything but a C++ function (PyCFunction) for an override (a
    # method-wrapper is not one, and binds to no instance).
    type_ = itertools.repeat(_PRIVATE_USE1).__next__


class DeviceModule(types.ModuleType):
    """`torch.npu` / `torch.sim`: the registered device module. It outlives any one simulator, so every
    attribute is looked up on the active simulator (device.sim.active()), or fails clearly without one."""

    def __getattr__(self, name: str) -> Any:
        sim = active()
        if sim is None:
            # Between simulators the device is gone: torch's own probes (hasattr, is_available, seeding
            # every device from torch.manual_seed) get "absent" answers, anything else AttributeError.
            if name in ("is_available", "is_initialized", "_is_in_bad_fork"):
                return lambda *a, **k: False
            if name == "device_count":
                return lambda *a, **k: 0
            if name in ("manual_seed", "manual_seed_all"):
                return lambda *a, **k: None
            raise AttributeError(f"torch.{self.__name__.split('.')[-1]}.{name}: no simulated device is active")
        return getattr(sim, name)


# The ops torch runs on the backend itself with Python dispatch off (torch.tensor(data, device=...)).
_BACKEND_OPS = ("empty_strided", "empty.memory_format", "copy_", "_copy_from", "_copy_from_and_resize")


def _backend_kernel(packet: Any, *args: Any, **kwargs: Any) -> Any:
    """Every aten op that reaches the backend itself: torch runs a few with Python dispatch off (torch.tensor
    (data, device=...) builds on the host and copies over that way). Hand them to the active simulator as
    its dispatch mode would have, or run them plainly without one."""
    op = _overload(packet, args, kwargs)
    sim = active()
    if sim is None:
        return plain_dispatch(op, args, kwargs)
    with sim._lock:
        return sim._dispatch(op, (SimTensor,), args, kwargs)


def _overload(packet: Any, args: tuple, kwargs: dict) -> Any:
    """The overload of `packet` these arguments call (a backend kernel is registered per overload name)."""
    if packet is torch.ops.aten.empty:
        return torch.ops.aten.empty.memory_format
    return packet.default


# The library that holds the backend's fallback kernel (kept alive: it unregisters when collected).
_KERNELS = torch.library.Library("aten", "IMPL")


def _op_kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
    """A backend kernel registered for one overload (cpu_kernel_composites): run as _backend_kernel runs its ops."""
    sim = active()
    if sim is None:
        return plain_dispatch(op, args, kwargs)
    with sim._lock:
        return sim._dispatch(op, (SimTensor,), args, kwargs)


def cpu_kernel_composites() -> list[str]:
    """aten ops (overload names) that have a CPU kernel, a derivative formula (VariableType) and, for every other
    backend, a CompositeImplicitAutograd decomposition (silu_backward, mish_backward, native_channel_shuffle in
    torch 2.13). A backend with no kernel of its own gets the decomposition at its Autograd key, before any
    dispatch mode sees the op, so the simulated device would compute with other ops than the CPU does (and than
    CUDA, which has its own kernel), and round differently (silu_backward by up to 4.8e-7). A PrivateUse1 kernel
    makes the dispatcher take the derivative formula instead, and the op itself reaches the simulator, which runs
    the CPU kernel."""
    found = []
    C = torch._C
    for name in C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        if not (C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
                and C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")):  # fmt: skip
            continue
        autograd = [line for line in C._dispatch_dump(name).splitlines() if line.startswith("Autograd[alias]")]
        if autograd and "VariableType" in autograd[0]:
            found.append(name.removeprefix("aten::"))
    return found


def _npu_package(module: DeviceModule) -> types.ModuleType:
    """An importable `torch_npu` whose `npu` is torch.npu, as the real package presents it."""
    pkg = types.ModuleType("torch_npu")
    pkg.__path__ = []  # a package, so `import torch_npu.npu` works
    pkg.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, is_package=True)  # find_spec answers
    pkg.__swapopt_simulated__ = True
    pkg.npu = module
    pkg.__version__ = f"{torch.__version__.split('+')[0]}.sim"
    return pkg


def register(flavour: str) -> None:
    """Register the backend for `flavour` (once per process; a second flavour raises)."""
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown simulator flavour {flavour!r}; choose one of: {', '.join(FLAVOURS)}")
    if _REGISTERED:
        if _REGISTERED[0] != flavour:
            raise RuntimeError(
                f"this process already simulates the {_REGISTERED[0]!r} flavour (device type "
                f"{backend_name(_REGISTERED[0])!r}); torch names its PrivateUse1 backend once per process, so the "
                f"{flavour!r} flavour needs a process of its own (SWAPOPT_SIM_PRESET selects it at start)"
            )
        return
    if not supported():
        raise RuntimeError(
            f"the simulated device needs torch >= 2.9 (torch._C._acc registers a Python backend); this is "
            f"torch {torch.__version__}"
        )
    name = BACKEND_NAMES[flavour]
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", name):
        raise RuntimeError(
            f"torch's PrivateUse1 backend is already named {current!r} (a real torch_npu?); the simulated "
            f"{flavour} device cannot be registered in this process"
        )
    module = DeviceModule(f"torch.{name}")
    if current != name:
        torch.utils.rename_privateuse1_backend(name)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    torch._register_device_module(name, module)
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
    for name in _BACKEND_OPS:
        _KERNELS.impl(name, functools.partial(_backend_kernel, getattr(torch.ops.aten, name.split(".")[0])), "PrivateUse1")
    for name in cpu_kernel_composites():  # the CPU's kernel, not a decomposition (cpu_kernel_composites)
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        _KERNELS.impl(name, functools.partial(_op_kernel, op), "PrivateUse1")
    _KERNELS.impl("scaled_dot_product_attention", kernels.sdpa_kernel, "AutogradPrivateUse1")  # the CPU's choice
    if flavour == "npu" and "torch_npu" not in sys.modules:
        sys.modules["torch_npu"] = _npu_package(module)
        npu_ops.install(sys.modules["torch_npu"])  # the torch_npu names frameworks import (device.sim.npu_ops)
        sys.modules["torch_npu.npu"] = sys.modules["torch.npu"] = module  # torch.npu is torch_npu.npu
        module.amp = sys.modules["torch_npu.npu.amp"] = npu_amp.module()  # torch.npu.amp.GradScaler
    _REGISTERED.append(flavour)
