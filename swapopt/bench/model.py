"""Synthetic LLM-shaped parameters (decoder blocks plus an embedding) with fixed gradients.

The optimizer step only sees tensor shapes, so a list of leaf tensors shaped like a decoder LLM's
is all a step benchmark needs: many mid-size matrices, a few small norms and one large embedding
(the param that does not fit a naive chunk).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

import torch

import device


class ModelShape(BaseModel):
    model_config = ConfigDict(frozen=True)

    hidden: int = Field(gt=0)
    layers: int = Field(gt=0)
    vocab: int = Field(default=32000, gt=0)

    def shapes(self) -> list[tuple[int, ...]]:
        h = self.hidden
        block = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h), (h,), (h,)]
        return [(self.vocab, h)] + block * self.layers + [(h,)]

    @property
    def numel(self) -> int:
        total = 0
        for s in self.shapes():
            n = 1
            for d in s:
                n *= d
            total += n
        return total


HIDDEN_LADDER = (64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)


def shape_for(billions: float) -> ModelShape:
    """A decoder shape with about `billions` x 1e9 params: the widest hidden size that still leaves
    about 8 blocks (hidden grows with size, as in LLM families). Sizes below 0.05B (test runs) get a
    small vocabulary."""
    target = billions * 1e9
    vocab = 32000 if billions >= 0.05 else 1024
    hidden = HIDDEN_LADDER[0]
    for h in HIDDEN_LADDER:
        if 8 * 12 * h * h + vocab * h <= target * 1.05:
            hidden = h
    layers = max(1, round((target - vocab * hidden) / (12 * hidden * hidden)))
    return ModelShape(hidden=hidden, layers=layers, vocab=vocab)


def make_params(
    shape: ModelShape | list[tuple[int, ...]], seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[torch.nn.Parameter]:
    """Device params of these shapes, with a deterministic gradient set on each."""
    shapes = shape.shapes() if isinstance(shape, ModelShape) else shape
    dev = device.torch_device()
    gen = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        # Generated on the host and copied so values do not depend on the device's RNG.
        p = torch.nn.Parameter(torch.empty(s, dtype=dtype, device=dev))
        with torch.no_grad():
            p.copy_(torch.randn(s, generator=gen, dtype=dtype).mul_(0.02))
        p.grad = torch.empty_like(p)
        p.grad.copy_(torch.randn(s, generator=gen, dtype=dtype).mul_(1e-3))
        params.append(p)
    return params


def clone_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Independent copies (values and grads) on the same device."""
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.detach().clone()
        out.append(q)
    return out
