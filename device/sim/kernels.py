"""Fused optimizer kernels as the npu flavour has them: torch_npu's kernels come from op-plugin, which
registers fewer of them than CUDA has, and one of those differs from CUDA's.

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
