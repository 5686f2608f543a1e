"""What an op touches, for the simulator: the kind of memory each storage is (StorageInfo: device, pinned host or
pageable host memory), each tensor argument's access (Arg), and the lane an op runs on (h2d, d2h, compute) with
whether the host waits for it (op_lane)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from device.sim.memory import Block
from device.sim.ops import OpInfo, arg_value
from device.sim.sanitizer import AccessLog

DEVICE, HOST_MEM, PAGEABLE = "device", "host", "pageable"
# Where an op's new outputs go when not to a device index (see device.sim.dispatch).
HOST_OUT, PINNED_OUT = -1, -2


@dataclass(eq=False)
class StorageInfo:
    uid: int
    kind: str
    nbytes: int
    alloc_actor: int  # the stream whose pool the block returns to when freed
    log: AccessLog = field(default_factory=AccessLog)
    recorded: set[int] = field(default_factory=set)  # streams named by record_stream
    block: Block | None = None  # what the allocator model holds for it (device storages)
    index: int = 0  # the device it is memory of (device storages)


@dataclass(slots=True)
class Arg:
    tensor: torch.Tensor
    storage: Any
    info: StorageInfo | None
    role: str

    @property
    def host_side(self) -> bool:
        return self.info is None or self.info.kind != DEVICE

    @property
    def pageable(self) -> bool:
        return self.info is None or self.info.kind == PAGEABLE

    @property
    def writes(self) -> bool:
        return self.role in ("w", "o")

    @property
    def traffic(self) -> int:
        """Bytes a kernel moves for this argument: in-place arguments are read and written."""
        return self.tensor.nbytes * (2 if self.role == "w" else 1)


def op_lane(
    func: Any, op: OpInfo, args: tuple, kwargs: dict, accesses: list[Arg], new_on_device: bool = True
) -> tuple[str, bool, bool]:
    """(lane, whether the host waits for the op, whether the host stages a pageable source itself).
    new_on_device: whether the op's new outputs are device memory (False: a copy to the host)."""
    blocking = op.sync or op.value_return
    if op.local_scalar:
        return "d2h", True, False
    if not op.copy:
        return "compute", blocking, False
    non_blocking = bool(arg_value(func, args, kwargs, "non_blocking", False))
    written, read = [a for a in accesses if a.writes], [a for a in accesses if not a.writes]
    if (op.new_outputs and new_on_device) or any(not a.host_side for a in written):
        sources = [a for a in read if a.host_side]
        if sources:  # H2D; from pageable memory the host stages the source before the call returns
            return "h2d", blocking or not non_blocking, any(a.pageable for a in sources)
    elif any(not a.host_side for a in read):
        # D2H; into pageable memory the call returns only when the copy is done, as CUDA does
        pageable = any(a.pageable for a in written) or (op.new_outputs and not non_blocking)
        return "d2h", blocking or not non_blocking or pageable, False
    return "compute", blocking, False

