"""XTuner v1 under the simulator's npu flavour, unpatched: the torch_npu functions its npu kernels call, its import,
its optimizer configs and its TrainEngine (tests/xtuner_engine_job.py).

XTuner resolves its device once, at import, so each check runs in a process of its own started with
SWAPOPT_DEVICE=sim SWAPOPT_SIM_PRESET=910b (torch names its PrivateUse1 backend once per process). The XTuner checks
skip without a checkout on SWAPOPT_XTUNER_SRC (tests/xtuner_real.py); the TrainEngine also needs ray and, on npu,
MindSpeed (SWAPOPT_MINDSPEED_SRC, a checkout of Ascend/MindSpeed).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import xtuner_real  # noqa: F401  (puts the checkouts named by SWAPOPT_XTUNER_SRC / SWAPOPT_MINDSPEED_SRC on sys.path)

ROOT = Path(__file__).resolve().parents[1]

# Found without importing them here: XTuner resolves its device at import, and this process is not the npu one.
HAVE = {name: importlib.util.find_spec(name) is not None for name in ("xtuner", "cyclopts", "ray", "mindspeed")}
NO_XTUNER = "XTuner v1 is not importable (set SWAPOPT_XTUNER_SRC to a checkout of InternLM/xtuner; needs cyclopts)"


def _npu_process(args: list[str], timeout: int = 300) -> str:
    """Run `python args` on the npu flavour (a fresh process); its stdout, or the failure's output."""
    env = {**os.environ, "SWAPOPT_DEVICE": "sim", "SWAPOPT_SIM_PRESET": "910b"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_torch_npu_functions_xtuner_calls_follow_their_formulas():
    """torch_npu.npu_rms_norm, npu_rotary_mul and npu_fusion_attention in the TND layout (XTuner's npu rms_norm,
    rotary embedding and flash attention): their documented formulas, forward and backward, and on the simulated
    device bitwise what the same ops give on the CPU."""
    code = """
    import device
    device.get_torch_device_module()
    import torch, torch_npu
    import torch.nn.functional as F
    from device.sim import npu_ops

    def both(fn, *host):
        # fn on the simulated device and on the CPU, forward and input grads: bitwise the same
        leaves = [[t.detach().to(dev).requires_grad_(t.is_floating_point()) for t in host] for dev in ("npu", "cpu")]
        outs = [fn(*xs) for xs in leaves]
        for out, xs in zip(outs, leaves):
            out.float().square().sum().backward()
        assert outs[0].device.type == "npu"
        assert torch.equal(outs[0].detach().cpu(), outs[1].detach()), fn
        for a, b in zip(*leaves):
            if a.requires_grad:
                assert a.grad.device.type == "npu" and torch.equal(a.grad.cpu(), b.grad), fn
        return outs[1].detach()

    torch.manual_seed(0)
    x, g = torch.randn(2, 5, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    y = both(lambda x, g: torch_npu.npu_rms_norm(x, g, epsilon=1e-5)[0], x, g)
    _, rstd = torch_npu.npu_rms_norm(x.to("npu"), g.to("npu"), epsilon=1e-5)
    assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32 and rstd.shape == (2, 5, 1)
    torch.testing.assert_close(y, F.rms_norm(x.float(), (16,), g.float(), 1e-5).bfloat16())
    torch.testing.assert_close(rstd.cpu(), x.float().square().mean(-1, keepdim=True).add(1e-5).rsqrt())

    q, cos, sin = torch.randn(2, 4, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    half = both(lambda q, c, s: torch_npu.npu_rotary_mul(q, c, s), q, cos, sin)
    torch.testing.assert_close(half, q * cos + torch.cat((-q[..., 4:], q[..., :4]), -1) * sin, rtol=0, atol=0)
    inter = both(lambda q, c, s: torch_npu.npu_rotary_mul(q, c, s, rotary_mode="interleave"), q, cos, sin)
    pairs = torch.stack((-q[..., 1::2], q[..., ::2]), -1).flatten(-2)
    torch.testing.assert_close(inter, q * cos + pairs * sin, rtol=0, atol=0)

    # TND: two sequences (3 and 5 tokens) packed along T, 4 query heads over 2 key/value heads, as XTuner calls it
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    def tnd(q, k, v, causal, lens=(3, 8)):
        kw = dict(atten_mask=mask.to(q.device), sparse_mode=3) if causal else {}
        return torch_npu.npu_fusion_attention(q, k, v, 4, "TND", scale=0.3, actual_seq_qlen=lens,
                                              actual_seq_kvlen=lens, **kw)
    for causal in (True, False):
        out = both(lambda q, k, v: tnd(q, k, v, causal)[0], q, k, v)
        ref = torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                         v[a:b].transpose(0, 1), is_causal=causal, scale=0.3, enable_gqa=True).transpose(0, 1)
                         for a, b in ((0, 3), (3, 8))])
        torch.testing.assert_close(out, ref)
    full = tnd(q.to("npu"), k.to("npu"), v.to("npu"), True)
    assert full[1].shape == full[2].shape == (4, 8, 8) and full[1].dtype == torch.float32
    # a sequence of length 0, and trailing zeros: sequences that take no part (rows after them are not computed)
    assert torch.equal(tnd(q.to("npu"), k.to("npu"), v.to("npu"), True, lens=(3, 3, 8))[0].cpu(), full[0].cpu())
    short = tnd(q.to("npu"), k.to("npu"), v.to("npu"), True, lens=(3, 0))
    assert torch.equal(short[0][:3].cpu(), full[0][:3].cpu()) and short[1].shape == (4, 8, 8)
    for bad in (dict(input_layout="TND"), dict(input_layout="BSND", actual_seq_qlen=(3,), actual_seq_kvlen=(3,))):
        try:
            torch_npu.npu_fusion_attention(q[None].npu(), k[None].npu(), v[None].npu(), 4, **bad)
        except NotImplementedError as err:
            print("refused:", "actual_seq" in str(err))
    try:
        torch_npu.npu_rotary_mul(q.npu(), q.npu(), q.npu(), rotary_mode="quarter")
    except NotImplementedError as err:
        print("refused:", "quarter" in str(err))
    """
    out = _npu_process(["-c", textwrap.dedent(code)])
    assert out.split() == ["refused:", "True"] * 3


@pytest.mark.skipif(not (HAVE["xtuner"] and HAVE["cyclopts"]), reason=NO_XTUNER)
def test_xtuner_imports_and_its_optimizer_configs_train_bitwise(tmp_path):
    """`import xtuner.v1` says npu, and XTuner's AdamWConfig(swap_optimizer=True) trains bitwise like its plain
    AdamW, building XTuner's SwapAdamW and, after use_swapopt(), swapopt."""
    assert _npu_process(["tests/xtuner_engine_job.py", "configs", str(tmp_path)]).split()[-2:] == ["ok", "configs"]


@pytest.mark.skipif(not (HAVE["xtuner"] and HAVE["cyclopts"]), reason=NO_XTUNER)
@pytest.mark.skipif(not HAVE["ray"], reason="XTuner's model package imports ray (xtuner/v1/rl/utils)")
@pytest.mark.skipif(
    not HAVE["mindspeed"],
    reason="on npu XTuner's model package imports MindSpeed at import (xtuner/v1/ops/moe/npu/group_gemm.py:2); "
    "set SWAPOPT_MINDSPEED_SRC to a checkout of Ascend/MindSpeed",
)
def test_xtuner_train_engine_trains_bitwise_with_swap_optimizer(tmp_path):
    """XTuner's TrainEngine on a tiny dense Qwen3 with XTuner's npu kernels: plain AdamW, XTuner's SwapAdamW and
    swapopt (use_swapopt()) give the same losses and params, bit for bit."""
    assert _npu_process(["tests/xtuner_engine_job.py", "engine", str(tmp_path)]).split()[-2:] == ["ok", "engine"]
