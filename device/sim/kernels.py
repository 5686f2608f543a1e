"""Device kernels that differ from torch's CPU ones: fused optimizer kernels as the npu flavour has them, and
kernels a device has for dtypes the CPU build lacks (device_kernel, at the end).

torch_npu's kernels come from op-plugin, which registers fewer fused optimizer kernels than CUDA has, and one of
those differs from CUDA's.

From Ascend/op-plugin (master 517f2e7d0, op_plugin/config/op_plugin_functions.yaml):
- ``_fused_adamw_`` with a float lr (yaml :615-616, all torch versions): FusedAdamWKernelNpuOpApi.cpp
  :20-65 never reads ``grade_scale`` (sic) or ``found_inf``: grads are not unscaled and an inf step is
  applied. Modeled by running the kernel with both set to None.
- ``_fused_sgd_`` (float and tensor lr, yaml :5591-5596): only from torch 2.7 (``op_api: [v2.7, newest]``);
  it reads both, and refuses momentum 0 (FusedSgdKernelOpApi.cpp :36, :81).
- no ``_fused_adam_``, no ``_fused_adamw_.tensor_lr``, no ``_fused_adagrad_``: torch_npu runs them
  through its CPU fallback, which copies every argument to the host, runs the CPU kernel and copies the
  results back, synchronously. Modeled as a host wait for the stream before and after the kernel (the
  timeline shows the pipeline serialized), counted per kernel in ``SimDevice.cpu_fallbacks``.
"""

from __future__ import annotations

from typing import Any

import torch

from device.sim.tensor import SimTensor

NATIVE = "native"  # an NPU kernel with CUDA's semantics
IGNORES_SCALING = "ignores_scaling"  # an NPU kernel that drops grad_scale/found_inf
CPU_FALLBACK = "cpu_fallback"  # no NPU kernel: torch_npu's synchronous CPU fallback


# torch.optim's fused kernels (aten); any other op runs as on CUDA.
_OPTIMIZER_KERNELS = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"})


def _torch_at_least(major: int, minor: int) -> bool:
    version = torch.__version__.split("+")[0].split(".")
    return (int(version[0]), int(version[1])) >= (major, minor)


def npu_kind(func: Any) -> str | None:
    """How the npu flavour runs aten op ``func``: None for anything but a fused optimizer kernel."""
    name = func.overloadpacket.__name__
    if name not in _OPTIMIZER_KERNELS:
        return None
    overload = func._overloadname
    if name == "_fused_adamw_":
        return IGNORES_SCALING if overload != "tensor_lr" else CPU_FALLBACK
    if name == "_fused_sgd_":
        return NATIVE if _torch_at_least(2, 7) else CPU_FALLBACK
    return CPU_FALLBACK  # _fused_adam_, _fused_adagrad_


def check_npu_args(func: Any, kwargs: dict) -> None:
    """Refuse what op-plugin's kernel refuses: _fused_sgd_ needs momentum > 0 (FusedSgdKernelOpApi.cpp :36, :81)."""
    if func.overloadpacket.__name__ == "_fused_sgd_" and not kwargs.get("momentum", 0) > 0:
        raise RuntimeError("_fused_sgd_ on NPU needs momentum > 0 (op-plugin FusedSgdKernelOpApi)")


def without_scaling(kwargs: dict) -> dict:
    """The arguments as op-plugin's _fused_adamw_ reads them: grad_scale and found_inf dropped."""
    return {**kwargs, "grad_scale": None, "found_inf": None}


# ----- kernels a device has and torch's CPU build lacks -------------------------------------------------
# A device op runs the CPU kernel on the tensors inside; where CPU has no kernel for a dtype the device
# supports, the simulator runs one of its own that gives the device's result. Integer histc: CUDA's
# `_histc_cuda` dispatches AT_DISPATCH_ALL_TYPES (aten/src/ATen/native/cuda/SummaryOps.cu), while CPU's
# `histogram_cpu` has no integer kernel.
_HISTC_INTEGRAL = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def _narrow(value: int, dtype: torch.dtype) -> int:
    """`value` converted to the integer type `dtype` as C++ converts it (two's complement wrap-around)."""
    bits = torch.iinfo(dtype).bits
    value &= (1 << bits) - 1
    if torch.iinfo(dtype).min < 0 and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


def _histc_integral(x: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> torch.Tensor:
    """torch.histc of an integer tensor as `_histc_cuda_template` computes it: bounds taken as int64
    (`Scalar::to<int64_t>`, truncating) and then as the input's type; min == max means the data's extremes
    (widened by one each way when equal); element v in [lo, hi] goes to bin (v - lo) * bins / (hi - lo) in
    integer arithmetic, the top edge into the last bin; counts in the input's dtype."""
    if bins <= 0:
        raise RuntimeError("bins must be > 0")
    dtype = x.dtype
    lo_arg, hi_arg = int(min), int(max)  # int() truncates toward zero, as the C++ conversion does
    lo, hi = _narrow(lo_arg, dtype), _narrow(hi_arg, dtype)
    if lo_arg == hi_arg and x.numel() > 0:
        lo, hi = int(x.min()), int(x.max())
    if lo == hi:
        lo, hi = _narrow(lo - 1, dtype), _narrow(hi + 1, dtype)
    if not lo < hi:
        raise RuntimeError("max must be larger than min")
    v = x.reshape(-1).to(torch.int64)
    v = v[(v >= lo) & (v <= hi)]
    index = torch.div((v - lo) * bins, hi - lo, rounding_mode="floor").clamp_(max=bins - 1)
    return torch.bincount(index, minlength=bins).to(dtype)


def _histc(x: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> torch.Tensor:
    if x.dtype in _HISTC_INTEGRAL:
        return _histc_integral(x, bins, min, max)
    return torch.ops.aten.histc.default(x, bins, min, max)


def _histc_out(x: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0, *, out: torch.Tensor) -> torch.Tensor:
    if x.dtype not in _HISTC_INTEGRAL:
        return torch.ops.aten.histc.out(x, bins, min, max, out=out)
    result = _histc_integral(x, bins, min, max)
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out.copy_(result)


_DEVICE_KERNELS = {"histc.default": _histc, "histc.out": _histc_out}


def device_kernel(func: Any) -> Any:
    """What runs aten op `func` on device tensors: the simulator's own kernel where CPU lacks one, else None
    (torch's CPU kernel)."""
    packet = func.overloadpacket
    if packet.__name__ != "histc":
        return None
    return _DEVICE_KERNELS.get(f"histc.{func._overloadname}")


# ----- composite ops whose CPU path is a kernel ---------------------------------------------------------
# scaled_dot_product_attention (CompositeImplicitAutograd) picks its implementation through a DispatchStub
# indexed by device type (`_fused_sdp_choice_stub` in aten/src/ATen/native/transformers/attention.cpp), which has
# no entry for a PrivateUse1 backend: on the simulated device it would always take the math path, where the CPU
# runs its flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, with its own backward) and rounds
# differently. So the backend registers sdpa_kernel at its Autograd key (device.sim.backend), where the
# decomposition would otherwise run: it asks the CPU's choice (on the tensors inside, no device op) and calls the
# op the CPU's composite calls for it, the boolean mask converted first as attention.cpp converts it
# (convert_boolean_attn_mask: 0 where True, -inf where False, in the query's dtype). The ops it calls record their
# own autograd nodes, as the composite's do; being in the dispatcher, it also holds inside a backward pass
# (a checkpointed forward recomputed there records the same ops as the first time).
_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)


def _inner(t: Any) -> Any:
    """The CPU tensor inside a SimTensor (requires_grad as the wrapper's: the choice may depend on it)."""
    if type(t) is not SimTensor:
        return t
    return t._elem.detach().requires_grad_(t.requires_grad) if t._elem.is_floating_point() else t._elem


def sdpa_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """aten.scaled_dot_product_attention on simulated device tensors, as the CPU computes it."""
    with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
        choice = torch.ops.aten._fused_sdp_choice(
            _inner(query), _inner(key), _inner(value), _inner(attn_mask), dropout_p, is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip
    mask = attn_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill_(mask.logical_not(), float("-inf"))
    if choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale
        )[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]
