"""Small helpers shared by corpus programs."""

from __future__ import annotations

import torch

import device

N = 256


def pinned(n: int = N, value: float = 1.0) -> torch.Tensor:
    host = device.pinned_empty(n)
    host.fill_(value)
    return host


def side_stream(sim):
    """A new stream that may use blocks the compute stream allocated so far."""
    side = sim.Stream()
    side.wait_stream(sim.default_stream())
    return side


def h2d(sim, stream, n: int = N):
    """A non-blocking H2D on `stream` into a fresh device tensor: (pinned source, device destination)."""
    host = pinned(n)
    dst = torch.empty(n)
    stream.wait_stream(sim.default_stream())
    with sim.stream(stream):
        dst.copy_(host, non_blocking=True)
    # dst came from the compute stream's pool: recording `stream` keeps its free from racing the copy, so
    # the only race a program shows is the one it is labelled with.
    dst.record_stream(stream)
    return host, dst


def d2h(sim, stream, n: int = N):
    """A non-blocking D2H on `stream` from a fresh device tensor: (device source, pinned destination)."""
    src = torch.full((n,), 3.0)
    host = device.pinned_empty(n)
    stream.wait_stream(sim.default_stream())
    with sim.stream(stream):
        host.copy_(src, non_blocking=True)
    # As in h2d: dropping src later must not add a free race of the helper's own.
    src.record_stream(stream)
    return src, host
