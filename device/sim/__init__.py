"""The simulated accelerator: a device on CPU that fails where a real one would (device/sim/device.py says how).

Modules, one concept each, listed from the bottom layer up (a module imports only modules listed before it;
tests/test_import_layers.py keeps it so):
- figures: preset_spec (SimPreset), preset_file (a preset as JSON), presets (h100, 910b, get_preset), ops (op
  schemas), costs (FLOPs per op), host_time (host CPU time inside the simulator), timeline (modeled time);
- memory and tensors: memory (device allocator model), host_memory (pinned host memory), sanitizer (vector
  clocks, access logs, StreamRaceError), accesses (what an op touches, which lane it runs on), tensor
  (SimTensor), kernels (device kernels that differ from the CPU's), npu_amp and npu_ops (torch_npu's names);
- which simulator is active (active), its dispatch modes (modes), its PrivateUse1 backend (backend) and the torch
  entry points it wraps (entry_points);
- SimDevice's parts: streams (streams, events and their ordering), storages (device and pinned memory),
  race_checks (the sanitizer's checks), outside_dispatch (host reads, aliases, collectives), dispatch (each op),
  graphs (CUDA / NPU graph capture and replay);
- device (SimDevice put together, activate, process_device), and this package's names.
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
)
from device.sim.graphs import SimGraph
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
    "SimGraph",
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
]
