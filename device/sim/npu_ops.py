"""torch_npu's own functions that frameworks import by name, on the simulated npu device.

transformers imports ``from torch_npu import npu_fusion_attention`` when torch_npu is present
(transformers/integrations/npu_flash_attention.py) and XTuner v1 imports ``torch_npu.contrib.transfer_to_npu``
when it finds an npu accelerator (xtuner/v1/utils/device.py): without these names the npu flavour fails at
import, or XTuner silently falls back to the CPU. On npu XTuner's dense model also calls
``torch_npu.npu_rms_norm`` (xtuner/v1/ops/rms_norm), ``torch_npu.npu_rotary_mul`` (xtuner/v1/ops/rotary_emb.py)
and, for its default flash attention, ``npu_fusion_attention`` in the variable-length TND layout
(xtuner/v1/ops/flash_attn/npu.py). They compute with torch's ops on the simulated device (checked and timed like
any other op), so each runs CPU kernels and gives bitwise what the same ops give on the CPU.

npu_fusion_attention follows torch_npu's documented formula (Ascend "torch_npu.npu_fusion_attention", API
reference): attention_out = Dropout(Softmax(Mask(scale * (Q K^T), atten_mask)), keep_prob) V, where atten_mask
is True at the positions that take no part; layouts BSH, SBH, BSND, BNSD and TND (variable length: the query's
and key/value's sequences packed along T, ``actual_seq_qlen`` / ``actual_seq_kvlen`` their cumulative ends, each
sequence attending within itself); key/value heads a factor of the query heads; sparse_mode 0 and 1 (the mask as
given), 2 (causal from the top left) and 3 (causal from the bottom right; for 2 and 3 the mask passed is the
compressed 2048 x 2048 upper triangle and is not read). It returns torch_npu's seven outputs: attention_out in
the query's layout, softmax_max and softmax_sum in float32 ((B, N, Sq, 8); for TND (N, T, 8), the default
softmax_layout), an empty softmax_out, and seed, offset and dropout-mask length as ints. What the simulator does
not model (pse, padding_mask, prefix, a mask with sparse_mode 0 or 1 under TND, band mode 4 and the varlen modes
7 and 8, pre/next token limits) is refused by name.

npu_rms_norm (torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (Tensor, Tensor)) and npu_rotary_mul
(torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor) follow op-plugin's documented formulas
(docs/context/torch_npu-npu_rms_norm.md, torch_npu-npu_rotary_mul.md in Ascend/op-plugin).
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


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, atten_mask: torch.Tensor | None, scale: float,
    keep_prob: float, sparse_mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of BNSD query, key and value: the output (B, N, Sq, D) and softmax max and sum (B, N, Sq, 8)."""
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
    return (out, softmax_max.expand(*softmax_max.shape[:-1], 8).contiguous(),
            softmax_sum.expand(*softmax_sum.shape[:-1], 8).contiguous())  # fmt: skip


def _segments(actual_seq_qlen: Any, actual_seq_kvlen: Any) -> list[tuple[int, int, int, int]]:
    """TND: each sequence's (query start, end, key/value start, end) from the cumulative lengths. Trailing zeros
    mark sequences that take no part (torch_npu's documented convention)."""
    out, q0, kv0 = [], 0, 0
    for q1, kv1 in zip(actual_seq_qlen, actual_seq_kvlen):
        q1, kv1 = int(q1), int(kv1)
        if q1 == 0 and kv1 == 0 and (q0 or kv0):
            break
        out.append((q0, q1, kv0, kv1))
        q0, kv0 = q1, kv1
    return out


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
    varlen = input_layout == "TND"
    unmodeled = {
        "pse": pse is not None, "padding_mask": padding_mask is not None, "prefix": prefix is not None,
        "actual_seq_qlen without input_layout TND": not varlen and actual_seq_qlen is not None,
        "actual_seq_kvlen without input_layout TND": not varlen and actual_seq_kvlen is not None,
        "input_layout TND without actual_seq_qlen and actual_seq_kvlen": varlen and (
            actual_seq_qlen is None or actual_seq_kvlen is None),
        "atten_mask with sparse_mode 0 or 1 in input_layout TND": varlen and sparse_mode in (0, 1)
        and atten_mask is not None,
        "pre_tockens": sparse_mode in (0, 1) and pre_tockens != _NO_LIMIT,
        "next_tockens": sparse_mode in (0, 1) and next_tockens != _NO_LIMIT,
        f"sparse_mode={sparse_mode}": sparse_mode not in (0, 1, 2, 3),
    }  # fmt: skip
    refused = [name for name, given in unmodeled.items() if given]
    if refused:
        raise NotImplementedError(f"npu_fusion_attention: {', '.join(refused)} is not modeled by the simulator")
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    if varlen:  # (T, N, D): each sequence attends within itself; softmax max and sum in the default NTD layout
        out = torch.zeros_like(query)
        stats = torch.zeros(2, query.shape[1], query.shape[0], 8, dtype=torch.float32, device=query.device)
        numels = 0
        for q0, q1, kv0, kv1 in _segments(actual_seq_qlen, actual_seq_kvlen):
            if q1 == q0:  # a sequence of length 0 (documented as allowed)
                continue
            q = query[q0:q1].transpose(0, 1).unsqueeze(0)
            k, v = key[kv0:kv1].transpose(0, 1).unsqueeze(0), value[kv0:kv1].transpose(0, 1).unsqueeze(0)
            seg, smax, ssum = _attend(q, k, v, None, scale, keep_prob, sparse_mode)
            out[q0:q1] = seg[0].transpose(0, 1).to(out.dtype)
            stats[0, :, q0:q1], stats[1, :, q0:q1] = smax[0], ssum[0]
            numels += 0 if keep_prob >= 1.0 else head_num * (q1 - q0) * (kv1 - kv0)
        return out, stats[0], stats[1], empty, 0, 0, numels
    q = _to_bnsd(query, input_layout, head_num)
    # BSH / SBH: key and value heads from their hidden size over the query's head size
    kv_heads = None if input_layout in ("BSND", "BNSD") else head_num * key.shape[-1] // query.shape[-1]
    k, v = _to_bnsd(key, input_layout, kv_heads), _to_bnsd(value, input_layout, kv_heads)
    out, softmax_max, softmax_sum = _attend(q, k, v, atten_mask, scale, keep_prob, sparse_mode)
    numels = 0 if keep_prob >= 1.0 else q.shape[0] * q.shape[1] * q.shape[-2] * k.shape[-2]
    return _from_bnsd(out, input_layout), softmax_max, softmax_sum, empty, 0, 0, numels


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu.npu_rms_norm: (x / Rms(x) * gamma, 1 / Rms(x)), Rms(x) = sqrt(mean(x^2) + epsilon) over gamma's
    dimensions (the last gamma.dim() of x). The reciprocal is float32, as on the NPU; the output takes x's dtype."""
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """torch_npu.npu_rotary_mul: r1 * x + r2 * rotate(x); rotate is (-x2, x1) of x's two halves ("half") or of its
    even and odd elements, interleaved back ("interleave")."""
    if rotary_mode == "half":
        x1, x2 = torch.chunk(self, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-self[..., 1::2], self[..., ::2]), dim=-1).reshape(self.shape)
    else:
        raise NotImplementedError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not modeled by the simulator")
    return r1 * self + r2 * rotated


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
    pkg.npu_rms_norm = npu_rms_norm
    pkg.npu_rotary_mul = npu_rotary_mul
    contrib = types.ModuleType("torch_npu.contrib")
    contrib.__path__ = []  # a package: `from torch_npu.contrib import transfer_to_npu` imports the submodule
    contrib.__spec__ = importlib.machinery.ModuleSpec("torch_npu.contrib", None, is_package=True)
    pkg.contrib = sys.modules["torch_npu.contrib"] = contrib
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
