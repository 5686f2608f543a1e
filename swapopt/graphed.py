"""A swapped step captured once as a device graph and replayed while its inputs stay put (``step_graph``).

Note [graphed step]
~~~~~~~~~~~~~~~~~~~
A step of an unchanged plan issues the same device work every time: the same copies between the same pinned host
ranges and staging slots, the same kernels over the same params, grads, slot views and step counts. What it costs
the host is the issuing: about a dozen calls a chunk (stream switches, event records and waits, copies, the fused
kernel), 250 us a chunk and more on an H100 host (bench/results/cuda-h100-2026-11-27-layouts-100m-cut-pieces.md),
so a plan of many small chunks is host-bound. A device graph (CUDA graphs; torch_npu's NPU graphs, aclmdlRI
capture) issues all of it with one launch.

With ``step_graph`` on, the second step in a row that runs a plan steadily (StepRun.steady: every chunk stepped
from its kept dicts or its plan's cut pieces by a direct step, no state created, no scalar state replaced) is not
run but captured: the same StepRun, on a side stream inside the device module's ``graph`` context, records its
work without doing it, and the graph is replayed at once on the caller's stream. Later steps replay it while
``holds`` says the step would issue the very same work:

- the plan is the same Prepared (HostLayout.prepare's checks: params, groups, arenas, state tensors);
- every param and every grad is at the address it was captured with (a graph bakes addresses in; a caching
  allocator gives a steady training loop's grads the same blocks step after step, which is why only addresses are
  kept, never a grad: a new address means a new capture, not a wrong result);
- every param's state dict holds the very objects it held (a scalar state replaced, a state added, a
  load_state_dict: a new capture; the swapped states are HostLayout.still_valid's to check), and the state mapping
  is the same;
- every group's hyperparameters are equal, by value for numbers and by identity for tensors: a float lr is baked
  into the kernel's arguments, so a scheduler that changes it every step makes every step a capture (a warning
  says so, after a few: pass ``lr`` as a device tensor, which a scheduler updates in place);
- step() has no keyword arguments and no GradScaler attributes.

What a replay cannot redo is Python: a capture is taken only where the step's Python work leaves nothing behind
that the next step needs anew. So every state must be a device tensor (an Adam step count on the host, as torch
keeps it without ``fused=True`` or ``capturable=True``, is advanced by the host at capture time only), and a cut
param's step count, stepped as a clone per piece, is published by copying the clone into the param's own tensor
rather than by putting the clone in its dict (StepRun.publish under step_graph).

A graph keeps the memory it was captured with (its private pool): the staging, (slots + 1) x chunk at most, stays
taken between steps instead of going back to the allocator, and comes back when the graph is dropped (another
plan, ``invalidate()``, ``offload()``). The events a capture records order work inside the graph; after a replay,
every per-param event (swap_out_event, ...) is one event recorded after it on the replaying stream, which the
graph's last copies join.

A capture that fails (an operation the device forbids while capturing, an error in the step's Python) did nothing
on the device, and its Python changes are undone (the state dicts as they were): the step runs as
usual, with a warning, and this optimizer does not try again. Its slot tensors, given memory inside the capture,
are let go (SwapOptimizerOperate.end_capture): the next step makes new ones, and new views of them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from loguru import logger

import device
from swapopt import internals, pipeline
from swapopt.context import StepContext
from swapopt.hoststate import is_swapped_state, local
from swapopt.layout import HostLayout, Prepared, same_objects

# Captures in a row, each for a change the replay could not take, after which step_graph warns that something
# changes at every step (a float lr under a scheduler, grads at new addresses).
RECAPTURE_WARNING = 3


# Each tensor's own method, where a tensor subclass answers for its own memory (the simulator's); else torch's
# method unbound, which saves the host a method lookup per tensor: a replay reads every param's and grad's address
# (on a 2-core host 3,299 addresses took 1.1-1.2 ms through the lookup, 0.3-0.5 ms unbound).
_DATA_PTR = operator.methodcaller("data_ptr")
_TENSOR_DATA_PTR = torch.Tensor.data_ptr
_GRAD = operator.attrgetter("grad")


def _address_reader(tensors: list[Any]) -> Any:
    """How to read ``tensors``' data addresses: torch's method unbound where no tensor's class overrides it."""
    plain = all(getattr(cls, "data_ptr", None) is _TENSOR_DATA_PTR for cls in set(map(type, tensors)))
    return _TENSOR_DATA_PTR if plain else _DATA_PTR


def _addresses(tensors: list[Any], dtensors: bool, read: Any = _DATA_PTR) -> list[int] | None:
    """The data addresses of ``tensors`` (their local shards where ``dtensors``) read with ``read``; None where one
    is missing or cannot be read (a grad that is None; one of a class ``read`` was not chosen for that has no
    storage: a new capture reads it its own way)."""
    try:
        if dtensors:
            return [local(t).data_ptr() for t in tensors]
        return list(map(read, tensors))
    except (AttributeError, TypeError, RuntimeError):
        return None


def _hyper(groups: list[dict]) -> list[list[tuple[str, Any]]]:
    return [[(key, value) for key, value in g.items() if key != "params"] for g in groups]


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False  # a tensor hyperparameter is read by the graph at its address: the same tensor or a new capture
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - a value that cannot say whether it is equal is taken as changed
        return False


def _scaled(ctx: StepContext) -> bool:
    """A GradScaler lent the step its scale and inf flag (per step values a graph would not read anew)."""
    return any(getattr(ctx.optimizer, k, None) is not None for k in internals.AMP_ATTRIBUTES)


def why_not(ctx: StepContext, prep: Prepared, kwargs: dict, mod: Any) -> str | None:
    """Why a step of this plan cannot be captured (None: it can): what a replay could not redo."""
    if device.graph_api(mod) is None:
        return f"the {ctx.device} device module has no graph capture"
    if kwargs:
        return "step() was given keyword arguments"
    if _scaled(ctx):
        return "a GradScaler hands the step its scale"
    state = ctx.state
    for p in prep.params:
        for key, value in state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                if device.is_host_tensor(value) and not is_swapped_state(p, key, value):
                    return (
                        f"state {key!r} is a host tensor, which the host would advance only while capturing "
                        f"(torch keeps Adam's step count on the host unless fused=True or capturable=True)"
                    )
            else:
                return f"state {key!r} is a Python {type(value).__name__}, which a replay would not update"
    for g in ctx.param_groups:
        for key, value in g.items():
            if key != "params" and isinstance(value, torch.Tensor) and device.is_host_tensor(value):
                return f"the group's {key!r} is a host tensor"
    return None


class GraphedStep:
    """One plan's step captured as a device graph, with what must hold for a replay to be that step (Note
    [graphed step])."""

    def __init__(self, graph: Any, mod: Any, prep: Prepared, ctx: StepContext, h2d: int, d2h: int, peak: int) -> None:
        self.graph, self.mod, self.prep = graph, mod, prep
        self.h2d, self.d2h, self.peak_staging_bytes = h2d, d2h, peak
        params = prep.params
        self.dtensors = any(local(p) is not p for p in params)
        grads = list(map(_GRAD, params))
        self.read_param, self.read_grad = _address_reader(params), _address_reader(grads)
        self.param_addresses = _addresses(params, self.dtensors, self.read_param)
        # Addresses only: a reference kept to a grad would keep its memory, and the next backward's grad (after
        # zero_grad(set_to_none=True)) could not get the same block from the caching allocator.
        self.grad_addresses = _addresses(grads, self.dtensors, self.read_grad)
        self.state_map = ctx.state
        # The step counts and other states not swapped (HostLayout.still_valid, run by prepare before, watches the
        # state dicts, their lengths and their swapped states): the graph reads them where they are.
        scalars = [
            (st, key, value) for p, st in zip(params, map(ctx.state.get, params)) if st
            for key, value in st.items() if not (isinstance(value, torch.Tensor) and is_swapped_state(p, key, value))
        ]  # fmt: skip
        self.scalar_dicts = [st for st, _, _ in scalars]
        self.scalar_keys = [key for _, key, _ in scalars]
        self.scalar_values = [value for _, _, value in scalars]
        self.hyper = _hyper(ctx.param_groups)

    @classmethod
    def capture(cls, ctx: StepContext, layout: HostLayout, prep: Prepared, mod: Any) -> GraphedStep:
        """Capture a step of ``prep`` on a side stream (nothing runs), then nothing else: the caller replays it.
        Raises where the capture failed, with the state dicts as they were (Note [graphed step])."""
        graph_cls, capture = device.graph_api(mod)  # type: ignore[misc]
        op = ctx.operate
        owners = [st for st in map(ctx.state.get, prep.params) if st is not None]
        saved = [dict(st) for st in owners]
        graph = graph_cls()
        side = mod.Stream()
        run = pipeline.StepRun(ctx, layout, prep, {}, None, capturing=True)
        op.begin_capture()
        try:
            # thread_local: a thread of the caller's (a checkpoint writer, a data loader) may go on using the device
            with capture(graph, stream=side, capture_error_mode="thread_local"):
                try:
                    run.run()
                finally:  # the copy streams joined the capture through its events: the origin waits for their work
                    side.wait_stream(op.h2d_stream)  # (also after an error, so that the capture ends and the error
                    side.wait_stream(op.d2h_stream)  # raised is the step's own)
            if not run.steady:
                raise RuntimeError("the step's Python changed what the next step would issue")
        except BaseException:
            op.end_capture(failed=True)
            for st, before in zip(owners, saved):
                st.clear()
                st.update(before)
            _reset(graph)
            raise
        op.end_capture(failed=False)
        return cls(graph, mod, prep, ctx, run.h2d, run.d2h, op.peak_staging_bytes)

    def holds(self, ctx: StepContext, prep: Prepared, kwargs: dict) -> bool:
        """Whether replaying issues exactly the work this step would (the checks of Note [graphed step]): C-level
        passes over the params, grads and state entries, a loop over the groups. The grads must be at the
        same addresses as at the capture, new tensors or not."""
        if prep is not self.prep or kwargs or ctx.operate.mod is not self.mod or ctx.state is not self.state_map:
            return False
        if _scaled(ctx):
            return False
        params = prep.params
        if _addresses(list(map(_GRAD, params)), self.dtensors, self.read_grad) != self.grad_addresses:
            return False  # a grad elsewhere (or none): the graph reads the addresses it was captured with
        if _addresses(params, self.dtensors, self.read_param) != self.param_addresses:
            return False
        if not same_objects(list(map(dict.get, self.scalar_dicts, self.scalar_keys)), self.scalar_values):
            return False
        groups = ctx.param_groups
        if len(groups) != len(self.hyper):
            return False
        for g, before in zip(groups, self.hyper):
            if len(g) != len(before) + 1:
                return False
            for key, value in before:
                now = g.get(key, _MISSING)
                if now is not value and not _same_value(now, value):
                    return False
        return True

    def replay(self, op: Any, last_chunk: dict[torch.Tensor, int], n_chunks: int) -> None:
        """The step: the graph launched on the current stream, after the last step's last swap-out (the host states
        it wrote are read again), between two timing events that stand for every event of the step."""
        mod = self.mod
        here = mod.current_stream()
        op.wait_for_last_swap_out(here)
        start = mod.Event(enable_timing=True)
        start.record(here)
        self.graph.replay()
        end = mod.Event(enable_timing=True)
        end.record(here)
        op.after_replay(start, end, last_chunk, n_chunks)

    def drop(self) -> None:
        """Give the graph's memory back (its pool goes when no graph holds it)."""
        _reset(self.graph)
        self.graph = None


_MISSING = object()


def _reset(graph: Any) -> None:
    reset = getattr(graph, "reset", None)
    if reset is not None:
        try:
            reset()
        except Exception as err:  # noqa: BLE001 - a graph that cannot be reset is left to the garbage collector
            logger.debug("swapopt step_graph: reset failed: {!r}", err)
