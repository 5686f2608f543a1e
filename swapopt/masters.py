"""fp32 master weights of low-precision params, kept in pinned host memory beside their states
(``master_weights``).

# Note [master weights]
# ~~~~~~~~~~~~~~~~~~~~~
# ``master_weights=True`` reproduces, bitwise, this mixed-precision recipe run with every tensor on the
# device, for each bf16/fp16 param p (fp32 params are their own masters and step as without the knob):
#   * at the start (the first step that swaps p, or a load without masters): master = p.float(), with
#     p's dense layout;
#   * each step, after the caller's clipping and unscaling of the low-precision grads:
#     master.grad = p.grad.float(); the wrapped optimizer steps the masters with its own kernels and
#     flags (for-loop, foreach, fused), its states being fp32 like the masters; then p.copy_(master),
#     rounded to nearest in p's dtype.
#   * With GradScaler the masters' fp32 grads are unscaled as ``scaler.unscale_`` would unscale them
#     (its non-finite check-and-unscale kernel, the inverse scale it computes) and an inf or NaN skips
#     the whole step; an optimizer whose kernel takes ``grad_scale``/``found_inf`` (fused AdamW) gets
#     them instead, as ``scaler.step`` would hand them to it.
# On the swap path the master lives in the host arena beside the param's states and moves with them:
# chunk k swaps in master and states, upcasts the grads of its pieces into the slot, steps the masters,
# writes each param piece from its master and swaps master and states out. A master's first value is
# made in the slot from the param (one chunk at a time: nothing of it is on the device between steps),
# and the master counts as made only once its param's last piece has been stepped, so a failing step
# leaves the param and its master as they were (Note [failure semantics] in swapopt.recovery).
# The param is written only after the inner update returned: a failure inside the update leaves the
# params of that chunk untouched (their masters may be partly updated in the slot, never copied out).
"""

from __future__ import annotations

import torch

from swapopt import hoststate
from swapopt.hoststate import local

MASTER = "\0master"  # host-layout and region key of a param's master (no state key can collide with it)
MASTER_KEY = "master_weight"  # its key in a state_dict()'s per-param state
LOW_PRECISION = (torch.bfloat16, torch.float16)


class Masters:
    """The masters of one SwapOptimizer: ``host[p]`` is ``{MASTER: pinned fp32 tensor}`` (a DTensor over the
    host shard for DTensor params; a one-entry dict so that the layout's cache checks treat it like a state
    dict), ``ready`` the params whose master holds a value (see Note [master weights])."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.host: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.ready: set[torch.Tensor] = set()
        self.warned_missing = False  # a load without masters was reported
        # GradScaler's inverse scale while a step unscales the masters' grads itself (None: it does not).
        self.inv_scale: torch.Tensor | None = None

    def wanted(self, p: torch.Tensor) -> bool:
        """p gets a master: the knob is on and p is low-precision."""
        return self.enabled and local(p).dtype in LOW_PRECISION

    def state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype the wrapped optimizer steps p in, so the dtype its states take."""
        return torch.float32 if self.wanted(p) else local(p).dtype

    def get(self, p: torch.Tensor) -> torch.Tensor | None:
        holder = self.host.get(p)
        return holder[MASTER] if holder is not None else None

    def ensure(self, p: torch.Tensor) -> bool:
        """Give p pinned host memory for its master if it needs one and has none; whether it was created."""
        if not self.wanted(p) or p in self.host:
            return False
        # unpinned: the first step's re-layout moves it into an arena, pinned there (HostLayout.prepare pins it
        # where it stays)
        self.host[p] = {MASTER: hoststate.new_host_like(p, torch.float32, pin=False)}
        self.ready.discard(p)
        return True

    def set(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Point p's master at ``value`` (a host tensor of the master's layout; ready or not is unchanged)."""
        holder = self.host.get(p)
        if holder is None:
            self.host[p] = {MASTER: value}
        else:
            holder[MASTER] = value

    def init_from(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Fill a host ``master`` from p now (a synchronous copy: the in-place path and checkpoint loads)."""
        local(master).copy_(local(p).detach())
        self.ready.add(p)
