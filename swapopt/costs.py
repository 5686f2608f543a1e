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
# Host time of one chunk beyond its launches and event calls: the pipeline's Python per chunk (stream switches, the
# update's call, its params' share of the direct step), on the H100's host: the least Python a chunk of the eager
# rows of one FSDP2 rank and Llama-2-7B (291 tensors, 28-66 chunks) took over the three runs of one lease, 80.9 us
# (Llama-2-7B at 64 requested chunks, run 2; the others 87.0-226.2 us as the host's speed moved), less its six event
# calls at the h100 preset's event_us (bench/results/cuda-h100-2026-11-28-lease.md; sim-h100-2026-11-28-events.md).
PYTHON_CHUNK_US = 43.0
LAUNCHES_PER_CHUNK = 4  # its swap-in, its swap-out, the update's step count and its kernel
# Its event records and stream waits (Note [host clock] in device/sim/timeline.py): the swap-in waits for its slot's
# last swap-out and records its end, the update waits for that and records its own, the swap-out waits for it and
# records the slot free again.
EVENT_CALLS_PER_CHUNK = 6
# Launches a chunk that holds cut pieces adds (Note [cut chunks] in swapopt.plan): the direct step's second call over
# them (the step counts' add and the kernel; each cut piece's step clone is one of the copies estimate_us counts);
# with as much Python as a chunk's (their state dicts, the call). A model, not a measurement: the H100 runs of
# 2026-11-27 timed the cut chunks before they were stepped directly (bench/results/cuda-h100-2026-11-27-host.md).
CUT_CHUNK_LAUNCHES = 2
_DEFAULT_PRESET = {"cuda": "h100", "npu": "910b"}


# Note [replayed costs]: with ``step_graph`` the steps after the first few replay a captured graph (Note [graphed
# step] in swapopt.graphed): the host issues one launch, and the device issues the graph's nodes itself, one each
# graph_node_gap_us on a stream (1.15 us on the H100 against a launch's 6.17 of host time). Planned with an eager
# step's host costs, such a step gets fewer, larger chunks than its replays want: on the simulated H100 the MoE
# layout at 16 requested chunks took 26 chunks and replayed at 1.06x the bound. So a step_graph plan is made with a
# chunk's host time that of its nodes on the device: launches and event calls at graph_node_gap_us each, no Python and
# nothing per tensor (a replay walks no lists).


def _from_preset(preset, replayed: bool = False) -> LinkCosts:
    # Each direction's latency and the rates with both busy as the preset models them (Note [link sharing] in
    # device/sim/preset_spec.py): under "sized" its duplex table's, under the other rules half the cap each.
    sized = getattr(preset, "link_sharing", None) == "sized"
    if replayed:  # Note [replayed costs]
        node = preset.graph_node_gap_us
        host = {"host_chunk_us": (LAUNCHES_PER_CHUNK + EVENT_CALLS_PER_CHUNK) * node, "host_copy_us": node,
                "host_tensor_us": 0.0, "host_cut_chunk_us": CUT_CHUNK_LAUNCHES * node}
    else:
        host = {
            "host_chunk_us": LAUNCHES_PER_CHUNK * preset.launch_us + EVENT_CALLS_PER_CHUNK * preset.event_us
            + PYTHON_CHUNK_US,
            "host_copy_us": preset.launch_us,
            "host_tensor_us": getattr(preset, "host_tensor_us", 0.0),
            "host_cut_chunk_us": CUT_CHUNK_LAUNCHES * preset.launch_us + PYTHON_CHUNK_US,
        }
    return LinkCosts(
        copy_latency_us=preset.copy_latency_us,
        h2d_gbps=preset.h2d_gbps,
        d2h_gbps=preset.d2h_gbps,
        duplex_gbps=preset.duplex_gbps,
        h2d_latency_share=getattr(preset, "h2d_latency_share", 0.5),
        duplex_table=tuple(getattr(preset, "duplex_table", ())) if sized else (),
        hbm_gbps=preset.hbm_gbps,
        **host,
    )


@functools.cache
def _named(name_or_path: str, replayed: bool = False) -> LinkCosts:
    from device.sim.presets import get_preset

    return _from_preset(get_preset(name_or_path), replayed)


def link_costs(device_type: str, replayed: bool = False) -> LinkCosts | None:
    """The costs of the link to ``device_type``'s devices; None on the host alone (nothing is swapped). ``replayed``:
    a step_graph step's, issued by the device from a captured graph (Note [replayed costs])."""
    if device.is_simulated():
        preset = getattr(device.get_torch_device_module(), "preset", None)
        if preset is not None:
            return _from_preset(preset, replayed)
    given = os.environ.get(ENV)
    if given:
        try:
            return _named(given, replayed)
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"swapopt: {ENV}={given!r} could not be read ({exc}); planning with the default costs", stacklevel=2
            )
    name = _DEFAULT_PRESET.get(device_type)
    return _named(name, replayed) if name is not None else None
