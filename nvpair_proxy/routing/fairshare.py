"""Fair share on a shared fleet (docs/decisions.md#fair-share): who else works on our owners,
how long a request waits for a slot we see free before it joins an engine's own queue, and
when a refused client should come back. Plain bookkeeping: no Twisted.

Late binding keeps requests in our queue until a slot frees. On a fleet only we send to, that
queue is the only one, and it is fair by turns (slotqueue.py). Another proxy's requests are
invisible to it: their slot frees and is filled again by that proxy at once, while we learn it
was free a poll later. So when an owner's engine shows work we did not send, a waiting request
holds for about one service time of the model's owners, then goes to an owner anyway and waits
in its engine's queue, which serves in arrival order: never longer than without us.
"""

from __future__ import annotations

import math

import attrs

from .enginetruth import EngineTruth

#: How long a read showing work we did not send marks its node as shared, unless a later read
#: shows only ours (reads come about once a second while traffic flows).
CONTENTION_MEMORY = 30.0
#: The bounded hold when no owner of the model has a measured service time yet, and its bounds.
HOLD_DEFAULT = 1.0
HOLD_MIN = 0.25
HOLD_MAX = 10.0
#: The bounds of a busy answer's Retry-After (seconds).
RETRY_MIN = 1
RETRY_MAX = 60


@attrs.define
class Contention:
    """The nodes whose engines' last read showed work we did not send (another proxy's, or a
    client that goes to the engine directly)."""

    memory: float = CONTENTION_MEMORY
    #: Counts the reads that found a node newly shared: whoever holds waiting requests
    #: compares it with the count it last saw.
    changes: int = 0
    _seen: dict[str, float] = attrs.Factory(dict)

    def read(self, node_id: str, truth: EngineTruth, ours: int, ended: int, now: float) -> None:
        """One read of ``node_id``'s engine arrived ``now``: ``ours`` of our dispatches run
        there now and ``ended`` of ours ended since the last read, which it may still count.
        Busy slots beyond both are someone else's (an undercount: never one that is ours)."""
        slots = truth.slots
        if slots is None:
            return
        if slots.busy - ours - ended > 0:
            if now - self._seen.get(node_id, -math.inf) >= self.memory:
                self.changes += 1
            self._seen[node_id] = now
        else:
            # The engine runs only ours now: the fleet is ours again until a read says not.
            self._seen.pop(node_id, None)

    def shared(self, node_ids: list[str], now: float) -> bool:
        """Whether any of ``node_ids`` showed another's work within ``memory``."""
        seen = self._seen
        if not seen:
            return False  # the usual case: nobody else works on this fleet
        return any(now - seen.get(node_id, -math.inf) < self.memory for node_id in node_ids)

    def forget(self, node_id: str) -> None:
        self._seen.pop(node_id, None)

    def recent(self, now: float) -> list[str]:
        """The nodes that showed another's work within ``memory``."""
        return [node_id for node_id, at in self._seen.items() if now - at < self.memory]


def hold_for(services: list[float]) -> float:
    """How long a request waits for a slot we see free before it joins an engine's queue:
    the shortest measured service time among the owners (the first of theirs to end frees a
    slot about then), within bounds."""
    if not services:
        return HOLD_DEFAULT
    return min(HOLD_MAX, max(HOLD_MIN, min(services)))


def retry_after(waiting: int, slots: int, service: float | None) -> int:
    """When a refused client should come back: the work queued ahead of it served at the
    owners' measured rate (``slots`` at once, ``service`` seconds each), within bounds; the
    least when the rate is not measured."""
    if service is None or slots <= 0:
        return RETRY_MIN
    seconds = math.ceil((waiting + 1) * service / slots)
    return min(RETRY_MAX, max(RETRY_MIN, seconds))
