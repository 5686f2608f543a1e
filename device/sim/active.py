"""Which simulator is active: the stack every part of the simulator asks, so none imports another for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from device.sim.device import SimDevice

_ACTIVE: list[SimDevice] = []


def active() -> SimDevice | None:
    """The innermost active simulator, if any."""
    return _ACTIVE[-1] if _ACTIVE else None
