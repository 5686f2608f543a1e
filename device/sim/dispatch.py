"""How the simulated device runs each aten op: Dispatch, the part of SimDevice that its dispatch mode
(device/sim/modes.py) and its backend kernels (device/sim/backend.py) hand every op to. It unwraps SimTensors to
the CPU tensors inside, decides where new outputs go, applies CUDA's device rules (and the npu flavour's
kernels), classifies what the op touches (device/sim/accesses.py), checks it (device/sim/race_checks.py), runs
it on the host or on a stream, accounts new device memory (device/sim/storages.py) and places it on the
timeline (device/sim/timeline.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from device.sim import kernels, npu_ops
from device.sim.accesses import DEVICE, HOST_MEM, HOST_OUT, PINNED_OUT, op_lane
from device.sim.accesses import Arg as _Arg
from device.sim.memory import OutOfMemoryError
from device.sim.ops import OpInfo, factory_bytes, fresh_outputs, new_outputs, tensors
from device.sim.plans import _PLANS, _Plan, _plan
from device.sim.tensor import (
    _CPU,
    _META_INPLACE,
    _PLACEHOLDER_BYTES,
    SimTensor,
    _check_same_device,
    _make_wrapper_subclass,
    _sync_metadata,
    _unwrap,
    check_fused_optimizer,
    wrap_outputs,
)
from device.sim.timeline import Timeline

# Tensor types whose __torch_dispatch__ is this one have no subclass behavior (plain tensors, Parameter).
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_autograd_node = torch._C._current_autograd_node


def _holds_tensors(value: Any) -> bool:
    """Whether _unwrap would look inside `value`: a tensor, or a list or tuple whose first item is a tensor, None
    or another list (a list of sizes holds none)."""
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], (torch.Tensor, type(None), list, tuple))


class Dispatch:
    """SimDevice's op dispatch. Mixed into SimDevice (device/sim/device.py), whose __init__ makes the state used
    here (_timeline, _labels, _pending, _host_alloc, _late_frees, _held, ...)."""

    # Set by SimDevice.__init__.
    _timeline: Timeline
    _labels: list[str]
    _pending: BaseException | None
    _host_alloc: int
    backend: str
    flavour: str
    sanitize: bool
    cpu_fallbacks: dict[str, int]
    strided_copies: int

    def _keep(self, err: BaseException) -> None:
        """An error inside backward, raised when backward() returns (Note [backward on the caller's thread]);
        the first one wins, as the first is what a pass on hardware would have stopped at."""
        if self._pending is None:
            self._pending = err

    def _deferred(self, err: BaseException, func: Any, args: tuple, kwargs: dict) -> Any:
        """An error of the op `func` inside backward (Note [backward on the caller's thread]): kept to be
        raised when backward() returns, and the op run plainly so that the pass can finish."""
        self._keep(err)
        found: list[SimTensor] = []
        hosts: list[torch.Tensor] = []
        args = tuple([_unwrap(a, found, hosts) for a in args])
        kwargs = {k: _unwrap(v, found, hosts) for k, v in kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = _CPU
        with torch.utils._python_dispatch._disable_current_modes():
            out = func(*args, **kwargs)
        place = found[0].device.index if found else HOST_OUT
        return self._wrap(out, found, hosts, place, func.overloadpacket)

    def _raise_pending(self) -> None:
        if self._pending is not None:
            err, self._pending = self._pending, None
            raise err

    def _label(self) -> str | None:
        return self._labels[-1] if self._labels else None

    def _profiler_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        name = str(func)
        if "enter" in name and args and isinstance(args[0], str):
            self._labels.append(args[0])
        elif "exit" in name and self._labels:
            # record_function ranges nest like context managers (the exit handle is a fresh
            # ScriptObject each time, so match by position, not identity).
            self._labels.pop()
        return out

    def _dispatch(self, func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
        if self._late_frees:
            self._drain_frees()
        if self._held:
            self._release_collectives()
        plan = _PLANS.get(id(func)) or _plan(func)
        if plan.profiler:
            return self._profiler_op(func, args, kwargs)
        for t in types:
            if t is SimTensor:
                continue
            if issubclass(t, FakeTensor):
                return func(*args, **kwargs)
            if t.__torch_dispatch__ is not _PLAIN_DISPATCH:
                return NotImplemented  # let the subclass (DTensor) run; its local ops come back here
        if plan.view:
            return self._view_op(plan, args, kwargs)
        return self._device_dispatch(func, args, kwargs, plan)

    def _view_op(self, plan: _Plan, args: tuple, kwargs: dict) -> Any:
        """A view or metadata op (plan.view: t, view, expand, detach, ... most ops of a training step) of device
        tensors alone: what _device_dispatch and _run do for it, written out. It reads and writes no data, so
        there is nothing to check or time; its outputs wrap views of the CPU tensors inside, on the inputs'
        device, and accesses made through them later are checked against their storage as any other's."""
        found: list[SimTensor] = []
        unwrapped = []
        for a in args:  # _unwrap, with its commonest cases inline
            kind = type(a)
            if kind is SimTensor:
                found.append(a)
                unwrapped.append(a._elem)
            elif kind is int or kind is float or kind is bool or a is None:
                unwrapped.append(a)
            elif _holds_tensors(a):  # host tensors, lists of tensors: the general way
                return self._device_dispatch(plan.func, args, kwargs, plan)
            else:
                unwrapped.append(a)  # sizes, dtypes, ...
        if not found or (kwargs and any(_holds_tensors(v) for v in kwargs.values())):
            return self._device_dispatch(plan.func, args, kwargs, plan)
        if plan.same_device and len(found) > 1:
            _check_same_device(plan.func, found, [])
        out = plan.call(*unwrapped, **kwargs)
        # Storages resized behind the dispatcher are picked up here as by any op (_refresh_sizes).
        storages = self._storages
        for w in found:
            e = w._elem
            if e.layout is not torch.strided:
                continue
            storage = e.untyped_storage()
            info = storages.get(storage._cdata)
            if info is not None and info.kind == DEVICE and storage.nbytes() != info.nbytes:
                self._refresh_sizes([_Arg(e, storage, info, "v")])
        device = found[0].device
        if type(out) is torch.Tensor:
            for w in found:
                if w._elem is out:  # returns its input (lift_fresh, detach_)
                    return w
            # wrap(out, device), written out: most ops of a training step come here
            made = _make_wrapper_subclass(
                SimTensor, out.size(), strides=out.stride(), storage_offset=out.storage_offset(), dtype=out.dtype,
                layout=out.layout, device=device, requires_grad=False, storage_size=_PLACEHOLDER_BYTES,
            )  # fmt: skip
            made._elem = out
            return made
        return wrap_outputs(out, found, [], device, plan.packet)

    def _route(self, device: Any) -> int:
        """The placement a `device=` argument names: a device index, or HOST_OUT for the host. The cuda
        flavour takes "cuda" for its own device type, as code written for CUDA names it, and so does the npu
        flavour after torch_npu.contrib.transfer_to_npu is imported, as torch_npu's does."""
        d = device if isinstance(device, torch.device) else torch.device(device)
        if d.type == "cpu":
            return HOST_OUT
        if d.type == self.backend or (d.type == "cuda" and (self.flavour == "cuda" or npu_ops.cuda_to_npu())):
            index = self._index(d)
            return self.current_device() if index is None else index
        raise RuntimeError(
            f"device {d} is not available here: the simulated {self.flavour} device is {self.backend!r} "
            f"(and the host is cpu)"
        )

    def _device_dispatch(self, func: Any, args: tuple, kwargs: dict, plan: _Plan | None = None) -> Any:
        """An op with SimTensors unwrapped to the CPU tensors inside (Note [simulated device type]): where its
        outputs go, CUDA's device rules, pinning, the npu flavour's kernels; then run it (_run) and wrap what
        it made on a device."""
        plan = plan or _plan(func)
        fused = plan.fused
        if fused and not (self.flavour == "npu" and plan.npu_kind == kernels.CPU_FALLBACK):
            # CUDA's rule for these kernels (device.sim.tensor._FUSED_OPTIMIZERS). torch_npu's CPU fallback copies
            # every argument to the host first, so there host tensors of any shape are fine.
            check_fused_optimizer(func, args, kwargs)
        found: list[SimTensor] = []
        hosts: list[torch.Tensor] = []
        unwrapped = []
        for a in args:  # _unwrap, with its commonest cases inline (this runs for every argument of every op)
            kind = type(a)
            if kind is SimTensor:
                found.append(a)
                unwrapped.append(a._elem)
            elif kind is int or kind is float or kind is bool or a is None:
                unwrapped.append(a)
            else:
                unwrapped.append(_unwrap(a, found, hosts))
        args = tuple(unwrapped)
        if kwargs:
            kwargs = {k: _unwrap(v, found, hosts) for k, v in kwargs.items()}
        packet = plan.packet
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta":
            return func(*args, **kwargs)  # meta tensors hold no memory and run no kernel, as on CUDA
        if device is not None:
            place = self._route(device)
            kwargs["device"] = _CPU
        elif found:
            place = found[0].device.index
        else:
            place = HOST_OUT
        if found and plan.same_device and (hosts or len(found) > 1):  # one device tensor alone cannot mix
            _check_same_device(func, found, hosts)
        if plan.pins and packet is torch.ops.aten.is_pinned:
            if found:
                return False
            return self._is_pinned(args[0])
        if (plan.pins and packet is torch.ops.aten._pin_memory) or kwargs.get("pin_memory"):
            # Only host memory can be pinned: pinning a device tensor, or a pinned result on the device, is
            # refused as CUDA refuses it; a pinned host result shaped like a device tensor
            # (`empty_like(t, device="cpu", pin_memory=True)`) is fine, as on CUDA.
            if place >= 0 or (packet is torch.ops.aten._pin_memory and found):
                kind = found[0].device.type if found else self.backend
                raise RuntimeError(f"cannot pin '{kind}' memory: only dense CPU tensors can be pinned")
            if found and plan.op.copy:
                # A copy of device data into a new pinned host tensor (`_to_copy(t, device="cpu",
                # pin_memory=True)`): a device-to-host copy on the stream, its output pinned.
                kwargs["pin_memory"] = False
                return self._wrap(self._run(func, args, kwargs, PINNED_OUT), found, hosts, HOST_OUT, packet)
            return self._pinned_alloc(func, args, kwargs)
        if place == HOST_OUT and packet is torch.ops.aten._to_copy and found and kwargs.get("non_blocking"):
            place = PINNED_OUT
        fallback = False
        if self.flavour == "npu" and found:  # fused optimizer kernels as op-plugin has them (device.sim.kernels)
            kind = plan.npu_kind
            if kind == kernels.NATIVE:
                kernels.check_npu_args(func, kwargs)
            if kind == kernels.IGNORES_SCALING:
                kwargs = kernels.without_scaling(kwargs)
            fallback = kind == kernels.CPU_FALLBACK
            if fallback:
                name = func.overloadpacket.__name__
                self.cpu_fallbacks[name] = self.cpu_fallbacks.get(name, 0) + 1
                self._host_sync_stream()  # the fallback's copies to the host wait for the stream's queued work
        out = self._run(func, args, kwargs, place, plan)
        if fallback:
            self._host_sync_stream()  # ... and its copies back are synchronous too
        if place < 0 and not found:
            return out
        if type(out) is torch.Tensor and place >= 0 and not plan.has_out:
            # One tensor on a device (most ops that compute): wrap_outputs' answer, written out.
            for w in found:
                if w._elem is out:  # an input returned (in place)
                    if packet in _META_INPLACE:
                        _sync_metadata(w)
                    return w
            if not any(h is out for h in hosts):  # a new tensor
                made = _make_wrapper_subclass(
                    SimTensor, out.size(), strides=out.stride(), storage_offset=out.storage_offset(),
                    dtype=out.dtype, layout=out.layout, device=self._device_objects.get(place)
                    or self._torch_device_of(place), requires_grad=False, storage_size=_PLACEHOLDER_BYTES,
                )  # fmt: skip
                made._elem = out
                return made
        wrapped = self._wrap(out, found, hosts, place, packet)
        if found and plan.has_out:
            # An out= argument the kernel resized (an empty `out`, as torch allows): its wrapper takes the
            # sizes its CPU tensor now has, as a device tensor's own sizes would change.
            for w in found:
                _sync_metadata(w)
        return wrapped

    def _wrap(self, out: Any, found: list[SimTensor], hosts: list[torch.Tensor], place: int, packet: Any) -> Any:
        return wrap_outputs(out, found, hosts, self._torch_device_of(place) if place >= 0 else None, packet)

    def _torch_device_of(self, index: int) -> torch.device:
        """torch.device(self.backend, index), made once per index."""
        made = self._device_objects.get(index)
        if made is None:
            made = self._device_objects[index] = torch.device(self.backend, index)
        return made

    def _pinned_alloc(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """pin_memory=True factories and Tensor.pin_memory() of host tensors give host memory, like pinned_empty
        (pinning device memory was refused before: _device_dispatch)."""
        if func.overloadpacket is torch.ops.aten._pin_memory:
            func, args, kwargs = torch.ops.aten.clone.default, args[:1], {}
        else:
            kwargs = {**kwargs, "pin_memory": False}  # a CPU-only torch cannot pin
        self._host_alloc += 1
        try:
            return self._run(func, args, kwargs, HOST_OUT)
        finally:
            self._host_alloc -= 1

    def _run(self, func: Any, args: tuple, kwargs: dict, place: int, plan: _Plan | None = None) -> Any:
        """Run one op on unwrapped tensors. ``place``: where new outputs go (a device index, HOST_OUT or
        PINNED_OUT)."""
        plan = plan or _plan(func)
        op = plan.op
        tensor_args: list[_Arg] = []
        has_input = has_device = False
        storages = self._storages
        nargs = len(args)
        for position, name, role in op.roles:
            value = args[position] if position < nargs else kwargs.get(name)
            for t in (value,) if type(value) is torch.Tensor else tensors(value):
                if not t.is_cpu or t.layout is not torch.strided:
                    continue
                storage = t.untyped_storage()
                info = storages.get(storage._cdata)
                if info is None and self._host_starts and role != "v":
                    t, storage, info = self._alias(t, storage)  # Note [aliases of host memory]
                if info is None and role != "v" and t.numel() and storage._cdata in self._first_uid:
                    raise RuntimeError(
                        f"{func} used a device tensor of shape {tuple(t.shape)} whose memory free_storage gave "
                        "back (a GPU would fault, or read memory now someone else's)"
                    )
                has_input = True
                has_device = has_device or (info is not None and info.kind == DEVICE)
                tensor_args.append(_Arg(t, storage, info, role))
        accesses = [a for a in tensor_args if a.role != "v"]
        if op.resize and has_device:
            self._check_resize(func, args, kwargs, tensor_args)
        if not accesses and not op.new_outputs:
            out = plan.call(*args, **kwargs)  # views and metadata
            if has_device:
                self._refresh_sizes(tensor_args)
            return out
        creates_device = op.new_outputs and place >= 0
        if self._host_alloc or not (has_device or creates_device):
            return self._host_op(func, op, args, kwargs, accesses)
        return self._stream_op(func, plan, args, kwargs, tensor_args, accesses, has_device, has_input, place)

    def _host_op(self, func: Any, op: OpInfo, args: tuple, kwargs: dict, accesses: list[_Arg]) -> Any:
        tracked = [a for a in accesses if a.info is not None]
        if self.sanitize and tracked:
            host = self._tls.host  # _host()
            epoch = self._clocks.tick(host)
            self._check_and_log(op.name, [(a, host, epoch) for a in tracked])
        out = func(*args, **kwargs)
        if self._host_alloc:
            for t in new_outputs(func, out):
                storage = t.untyped_storage()
                if self._lookup(storage) is None:
                    self._register(storage, HOST_MEM)
        elif not op.alloc_only:
            labels = self._labels
            self._timeline.host_op(sum(a.tensor.nbytes for a in accesses), op.name, labels[-1] if labels else None)
        return out

    def _stream_op(
        self,
        func: Any,
        plan: _Plan,
        args: tuple,
        kwargs: dict,
        tensor_args: list[_Arg],
        accesses: list[_Arg],
        has_device: bool,
        has_input: bool,
        place: int,
    ) -> Any:
        """Run a device op on its stream: on device tensors, with the simulator's own kernel where torch's CPU
        kernel cannot compute it (plan.kernel, device.sim.kernels.device_kernel)."""
        op = plan.op
        kernel = plan.kernel if has_device else None
        node = _autograd_node()  # _op_stream(), written out
        stream = self._node_stream(node) if node is not None else (self._tls.current or self._default)
        if self._captures and stream.actor in self._captures:
            # Note [graph capture]: recorded into the graph, not run; outputs from the graph's pool.
            return self._capture_op(func, plan, args, kwargs, tensor_args, accesses, has_device, place, stream)
        index = place if place >= 0 else None
        if not has_input:  # a factory: refuse before allocating
            need = factory_bytes(func, args, kwargs)
            if not self._memory(index).fits(need):
                raise self._oom(need, index)
        new_on_device = place >= 0
        if op.copy or op.local_scalar:
            lane, blocking, staged_src = op_lane(func, op, args, kwargs, accesses, new_on_device)
        else:  # op_lane's answer for every other op
            lane, blocking, staged_src = "compute", op.sync or op.value_return, False
        if self.flavour == "npu" and op.copy and lane in ("h2d", "d2h") and not blocking and not all(
            a.tensor.is_contiguous() for a in accesses
        ):
            # torch_npu copies a non-contiguous host<->device pair through contiguous temporaries and waits for
            # the copy stream: the host blocks, however non_blocking was asked.
            blocking = True
            self.strided_copies += 1
        if blocking and self._captures:  # a host wait while streams capture (Note [graph capture])
            self._capture_unsafe(f"{op.name} on {stream.name}, which makes the host wait for it,")

        host = self._tls.host  # _host()
        clocks = self._clocks
        clocks.merge(stream.actor, clocks._vc[host])  # merge_actor: a launch follows everything the host did before it
        epoch = clocks.tick(stream.actor)
        if self.sanitize and accesses:
            # Copies access host memory from the stream; other kernels only take host scalars, read at launch.
            host_epoch = 0
            checks = []
            for a in accesses:
                info = a.info
                if (info is None or info.kind != DEVICE) and (not op.copy or (staged_src and not a.writes)):  # host_side
                    host_epoch = host_epoch or self._clocks.tick(host)
                    checks.append((a, host, host_epoch))
                else:
                    checks.append((a, stream.actor, epoch))
            self._check_and_log(op.name, checks)

        out = (kernel or plan.call)(*args, **kwargs)

        new = fresh_outputs(plan.fresh, out)
        created = []
        pinned = []
        storages = self._storages
        try:
            for t in new:
                storage = t.untyped_storage()
                if storages.get(storage._cdata) is not None:  # _lookup
                    continue
                if new_on_device:
                    created.append((t, storage, self._register(storage, DEVICE, stream.actor, index=index)))
                elif place == PINNED_OUT:  # .to("cpu", non_blocking=True) copies into pinned memory, as torch does
                    pinned.append((t, self._register(storage, HOST_MEM)))
        except OutOfMemoryError:  # the op's outputs are dropped, as if the allocation had failed
            for _, storage, _ in created:
                self._forget(storage)
            raise
        self._refresh_sizes(tensor_args)
        if self.sanitize:
            # A fresh block is safe to use on its allocation stream only: the caching allocator may hand out
            # memory whose last user on that stream is still queued, so other streams must wait for it first.
            name = f"{op.name} (allocation)" if op.alloc_only else op.name
            for t, _, info in created:
                self._log_new(t, info, stream, epoch, name)
            # The stream writes a pinned output until the copy is done: the host may read it only after.
            for t, info in pinned:
                self._log_new(t, info, stream, epoch, name)
        if op.alloc_only:
            return out

        if lane == "compute":
            nbytes = 0
            for a in accesses:  # Arg.traffic
                nbytes += a.tensor.nbytes * (2 if a.role == "w" else 1)
            for t in new:
                nbytes += t.nbytes
        elif op.local_scalar:
            nbytes = sum(a.tensor.element_size() for a in accesses)
        else:
            nbytes = sum(a.tensor.nbytes for a in accesses if a.writes) + sum(t.nbytes for t in new)
        flops = plan.flops(func, args, kwargs) if plan.flops is not None and lane == "compute" else None
        # The tensors it takes set the host's cost of issuing it (Note [host clock] in device/sim/timeline.py).
        labels = self._labels
        timed = self._timeline.launch(stream.name, stream.tail_us, lane, nbytes, op.name, labels[-1] if labels else None,
                                      flops, tensors=len(tensor_args))
        stream.tail_us = timed.end_us
        if blocking:
            self._clocks.merge_actor(host, stream.actor)
            self._timeline.wait_host(timed.end_us)
        return out
