"""Muon with XTuner: what use_swapopt() does (nothing) and what swapopt can swap instead.

- XTuner's ``MuonConfig`` has no swap flag and is left as it is; XTuner's own ``Muon`` is not per-param (a
  ``group["step"]`` counter, Newton-Schulz over batches of params gathered across ranks) and SwapOptimizer
  refuses it, or, when forced with ``per_param=True``, fails the first step naming the group write.
- torch's ``torch.optim.Muon`` on the params XTuner's MuonConfig gives Muon (2-D, not the embedding nor the head),
  with AdamW on the rest, both wrapped in SwapOptimizer, trains bitwise like the unwrapped pair; Muon's params
  are swapped whole (never cut across chunks), AdamW's may be cut.

The torch part runs without XTuner; the XTuner parts skip without it (tests/xtuner_real.py)."""

from __future__ import annotations

import types

import pytest
import torch
import xtuner_real  # before XTuner: it may put a checkout on sys.path
from pydantic import ValidationError
from torch import nn

import device
from swapopt import SwapOptimizer
from swapopt.integrations.xtuner import use_swapopt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

OPTIM = xtuner_real.xtuner_module("xtuner.v1.config.optim")
HAVE_MOE = OPTIM is not None and xtuner_real.xtuner_module("xtuner.v1.model.moe.qwen3") is not None
needs_xtuner = pytest.mark.skipif(OPTIM is None, reason="XTuner v1 is not importable (set SWAPOPT_XTUNER_SRC)")
needs_moe = pytest.mark.skipif(
    not HAVE_MOE, reason="XTuner v1's MoE model is not importable (set SWAPOPT_XTUNER_SRC; it needs ray)"
)


class Tiny(nn.Module):
    """XTuner's param names for the parts MuonConfig treats apart: ``embed_tokens``, ``lm_head``, norms (1-D),
    and a [1, D] matrix (``p.numel() in p.shape``, AdamW in XTuner), plus 2-D projections for Muon."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"q_proj": nn.Linear(16, 24), "o_proj": nn.Linear(24, 16, bias=False),
                           "input_layernorm": nn.LayerNorm(16)})
            for _ in range(2)
        )  # fmt: skip
        self.scale = nn.Parameter(torch.ones(1, 16))
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.config = types.SimpleNamespace(n_routed_experts=1)  # what MuonConfig.build reads off the model

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids[:, :-1]).reshape(-1, 16)
        for layer in self.layers:
            h = h + layer["o_proj"](torch.tanh(layer["q_proj"](layer["input_layernorm"](h))))
        logits = self.lm_head(h * self.scale)
        return nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))


def xtuner_muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon params, AdamW params) by XTuner's rule (xtuner/v1/config/optim.py, MuonConfig.build): Muon for
    tensors of 2 or more dims that are not the embedding nor the head and not effectively 1-D."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        is_muon = p.ndim >= 2 and "embed_tokens" not in name and "lm_head" not in name and p.numel() not in p.shape
        (muon if is_muon else adamw).append(p)
    return muon, adamw


def build_pair(model: nn.Module, swap: bool) -> list[torch.optim.Optimizer]:
    muon, adamw = xtuner_muon_split(model)
    opts = [torch.optim.Muon(muon, lr=2e-2, weight_decay=0.1), torch.optim.AdamW(adamw, lr=1e-2, weight_decay=0.1)]
    if swap:
        # chunk_mb: a budget below the largest Muon matrix's states, so whole-param chunks are forced apart.
        opts = [SwapOptimizer(opts[0], chunk_mb=0.001), SwapOptimizer(opts[1], chunk_mb=0.001)]
    return opts


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_torch_muon_on_xtuner_param_split_swaps_whole_params_bitwise(sim):
    torch.manual_seed(0)
    with torch.device("cpu"):
        ref_model = Tiny()
    swap_model = Tiny()
    swap_model.load_state_dict(ref_model.state_dict())
    ref_model.to(device.torch_device())
    swap_model.to(device.torch_device())
    ref, swap = build_pair(ref_model, swap=False), build_pair(swap_model, swap=True)

    for step in range(4):
        ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(step), device="cpu")
        for model, opts in ((ref_model, ref), (swap_model, swap)):
            model(ids.to(device.torch_device())).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    for opt in swap:
        opt.wait_for_swap_out()

    for (name, r), s in zip(ref_model.named_parameters(), swap_model.parameters()):
        assert torch.equal(r.detach().cpu(), s.detach().cpu()), name
    for r_opt, s_opt in zip(ref, swap):
        for r, s in zip(r_opt.param_groups[0]["params"], s_opt.param_groups[0]["params"]):
            assert r_opt.state[r].keys() == s_opt.state[s].keys()
            for key, value in r_opt.state[r].items():
                assert torch.equal(value.cpu(), s_opt.state[s][key].cpu()), key
                if key == "momentum_buffer":
                    assert s_opt.state[s][key].device.type == "cpu"  # swapped: lives in host memory

    muon_plan, adamw_plan = (opt._layout.prepared.plan for opt in swap)
    muon_params = swap[0].param_groups[0]["params"]
    assert len(muon_params) == 4 and all(p.ndim == 2 for p in muon_params)
    assert len(muon_plan.chunks) > 1
    pieces = [pc for chunk in muon_plan.chunks for pc in chunk.pieces]
    # Whole params: each Muon param is one piece, from its first element to its last.
    assert sorted(pc.index for pc in pieces) == list(range(len(muon_params)))
    assert all(pc.start == 0 and pc.stop == muon_params[pc.index].numel() for pc in pieces)
    assert any(pc.start > 0 for chunk in adamw_plan.chunks for pc in chunk.pieces)  # AdamW's are cut


@needs_xtuner
def test_xtuner_muon_config_has_no_swap_flag_and_is_left_alone():
    use_swapopt(OPTIM.AdamWConfig)
    assert "swap_optimizer" not in OPTIM.MuonConfig.model_fields
    assert not hasattr(OPTIM.MuonConfig.build, "__swapopt_original__")
    assert not OPTIM.MuonConfig.__dict__.get("__swapopt_patched__")
    with pytest.raises(ValidationError, match="swap_optimizer"):
        OPTIM.MuonConfig(swap_optimizer=True)


@needs_xtuner
def test_xtuner_muon_config_groups_match_the_documented_rule(pg):
    torch.manual_seed(0)
    model = Tiny().to(device.torch_device())
    opt = OPTIM.MuonConfig(lr=1e-2).build(model)
    muon, adamw = xtuner_muon_split(model)
    by_algo: dict[str, list[int]] = {}
    for group in opt.param_groups:
        by_algo.setdefault(group["algorithm"], []).extend(id(p) for p in group["params"])
    assert sorted(by_algo["muon"]) == sorted(map(id, muon)) and sorted(by_algo["adamw"]) == sorted(map(id, adamw))


@needs_moe
def test_xtuner_muon_is_refused_and_forcing_it_fails_the_first_step(pg):
    import xtuner_moe
    import xtuner_moe_ops

    with xtuner_moe_ops.install():
        engine = type("TrainEngine", (xtuner_moe.MoETrainEngine,), {})(OPTIM.MuonConfig(lr=1e-2))
        opt = engine.optimizer
        assert type(opt).__module__ == "xtuner.v1.optim.muon"
        assert {g.get("num_experts", 1) for g in opt.param_groups} > {1}  # per-expert groups of the MoE model
        with pytest.raises(ValueError, match="not known to be a per-param optimizer"):
            SwapOptimizer(opt)
        forced = SwapOptimizer(opt, per_param=True, swap_optimizer_times=4)
        engine.train_step(0)
        with pytest.raises(RuntimeError, match=r"wrote param_groups\[\d+\]\['step'\]"):
            forced.step()
