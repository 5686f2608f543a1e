"""Frameworks see a device type they know, and the simulated device computes what the CPU computes.

XTuner v1 resolves its device once, at import (xtuner/v1/utils/device.py: `torch.accelerator.current_accelerator()
.type` must be cpu, cuda or npu; on npu it imports torch_npu.contrib.transfer_to_npu, and any error there makes
it fall back to "cpu"); transformers imports `from torch_npu import npu_fusion_attention` when torch_npu is
present. Each flavour runs in a process of its own (a process registers one), started with SWAPOPT_DEVICE=sim.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import cli_zygote
import simdevice as simulator
import xtuner_real

ROOT = Path(__file__).resolve().parents[1]

# XTuner v1's device check (xtuner/v1/utils/device.py at the commit in tests/xtuner_real.py), reproduced.
XTUNER_CHECK = """
import torch
if torch.accelerator.is_available():
    kind = torch.accelerator.current_accelerator().type
    if kind == "npu":
        from torch_npu.contrib import transfer_to_npu  # noqa: F401
else:
    kind = "cpu"
assert kind in ("cpu", "cuda", "npu"), kind
"""


def _run(preset: str, *parts: str) -> str:
    """Run the code `parts` (each dedented) in a fresh process on the simulator of `preset`; its stdout."""
    code = "\n".join(textwrap.dedent(part) for part in parts)
    env = {**os.environ, "SWAPOPT_DEVICE": "sim", "SWAPOPT_SIM_PRESET": preset}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = cli_zygote.run(["-c", code], env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_cuda_flavour_says_cuda_to_frameworks():
    out = _run(
        "h100",
        """
        import device
        device.get_torch_device_module()  # starts the process-wide simulator
        """,
        XTUNER_CHECK,
        """
        print(kind)
        t = torch.ones(2, device=torch.accelerator.current_accelerator())  # as XTuner's trainer warms up
        print(t.device.type)
        # torch's own modules keep the registered backend: process groups, rng and streams are looked up by the
        # device type of the tensors
        print(torch._C._get_accelerator().type)
        import torch.utils.checkpoint as ckpt
        print(ckpt.DefaultDeviceType.get_device_type())
        import xtuner_real
        if xtuner_real.xtuner_module("xtuner.v1.utils.device") is not None:
            import xtuner.v1
            from xtuner.v1.utils.device import get_device, get_torch_device_module
            assert get_device() == "cuda" and get_torch_device_module() is torch.cuda
        """,
    )
    assert out.split() == ["cuda", "sim", "sim", "sim"]


def test_npu_flavour_has_the_torch_npu_names_frameworks_import():
    out = _run(
        "910b",
        """
        import device
        device.get_torch_device_module()
        """,
        XTUNER_CHECK,
        """
        print(kind)
        from torch_npu import npu_fusion_attention
        import transformers.integrations.npu_flash_attention as hf  # imports it when torch_npu is present
        assert hf.npu_fusion_attention is npu_fusion_attention
        # transfer_to_npu: code written for CUDA names the npu device
        print(torch.ones(2, device="cuda").device, torch.ones(2, device="cpu").cuda().device)
        side = torch.cuda.Stream()  # XTuner's MoE model makes one at construction
        with torch.cuda.stream(side):
            torch.ones(2, device="cuda")
        torch.cuda.synchronize()
        torch.manual_seed(0)
        q, k = torch.randn(2, 16, 4, 8, device="npu"), torch.randn(2, 16, 2, 8, device="npu")
        mask = torch.triu(torch.ones(2048, 2048, device="npu"), diagonal=1).bool()
        out = npu_fusion_attention(q, k, k, 4, "BSND", atten_mask=mask, scale=0.3, sparse_mode=3)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), is_causal=True, scale=0.3, enable_gqa=True
        ).transpose(1, 2)
        torch.testing.assert_close(out[0], ref)
        assert len(out) == 7 and out[1].shape == (2, 4, 16, 8) and out[0].device.type == "npu"
        bsh = npu_fusion_attention(q.flatten(2), k.flatten(2), k.flatten(2), 4, "BSH", scale=0.3, sparse_mode=2,
                                   atten_mask=mask)[0]
        torch.testing.assert_close(bsh, ref.flatten(2))
        try:
            npu_fusion_attention(q, k, k, 4, "BSND", pse=q)
        except NotImplementedError as err:
            print("refused", "pse" in str(err))
        import xtuner_real
        if xtuner_real.xtuner_module("xtuner.v1.utils.device") is not None:
            import xtuner.v1
            from xtuner.v1.utils.device import get_device
            assert get_device() == "npu"
        """,
    )
    assert out.split() == ["npu", "npu:0", "npu:0", "refused", "True"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 32)
        return x + self.down(F.silu(self.up(x)))


def _train(dev: torch.device | str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block()).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    data = torch.randn(4, 2, 16, 32, device="cpu")
    losses = []
    for step in range(4):
        # the second block checkpointed: its forward runs again inside the backward pass, as the engine's does
        h = model[0](data[step].to(dev))
        loss = torch.utils.checkpoint.checkpoint(model[1], h, use_reentrant=False).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return losses + [p.detach().cpu() for p in model.parameters()]


def test_training_job_is_bitwise_the_cpus(clean_device_env):
    """silu's backward and scaled_dot_product_attention run the CPU's kernels on the simulated device (not
    decompositions that round differently), so a job's losses and params are bitwise those on the CPU."""
    on_cpu = _train("cpu")
    with simulator.activate() as sim:
        simulated = _train(sim.torch_device())
    assert len(on_cpu) == len(simulated)
    for a, b in zip(on_cpu, simulated):
        assert torch.equal(a, b)


@pytest.mark.skipif(xtuner_real.xtuner_module("xtuner.v1.utils.device") is None, reason="needs XTuner v1")
def test_xtuner_resolves_the_simulated_device():
    """With XTuner importable: its own module says cuda under the cuda flavour (no workaround)."""
    out = _run(
        "h100",
        """
        import device
        device.get_torch_device_module()
        import xtuner_real  # puts a checkout named by SWAPOPT_XTUNER_SRC on sys.path
        import torch, xtuner.v1
        from xtuner.v1.utils.device import get_device
        from xtuner.v1.optim import swap_adamw
        print(get_device(), swap_adamw.DEVICE)
        """,
    )
    assert out.split() == ["cuda", "cuda"]


@pytest.mark.parametrize("fn", [F.silu, F.mish], ids=["silu", "mish"])
def test_activation_backward_runs_the_cpu_kernel(fn, clean_device_env):
    """silu_backward and mish_backward have a CPU kernel and, for other backends, a decomposition: the simulated
    device runs the kernel, as CUDA runs its own."""
    x = torch.randn(257, 31, device="cpu")

    def grad(dev: torch.device | str) -> torch.Tensor:
        leaf = x.to(dev).detach().requires_grad_()
        fn(leaf).mul(x.to(dev)).sum().backward()
        return leaf.grad.cpu()

    on_cpu = grad("cpu")
    with simulator.activate() as sim:
        assert torch.equal(grad(sim.torch_device()), on_cpu)
