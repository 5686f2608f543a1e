"""The device's link and host costs the planner models (Note [chunk count from costs] in swapopt.plan).

On the simulator they are its preset's; on a GPU or NPU those of a calibrated preset file when
``SWAPOPT_LINK_PRESET`` names one (the file ``python -m swapopt.verify`` writes), else the simulator's preset
for that device type (h100 for CUDA, 910b for NPU), whose figures cite their sources.
"""

from __future__ import annotations

import functools
import os
import warnings

import device
from swapopt.plan import LinkCosts

ENV = "SWAPOPT_LINK_PRESET"
# Host time of one chunk beyond its launches: the pipeline's Python per chunk (events, stream switches, the
# update's call), as the layout benchmark's Python time per chunk measures it on the simulator.
PYTHON_CHUNK_US = 30.0
LAUNCHES_PER_CHUNK = 4  # its swap-in, its swap-out, the update's step count and its kernel
# Launches a chunk that holds cut pieces adds (Note [cut chunks] in swapopt.plan): the direct step's second call over
# them (the step counts' add and the kernel; each cut piece's step clone is one of the copies estimate_us counts);
# with as much Python as a chunk's (their state dicts, the call). A model, not a measurement: the H100 runs of
# 2026-11-27 timed the cut chunks before they were stepped directly (bench/results/cuda-h100-2026-11-27-host.md).
CUT_CHUNK_LAUNCHES = 2
_DEFAULT_PRESET = {"cuda": "h100", "npu": "910b"}


def _from_preset(preset) -> LinkCosts:
    # Each direction's latency and the rates with both busy as the preset models them (Note [link sharing] in
    # device/sim/preset_spec.py): under "sized" its duplex table's, under the other rules half the cap each.
    sized = getattr(preset, "link_sharing", None) == "sized"
    return LinkCosts(
        copy_latency_us=preset.copy_latency_us,
        h2d_gbps=preset.h2d_gbps,
        d2h_gbps=preset.d2h_gbps,
        duplex_gbps=preset.duplex_gbps,
        host_chunk_us=LAUNCHES_PER_CHUNK * preset.launch_us + PYTHON_CHUNK_US,
        h2d_latency_share=getattr(preset, "h2d_latency_share", 0.5),
        duplex_table=tuple(getattr(preset, "duplex_table", ())) if sized else (),
        host_copy_us=preset.launch_us,
        host_tensor_us=getattr(preset, "host_tensor_us", 0.0),
        host_cut_chunk_us=CUT_CHUNK_LAUNCHES * preset.launch_us + PYTHON_CHUNK_US,
        hbm_gbps=preset.hbm_gbps,
    )


@functools.cache
def _named(name_or_path: str) -> LinkCosts:
    from device.sim.presets import get_preset

    return _from_preset(get_preset(name_or_path))


def link_costs(device_type: str) -> LinkCosts | None:
    """The costs of the link to ``device_type``'s devices; None on the host alone (nothing is swapped)."""
    if device.is_simulated():
        preset = getattr(device.get_torch_device_module(), "preset", None)
        if preset is not None:
            return _from_preset(preset)
    given = os.environ.get(ENV)
    if given:
        try:
            return _named(given)
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"swapopt: {ENV}={given!r} could not be read ({exc}); planning with the default costs", stacklevel=2
            )
    name = _DEFAULT_PRESET.get(device_type)
    return _named(name) if name is not None else None
