"""Plain-torch versions of XTuner's three MoE kernels, for running XTuner's MoE models on the simulator.

XTuner v1 picks its MoE kernels once, at import, by device: CUDA uses the ``grouped_gemm`` extension and Triton,
NPU uses torch_npu / MindSpeed ops, and the CPU entries (``xtuner/v1/ops/moe/protocol.py``) raise
NotImplementedError. The simulator runs torch's CPU kernels, and XTuner is imported there as if on the CPU (see
``tests/xtuner_real.py``), so its MoE layers would stop at the first permute. ``install()`` puts these in place of
the CPU stubs, with the same signatures (``GroupGemmProtocol``, ``MoePermuteProtocol``, ``MoeUnpermuteProtocol``):

- ``permute(x [T, H], indices [T, K])`` -> rows of ``x`` ordered by expert id (stable), ``row_id_map``;
- ``unpermute(y [T*K, H], row_id_map, probs [T, K])`` -> ``sum_k probs[t, k] * y[row of (t, k)]``;
- ``group_gemm(x [N, in], w [E, out, in], split_sizes [E])`` -> each expert's rows times ``w[e].T``.

They are built from deterministic torch ops (a stable sort, index_select / index_copy, matmul), forward and
backward, so two runs of the same model and batch give bitwise the same grads: what the optimizer tests compare.
The numbers are not those of XTuner's fused kernels (different summation order), which no test here relies on.

Where the CPU kernels lack a dtype that CUDA has, the same applies: ``torch.histc`` on integer ids (XTuner's
routers count tokens per expert that way) runs on CUDA but not on the CPU; ``histc`` below counts integer ids
through a float copy (exact for ids below 2**24) and is installed for the duration of ``install()``'s context.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def permute(input_act, indices, num_topK=None, num_out_tokens=None, num_negative_one_in_indices=None):
    if indices.dim() == 1:
        indices = indices.view(-1, 1)
    k = indices.size(1)
    order = torch.argsort(indices.reshape(-1).to(torch.int64), stable=True)  # (t, k) flattened as t * K + k
    return input_act.index_select(0, order // k), order


def unpermute(input_act, row_id_map, probs=None):
    k = probs.size(1) if probs is not None else 1
    rows = torch.zeros_like(input_act).index_copy(0, row_id_map, input_act)  # back to (t, k) order
    rows = rows.view(-1, k, *input_act.shape[1:])
    if probs is None:
        return rows.sum(1)
    weighted = rows.float() * probs.float().view(*probs.shape, *([1] * (input_act.dim() - 1)))
    return weighted.sum(1).to(input_act.dtype)


def group_gemm(x, weights, split_sizes):
    sizes = [int(s) for s in split_sizes.tolist()]
    parts = torch.split(x, sizes, dim=0)
    return torch.cat([part @ weights[e].transpose(0, 1) for e, part in enumerate(parts)], dim=0)


_histc = torch.histc


def histc(input, bins=100, min=0, max=0, *, out=None):
    if input.is_floating_point():
        return _histc(input, bins=bins, min=min, max=max, out=out)
    counted = _histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)
    return counted if out is None else out.copy_(counted)


_NAMES = {"permute": permute, "unpermute": unpermute, "group_gemm": group_gemm}


@contextmanager
def install() -> Iterator[None]:
    """Replace XTuner's CPU MoE stubs (wherever a module imported them by name) and integer ``torch.histc``,
    for the block."""
    from xtuner.v1.ops.moe import protocol

    stubs = {
        "permute": protocol.cpu_permute, "unpermute": protocol.cpu_unpermute, "group_gemm": protocol.cpu_group_gemm,
    }  # fmt: skip
    swapped = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("xtuner.") or module is None:
            continue
        for attr in ("permute", "unpermute", "group_gemm"):
            current = module.__dict__.get(attr)
            if current is stubs[attr]:
                swapped.append((module, attr, current))
                setattr(module, attr, _NAMES[attr])
    if not swapped:
        raise RuntimeError("XTuner's CPU MoE kernels were not found: is XTuner imported as on the CPU?")
    torch.histc = histc
    try:
        yield
    finally:
        torch.histc = _histc
        for module, attr, current in swapped:
            setattr(module, attr, current)
