"""Every shipped config loads and validates; the variants differ only where they should."""

from __future__ import annotations

from pathlib import Path

import pytest

from swapopt.engine.config import load_config
from swapopt.train import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["tiny.py", "tiny_resident.py", "tiny.yaml", "llm_1b.py", "rl_colocate.py"])
def test_config_loads(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.optim.swap_optimizer == (name != "tiny_resident.py")


def test_yaml_form_equals_python_form():
    assert load_config(CONFIGS / "tiny.yaml") == load_config(CONFIGS / "tiny.py")


def test_resident_baseline_differs_only_in_swapping():
    tiny = load_config(CONFIGS / "tiny.py").model_dump()
    resident = load_config(CONFIGS / "tiny_resident.py").model_dump()
    tiny["optim"]["swap_optimizer"] = False
    tiny["train"]["compare_resident"] = 0
    assert resident == tiny


def test_llm_1b_is_1b_class():
    m = load_config(CONFIGS / "llm_1b.py").model
    per_layer = 4 * m.dim**2 + 3 * m.dim * m.hidden_dim + 2 * m.dim
    n_params = m.n_layers * per_layer + 2 * m.vocab_size * m.dim + m.dim
    assert 0.9e9 < n_params < 1.5e9


def test_rl_colocate_offloads_between_phases(clean_device_env, capsys):
    rc = main([str(CONFIGS / "rl_colocate.py"), "--cfg-options", "model.dim=32", "model.n_layers=1",
               "model.n_heads=2", "train.batch=2", "train.seq_len=16", "train.steps=4", "rl.rollout_every=2",
               "rl.rollout_buffer_mb=2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("rollout after step") == 1  # after step 2; none after the last step
    assert "optimizer offloaded, 2 MiB buffer held" in out


def test_llm_100m_prefetches_with_overlap():
    optim = load_config(CONFIGS / "llm_100m.py").optim
    assert optim.swap_optimizer and optim.overlap_forward and optim.prefetch
