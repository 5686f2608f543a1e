"""What Ascend NPUs change for swapopt: which fused optimizer kernels torch_npu has, and how they differ.

torch_npu takes its aten kernels from Ascend/op-plugin (op_plugin/config/op_plugin_functions.yaml, master
517f2e7d0). For the fused optimizer kernels torch.optim calls:
- ``_fused_adamw_`` with a float lr (yaml :615-616, every torch version) exists, but
  FusedAdamWKernelNpuOpApi.cpp :20-65 never reads ``grad_scale``/``found_inf``: under a GradScaler that
  trusts the kernel to unscale and skip (``_step_supports_amp_scaling``), grads stay scaled and inf/NaN
  steps are applied. AdamW(fused=True), and Adam(fused=True, decoupled_weight_decay=True), call it.
- ``_fused_sgd_`` (float and tensor lr, yaml :5591-5596) exists from torch 2.7 only
  (``op_api: [v2.7, newest]``) and reads both; it needs momentum > 0 (FusedSgdKernelOpApi.cpp :36, :81).
- there is no ``_fused_adam_``, no ``_fused_adamw_.tensor_lr`` and no ``_fused_adagrad_``: torch_npu runs
  them through its CPU fallback, copying every tensor to the host and back synchronously, which
  serializes swapopt's pipeline (each chunk's update waits for the host).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from loguru import logger

from swapopt import internals

NATIVE = "native"  # an NPU kernel with CUDA's semantics
IGNORES_SCALING = "ignores_scaling"  # an NPU kernel that drops grad_scale/found_inf
CPU_FALLBACK = "cpu_fallback"  # no NPU kernel: torch_npu's synchronous CPU fallback


def _torch_at_least(major: int, minor: int) -> bool:
    version = torch.__version__.split("+")[0].split(".")
    return (int(version[0]), int(version[1])) >= (major, minor)


def fused_kernel(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    """The aten kernel a fused group of a torch.optim optimizer steps with (None: the group is not fused)."""
    if not group.get("fused"):
        return None
    tensor_lr = isinstance(group.get("lr"), torch.Tensor)
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        # AdamW is Adam with decoupled weight decay in recent torch; older torch has no such key.
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        if decoupled:
            return "_fused_adamw_.tensor_lr" if tensor_lr else "_fused_adamw_"
        return "_fused_adam_"
    if isinstance(optimizer, torch.optim.SGD):
        return "_fused_sgd_"
    if isinstance(optimizer, torch.optim.Adagrad):
        return "_fused_adagrad_"
    return f"fused {type(optimizer).__name__}"


def kernel_kind(kernel: str) -> str:
    """How torch_npu runs fused kernel ``kernel`` (see the module docstring)."""
    if kernel == "_fused_adamw_":
        return IGNORES_SCALING
    if kernel == "_fused_sgd_":
        return NATIVE if _torch_at_least(2, 7) else CPU_FALLBACK
    return CPU_FALLBACK


def ignores_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a group steps with a kernel that drops GradScaler's grad_scale/found_inf on NPU."""
    return any(
        kernel_kind(k) == IGNORES_SCALING
        for g in optimizer.param_groups
        if (k := fused_kernel(optimizer, g)) is not None
    )


def cpu_fallback_kernels(optimizer: torch.optim.Optimizer) -> list[str]:
    """The fused kernels of ``optimizer``'s groups that torch_npu runs through its CPU fallback."""
    kernels = [k for g in optimizer.param_groups if (k := fused_kernel(optimizer, g)) is not None]
    return sorted({k for k in kernels if kernel_kind(k) == CPU_FALLBACK})


def fallback_message(optimizer: torch.optim.Optimizer, kernels: list[str]) -> str:
    return (
        f"{type(optimizer).__name__}(fused=True) steps with {', '.join(kernels)}, which torch_npu has no NPU "
        "kernel for: it runs through torch_npu's CPU fallback, copying every chunk to the host and back "
        "synchronously, which serializes the swap pipeline. Use foreach=True (fused=False) instead; on NPU "
        "only AdamW with a float lr, and SGD with momentum on torch >= 2.7, have fused kernels"
    )


def check_fused(optimizer: torch.optim.Optimizer, stacklevel: int = 3) -> None:
    """Warn when ``optimizer`` would step through torch_npu's CPU fallback, and refuse a fused SGD group
    without momentum, which op-plugin's _fused_sgd_ rejects (call on the npu device)."""
    for i, group in enumerate(optimizer.param_groups):
        kernel = fused_kernel(optimizer, group)
        if kernel == "_fused_sgd_" and kernel_kind(kernel) == NATIVE and not group.get("momentum", 0) > 0:
            raise ValueError(
                f"param group {i}: SGD(fused=True) without momentum fails on NPU (op-plugin's _fused_sgd_ needs "
                "momentum > 0); use fused=False, or a momentum"
            )
    kernels = cpu_fallback_kernels(optimizer)
    if kernels:
        warnings.warn(f"swapopt: {fallback_message(optimizer, kernels)}", stacklevel=stacklevel)


# What this process has said already (check_foreach speaks once per process).
SAID: set[str] = set()


def check_foreach(optimizer: torch.optim.Optimizer, stacklevel: int = 3) -> None:
    """Say once when the default (foreach=None) of a torch.optim optimizer is the per-tensor loop on this NPU:
    torch_npu lists npu among the foreach devices only on Ascend910B/910_9x with CANN >= 8.0
    (torch_npu/utils/_optim.py:14-34 in v2.6.0)."""
    if "foreach" in SAID or type(optimizer).__module__.split(".")[0] != "torch":
        return
    if any(g.get("foreach") is not None or g.get("fused") for g in optimizer.param_groups):
        return  # chosen explicitly
    if "npu" in internals.foreach_devices():
        return
    SAID.add("foreach")
    message = (
        f"{type(optimizer).__name__} defaults to its per-tensor loop on this NPU: torch_npu enables foreach "
        "kernels only on Ascend 910B/910_9x with CANN >= 8.0. Each chunk's update then launches a few kernels "
        "per tensor; upgrade CANN where the chip supports it"
    )
    warnings.warn(f"swapopt: {message}", stacklevel=stacklevel)
    logger.info("swapopt: {}", message)


def check_optimizer(optimizer: torch.optim.Optimizer, stacklevel: int = 3) -> None:
    """SwapOptimizer's construction on the npu device: the fused-kernel and foreach checks above."""
    check_fused(optimizer, stacklevel=stacklevel + 1)
    check_foreach(optimizer, stacklevel=stacklevel + 1)


# Below this many bytes of rounding the pinned-memory advice is not worth a warning.
PINNED_OVERHEAD_TOLD = 64 * 2**20


def check_pinned(requested: int, taken: int, stacklevel: int = 7) -> None:
    """Say once per process when torch_npu's power-of-two rounding of pinned host allocations costs more
    than an eighth (and PINNED_OVERHEAD_TOLD) on top of the state arenas (device.npu_pinned_bytes), with the
    setting that avoids it."""
    if "pinned" in SAID or taken - requested <= max(requested / 8, PINNED_OVERHEAD_TOLD):
        return
    SAID.add("pinned")
    message = (
        f"the pinned state arenas ask for {requested / 2**20:.1f} MiB but torch_npu's host allocator takes "
        f"{taken / 2**20:.1f} MiB: it rounds each pinned allocation up to a power of two. Set "
        "PYTORCH_NPU_ALLOC_CONF=pin_memory_expandable_segments:True (before torch_npu initializes) to round "
        "to 512 bytes instead"
    )
    warnings.warn(f"swapopt: {message}", stacklevel=stacklevel)
    logger.info("swapopt: {}", message)
