"""Parameter layouts of real models: how many tensors, of which shapes, not only how many params.

A swap step's bytes depend on the param count, but its host work and kernel launches depend on how
many tensors carry those params. These layouts give the benchmark both: Llama-2-7B's 291 tensors, a
fine-grained MoE with thousands of expert matrices, one rank's FSDP2 shards of Llama-2-7B (bytes
shrink with the world size, tensor counts do not) and ten thousand tiny params.

``scaled(layout, factor)`` divides every dim by `factor` (rounding, at least 1), so a layout too
large for the host running the simulator keeps its tensor count and relative shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

from swapopt.bench.model import make_params

Shape = tuple[int, ...]

# Llama-2-7B, from its Hugging Face config.json (meta-llama/Llama-2-7b-hf): hidden_size 4096,
# intermediate_size 11008, num_hidden_layers 32, num_attention_heads 32 = num_key_value_heads,
# vocab_size 32000, untied embeddings.
LLAMA2_7B = {"hidden": 4096, "intermediate": 11008, "layers": 32, "vocab": 32000, "kv_dim": 4096}

# Mixtral-8x7B, from its Hugging Face config.json (mistralai/Mixtral-8x7B-v0.1): hidden_size 4096,
# intermediate_size 14336 per expert, num_hidden_layers 32, num_attention_heads 32 with
# num_key_value_heads 8 (head_dim 128: k/v project to 1024), num_local_experts 8, vocab_size 32000.
MIXTRAL_8X7B = {"hidden": 4096, "intermediate": 14336, "layers": 32, "vocab": 32000, "kv_dim": 1024, "experts": 8}

# Mixtral's expert shapes with 32 experts per layer instead of 8: fine-grained MoE models carry many
# more, smaller experts, and the tensor count is what this layout is about (32 layers x 103 + 3 = 3,299).
MOE_EXPERTS = 32

FSDP_WORLD = 256
TINY_COUNT, TINY_NUMEL = 10_000, 128


class Layout(BaseModel):
    """Named tensor shapes of one model (or one rank's shards of it)."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str  # where the shapes come from
    tensors: tuple[tuple[str, Shape], ...]
    scale: int = Field(default=1, ge=1)  # every dim divided by this (rounded, >= 1)

    @property
    def count(self) -> int:
        return len(self.tensors)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors)

    @property
    def shapes(self) -> list[Shape]:
        return [shape for _, shape in self.tensors]


def _attention(pre: str, hidden: int, kv_dim: int) -> list[tuple[str, Shape]]:
    """q, k, v, o projections of one decoder layer (grouped-query attention when kv_dim < hidden)."""
    return [
        (f"{pre}.self_attn.q_proj.weight", (hidden, hidden)),
        (f"{pre}.self_attn.k_proj.weight", (kv_dim, hidden)),
        (f"{pre}.self_attn.v_proj.weight", (kv_dim, hidden)),
        (f"{pre}.self_attn.o_proj.weight", (hidden, hidden)),
    ]


def llama7b() -> Layout:
    """Llama-2-7B: embedding, 32 decoder layers of (q, k, v, o, gate, up, down, 2 RMSNorms), final norm, lm_head."""
    c = LLAMA2_7B
    h, f = c["hidden"], c["intermediate"]
    tensors: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (c["vocab"], h))]
    for i in range(c["layers"]):
        pre = f"model.layers.{i}"
        tensors += _attention(pre, h, c["kv_dim"]) + [
            (f"{pre}.mlp.gate_proj.weight", (f, h)),
            (f"{pre}.mlp.up_proj.weight", (f, h)),
            (f"{pre}.mlp.down_proj.weight", (h, f)),
            (f"{pre}.input_layernorm.weight", (h,)),
            (f"{pre}.post_attention_layernorm.weight", (h,)),
        ]
    tensors += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab"], h))]
    return Layout(name="llama7b", source="Llama-2-7B config (meta-llama/Llama-2-7b-hf)", tensors=tuple(tensors))


def moe(experts: int = MOE_EXPERTS) -> Layout:
    """Mixtral-like MoE: per layer q, k, v, o, the router, `experts` x (w1, w2, w3) and 2 RMSNorms."""
    c = MIXTRAL_8X7B
    h, f = c["hidden"], c["intermediate"]
    tensors: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (c["vocab"], h))]
    for i in range(c["layers"]):
        pre = f"model.layers.{i}"
        tensors += _attention(pre, h, c["kv_dim"]) + [
            (f"{pre}.block_sparse_moe.gate.weight", (experts, h)),
        ]
        for e in range(experts):
            ex = f"{pre}.block_sparse_moe.experts.{e}"
            tensors += [(f"{ex}.w1.weight", (f, h)), (f"{ex}.w2.weight", (h, f)), (f"{ex}.w3.weight", (f, h))]
        tensors += [(f"{pre}.input_layernorm.weight", (h,)), (f"{pre}.post_attention_layernorm.weight", (h,))]
    tensors += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab"], h))]
    return Layout(
        name="moe",
        source=f"Mixtral-8x7B config (mistralai/Mixtral-8x7B-v0.1) shapes, {experts} experts per layer",
        tensors=tuple(tensors),
    )


def fsdp_shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(local rows, padded rows) of `rank`'s FSDP2 shard of a dim 0 of `rows`.

    FSDP2 splits dim 0 as torch.chunk does: ceil(rows / world) rows per rank, the last ranks getting
    fewer or none. It pads each shard to ceil(rows / world) rows for its all-gather buffer, but the
    param the optimizer sees (and so every state) is the unpadded local part.
    """
    padded = -(-rows // world)
    local = max(0, min(padded, rows - rank * padded))
    return local, padded


def fsdp_shard(layout: Layout, world: int = FSDP_WORLD, rank: int = 0) -> Layout:
    """One rank's local FSDP2 shards (dim 0 sharded, unpadded) of every tensor of `layout`."""
    tensors = tuple(
        (name, (fsdp_shard_rows(shape[0], world, rank)[0], *shape[1:])) for name, shape in layout.tensors
    )
    return Layout(
        name=f"{layout.name}-fsdp{world}",
        source=f"{layout.source}, FSDP2 rank {rank} of {world} (dim 0 sharded)",
        tensors=tensors,
    )


def fsdp256() -> Layout:
    """Rank 0's FSDP2 shards of Llama-2-7B at world size 256."""
    return fsdp_shard(llama7b(), FSDP_WORLD, 0).model_copy(update={"name": "fsdp256"})


def tiny10k() -> Layout:
    """10,000 params of 128 elements: the per-tensor cost with nothing to hide it."""
    tensors = tuple((f"p{i}", (TINY_NUMEL,)) for i in range(TINY_COUNT))
    return Layout(name="tiny10k", source="synthetic: 10,000 vectors of 128", tensors=tensors)


LAYOUTS: dict[str, Callable[[], Layout]] = {"llama7b": llama7b, "moe": moe, "fsdp256": fsdp256, "tiny10k": tiny10k}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]()
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; choices: {', '.join(LAYOUTS)}") from None


def scaled(layout: Layout, factor: int) -> Layout:
    """Every dim divided by `factor` (rounded, at least 1): same tensor count, same relative shapes."""
    if factor < 1:
        raise ValueError(f"scale factor must be >= 1, got {factor}")
    if factor == 1:
        return layout
    tensors = tuple((name, tuple(max(1, round(d / factor)) for d in shape)) for name, shape in layout.tensors)
    return Layout(name=layout.name, source=layout.source, tensors=tensors, scale=layout.scale * factor)


def scale_to_fit(layout: Layout, max_numel: int) -> Layout:
    """`layout` scaled to at most `max_numel` params: the first factor that fits, counting up from
    sqrt(numel / max_numel) (most params sit in matrices, whose size falls as factor^2)."""
    factor = max(1, math.isqrt(max(layout.numel // max(max_numel, 1), 1)))
    while True:
        candidate = scaled(layout, factor)
        if candidate.numel <= max_numel or all(d == 1 for s in candidate.shapes for d in s):
            return candidate
        factor += 1


def make_layout_params(
    layout: Layout | str, scale: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[torch.nn.Parameter]:
    """Params of `layout`'s shapes (every dim divided by `scale`) on the current device, each with a
    deterministic gradient."""
    shape = get_layout(layout) if isinstance(layout, str) else layout
    return make_params(scaled(shape, scale).shapes, seed=seed, dtype=dtype)
