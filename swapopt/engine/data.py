"""Byte-level language-modelling batches from a small text corpus.

The shipped corpus, ``data/tinyshakespeare.txt``, is the first 63,889 bytes (Coriolanus, acts I-II) of
``data/tinyshakespeare/input.txt`` in the public GitHub repository karpathy/char-rnn: Shakespeare, in the
public domain. It lets the main job run offline on a fresh machine.

Batch ``step`` is a pure function of (seed, step): the global batch of ``world_size * batch`` windows is
drawn from a generator seeded by both, and each rank takes its own slice. Resuming at step N therefore
sees exactly the batches an uninterrupted run would have seen, without saving any loader state.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = Path(__file__).parent / "data" / "tinyshakespeare.txt"


def load_tokens(path: str | Path | None = None) -> torch.Tensor:
    """The file's bytes as a uint8 tensor (token ids 0..255)."""
    raw = Path(path or CORPUS).read_bytes()
    if len(raw) < 2:
        raise ValueError(f"corpus {path or CORPUS} is too short to train on")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


class ByteBatches:
    def __init__(self, tokens: torch.Tensor, batch: int, seq_len: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"corpus of {tokens.numel()} tokens is too short for seq_len={seq_len}")
        self.tokens, self.batch, self.seq_len = tokens, batch, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size

    def windows(self, step: int, pin_memory: bool = False) -> torch.Tensor:
        """The batch as one int64 host tensor of shape (batch, seq_len + 1). ``pin_memory``: built in pinned
        host memory, so that one asynchronous copy moves it and reading it never waits for the device."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1,
                               (self.world_size * self.batch,), generator=gen, device="cpu", pin_memory=pin_memory)
        mine = starts[self.rank * self.batch:(self.rank + 1) * self.batch]
        windows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in mine.tolist()]).long()
        return windows.pin_memory() if pin_memory else windows

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 of shape (batch, seq_len); targets are inputs shifted by one."""
        windows = self.windows(step)
        return windows[:, :-1], windows[:, 1:]
