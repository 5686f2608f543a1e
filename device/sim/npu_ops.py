"""torch_npu's own functions that frameworks import by name, on the simulated npu device.

transformers imports ``from torch_npu import npu_fusion_attention`` when torch_npu is present
(transformers/integrations/npu_flash_attention.py) and XTuner v1 imports ``torch_npu.contrib.transfer_to_npu``
when it finds an npu accelerator (xtuner/v1/utils/device.py): without these names the npu flavour fails at
import, or XTuner silently falls back to the CPU. They compute with torch's ops on the simulated device (checked
and timed like any other op).

npu_fusion_attention follows torch_npu's documented formula (Ascend "torch_npu.npu_fusion_attention", API
reference): attention_out = Dropout(Softmax(Mask(scale * (Q K^T), atten_mask)), keep_prob) V, where atten_mask
is True at the positions that take no part; layouts BSH, SBH, BSND, BNSD; key/value heads a factor of the query
heads; sparse_mode 0 and 1 (the mask as given), 2 (causal from the top left) and 3 (causal from the bottom
right; for 2 and 3 the mask passed is the compressed 2048 x 2048 upper triangle and is not read). It returns
torch_npu's seven outputs: attention_out in the query's layout, softmax_max and softmax_sum (B, N, Sq, 8) in
float32, an empty softmax_out, and seed, offset and dropout-mask length as ints. What the simulator does not
model (pse, padding_mask, prefix, variable-length TND, band mode 4, pre/next token limits) is refused by name.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

_CUDA_TO_NPU: list[bool] = []  # transfer_to_npu was imported in this process
# Called once transfer_to_npu is imported: the torch entry points (device/sim/entry_points.py, which sits above this
# module) present torch.cuda for the active simulator.
_ON_CUDA_TO_NPU: list[Callable[[], None]] = []


def on_cuda_to_npu(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever torch_npu.contrib.transfer_to_npu is imported."""
    if callback not in _ON_CUDA_TO_NPU:
        _ON_CUDA_TO_NPU.append(callback)


def cuda_to_npu() -> bool:
    """Whether torch_npu.contrib.transfer_to_npu was imported: "cuda" device arguments then name the npu device."""
    return bool(_CUDA_TO_NPU)


_NO_LIMIT = 2147483647


def _to_bnsd(t: torch.Tensor, layout: str, heads: int | None) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout in ("BSH", "SBH"):
        if layout == "SBH":
            t = t.transpose(0, 1)
        b, s, h = t.shape
        d = h // heads if heads else h
        return t.reshape(b, s, h // d, d).transpose(1, 2)
    raise NotImplementedError(f"npu_fusion_attention: input_layout {layout!r} is not modeled by the simulator")


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    b, n, s, d = t.shape
    out = t.transpose(1, 2).reshape(b, s, n * d)
    return out.transpose(0, 1) if layout == "SBH" else out


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = _NO_LIMIT,
    next_tockens: int = _NO_LIMIT,
    inner_precise: int = 0,
    prefix: Any = None,
    actual_seq_qlen: Any = None,
    actual_seq_kvlen: Any = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """torch_npu.npu_fusion_attention (see the module docstring for what is modeled)."""
    unmodeled = {
        "pse": pse is not None, "padding_mask": padding_mask is not None, "prefix": prefix is not None,
        "actual_seq_qlen": actual_seq_qlen is not None, "actual_seq_kvlen": actual_seq_kvlen is not None,
        "pre_tockens": sparse_mode in (0, 1) and pre_tockens != _NO_LIMIT,
        "next_tockens": sparse_mode in (0, 1) and next_tockens != _NO_LIMIT,
        f"sparse_mode={sparse_mode}": sparse_mode not in (0, 1, 2, 3),
    }  # fmt: skip
    refused = [name for name, given in unmodeled.items() if given]
    if refused:
        raise NotImplementedError(f"npu_fusion_attention: {', '.join(refused)} is not modeled by the simulator")
    q = _to_bnsd(query, input_layout, head_num)
    # BSH / SBH: key and value heads from their hidden size over the query's head size
    kv_heads = None if input_layout in ("BSND", "BNSD") else head_num * key.shape[-1] // query.shape[-1]
    k, v = _to_bnsd(key, input_layout, kv_heads), _to_bnsd(value, input_layout, kv_heads)
    sq, skv = q.shape[-2], k.shape[-2]
    if k.shape[1] != q.shape[1]:  # grouped heads: each key/value head serves N1 / N2 query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    masked = None
    if sparse_mode in (0, 1) and atten_mask is not None:
        masked = atten_mask.bool()
    elif sparse_mode in (2, 3):
        rows = torch.arange(sq, device=scores.device).unsqueeze(1)
        cols = torch.arange(skv, device=scores.device).unsqueeze(0)
        masked = cols > rows + (skv - sq if sparse_mode == 3 else 0)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    softmax_max = scores.amax(dim=-1, keepdim=True)
    softmax_sum = (scores - softmax_max).exp().sum(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    if keep_prob < 1.0:
        probs = torch.nn.functional.dropout(probs, p=1.0 - keep_prob)
    out = torch.matmul(probs.to(v.dtype), v)
    stats = (softmax_max.expand(*softmax_max.shape[:-1], 8).contiguous(),
             softmax_sum.expand(*softmax_sum.shape[:-1], 8).contiguous())  # fmt: skip
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    numels = 0 if keep_prob >= 1.0 else q.shape[0] * q.shape[1] * sq * skv
    return _from_bnsd(out, input_layout), stats[0], stats[1], empty, 0, 0, numels


class _TransferToNpu(importlib.abc.Loader):
    """Importing torch_npu.contrib.transfer_to_npu makes code written for CUDA run on the npu device: its
    "cuda" device arguments and `.cuda()` calls name the npu device, and torch.cuda's functions answer for it."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        _CUDA_TO_NPU.append(True)
        # torch's argument parser initializes CUDA for a "cuda" device argument, which a CPU-only torch refuses;
        # here such an argument names the npu device (as the cuda flavour's torch.cuda surface does).
        torch.cuda._lazy_init = lambda: None
        # ... and torch.cuda's functions and classes (torch.cuda.Stream, current_stream...) are the npu device's.
        for callback in _ON_CUDA_TO_NPU:
            callback()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        simulated = getattr(sys.modules.get("torch_npu"), "__swapopt_simulated__", False)
        if fullname == "torch_npu.contrib.transfer_to_npu" and simulated:
            return importlib.machinery.ModuleSpec(fullname, _TransferToNpu())
        return None


def install(pkg: types.ModuleType) -> None:
    """Give the simulated torch_npu package these names."""
    pkg.npu_fusion_attention = npu_fusion_attention
    contrib = types.ModuleType("torch_npu.contrib")
    contrib.__path__ = []  # a package: `from torch_npu.contrib import transfer_to_npu` imports the submodule
    contrib.__spec__ = importlib.machinery.ModuleSpec("torch_npu.contrib", None, is_package=True)
    pkg.contrib = sys.modules["torch_npu.contrib"] = contrib
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
