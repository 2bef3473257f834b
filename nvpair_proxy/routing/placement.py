"""Where a request goes in standalone mode: what each owner's engine reports, ranked.

In broker mode the cluster's scheduler ranks, and the reservation chooser spreads a burst
over its figures. In standalone mode nobody else ranks, and our own count of dispatches in
flight cannot see an engine's other clients, nor whether a model is loaded. So the owners are
ranked by what the engines report (docs/decisions.md#standalone-placement): a free slot before
a full engine, a loaded model before one that would load first, fewer busy slots before more,
then node id. Plain bookkeeping: no Twisted.
"""

from __future__ import annotations

import attrs

from ..nodes.discovery import Node
from .enginetruth import EngineTruth

# Warm first, then the nodes that do not say, then cold ones: a node that says nothing is
# placed as before, between the two it might be.
_WARMTH = {True: 0, None: 1, False: 2}


@attrs.frozen
class Standing:
    """One owner's state for one model, as placement weighs it."""

    node_id: str
    #: Slots the engine runs at once; None: unknown, which is never full.
    total: int | None
    #: Slots running now: the larger of ours in flight and what the engine reported (its
    #: count includes ours; any excess is its other clients).
    busy: int
    #: Whether the model is loaded there; None: the engine does not say.
    warm: bool | None

    @property
    def full(self) -> bool:
        return self.total is not None and self.busy >= self.total

    @property
    def free_slots(self) -> int | None:
        """Slots free now; None when unknown (as many as asked)."""
        return None if self.total is None else max(0, self.total - self.busy)

    def key(self) -> tuple[bool, int, int]:
        return (self.full, _WARMTH[self.warm], self.busy)


def rank_key(
    node: Node, model: str | None, truth: EngineTruth | None, ours: int, ended_since_read: int = 0
) -> tuple[bool, int, int]:
    """``standing(...).key()`` without the value: the ranking's per-request path."""
    reported = truth.slots_for(model) if truth is not None else None
    if reported is None:
        total, busy = node.slots, ours
    else:
        total = reported.total if node.slots is None else min(reported.total, node.slots)
        busy = max(ours, reported.busy - ended_since_read)
    warm = truth.is_warm(model) if truth is not None and model is not None else None
    return (total is not None and busy >= total, _WARMTH[warm], busy)


def standing(
    node: Node, model: str | None, truth: EngineTruth | None, ours: int, ended_since_read: int = 0
) -> Standing:
    """``ours``: our dispatches in flight to the node now; ``ended_since_read``: ours that
    ended there since the engine's report was read, which that report still counts as busy."""
    reported = truth.slots_for(model) if truth is not None else None
    total = reported.total if reported is not None else None
    if node.slots is not None:
        total = node.slots if total is None else min(total, node.slots)
    busy = ours if reported is None else max(ours, reported.busy - ended_since_read)
    warm = truth.is_warm(model) if truth is not None and model is not None else None
    return Standing(node.id, total, busy, warm)
