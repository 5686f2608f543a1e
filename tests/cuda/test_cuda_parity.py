"""Parity and memory of SwapOptimizer on a real CUDA device: `python -m pytest -m cuda tests/cuda`."""

from __future__ import annotations

import pytest
import torch

import device
from swapopt import SwapOptimizer
from swapopt.hoststate import is_swapped_state

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

O = torch.optim
STEPS = 5


@pytest.fixture(autouse=True)
def _cuda_env(monkeypatch):
    monkeypatch.setenv("SWAPOPT_DEVICE", "cuda")
    torch.cuda.synchronize()


def _run_pair(make, sizes=((3000,), (7, 33), ()), dtype=torch.float32, **kw):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ps = [torch.nn.Parameter(torch.randn(s, device=dev).to(dtype)) for s in sizes]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    half = len(ps) // 2 or 1
    opt = SwapOptimizer(make([{"params": ps[:half]}, {"params": ps[half:], "lr": 3e-3}]), **kw)
    ref = make([{"params": rs[:half]}, {"params": rs[half:], "lr": 3e-3}])
    for _ in range(STEPS):
        for p, r in zip(ps, rs):
            g = torch.randn(p.shape, device=dev).to(dtype)
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    opt.wait_for_swap_out()
    torch.cuda.synchronize()
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert torch.equal(p, r), f"param {i}"
        for k, v in ref.state[r].items():
            if isinstance(v, torch.Tensor):
                got = opt.state[p][k]
                if is_swapped_state(p, k, got):
                    assert device.is_host_tensor(got) and got.is_pinned(), (i, k)
                assert torch.equal(got.to(v.device), v), f"param {i} state {k}"
    return opt


CASES = {
    "adamw_foreach": lambda g: O.AdamW(g, lr=1e-2, foreach=True),
    "adamw_fused": lambda g: O.AdamW(g, lr=1e-2, fused=True),
    "adam_capturable": lambda g: O.Adam(g, lr=1e-2, capturable=True, foreach=True),
    "adam_capturable_single": lambda g: O.Adam(g, lr=1e-2, capturable=True, foreach=False, amsgrad=True),
    "adam_fused_amsgrad_maximize": lambda g: O.Adam(g, lr=1e-2, fused=True, amsgrad=True, maximize=True),
    "adamw_capturable_fused": lambda g: O.AdamW(g, lr=1e-2, fused=True, capturable=True),
    "sgd_nesterov": lambda g: O.SGD(g, lr=1e-2, momentum=0.9, nesterov=True),
    "sgd_fused": lambda g: O.SGD(g, lr=1e-2, momentum=0.9, fused=True),
    "adagrad": lambda g: O.Adagrad(g, lr=1e-2),
    "rmsprop_centered": lambda g: O.RMSprop(g, lr=1e-2, centered=True, momentum=0.9, capturable=True),
    "adamax_capturable": lambda g: O.Adamax(g, lr=1e-2, capturable=True),
    "nadam_capturable": lambda g: O.NAdam(g, lr=1e-2, capturable=True),
    "radam_capturable": lambda g: O.RAdam(g, lr=1e-2, capturable=True),
    "asgd_capturable": lambda g: O.ASGD(g, lr=1e-2, capturable=True),
    "rprop_capturable": lambda g: O.Rprop(g, lr=1e-2, capturable=True),
    "adadelta_capturable": lambda g: O.Adadelta(g, lr=1.0, capturable=True),
    "adafactor": lambda g: O.Adafactor(g, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("times", [1, 3, 16])
def test_cuda_parity(name, times):
    _run_pair(CASES[name], swap_optimizer_times=times)


@pytest.mark.parametrize("name", ["adamw_foreach", "adamw_fused", "sgd_nesterov"])
def test_cuda_parity_bf16_and_split(name):
    _run_pair(CASES[name], dtype=torch.bfloat16, swap_optimizer_times=4)
    _run_pair(CASES[name], sizes=((1 << 16,), (300, 7)), chunk_mb=0.125)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_parity_mixed_chunks(name):
    # chunks of whole params and cut pieces (Note [mixed chunks] in swapopt.pipeline), as on the simulator
    from test_mixed_chunks import CHUNK_MB, SHAPES

    _run_pair(CASES[name], sizes=SHAPES, chunk_mb=CHUNK_MB)


@pytest.mark.parametrize("slots", [2, 3])
def test_cuda_peak_memory(slots):
    dev = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(1024, 1024, device=dev)) for _ in range(8)]
    opt = SwapOptimizer(O.AdamW(params, lr=1e-3, fused=True), swap_optimizer_times=16, slots=slots)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        chunk = opt._layout.prepared.plan.max_chunk_bytes
        assert torch.cuda.max_memory_allocated() - base <= (slots + 1) * chunk
        probe = torch.empty(1, device=dev)  # an allocation lets the allocator retire record_stream'd blocks
        # only the fused optimizer's device step counters (one 512-byte block each) were added, on step 1
        assert torch.cuda.memory_allocated() <= base + (len(params) + 1) * 512
        del probe


@pytest.mark.parametrize("where", ["kernel", "after_add"])
def test_a_failed_fused_update_takes_its_step_count_adds_back_on_cuda(where, monkeypatch):
    """Fused AdamW steps each chunk by the direct fused call, which takes no copy of the step counts (Note [undone
    step counts] in swapopt.internals). The kernel of chunk 1 raises, or a Ctrl-C lands as its step count add returns:
    chunk 1's params and step counts are as before the step, chunk 0's stepped, and the next step runs."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ps = [torch.nn.Parameter(torch.randn(256, device=dev)) for _ in range(8)]
    opt = SwapOptimizer(O.AdamW(ps, lr=1e-2, fused=True), swap_optimizer_times=2)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, device=dev)
        opt.step()
    opt.wait_for_swap_out()
    chunks = opt._layout.prepared.plan.chunks
    assert len(chunks) == 2
    counts = [float(opt.state[p]["step"]) for p in ps]
    values = [p.detach().clone() for p in ps]
    seen: list[int] = []
    if where == "kernel":
        real = torch._fused_adamw_

        def kernel(*a, **kw):
            seen.append(1)
            if len(seen) == 2:
                raise RuntimeError("inside the fused kernel call")
            return real(*a, **kw)

        monkeypatch.setattr(torch, "_fused_adamw_", kernel)
    else:
        real = torch._foreach_add_

        def add(*a, **kw):
            out = real(*a, **kw)
            seen.append(1)
            if len(seen) == 2:
                raise KeyboardInterrupt
            return out

        monkeypatch.setattr(torch, "_foreach_add_", add)
    for p in ps:
        p.grad = torch.randn(p.shape, device=dev)
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        opt.step()
    monkeypatch.undo()
    opt.wait_for_swap_out()
    torch.cuda.synchronize()
    failed = {pc.index for pc in chunks[1].pieces}
    assert failed and failed.isdisjoint(pc.index for pc in chunks[0].pieces)
    for i, p in enumerate(ps):
        assert float(opt.state[p]["step"]) == counts[i] + (i not in failed), i
        assert torch.equal(p.detach(), values[i]) == (i in failed), i
    opt.step()
    opt.wait_for_swap_out()
    assert not opt.swap_stats().failed
