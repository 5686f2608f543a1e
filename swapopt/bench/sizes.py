"""Model sizes for a real device: from 0.1B params up to the largest that fits device and host."""

from __future__ import annotations

import os

import device

LADDER = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def _host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fits(billions: float, free_device: int, host: int, times: int = 16, slots: int = 3) -> bool:
    """Whether the swap strategies fit: fp32 params and grads on the device (8 B/param) plus
    (slots + 1) staging chunks of states, and the host-step strategy's 16 B/param of host memory,
    each with 10% headroom."""
    n = billions * 1e9
    device_need = 8 * n + (slots + 1) * 8 * n / times
    return device_need <= 0.9 * free_device and 16 * n <= 0.9 * host


def auto_sizes() -> list[float]:
    free, _ = device.get_torch_device_module().mem_get_info()
    host = _host_bytes()
    sizes = [b for b in LADDER if fits(b, free, host)]
    return sizes or [LADDER[0]]
