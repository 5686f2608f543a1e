"""device.sim as the tests use it: activate() also makes the simulated device torch's default device, so
tests read as written for a machine whose default device is the accelerator (factories without a device
make device tensors; host memory is asked for by name: device="cpu" (with pin_memory=True for pinned memory:
pin_memory alone asks to pin device memory, which CUDA refuses), or device.pinned_empty)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from device.sim import *  # noqa: F403
from device.sim import _PROCESS  # noqa: F401
from device.sim import activate as _activate


@contextmanager
def on_device(device: Any) -> Iterator[Any]:
    """torch's default device is `device`'s for the block."""
    previous = torch.get_default_device()
    torch.set_default_device(device.torch_device())
    try:
        yield device
    finally:
        torch.set_default_device(previous)


@contextmanager
def host_default() -> Iterator[None]:
    """torch's default device is the host's for the block, as in a training script whose framework places
    the model and the batches (the frameworks' tests)."""
    previous = torch.get_default_device()
    torch.set_default_device("cpu")
    try:
        yield
    finally:
        torch.set_default_device(previous)


def test_flavour() -> str:
    """The flavour an in-process test simulates: the one the process registered, else SWAPOPT_SIM_PRESET's,
    else cuda. Never the first activated preset's: a process registers one flavour for good, so a test that
    borrows the 910b preset's figures would otherwise turn every later test of its worker into an npu one."""
    return registered_flavour() or process_flavour() or "cuda"  # noqa: F405


@contextmanager
def activate(*args: Any, **kwargs: Any) -> Iterator[Any]:
    if len(args) < 5:  # flavour not given by position
        kwargs.setdefault("flavour", test_flavour())
    with _activate(*args, **kwargs) as device, on_device(device):
        yield device
