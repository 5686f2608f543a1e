"""XTuner v1's MoE model (a tiny ``Qwen3MoEConfig``) trained by the stand-in TrainEngine, on the simulator.

Needs XTuner v1 importable (tests/xtuner_real.py: a checkout on ``SWAPOPT_XTUNER_SRC``, with ``cyclopts`` and
``ray`` installed, which XTuner's model package imports). The model, its router, dispatcher, grouped experts,
attention, loss context and ``SequenceContext`` are XTuner's own; the three device kernels under the experts
(permute, unpermute, grouped GEMM) are the plain-torch ones of tests/xtuner_moe_ops.py, since XTuner has CUDA
and NPU kernels only. The engine around it is the optimizer-facing part of XTuner's TrainEngine
(tests/xtuner_standin.py): FSDP2 over the ranks with one shard unit per decoder layer (XTuner's ``ep_size=1``
layout: every rank holds every expert, sharded along dim 0), ``optim_cfg.build(model)``, clipping, step, DCP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import xtuner_real  # before XTuner: it may put a checkout on sys.path
from xtuner_standin import TrainEngine

import device

QWEN3 = xtuner_real.xtuner_module("xtuner.v1.model.moe.qwen3")

VOCAB, SEQ = 64, 32
N_EXPERTS, TOP_K = 8, 2


def tiny_config() -> Any:
    """XTuner's Qwen3-MoE, shrunk: 2 layers, 8 routed experts (top-2), hidden 32, expert width 16."""
    from xtuner.v1.model.moe.moe import BalancingLossConfig
    from xtuner.v1.module.attention import MHAConfig
    from xtuner.v1.module.rope import RopeParametersConfig
    from xtuner.v1.module.router.greedy import GreedyRouterConfig

    return QWEN3.Qwen3MoEConfig(
        vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=None, bos_token_id=0, eos_token_id=1,
        num_hidden_layers=2, max_window_layers=2, hidden_size=32, intermediate_size=64, rms_norm_eps=1e-6,
        rope_parameters_cfg=RopeParametersConfig(rope_theta=1e6), hidden_act="silu",
        attention=MHAConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
                            attn_impl="eager_attention"),
        tie_word_embeddings=False, n_routed_experts=N_EXPERTS, n_shared_experts=0, num_experts_per_tok=TOP_K,
        moe_intermediate_size=16,
        router=GreedyRouterConfig(scoring_func="softmax", norm_topk_prob=True, router_scaling_factor=1.0),
        balancing_loss_cfg=BalancingLossConfig(), compile_cfg=False,
    )  # fmt: skip


def expert_names(model: torch.nn.Module) -> list[str]:
    """The routed experts' fused weights (``experts.fused_w1w3`` / ``experts.fused_w2``: all experts of a layer
    in one param, the layout XTuner's Muon config also keys on)."""
    return [n for n, _ in model.named_parameters() if ".experts.fused_" in n]


class MoETrainEngine(TrainEngine):
    """The stand-in TrainEngine with XTuner's MoE model and XTuner's batch types."""

    def build_model(self, seed: int) -> torch.nn.Module:
        # XTuner builds on the host (or meta) and initializes there, then places the params on the device.
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            model = tiny_config().build()
            model.init_weights()
        model = model.to(device.torch_device())
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.torch_device().type, (dist.get_world_size(),))
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model

    def train_step(self, step: int) -> float:
        from xtuner.v1.data_proto import SequenceContext
        from xtuner.v1.loss.ce_loss import CELossConfig

        dev = device.torch_device()
        ids = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(200 + step), device="cpu")
        seq_ctx = SequenceContext.from_input_ids((ids[:, :-1],), device=dev)
        loss_cfg = CELossConfig()
        loss_ctx = loss_cfg.build(data={"shifted_labels": ids[:, 1:]}, sp_mesh=None)
        loss_ctx.loss_kwargs.to(dev)  # XTuner's loss context moves the labels to its import-time device (the host)
        loss_ctx = loss_cfg.loss_ctx_cls.build_batches([loss_ctx])[0]
        out = self.model(seq_ctx=seq_ctx, loss_ctx={"lm": loss_ctx})
        loss = out["loss"]
        if out["balancing_loss"] is not None:
            loss = loss + out["balancing_loss"]
        loss.backward()
        return loss.item()


def expert_chunks(engine) -> dict[str, set[int]]:
    """For each fused expert weight, the chunks of the swap plan holding a piece of it."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.model.named_parameters()}
    prepared = opt._layout.prepared
    experts = set(expert_names(engine.model))
    held: dict[str, set[int]] = {n: set() for n in experts}
    for k, chunk in enumerate(prepared.plan.chunks):
        for piece in chunk.pieces:
            name = names[id(prepared.params[piece.index])]
            if name in experts:
                held[name].add(k)
    return held
