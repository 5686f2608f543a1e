"""SimTensor: a tensor on the simulated device, over CPU memory (Note [simulated device type]).

The wrapper reports the simulated device (`sim:N` / `npu:N`) and its own sizes and strides; the CPU tensor
inside (`_elem`) holds the data and is what the kernels run on. Views of a SimTensor wrap views of its
`_elem`, so they share memory as device views do. While a simulator is active its dispatch mode runs every
op (and the backend fallback below catches the few torch runs with Python dispatch off, such as
torch.tensor(data, device=...)); after it exits, a SimTensor still works, unchecked and untimed.
"""

from __future__ import annotations

from typing import Any

import torch

from device.sim import host_time
from device.sim.ops import _arg_names

_PLACEHOLDER_BYTES = 2**56


class SimTensor(torch.Tensor):
    _elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device) -> SimTensor:
        return wrap(elem, device, cls)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        body = repr(self._elem)
        if body.startswith("tensor(") and body.endswith(")"):
            body = body[: -1] + f", device='{self.device}')"
        return body

    def __format__(self, format_spec: str) -> str:
        # torch.Tensor.__format__ formats a 0-dim tensor as its number only when its type is exactly Tensor; a
        # 0-dim CUDA tensor formats as its number (f"{step}": Lightning's checkpoint names, say).
        if self.dim() == 0:
            return self.detach().item().__format__(format_spec)
        return super().__format__(format_spec)

    # Only dispatch is intercepted: torch.Tensor's default __torch_function__ is Python that every attribute
    # read goes through on a subclass (``p.grad`` 1.3 us, ``p.dtype`` 0.7 us on a 2-core host, against 0.16 and
    # 0.12 on a plain tensor), host time a device's tensors never cost; the ops it would rewrap come back from
    # the simulator's dispatch as SimTensors already.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Reached with no simulator active (one that is active sees every op first): the tensor outlives its
        # simulator and its ops run unchecked and untimed, so results can still be read after the block.
        return plain_dispatch(func, args, kwargs or {})

    # Memory is the CPU storage inside: FSDP's storage resizes, data_ptr identity and the simulator's
    # free_storage/alloc_storage act on it. (Its `.device` says cpu: a storage cannot carry our device.)
    # Both are simulator frames (host_time.counted): on a device they are C++ getters of well under a
    # microsecond, so their Python here is not the caller's host time.
    @host_time.counted
    def untyped_storage(self) -> torch.UntypedStorage:
        return self._elem.untyped_storage()

    @host_time.counted
    def data_ptr(self) -> int:
        return self._elem.data_ptr()

    def __reduce_ex__(self, protocol: int) -> Any:
        # torch.save writes a host copy (a dispatched device-to-host copy, ordered like any other), rebuilt on
        # load as torch's own function for backends without host-visible storage does (_rebuild_from_host).
        host = self.detach().cpu()
        return (_rebuild_from_host, (host, self.dtype, str(self.device), self.requires_grad))

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        # torch's Tensor.__deepcopy__ clones the storage (UntypedStorage.clone: a new storage, then a copy_ into it);
        # here that new storage would be one of the CPU tensor inside, which the simulator never saw allocated and so
        # takes for pageable host memory, where a deepcopy of a device tensor is device memory (a copy into it would
        # count as host to device, and its bytes as no device memory). So the new storage is allocated on the device
        # and filled by the same copy_, once per storage of a deepcopy (views of one storage stay views of one
        # copy), and the tensor rebuilt over it.
        found = memo.get(id(self))
        if found is not None:
            return found
        if not self.is_leaf:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment")  # fmt: skip
        storage = self._elem.untyped_storage()
        key = (SimTensor, storage._cdata)
        with torch.no_grad():
            base = memo.get(key)
            if base is None:
                whole = self.detach().as_strided((storage.nbytes() // self.element_size(),), (1,), 0)
                base = memo[key] = torch.empty_like(whole).copy_(whole)
            new = base.as_strided(self.size(), self.stride(), self.storage_offset())
        new.requires_grad_(self.requires_grad)
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        memo[id(self)] = new
        return new

    # torch.compile and Module._apply (swap_tensors) see the wrapper through this protocol.
    def __tensor_flatten__(self) -> tuple[list[str], torch.device]:
        return ["_elem"], self.device

    @staticmethod
    def __tensor_unflatten__(inner: dict, device: torch.device, outer_size: Any, outer_stride: Any) -> SimTensor:
        return SimTensor(inner["_elem"], device)


_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


def wrap(elem: torch.Tensor, device: torch.device, cls: type = SimTensor) -> SimTensor:
    """SimTensor(elem, device), without the class call's own frames: every op's new device output is made here."""
    out = _make_wrapper_subclass(
        cls,
        elem.size(),
        strides=elem.stride(),
        storage_offset=elem.storage_offset(),
        dtype=elem.dtype,
        layout=elem.layout,
        device=device,
        requires_grad=False,
        # The wrapper's own storage holds no memory (that is _elem's); sized past any tensor, so that
        # a resize_ or set_ of _elem can be mirrored on the wrapper's sizes (SimDevice._wrap).
        storage_size=_PLACEHOLDER_BYTES,
    )
    out._elem = elem
    return out


def _rebuild_from_host(data: torch.Tensor, dtype: torch.dtype, device: str, requires_grad: bool) -> torch.Tensor:
    """torch._utils._rebuild_device_tensor_from_cpu_tensor, which refuses a callable map_location; torch calls one
    with a CUDA tensor's storage (on the host) and its saved location, and places the tensor where the storage it
    returns lives (None: the saved device). Lightning loads with `lambda storage, loc: storage`: host memory."""
    map_location = torch.serialization._serialization_tls.map_location
    if map_location is None or isinstance(map_location, (dict, str, torch.device)):
        return torch._utils._rebuild_device_tensor_from_cpu_tensor(data, dtype, device, requires_grad)
    placed = map_location(data.untyped_storage(), device)
    tensor = data.to(dtype=dtype, device=device if placed is None else placed.device)
    tensor.requires_grad = requires_grad
    return tensor


torch.serialization.add_safe_globals([_rebuild_from_host])  # loads with weights_only, as torch's own function

_CPU = torch.device("cpu")
# Ops whose tensors may sit on different devices: copies (op_info().copy) and these.
_MIX_FREE = frozenset(
    getattr(torch.ops.aten, n) for n in ("set_", "index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index")
)
# In-place ops that change a tensor's sizes or strides: the wrapper follows the CPU tensor inside.
_META_INPLACE = frozenset(
    getattr(torch.ops.aten, n)
    for n in ("t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "resize_", "resize_as_", "set_", "swapdims_",
              "swapaxes_")  # fmt: skip
)
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)


def _unwrap(value: Any, found: list, hosts: list) -> Any:
    """value with SimTensors replaced by the CPU tensors inside (collected in found; host tensors in hosts)."""
    if type(value) is SimTensor:
        found.append(value)
        return value._elem
    if isinstance(value, torch.Tensor):
        hosts.append(value)
        return value
    # Nested lists too: c10d's scatter/gather/all_gather take Tensor[][] (one list per rank).
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (torch.Tensor, type(None), list, tuple)):
        out = []
        for v in value:  # a list of SimTensors (foreach and fused kernels, thousands long) without a frame per item
            if type(v) is SimTensor:
                found.append(v)
                out.append(v._elem)
            else:
                out.append(_unwrap(v, found, hosts))
        return out if type(value) is list else type(value)(out)
    return value


# torch.optim's fused kernels. Their float-lr overloads carry the dispatcher's device check
# (native_functions.yaml declares no `device_check: NoCheck` for them): every tensor, `state_steps` included, must
# be on the params' device, so a 0-dim host `step` is refused as CUDA refuses it ("... but got state_steps is on
# cpu ..."). Their `tensor_lr` overloads are `device_check: NoCheck`, and CUDA's kernels
# (aten/src/ATen/native/cuda/FusedAdamKernel.cu, FusedAdamWKernel.cu, FusedSgdKernel.cu, FusedAdagradKernel.cu)
# begin with `if (lr.is_cpu()) { ...(lr.item<double>()...); return; }`: a host lr of one element, of any rank,
# is read on the host; every other tensor must still be on the params' device.
_FUSED_OPTIMIZERS = frozenset(
    p
    for p in (getattr(torch.ops.aten, n, None) for n in (
        "_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_",
        "_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad",
    ))  # fmt: skip
    if p is not None
)


def is_fused_optimizer(func: Any) -> bool:
    return func.overloadpacket in _FUSED_OPTIMIZERS


def check_fused_optimizer(func: Any, args: tuple, kwargs: dict) -> None:
    """CUDA's device rule for a fused optimizer kernel (see _FUSED_OPTIMIZERS), on its arguments as the caller
    passed them: the first tensor's device is every tensor's, argument by argument, as torch's generated check
    names the first argument that differs."""
    tensor_lr = func._overloadname == "tensor_lr"
    common: torch.device | None = None
    common_index = None  # common's index when it is a SimTensor's device (a simulator has one device type)
    nargs = len(args)
    for position, name in enumerate(_arg_names(func)):
        value = args[position] if position < nargs else kwargs.get(name)
        if tensor_lr and name == "lr" and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            if value.numel() != 1:  # lr.item() in the kernel
                raise RuntimeError(f"a Tensor with {value.numel()} elements cannot be converted to Scalar")
            continue
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if type(t) is SimTensor and common_index is not None and t.get_device() == common_index:
                continue  # on common's device, told without making a torch.device per tensor
            if not isinstance(t, torch.Tensor):
                continue
            if common is None:
                common = t.device
                common_index = common.index if type(t) is SimTensor else None
            elif t.device != common:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but got {name} is on {t.device}, different "
                    f"from other tensors on {common} (when checking argument in method {func})"
                )


def _check_same_device(func: Any, found: list[SimTensor], hosts: list[torch.Tensor]) -> None:
    """CUDA's rule for ops built on TensorIterator (`device_check: NoCheck # TensorIterator` in
    native_functions.yaml, which most device kernels are): one kernel reads one device; a 0-dim host tensor
    passes as a scalar (TensorIterator reads a CPU scalar on the host). Fused optimizers: check_fused_optimizer."""
    first = found[0].device
    other = None
    for w in found[1:]:  # the first other device, if any (a loop: this runs for most ops of two tensors or more)
        if w.device != first:
            other = w.device
            break
    if other is None and hosts:
        other = next((h.device for h in hosts if h.dim() > 0 and h.layout is torch.strided), None)
    if other is not None:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {first} and {other}! "
            f"(in {func})"
        )


def _sync_metadata(w: SimTensor) -> None:
    """Give the wrapper the sizes, strides and offset its CPU tensor took (t_, resize_, set_...)."""
    e = w._elem
    if w.size() != e.size() or w.stride() != e.stride() or w.storage_offset() != e.storage_offset():
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            torch.ops.aten.as_strided_.default(w, e.size(), e.stride(), e.storage_offset())


def wrap_outputs(out: Any, found: list[SimTensor], hosts: list[torch.Tensor], device: torch.device | None, packet: Any) -> Any:
    """Outputs as the caller sees them: an input (in-place, out=) as the object passed in, a new tensor on
    `device` as a SimTensor, a new host tensor (device None) as itself."""
    if isinstance(out, (list, tuple)):
        return type(out)(wrap_outputs(o, found, hosts, device, packet) for o in out)
    if not isinstance(out, torch.Tensor):
        return out
    for w in found:
        if w._elem is out:
            if packet in _META_INPLACE:
                _sync_metadata(w)
            return w
    for h in hosts:
        if h is out:
            return h
    return out if device is None else wrap(out, device)


def plain_dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run an op on SimTensors with no simulator: on the CPU tensors inside, outputs on the inputs' device."""
    found: list[SimTensor] = []
    hosts: list[torch.Tensor] = []
    args = tuple([_unwrap(a, found, hosts) for a in args])
    kwargs = {k: _unwrap(v, found, hosts) for k, v in kwargs.items()}
    device = found[0].device if found else None
    target = kwargs.get("device")
    if target is not None:
        target = torch.device(target)
        device = None if target.type == "cpu" else torch.device(target.type, target.index or 0)
        kwargs["device"] = _CPU
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
        out = func(*args, **kwargs)
    return wrap_outputs(out, found, hosts, device, func.overloadpacket)
