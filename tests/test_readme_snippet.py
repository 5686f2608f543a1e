"""README's "Use it in a training script" snippet runs as written under SWAPOPT_DEVICE=sim."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import cli_zygote

ROOT = Path(__file__).resolve().parent.parent

# What the snippet leaves to the reader: a model whose output has .loss, and a loader. Defined before the
# snippet imports swapopt, and the model is built by the snippet's first line, as in a real script.
PRELUDE = textwrap.dedent(
    """
    import types
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

        def forward(self, batch):
            x, y = batch
            return types.SimpleNamespace(loss=torch.nn.functional.mse_loss(self.body(x).squeeze(-1), y))

    def build_model():
        torch.manual_seed(0)
        return Model()

    def batches(n=4):  # batches on the accelerator, as a script's loader hands them to the model
        for _ in range(n):
            yield torch.randn(8, 16).cuda(), torch.randn(8).cuda()

    loader = batches()
    """
)

EPILOGUE = textwrap.dedent(
    """
    import device
    simulated = device.get_torch_device_module()
    assert device.is_simulated() and device.sim.active() is simulated
    p = next(model.parameters())
    assert not simulated.is_host(p), "the model lives in simulated device memory"
    opt.wait_for_swap_out()
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    assert states and all(simulated.is_host(t) for t in states), "states are pinned host memory between steps"
    simulated.synchronize()
    print("SNIPPET-OK", sched.last_epoch)
    """
)


def snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it in a training script", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's training-script section has no python block"
    return match.group(1)


def test_snippet_runs_as_written_under_the_simulator(tmp_path):
    code = snippet()
    assert "SwapOptimizer" in code and ".cuda()" in code
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + "\n" + code + "\n" + EPILOGUE)
    env = {**os.environ, "SWAPOPT_DEVICE": "sim", "PYTHONPATH": str(ROOT)}
    done = cli_zygote.run([str(script)], cwd=os.getcwd(), env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SNIPPET-OK 4" in done.stdout
