"""Plain-torch versions of XTuner's three MoE kernels, for running XTuner's MoE models on the simulator.

XTuner v1 picks its MoE kernels once, at import, by device: CUDA uses the ``grouped_gemm`` extension and Triton,
NPU uses torch_npu / MindSpeed ops, and the CPU entries (``xtuner/v1/ops/moe/protocol.py``) raise
NotImplementedError. ``install()`` puts these in place of the kernels that cannot run on the simulator, with the
same signatures (``GroupGemmProtocol``, ``MoePermuteProtocol``, ``MoeUnpermuteProtocol``):

- ``permute(x [T, H], indices [T, K])`` -> rows of ``x`` ordered by expert id (stable), ``row_id_map``;
- ``unpermute(y [T*K, H], row_id_map, probs [T, K])`` -> ``sum_k probs[t, k] * y[row of (t, k)]``;
- ``group_gemm(x [N, in], w [E, out, in], split_sizes [E])`` -> each expert's rows times ``w[e].T``.

They are built from deterministic torch ops (a stable sort, index_select / index_copy, matmul), forward and
backward, so two runs of the same model and batch give bitwise the same grads: what the optimizer tests compare.
The numbers are not those of XTuner's fused kernels (different summation order), which no test here relies on.

Which ones depends on the device XTuner resolved at import:
- cuda (the 2-rank test: its ranks import XTuner after the simulator is up, SWAPOPT_DEVICE=sim): the grouped GEMM
  only. On cuda XTuner's grouped GEMM is always a GPU kernel, picked at import: its Triton kernels
  (``m_grouped_gemm`` / ``k_grouped_gemm``, xtuner/v1/ops/moe/cuda/group_gemm.py) or, with
  ``XTUNER_USE_CUTLASS_GROUP_GEMM=1``, a CUTLASS extension; no config picks torch ops, and neither can run without
  a GPU. Its cuda permute and unpermute are torch ops (``cuda_token_permute_torch``, used when the ``grouped_gemm``
  extension is not installed) and run as they are.
- cpu (the 1-rank test, in the test process: XTuner is imported at collection, before a simulator is up, so that
  the test runs without triton, which XTuner's cuda modules import): all three CPU stubs.
The npu flavour would need the grouped GEMM replaced too: there it is MindSpeed's ``Ops.gmm``, whose ``npu_gmm``
builds and loads an Ascend operator extension (mindspeed/ops/gmm.py: ``GMMOpBuilder().load()``), which needs CANN.
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


_NAMES = {"permute": permute, "unpermute": unpermute, "group_gemm": group_gemm}


@contextmanager
def install() -> Iterator[None]:
    """Replace, for the block, the MoE kernels XTuner picked that cannot run here (wherever a module imported them by
    name). With XTuner resolving cpu: its three CPU stubs. With XTuner resolving cuda (the simulated device): its
    Triton grouped GEMM only; its cuda permute and unpermute are torch ops and run as they are."""
    from xtuner.v1.ops.moe import protocol
    from xtuner.v1.utils.device import get_device

    if get_device() == "cuda":
        from xtuner.v1.ops.moe.cuda.group_gemm import triton_group_gemm

        stubs = {"group_gemm": triton_group_gemm}
    else:
        stubs = {
            "permute": protocol.cpu_permute, "unpermute": protocol.cpu_unpermute, "group_gemm": protocol.cpu_group_gemm,
        }  # fmt: skip
    swapped = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("xtuner.") or module is None:
            continue
        for attr in stubs:
            current = module.__dict__.get(attr)
            if current is stubs[attr]:
                swapped.append((module, attr, current))
                setattr(module, attr, _NAMES[attr])
    if not swapped:
        raise RuntimeError(f"XTuner's {get_device()} MoE kernels {sorted(stubs)} were not found")
    try:
        yield
    finally:
        for module, attr, current in swapped:
            setattr(module, attr, current)
