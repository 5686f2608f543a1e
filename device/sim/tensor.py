"""SimTensor: a tensor on the simulated device, over CPU memory (Note [simulated device type]).

The wrapper reports the simulated device (`sim:N` / `npu:N`) and its own sizes and strides; the CPU tensor
inside (`_elem`) holds the data and is what the kernels run on. Views of a SimTensor wrap views of its
`_elem`, so they share memory as device views do. Only the simulator's dispatch mode runs ops on them: a
SimTensor used with no simulator active raises, as a CUDA tensor would after its context is gone.
"""

from __future__ import annotations

from typing import Any

import torch


class SimTensor(torch.Tensor):
    _elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device) -> SimTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=device,
            requires_grad=False,
        )
        out._elem = elem
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        body = repr(self._elem)
        if body.startswith("tensor(") and body.endswith(")"):
            body = body[: -1] + f", device='{self.device}')"
        return body

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(
            f"{func} on a simulated device tensor with no simulator active: it belongs to a simulator that "
            f"has exited (device.sim.activate), as a CUDA tensor is unusable once its context is gone"
        )

    # Memory is the CPU storage inside: FSDP's storage resizes, data_ptr identity and the simulator's
    # free_storage/alloc_storage act on it. (Its `.device` says cpu: a storage cannot carry our device.)
    def untyped_storage(self) -> torch.UntypedStorage:
        return self._elem.untyped_storage()

    def data_ptr(self) -> int:
        return self._elem.data_ptr()

    def __reduce_ex__(self, protocol: int) -> Any:
        # torch.save writes a host copy (a dispatched device-to-host copy, ordered like any other), rebuilt on
        # load with torch's own function for backends without host-visible storage (allowed by weights_only).
        host = self.detach().cpu()
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (host, self.dtype, str(self.device), self.requires_grad),
        )

    # torch.compile and Module._apply (swap_tensors) see the wrapper through this protocol.
    def __tensor_flatten__(self) -> tuple[list[str], torch.device]:
        return ["_elem"], self.device

    @staticmethod
    def __tensor_unflatten__(inner: dict, device: torch.device, outer_size: Any, outer_stride: Any) -> SimTensor:
        return SimTensor(inner["_elem"], device)


def unwrap(t: Any) -> Any:
    return t._elem if type(t) is SimTensor else t
