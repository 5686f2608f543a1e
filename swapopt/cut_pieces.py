"""The cut pieces of a mixed chunk, their inputs and outputs worked out once per plan (Note [cut pieces]).

A chunk that holds pieces of params cut across chunk boundaries steps those pieces in a call of their own
(Note [mixed chunks] in swapopt.pipeline). Their state dicts are made each step, because a piece steps a
clone of its param's step count, published only once the param's last piece is stepped. Everything else about
them is fixed by the plan: which slot views stand for their swapped states, which host ranges those views go
back to, which of them ends its param. ``CutPieces`` keeps that, so a step's work per cut piece is the clone of
its step count, the binding of its grad and one dict.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from swapopt import hoststate, subclass_state
from swapopt.direct import DirectStep
from swapopt.hoststate import local
from swapopt.layout import GRAD
from swapopt.masters import MASTER

# Note [cut pieces]
# ~~~~~~~~~~~~~~~~~
# StepRun.piece_input makes a cut piece's state dict from its param's: the slot view of each swapped state (from
# the chunk's views), a clone of each tensor that is not swapped (the step count) and any other value as it is.
# The chunk's output then copies each swapped state's slot view back to its host range, and the piece that ends
# its param publishes the dict's other values as the param's own (StepRun.piece_output, StepRun.publish). For a
# piece of a flat (element-wise) param whose dict holds plain tensors and values, the keys of that dict are all
# that decides which entry is which, and the views and the host ranges are the plan's (persistent slots, Note
# [persistent slots] in swapopt.operate). So CutPieces records per piece the keys and the views, and a step
# checks that each param's dict still has those very keys before it makes the dicts from them; any other dict
# (a key added or removed, a subclass state, a master weight, a grad gathered into the slot) takes
# piece_input as before. The dicts are the same dicts piece_input makes, so the failure path (Note [failure
# semantics]) reads them as before. Where the optimizer has a direct step (Note [direct step]), its lists are
# gathered once and only the step counts' clones are put in each step; the direct step updates the views and
# the clones in place, so the outputs are the plan's copies and the clones, known without looking at the dicts.


class _Piece:
    """One cut piece: where it sits in the chunk, its param, and the entries its dict is made of."""

    __slots__ = ("param", "target", "start", "stop", "keys", "entries", "last", "copies")

    def __init__(self, param: torch.Tensor, target: torch.Tensor, piece: Any,
                 entries: list[tuple[str, torch.Tensor | None]], last: bool, copies: list) -> None:  # fmt: skip
        self.param, self.target = param, target
        self.start, self.stop = piece.start, piece.stop
        self.entries = entries  # (key, the slot view the optimizer sees, or None: the param's value, cloned)
        self.keys = frozenset(key for key, _ in entries)
        self.last = last  # the piece ends its param: its dict's other values are published
        self.copies = copies  # (host range, slot view) of each swapped state


class CutPieces:
    """The cut positions of one chunk, for the views they were made with (Note [cut pieces])."""

    def __init__(self, pieces: list[_Piece], views: Any) -> None:
        self.pieces = pieces
        self.views = views
        self.direct: DirectStep | None = None  # the lists of a direct step, gathered at the first step
        self.direct_at: list[list[int]] = []  # per group of the direct step, per member: the piece whose step count
        self.copies = [c for piece in pieces for c in piece.copies]

    @classmethod
    def build(cls, prep: Any, k: int, positions: list[int], targets: list[torch.Tensor], views: Any,
              state: Any) -> CutPieces | None:  # fmt: skip
        """The cut ``positions`` of chunk k as CutPieces, or None where one of them takes piece_input's general
        path (not a flat piece, no state dict, a master, a grad gathered into the slot, a subclass state)."""
        chunk = prep.plan.chunks[k]
        pieces = []
        for pos in positions:
            piece = chunk.pieces[pos]
            staged = views[pos]
            p = prep.params[piece.index]
            st = state.get(p)
            if not prep.flat[piece.index] or prep.is_whole(piece) or not st or MASTER in staged or GRAD in staged:
                return None
            entries: list[tuple[str, torch.Tensor | None]] = []
            copies = []
            for key, value in st.items():
                if key in staged:
                    given, slot_view, host = staged[key]
                    entries.append((key, given))
                    if host is not None and slot_view.numel():
                        copies.append((host, slot_view))
                elif subclass_state.is_subclass_state(value):
                    return None
                else:
                    entries.append((key, None))
            last = piece.stop == local(p).numel()
            pieces.append(_Piece(p, targets[pos], piece, entries, last, copies))
        return cls(pieces, views)

    def inputs(self, state: Any) -> defaultdict | None:
        """This step's state dicts of the cut pieces, keyed by the tensors stepped, with their grads bound; None
        (nothing bound) where a param's dict no longer has the keys it was built for or a grad is missing."""
        dicts = []
        for piece in self.pieces:
            st = state.get(piece.param)
            if st is None or st.keys() != piece.keys or piece.param.grad is None:
                return None
            dicts.append(st)
        made: defaultdict = defaultdict(dict)  # as piece_input's: the inner step may be handed it
        for piece, st in zip(self.pieces, dicts):
            pst = {}
            for key, view in piece.entries:
                if view is None:
                    value = st[key]
                    pst[key] = value.clone() if isinstance(value, torch.Tensor) else value
                else:
                    pst[key] = view
            g = local(piece.param.grad)
            piece.target.grad = hoststate.flat_view(g)[piece.start : piece.stop]
            made[piece.target] = pst
        return made

    def run_direct(self, members: list[list[torch.Tensor]], groups: list[dict], made: dict, optimizer: Any) -> bool:
        """Step the cut pieces by a direct step (Note [direct step]) over ``made`` (from inputs): the lists are
        gathered once, the step counts put in each step. False: nothing done, the inner step must run."""
        if self.direct is None:
            self.direct = DirectStep.build(members, groups, made)
            if self.direct is None:
                return False
            at = {id(piece.target): i for i, piece in enumerate(self.pieces)}
            self.direct_at = [[at[id(t)] for t in ps] for ps in members]
        steps = [pst["step"] for pst in made.values()]  # made by inputs(): one dict per piece, in order
        for g, at in zip(self.direct.groups, self.direct_at):
            g.steps = [steps[i] for i in at]
        try:
            return self.direct.run(optimizer, groups)
        finally:  # the clones are this step's: kept past it, the device memory of each would stay taken
            for g in self.direct.groups:
                g.steps = []

    def outputs(self, made: dict) -> tuple[list, list, list]:
        """After a direct step over ``made``: the swap-out copies of the cut pieces, nothing to hold, and (param,
        scalars) of each param whose last piece this is (StepRun.pieces_output, known from the plan)."""
        finals = []
        for piece, pst in zip(self.pieces, made.values()):  # made by inputs(): one dict per piece, in order
            if piece.last:
                finals.append((piece.param, {key: pst[key] for key, view in piece.entries if view is None}))
        return self.copies, [], finals
