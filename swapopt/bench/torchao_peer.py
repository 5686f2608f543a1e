"""torchao's CPUOffloadOptimizer as a benchmark peer: where it comes from and what it needs on the simulator
(shared by the peers table, swapopt.bench.peers, and the strategy of the quick table, swapopt.bench.strategies)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import device


def short_reason(err: BaseException) -> str:
    """An exception as one line of at most 400 characters, for a table's note."""
    text = f"{type(err).__name__}: {err}".strip()
    return text if len(text) <= 400 else text[:397] + "..."


def offload_class() -> tuple[type | None, str | None]:
    """torchao's CPUOffloadOptimizer, or None and why it is not importable."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception as err:  # noqa: BLE001 - not installed, or built for another torch
        return None, f"torchao is not importable (pip install torchao): {short_reason(err)}"
    return CPUOffloadOptimizer, None


@contextlib.contextmanager
def on_simulator() -> Iterator[list[str]]:
    """What torchao needs to run on the simulator, and nothing on a real device: torchao picks its device from
    ``torch.cuda.is_available()``, which the simulator keeps False (no tensor is cuda-typed) while it presents
    the rest of torch.cuda (streams, events, synchronize), so name cuda for it."""
    notes: list[str] = []
    if not device.is_simulated():
        yield notes
        return
    import torchao.optim.cpu_offload as cpu_offload

    saved_devices = cpu_offload.get_available_devices
    cpu_offload.get_available_devices = lambda: ["cpu", "cuda"]
    try:
        yield notes
    finally:
        cpu_offload.get_available_devices = saved_devices
