"""The simulated accelerator: a device on CPU that fails where a real one would (device/sim/device.py says how).

Parts, one concept each: backend (its PrivateUse1 device type and flavours), tensor (SimTensor), device
(SimDevice: the torch.cuda-like surface and the dispatch of every op), active (which simulator is active),
modes and entry_points (how ops and the calls the dispatcher does not see reach it), dispatch and ops
(per-op classification), sanitizer, memory, streams, timeline, costs, presets, host_time.
"""

from device.sim.active import active
from device.sim.backend import BACKEND_NAMES, FLAVOURS, backend_name, registered_flavour
from device.sim.device import (
    _PROCESS,
    OutOfMemoryError,
    SimDevice,
    activate,
    device_count,
    preset_from_env,
    process_device,
    process_flavour,
    typed_default,
)
from device.sim.presets import PRESETS, SimPreset
from device.sim.sanitizer import StreamRaceError
from device.sim.streams import SimEvent, SimStream
from device.sim.tensor import SimTensor
from device.sim.timeline import TimelineOp

__all__ = [
    "BACKEND_NAMES",
    "FLAVOURS",
    "OutOfMemoryError",
    "PRESETS",
    "SimDevice",
    "SimEvent",
    "SimPreset",
    "SimStream",
    "SimTensor",
    "StreamRaceError",
    "TimelineOp",
    "activate",
    "active",
    "backend_name",
    "device_count",
    "preset_from_env",
    "process_device",
    "process_flavour",
    "registered_flavour",
    "typed_default",
]
