"""README's "Use it from your framework" snippets run as written (the training calls themselves, `.train(` and
`.fit(`, are left to the per-framework tests, which train, checkpoint and resume)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swapopt import SwapOptimizer

README = Path(__file__).resolve().parent.parent / "README.md"


def snippets() -> dict[str, str]:
    text = README.read_text()
    start = text.index("## Use it from your framework")
    end = text.find("\n## ", start + 1)  # up to the next section, whichever it is
    section = text[start:end if end != -1 else len(text)]
    out: dict[str, str] = {}
    name, block = "", None
    for line in section.splitlines():
        if block is not None:
            if line.startswith("```"):
                out[name] = "\n".join(block)
                block = None
            else:
                block.append(line)
        elif line.startswith("**"):
            name = line[2:line.index("**", 2)].split(" (")[0].strip()  # the paragraph's bold lead
        elif line.startswith("```python"):
            block = []
    return out


def run(name: str, **namespace) -> dict:
    code = "\n".join(line for line in snippets()[name].splitlines() if ".train(" not in line and ".fit(" not in line)
    ns = {"torch": torch, "swapopt": __import__("swapopt"), **namespace}
    exec(compile(code, f"README:{name}", "exec"), ns)
    return ns


def test_every_framework_has_a_snippet():
    assert {"Class form", "Hugging Face Trainer", "XTuner v1", "torchtitan", "Lightning"} <= snippets().keys()


def test_class_form_and_xtuner_snippets(sim):
    ns = run("Class form", model=torch.nn.Linear(4, 4))
    assert isinstance(ns["opt"], SwapOptimizer) and ns["opt"].swap_optimizer_times == 16
    assert ns["SwapSGD"].__name__ == "SwapSGD"
    ns = run("XTuner v1")
    opt = ns["optim_cfg"].build(torch.nn.Linear(4, 4))
    assert isinstance(opt, SwapOptimizer) and opt.param_groups[0]["lr"] == 6e-5


def test_torchtitan_snippet(sim):
    pytest.importorskip("torchtitan")
    from torchtitan.components.optimizer import ParamGroupConfig

    ns = run("torchtitan", ParamGroupConfig=ParamGroupConfig, model_parts=[torch.nn.Linear(4, 4)])
    assert all(isinstance(o, SwapOptimizer) for o in ns["optimizers"])


def test_hf_snippet_builds_a_swapping_optimizer(sim, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    ns = run("Hugging Face Trainer", Trainer=transformers.Trainer, model=transformers.LlamaForCausalLM(cfg),
             args=args, ds=[])
    opt = ns["trainer"].create_optimizer()
    assert isinstance(opt, SwapOptimizer) and opt.swap_optimizer_times == 16


def test_lightning_snippet(sim):
    L = pytest.importorskip("lightning")
    ns = run("Lightning", L=L, module=None)
    module = torch.nn.Linear(4, 4)
    assert isinstance(ns["configure_optimizers"](module), SwapOptimizer)
    assert type(ns["trainer"].strategy).__name__ == "SwapSingleDeviceStrategy"
