"""``resident_mb="auto"``: keep as many states on the device as its spare memory holds (Note [resident auto]).

Note [resident auto]
~~~~~~~~~~~~~~~~~~~~
A number of MiB for ``resident_mb`` asks the user to know what the device has left after the forward and
the backward. ``"auto"`` measures it instead, at every swapped step, from the device module's own counters
(the same names on ``torch.cuda``, torch_npu's ``torch.npu`` and the simulator):

- ``peak``: ``max_memory_allocated()``, the most the allocator handed out since its peak counter was last
  reset: the forward/backward peak of this step when the training loop resets it every iteration (swapopt's
  engine does), else the highest of the run. swapopt never resets it itself: that would change what the
  user's own peak-memory logging reports. Resident states stay on the device through the forward, so they
  are part of that peak;
- ``usable``: ``mem_get_info()[0] + memory_reserved()``: the device's free memory plus what this process's
  caching allocator already holds, i.e. everything its tensors could occupy at once (no more than
  ``set_per_process_memory_fraction`` allows, where the module has ``get_per_process_memory_fraction``);
- ``peak_resident`` and ``growth``: the resident states' bytes when that peak was reached, and how much the
  rest of what stays on the device between steps (params, grads, the user's own tensors) has grown since: a
  peak new since the last step was reached with the present ones, an older one with those of the step that
  first read it (the peak is not reset, so swapopt keeps track of what the peak it reads was made of);
- ``step``: ``memory_allocated()`` at the step's entry (params, grads, resident states: what stays through
  the step) plus a bound on the step's staging, ``(slots + 1)`` chunks of at most 1.25 x 1/``times`` of all
  state bytes (or ``chunk_mb``), the most the planner uses for any resident share (swapopt.plan).

The memory states may take is then ``available = min(peak_resident + usable - peak - growth, resident +
usable - step)``, ``resident`` being the resident bytes now: the least the next forward (its transient memory
as at the peak, on top of what is held now) and the step leave them. It does not move when swapopt itself
changes the resident share, only when the workload, or memory held between steps, changes.
swapopt keeps ``fraction x available - margin`` resident (``fraction`` 0.9 for ``"auto"``, F for
``"auto:F"``), ``margin`` being 1% of ``usable``. Why these figures:

- the states are re-planned only when ``available`` changes by more than ``REPLAN_CHANGE`` (10%) of the value
  they were planned for; a fall within that leaves the plan, so at least 10% of ``available`` must stay free
  or the next forward could run out of memory: hence ``fraction`` <= 0.9;
- what the counters do not see: the caching allocator rounds every block to 512 bytes and carves blocks from
  segments of 2 MiB (blocks up to 1 MiB), 20 MiB (up to 10 MiB) or multiples of 2 MiB (c10/cuda/
  CUDACachingAllocator.cpp, which device/sim/memory.py models), and fragmentation can leave free bytes of a
  segment unusable for a large request; 1% of what the process may use (0.8 GiB of a whole 80 GB H100)
  covers the resident states' rounding and a fragmented segment per size class.

With ``overlap_forward`` or ``prefetch`` the staging is also held during a forward; the first measurement,
before any step, adds the staging bound to the forward's peak (later peaks include it).

The peak counts whatever ran since it was last reset: in an RL loop, the rollout's, unless the peak counter is
reset after it (``reset_peak_memory_stats()``, as swapopt's engine does every training step and around its
rollout phase); without a reset ``"auto"`` sizes the states for the rollout's peak, which is safe but keeps
fewer resident.

A workload whose activations grow by more than the margin from one step to the next (variable sequence
lengths) can still run out of memory in the forward that first grows, before any step has measured it:
use ``"auto:F"`` with a smaller F, or a fixed ``resident_mb``, there. ``master_weights`` is refused with
``"auto"`` as with any ``resident_mb > 0`` (swapopt.optimizer). The budget is handed to the planner as the
MiB figure a fixed ``resident_mb`` gives (``StepContext.settings``), so everything after it (pick_resident,
host-memory checks, offload) works as for a fixed budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger

import device
from swapopt.hoststate import local

MiB = 1 << 20
AUTO = "auto"
DEFAULT_FRACTION = 0.9  # 1 - REPLAN_CHANGE: see Note [resident auto]
REPLAN_CHANGE = 0.10  # a change of the available memory past this share of the planned one re-plans
MARGIN = 0.01  # of the memory the process may use: allocator rounding, fragmentation (Note [resident auto])
CHUNK_SLACK = 1.25  # the planner may use chunks up to 25% larger than 1/times (swapopt.plan)


def parse_resident_mb(value: Any) -> float | str:
    """The ``resident_mb`` knob: a number of MiB >= 0, ``"auto"``, or ``"auto:F"`` with 0 < F <= 0.9 (the share
    of the measured spare memory kept resident). Numbers in strings (YAML, command lines) are numbers."""
    if isinstance(value, bool):  # pydantic would take True as 1 MiB
        raise ValueError(f"must be a number of MiB >= 0 or 'auto', got {value!r} (a budget, not a switch)")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        if text.startswith(AUTO + ":"):
            share = text[len(AUTO) + 1:]
            try:
                fraction = float(share)
            except ValueError:
                fraction = math.nan
            if not 0 < fraction <= DEFAULT_FRACTION:
                raise ValueError(
                    f"{value!r}: the share after 'auto:' must be a number in (0, {DEFAULT_FRACTION}], "
                    f"got {share!r} (it is re-planned only when free memory changes by more than "
                    f"{REPLAN_CHANGE:.0%}, so at least that much of it stays free)"
                )
            return f"{AUTO}:{fraction:g}"
        try:
            number = float(text)
        except ValueError:
            raise ValueError(
                f"must be a number of MiB >= 0, 'auto' or 'auto:F' (0 < F <= {DEFAULT_FRACTION}), "
                f"got {value!r}"
            ) from None
    else:
        raise ValueError(f"must be a number of MiB >= 0 or 'auto', got {type(value).__name__}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"must be a finite number of MiB >= 0 or 'auto', got {value!r}")
    return number


def fraction_of(resident_mb: float | str) -> float | None:
    """The share of the spare memory kept resident for ``"auto"``/``"auto:F"``; None for a number of MiB."""
    if isinstance(resident_mb, str):
        return DEFAULT_FRACTION if resident_mb == AUTO else float(resident_mb.split(":", 1)[1])
    return None


@dataclass(frozen=True)
class Reading:
    """One measurement of the device (bytes), the terms of Note [resident auto]: ``peak``, the resident bytes it
    was reached with (``peak_resident``) and the growth of the other memory held between steps since then
    (``growth``); ``usable``; ``step``, and the resident bytes on the device now (``resident``)."""

    peak: int
    peak_resident: int
    growth: int
    usable: int
    step: int
    resident: int
    capacity: int

    @property
    def available(self) -> int:
        """What states may take: the least the next forward's peak and the step's own leave them."""
        forward = self.peak_resident + self.usable - self.peak - self.growth
        step = self.resident + self.usable - self.step
        return max(min(forward, step), 0)


def budget_bytes(reading: Reading, fraction: float) -> int:
    """The resident budget for ``reading``: ``fraction`` of the available memory less the margin."""
    return max(int(fraction * reading.available) - int(MARGIN * reading.usable), 0)


def device_state_bytes(state: Any, params: Sequence[torch.Tensor] | set[torch.Tensor]) -> int:
    """Bytes of ``params``' states that are in device memory now (0-dim scalars excluded: they are not
    planned as resident bytes)."""
    total = 0
    for p in params:
        for value in (state.get(p) or {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and not device.is_host_tensor(value):
                loc = local(value)
                total += loc.numel() * loc.element_size()
    return total


def _process_cap(mod: Any, dev: torch.device, total: int) -> int | None:
    """The bytes ``set_per_process_memory_fraction`` lets this process allocate, where the module says."""
    get = getattr(mod, "get_per_process_memory_fraction", None)
    if get is None:
        return None
    try:
        fraction = float(get(dev))
    except (RuntimeError, TypeError, ValueError):  # not set, or a module whose signature differs
        return None
    return int(fraction * total) if 0 < fraction < 1 else None


class AutoResident:
    """The measured resident budget of one SwapOptimizer with ``resident_mb="auto"``: measure at each swapped
    step, keep the budget while the available memory stays within REPLAN_CHANGE of the planned one."""

    def __init__(self, fraction: float, slots: int, times: int, chunk_mb: float | None, overlaps: bool = False) -> None:
        self.fraction = fraction
        # overlap_forward or prefetch: the staging is held during a forward too (the update under it, or the
        # first chunks swapped in after it), which the first peak read, before any step, cannot show
        self.overlaps = overlaps
        self.slots = slots
        self.times = times
        self.chunk_mb = chunk_mb
        self.planned: Reading | None = None  # the reading the budget was made from
        self.budget = 0  # bytes handed to the planner
        self.replans = 0  # budgets made after the first
        self.last: Reading | None = None  # the latest reading (for logs and tests)
        self._staging: tuple[tuple[int, ...], int] | None = None  # (param ids, staging bound)
        self._resident: tuple[Any, int] | None = None  # (the Prepared it was counted for, resident bytes)
        self._peak: tuple[int, int, int] | None = None  # (the last peak read, its resident bytes, its base bytes)

    def staging_bound(self, layout: Any, params: list[torch.Tensor], groups: list[int]) -> int:
        """The most staging any plan of these params holds: (slots + 1) chunks of the largest chunk the planner
        makes with every state swapped (a resident share only makes chunks smaller)."""
        key = tuple(map(id, params))
        if self._staging is not None and self._staging[0] == key:
            return self._staging[1]
        sizes = [layout.state_bytes(p, gi)[0] for p, gi in zip(params, groups)]
        total = sum(sizes)
        if self.chunk_mb is not None:
            chunk = int(self.chunk_mb * MiB)
        else:
            chunk = math.ceil(CHUNK_SLACK * total / self.times)
        if not layout.elementwise:  # whole params: a chunk is at least the largest one
            chunk = max([chunk, *sizes])
        bound = (self.slots + 1) * min(chunk, total) if total else 0
        self._staging = (key, bound)
        return bound

    def resident_now(self, layout: Any) -> int:
        """Bytes the resident states take on the device now (counted once per plan)."""
        prep = layout.prepared
        if prep is not None and self._resident is not None and self._resident[0] is prep:
            return self._resident[1]
        return device_state_bytes(layout.state, layout.resident)

    def planned_resident(self, layout: Any, prep: Any) -> None:
        """After a step of plan ``prep``: count its resident states (created on the device by its first step)."""
        if self._resident is None or self._resident[0] is not prep:
            self._resident = (prep, device_state_bytes(layout.state, prep.resident))

    def update(self, mod: Any, dev: torch.device, layout: Any, params: list[torch.Tensor], groups: list[int]) -> bool:
        """Measure at a step's entry; True when the budget changed (the caller re-plans)."""
        staging = self.staging_bound(layout, params, groups)
        peak = int(mod.max_memory_allocated(dev))
        free, total = mod.mem_get_info(dev)
        usable = int(free) + int(mod.memory_reserved(dev))
        cap = _process_cap(mod, dev, int(total))
        if cap is not None:  # set_per_process_memory_fraction: the allocator refuses past it, free or not
            usable = min(usable, cap)
        allocated = int(mod.memory_allocated(dev))
        resident = self.resident_now(layout)
        base = allocated - resident  # what stays between steps besides the states: params, grads, the user's
        # A peak new since the last step (or counted afresh after a reset) was reached with the present resident
        # states and base; an older one with those of the step that first read it. swapopt never resets the peak
        # (the user's peak-memory logging reads it): without this, a peak reached with more resident states than
        # there are now would read as memory the device has not got, and memory taken or freed between steps
        # (held through the next forward) would go unseen.
        if self._peak is None or peak != self._peak[0]:
            self._peak = (peak, resident, base)
        _, peak_resident, peak_base = self._peak
        growth = base - peak_base + (staging if self.overlaps and self.planned is None else 0)
        reading = Reading(peak, peak_resident, growth, usable, allocated + staging, resident, int(total))
        self.last = reading
        planned = self.planned
        if planned is not None and abs(reading.available - planned.available) <= REPLAN_CHANGE * planned.available:
            return False
        budget = budget_bytes(reading, self.fraction)
        first = planned is None
        self.planned = reading
        if budget == self.budget and not first:
            return False
        if not first:
            self.replans += 1
        logger.info(
            "swapopt resident auto: peak {:.1f} MiB (with {:.1f} MiB resident), step {:.1f} MiB, usable {:.1f} MiB: "
            "{:.1f} MiB available for states, {:.1f} MiB kept resident ({})",
            reading.peak / MiB, reading.peak_resident / MiB, reading.step / MiB, reading.usable / MiB,
            reading.available / MiB, budget / MiB, "first plan" if first else "re-plan",
        )  # fmt: skip
        changed = budget != self.budget
        self.budget = budget
        return changed or first
