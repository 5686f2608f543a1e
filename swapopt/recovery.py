"""Failure path of a swapped step: drain, complete, roll forward (Note [failure semantics]).

swapopt.pipeline.StepRun.run calls ``recover`` when anything raises between its first swap-in and the
end of the step, then ``drop_frames`` before the exception propagates. Planning and pinned allocation
fail before any param is touched and need nothing here.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from loguru import logger

import device
from swapopt import inner, internals
from swapopt.hoststate import wrap_like
from swapopt.operate import step_range

# Note [failure semantics]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A step that raises leaves every param either fully stepped (value, swapped states, scalar states
# such as the step count) or untouched, except for the params of the chunk whose inner update raised.
#   * Before chunk k's inner update (planning, pinned allocation of new states, which is done before
#     any swap-in, a swap-in, preparing the pieces): chunk k's params are untouched. Chunks < k are
#     stepped and their swap-outs queued.
#   * After chunk k's inner update returned (collecting its outputs, queuing its swap-out, publishing
#     its scalars; a KeyboardInterrupt there): the streams are drained and chunk k is completed
#     synchronously from the slot (its params are then fully stepped).
#   * Inside the inner update (the optimizer's own code, or a group-level write it made, found right
#     after it): it updates params in place and may have written some of chunk k's before raising,
#     which nothing here can undo without a copy of every param each step. Chunk k's params keep their
#     old states and step counts; an ERROR names each.
# Then every param split across the boundary (pieces stepped before, pieces left) is rolled forward
# by stepping its remaining pieces one by one (_roll_forward); a param whose piece sat in a failed
# inner update is left partial and named in the ERROR. Staging is released and the failing frames'
# locals are dropped before the exception propagates, so the caller's except block can free memory.


def recover(run: Any) -> None:
    """The failure path of a StepRun (Note [failure semantics]): drain, complete, roll forward."""
    ctx, prep, progress = run.ctx, run.prep, run.progress
    stage, k = progress.get("stage", ("done", -1))
    chunk = progress.pop("chunk", None)
    scalars = progress.pop("scalars", None)
    undo = progress.pop("undo", None)
    try:
        ctx.operate.drain()
        failed, entered = k + 1, False
        if stage in ("input", "update"):
            failed, entered = k, stage == "update"
        elif stage == "output":
            if _complete_chunk(run, k, chunk):
                failed, entered = k + 1, False
            else:
                failed, entered = k, True
        if entered:
            # the chunk's own scalar states (step counts) were stepped in place: back to their old values, the
            # logged adds first, since a copy taken is from before them (Note [undone step counts])
            internals.undo_step_adds(undo or ())
            for own, old in scalars or ():
                internals.foreach_copy(own, list(old))
            names = sorted({pc.index for pc in prep.plan.chunks[failed].pieces})
            logger.error(
                "swapopt: step failed inside the update of chunk {}; these params may be partly updated in "
                "place and keep their old states and step counts: {}",
                failed, "; ".join(_name(ctx, prep, i) for i in names),
            )  # fmt: skip
        _roll_forward(run, failed, entered)
    except BaseException:  # noqa: BLE001 - never mask the original exception
        logger.exception("swapopt: completing params after a failed step raised")


def _complete_chunk(run: Any, k: int, chunk: tuple | None) -> bool:
    """Chunk k's inner update returned but its outputs were not all queued: finish them synchronously
    (streams drained). Returns whether every param of the chunk is now stepped."""
    if chunk is None:
        return False
    targets, chunk_state, views = chunk
    op = run.op
    try:
        with op.mod.stream(op.compute_stream):
            copies, _, finals = run.chunk_output(k, targets, chunk_state, views)
            for dst, src in copies:
                dst.copy_(src)  # blocking: the host has seen the data on return
        for p, scalars in finals:
            run.publish(p, scalars)
    except BaseException as exc:  # noqa: BLE001 - reported, the original exception is raised
        logger.error("swapopt: completing chunk {} after a failed step raised {!r}", k, exc)
        return False
    logger.debug("swapopt: step failed after the update of chunk {}; the chunk was completed", k)
    return True


def _name(ctx: Any, prep: Any, i: int) -> str:
    p = prep.params[i]
    gi = prep.groups[i]
    j = next(j for j, q in enumerate(ctx.param_groups[gi]["params"]) if q is p)
    return f"param_groups[{gi}]['params'][{j}] of shape {tuple(p.shape)}"


def _roll_forward(run: Any, failed: int, entered: bool) -> None:
    """After a failure in chunk ``failed`` (streams drained): complete every param whose update began
    in an earlier chunk but whose last piece was not stepped, one piece at a time, synchronously.

    Chunk ``failed``'s own pieces are redone only when the inner optimizer had not been entered for
    that chunk (``entered`` False): then nothing of the chunk was written (the swap-out was never
    queued and scalar states are clones). Otherwise the inner optimizer may have updated part of the
    param in place before raising (AdamW's weight decay, say) and a redo could apply that part twice,
    so the param is left as it is: pieces before the chunk stepped, the rest with its old host
    states, its scalar states old; an ERROR names it.
    """
    ctx, prep, pending = run.ctx, run.prep, run.pending
    plan = prep.plan
    begun = {pc.index for c in plan.chunks[:failed] for pc in c.pieces}
    rolled = 0
    for i in sorted(i for i in begun if plan.last_chunk[i] >= failed):
        p = prep.params[i]
        pieces = [
            (j, pos) for j in range(failed, len(plan.chunks)) for pos, pc in enumerate(plan.chunks[j].pieces)
            if pc.index == i
        ]  # fmt: skip
        cut = plan.chunks[pieces[0][0]].pieces[pieces[0][1]].start  # elements [0, cut) are stepped
        if entered and pieces[0][0] == failed:
            stop = plan.chunks[failed].pieces[pieces[0][1]].stop
            pending.pop(p, None)
            logger.error(
                "swapopt: step failed inside the update of chunk {}; {} was split across it and is left "
                "partially stepped: elements [0, {}) were stepped, the rest keep their old states (elements "
                "[{}, {}) were in the failed update and may be partially updated in place); step count old{}",
                failed, _name(ctx, prep, i), cut, cut, stop,
                "; the states this step created for it are dropped" if p not in run.layout.host else "",
            )  # fmt: skip
            continue
        try:
            scalars = None
            for j, pos in pieces:
                cut = plan.chunks[j].pieces[pos].start
                scalars = _recover_piece(run, j, pos)
            run.publish(p, scalars)
            rolled += 1
        except Exception as exc:  # noqa: BLE001 - the original exception is the one to raise
            created = pending.pop(p, None)
            logger.error(
                "swapopt: step failed in chunk {}; completing {} failed too ({!r}): elements [0, {}) were "
                "stepped, the rest keep their old states (the piece from element {} on may be partially "
                "updated in place); step count old{}",
                failed, _name(ctx, prep, i), exc, cut, cut,
                "; the states this step created for it are dropped" if created else "",
            )  # fmt: skip
    if rolled:
        logger.debug("swapopt: step failed in chunk {}; rolled {} split params forward", failed, rolled)


def _recover_piece(run: Any, j: int, pos: int) -> dict[str, Any] | None:
    """Step piece ``pos`` of chunk ``j`` on its own, as the pipeline does, in fresh device buffers on the
    compute stream; every copy is synchronous, so the host has seen all of it on return. Returns the
    piece's scalar states when it is its param's last piece."""

    ctx, prep, op = run.ctx, run.prep, run.op
    piece = prep.plan.chunks[j].pieces[pos]
    dev = device.torch_device(ctx.device)
    with op.mod.stream(op.compute_stream), step_range(f"swapopt.recover[{j}]"):
        views: dict[str, tuple] = {}
        for r in prep.regions[j]:
            if r.piece == pos:
                if r.host is None:  # the gathered grad
                    buf = torch.empty(r.nbytes // r.dtype.itemsize, dtype=r.dtype, device=dev)
                else:
                    buf = torch.empty_strided(r.host.shape, r.host.stride(), dtype=r.dtype, device=dev)
                    buf.copy_(r.host)
                views[r.key] = (wrap_like(r.layout, buf) if r.layout is not None else buf, buf, r.host)
        t, pst = run.piece_input(piece, views)
        chunk_state: defaultdict = defaultdict(dict)
        if pst is not None:
            chunk_state[t] = pst
        inner.run_inner(ctx, {prep.groups[piece.index]: [t]}, chunk_state, run.kwargs)
        entered = t in chunk_state
        copies, _, scalars = run.piece_output(piece, t, chunk_state[t] if entered else {}, views)
        for dst, src in copies:
            dst.copy_(src)  # the host waits: the buffers are freed on return
    return scalars if entered else None


def drop_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames below the step in exc's traceback: they hold slot views
    and device tensors, which would stay alive as long as the exception does."""
    tb = exc.__traceback__
    tb = tb.tb_next if tb is not None else None  # the frame handling the exception keeps running
    while tb is not None:
        try:
            tb.tb_frame.clear()
        except RuntimeError:  # a frame still executing (a generator, say) keeps its locals
            pass
        tb = tb.tb_next
