"""The largest model the engine's LM trains on one device and its host: ``python -m swapopt.bench.capacity``.

Four ways of holding AdamW, by arithmetic over the device's and the host's capacity (a simulator preset's, or
given), never by allocating (docs/optimizer.md, "Host memory", spells it out):

- ``resident``: fp32 params, grads and both moments in device memory (16 B/param), nothing on the host;
- ``swapped``: fp32 params and grads on the device (8 B/param), the moments in pinned host memory (8 B/param),
  streamed through ``slots`` + 1 staging chunks of 1/``times`` of them;
- ``masters``: bf16 params and grads on the device (4 B/param), fp32 masters and moments on the host
  (12 B/param), each chunk's slot also holding its grads upcast to fp32 (16 B/param of the chunk in all);
- ``masters-8bit``: as ``masters`` with torchao's ``AdamW8bit`` moments (``torchao.optim``): each moment is
  a uint8 code a param plus an fp32 scale per block of 256 (``OptimState8bit.zeros`` in
  torchao/optim/subclass_8bit.py; ``block_size=256`` is AdamW8bit's default in torchao/optim/adam.py, torchao
  0.18), 2 x (1 + 4/256) = 2.03 B/param for the two, so 4 + 2.03 = 6.03 B/param on the host (the 256-entry
  fp32 code table of each state tensor, 1 KiB, is left out).

On top of that the device holds one step's activations (the engine's gradient checkpointing: one saved input
a block, one block's recompute, fp32 logits and their grad) and ``DEVICE_RESERVE`` for the CUDA context and
allocator slack; the host holds the pinned bytes within swapopt's bound (1.02 x + 256 MiB) and ``HOST_RESERVE``
for the process. The search runs over width (dim a multiple of 256, ffn 8/3 dim rounded up to 256 as LLaMA's
11008 for 4096, heads of 128) and depth, and reports the largest parameter count that fits.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Literal

GiB = 1 << 30
MiB = 1 << 20
MODES: tuple[str, ...] = ("resident", "swapped", "masters", "masters-8bit")
Mode = Literal["resident", "swapped", "masters", "masters-8bit"]
BLOCK_8BIT = 256  # torchao AdamW8bit's default block_size: one fp32 scale per 256 codes
# Bytes of AdamW8bit's two moments per BLOCK_8BIT params: a uint8 code a param and a 4-byte scale a block, each.
MOMENTS_8BIT_PER_BLOCK = 2 * (BLOCK_8BIT + 4)
DEVICE_RESERVE = 2 * GiB  # CUDA context, cuBLAS workspaces, allocator fragmentation: assumed
HOST_RESERVE = 4 * GiB  # the interpreter, torch, CUDA's host side, the data loader: assumed
ASPECT = 256  # the widest a searched model may be per layer (dim / n_layers)
VOCAB = 256  # the engine's byte-level vocabulary (swapopt.engine.config.ModelConfig.vocab_size)


@dataclass(frozen=True)
class CapacityRow:
    """One model and what it takes: params, device bytes (params, grads, resident states, staging,
    activations, reserve) and host bytes (pinned states and masters within the bound, reserve)."""

    mode: str
    dim: int
    n_layers: int
    ffn_dim: int
    n_params: int
    device_bytes: int
    host_bytes: int
    pinned_bytes: int
    fits: bool


def ffn_for(dim: int) -> int:
    """The SwiGLU width LLaMA gives ``dim``: 8/3 of it rounded up to a multiple of 256 (4096 -> 11008)."""
    return -(-(8 * dim // 3) // 256) * 256


def lm_params(dim: int, n_layers: int, ffn_dim: int, vocab: int = VOCAB) -> int:
    """Parameters of swapopt.engine.model's LM (untied embeddings): per block qkv and out (4 dim^2), gate, up
    and down (3 dim ffn) and two norms; the embedding, the output head and the final norm."""
    return n_layers * (4 * dim * dim + 3 * dim * ffn_dim + 2 * dim) + 2 * vocab * dim + dim


def activation_bytes(dim: int, n_layers: int, ffn_dim: int, tokens: int, itemsize: int, vocab: int = VOCAB) -> int:
    """One step's activations with gradient checkpointing (as swapopt.engine.preflight.estimate counts them):
    one saved block input per layer, one block's recompute, and fp32 logits with their grad."""
    block = tokens * (10 * dim + 3 * ffn_dim) * itemsize
    return n_layers * tokens * dim * itemsize + block + 3 * tokens * vocab * 4


def need(
    mode: Mode, dim: int, n_layers: int, ffn_dim: int | None = None, *, tokens: int = 2048, slots: int = 3,
    times: int = 16,
) -> tuple[int, int, int]:
    """(device bytes, host bytes, pinned bytes) of one train step of the LM in ``mode``."""
    ffn = ffn_dim or ffn_for(dim)
    n = lm_params(dim, n_layers, ffn)
    if mode == "resident":
        dev_per, pinned, slot_bytes, itemsize = 16, 0, 0, 4
    elif mode == "swapped":
        dev_per, pinned, slot_bytes, itemsize = 8, 8 * n, 8 * n, 4
    elif mode == "masters":
        dev_per, pinned, slot_bytes, itemsize = 4, 12 * n, 16 * n, 2
    elif mode == "masters-8bit":  # the master and the 8-bit moments; the slot also holds the grad upcast to fp32
        moments = -(-n * MOMENTS_8BIT_PER_BLOCK // BLOCK_8BIT)
        dev_per, pinned, slot_bytes, itemsize = 4, 4 * n + moments, 8 * n + moments, 2
    else:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    # the largest chunk: 1/times of the swapped bytes, or the largest param's if one param is bigger (the
    # planner splits element-wise params across chunks, so it is not)
    staging = (slots + 1) * -(-slot_bytes // times) if pinned else 0
    device_bytes = dev_per * n + staging + activation_bytes(dim, n_layers, ffn, tokens, itemsize) + DEVICE_RESERVE
    host_bytes = (int(1.02 * pinned) + 256 * MiB if pinned else 0) + HOST_RESERVE
    return device_bytes, host_bytes, pinned


def row(mode: Mode, dim: int, n_layers: int, device_capacity: int, host_capacity: int,
        ffn_dim: int | None = None, **kw: int) -> CapacityRow:
    ffn = ffn_dim or ffn_for(dim)
    d, h, p = need(mode, dim, n_layers, ffn, **kw)
    return CapacityRow(mode, dim, n_layers, ffn, lm_params(dim, n_layers, ffn), d, h, p,
                       d <= device_capacity and h <= host_capacity)


def largest(mode: Mode, device_capacity: int, host_capacity: int, dims: range = range(1024, 16385, 256),
            max_layers: int = 256, **kw: int) -> CapacityRow | None:
    """The model of the most params that fits in ``mode``: for each width the deepest that fits (need grows
    with depth, so a bisection finds it), the best over widths. Shapes stay those of LLMs: at least one layer
    per ``ASPECT`` of width (4096 wide: 16 layers or more; Llama-2-7B has 32)."""
    best: CapacityRow | None = None
    for dim in dims:
        lo, hi = 0, max_layers
        while lo < hi:  # the most layers that fit at this width
            mid = (lo + hi + 1) // 2
            if row(mode, dim, mid, device_capacity, host_capacity, **kw).fits:
                lo = mid
            else:
                hi = mid - 1
        if lo < max(1, dim // ASPECT):
            continue
        if best is None or lm_params(dim, lo, ffn_for(dim)) > best.n_params:
            best = row(mode, dim, lo, device_capacity, host_capacity, **kw)
    return best


def capacity_table(
    preset: str = "h100", host_bytes: int | None = None, *, device_bytes: int | None = None, tokens: int = 2048,
    slots: int = 3, times: int = 16,
) -> list[CapacityRow]:
    """Per mode (MODES), the largest LM that trains on the preset's device (``device_bytes`` overrides its
    capacity_bytes) beside a host of ``host_bytes`` (default: the preset's host_capacity_bytes, or
    SWAPOPT_SIM_HOST_MB); a step of ``tokens`` tokens, ``slots`` staging slots, ``times`` chunks. Arithmetic
    only: nothing is allocated. A mode where nothing fits has no row."""
    from device.sim.host_memory import capacity_from_env
    from device.sim.presets import get_preset

    p = get_preset(preset)
    dev = int(device_bytes if device_bytes is not None else p.capacity_bytes)
    host = int(host_bytes if host_bytes is not None else capacity_from_env(p.host_capacity_bytes))
    kw = {"tokens": tokens, "slots": slots, "times": times}
    rows = [largest(m, dev, host, **kw) for m in MODES]  # type: ignore[arg-type]
    return [r for r in rows if r is not None]


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def format_table(rows: list[CapacityRow], preset: str, device_bytes: int, host_bytes: int) -> str:
    lines = [
        f"largest swapopt.engine LM per mode on {preset}: device {device_bytes / GiB:.1f} GiB, host {host_bytes / GiB:.1f} GiB",
        "| mode | params | dim | layers | ffn | device | host (pinned) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.mode} | {r.n_params / 1e9:.2f}B | {r.dim} | {r.n_layers} | {r.ffn_dim} | "
                     f"{_gb(r.device_bytes)} | {_gb(r.host_bytes)} ({_gb(r.pinned_bytes)}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swapopt.bench.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="h100", help="simulator preset (or preset JSON file): its device capacity")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="host RAM in GiB (default: the preset's host_capacity_bytes, or SWAPOPT_SIM_HOST_MB)")
    ap.add_argument("--device-gib", type=float, default=None, help="device memory in GiB (default: the preset's)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch x seq_len)")
    ap.add_argument("--check", nargs=3, type=int, metavar=("DIM", "LAYERS", "FFN"),
                    help="also say whether this model fits, per mode")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = ap.parse_args(argv)
    from device.sim.host_memory import capacity_from_env
    from device.sim.presets import get_preset

    p = get_preset(args.preset)
    dev = int(args.device_gib * GiB) if args.device_gib else p.capacity_bytes
    host = int(args.host_gib * GiB) if args.host_gib else capacity_from_env(p.host_capacity_bytes)
    rows = capacity_table(args.preset, host, device_bytes=dev, tokens=args.tokens)
    checks = [row(m, *args.check[:2], dev, host, ffn_dim=args.check[2], tokens=args.tokens)  # type: ignore[arg-type]
              for m in MODES] if args.check else []
    if args.json:
        print(json.dumps({"largest": [asdict(r) for r in rows], "check": [asdict(r) for r in checks]}, indent=1))
        return 0
    print(format_table(rows, p.name, dev, host))
    for r in checks:
        print(f"{r.mode}: dim {r.dim}, {r.n_layers} layers, ffn {r.ffn_dim} ({r.n_params / 1e9:.2f}B params): device "
              f"{_gb(r.device_bytes)}, host {_gb(r.host_bytes)} (pinned {_gb(r.pinned_bytes)}): "
              + ("fits" if r.fits else "does not fit"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
