"""Late binding: requests wait here, in the proxy, for a free slot on any owner.

A request sent to an engine whose slots are all busy waits inside that engine, where nothing
can move it even when another node frees first (those queues are invisible and
un-retargetable: docs/references.md#engine-queues). One queue in front of several servers
beats a queue per server, so when every owner with a known slot count is full a request waits
in its facade's queue instead, and is dispatched to the first owner that frees
(docs/decisions.md#late-binding).

Waiting costs no attempt and holds no reservation. Per model, failovers go first; then the
clients take turns, a request each, each client's own in arrival order; batch work last,
until it has waited 30 s (docs/decisions.md#fair-share). The whole queue keeps one timer, for
the earliest deadline, patience or hold: waiting is never a timer per request.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Iterator

import attrs
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from ..core.timers import cancel_pending
from .clients import BATCH_AGE


@attrs.define(eq=False)
class Waiter:
    """One request waiting for a slot for ``model``: ``wake`` dispatches it, ``expire`` ends
    it at its deadline. Each is called at most once, and never after it left the queue."""

    model: str
    deadline: float
    since: float
    wake: Callable[[], None] = attrs.field(repr=False)
    expire: Callable[[], None] = attrs.field(repr=False)
    ahead: bool = False
    #: Affinity: the node this request waits for while another is free, until
    #: ``patience_until``; then it takes any (docs/decisions.md#affinity).
    prefer: str | None = None
    patience_until: float | None = None
    #: Seconds it is expected to hold a slot of ``prefer`` once there.
    work: float = 0.0
    #: Fair share (docs/decisions.md#fair-share): the digest naming its client, whose turn it
    #: waits for, and whether it yields to every other request (``batch``, until it aged).
    client: bytes = attrs.field(default=b"", repr=False)
    batch: bool = False
    #: Batch work that waited ``BATCH_AGE``: it takes turns like any other now.
    aged: bool = False
    #: The bounded hold: when the owners show work we did not send, a waiter does not wait
    #: past this for a slot we see free; it is then ``forced`` into the engine's own queue.
    hold_until: float | None = None
    forced: bool = False


# Clients remembered per model for their last turn; past it, the one served longest ago is
# forgotten (it then counts as never served, which only brings its next turn forward).
REMEMBERED_CLIENTS = 1024


@attrs.define(eq=False)
class _Line:
    """One model's waiters: failovers first in arrival order; then the clients' turns, the
    client served longest ago (or never) first, a request each, each client's own in arrival
    order; then batch work, in arrival order, until it has waited ``BATCH_AGE`` and takes
    turns like the rest."""

    ahead: deque[Waiter] = attrs.Factory(deque)
    #: Each waiting client's requests, in arrival order.
    turns: dict[bytes, deque[Waiter]] = attrs.Factory(dict)
    batch: deque[Waiter] = attrs.Factory(deque)
    #: When each client's request last left this line for a slot (oldest first), as the
    #: count of turns taken then: a count, not the clock, because several slots can free at
    #: one clock reading, and ties would give them all to the client that came first.
    served: dict[bytes, int] = attrs.Factory(dict)
    taken: int = 0
    size: int = 0

    def __len__(self) -> int:
        return self.size

    def first(self) -> Waiter | None:
        return next(iter(self), None)

    def __iter__(self) -> Iterator[Waiter]:
        """In the order they go: failovers, then a round of the clients' first requests,
        then of their second ones, and so on, then batch work."""
        yield from self.ahead
        queues = self._rotation()
        depth = 0
        while queues:
            for waiters in queues:
                yield waiters[depth]
            depth += 1
            queues = [waiters for waiters in queues if len(waiters) > depth]
        yield from self.batch

    def _rotation(self) -> list[deque[Waiter]]:
        """The waiting clients' requests, whose turn is next first: served longest ago (never
        served first), then waiting longest."""
        turns = self.turns
        if len(turns) < 2:
            return list(turns.values())  # the usual case: one client, or nobody, waits
        served = self.served
        return sorted(
            turns.values(), key=lambda w: (served.get(w[0].client, -math.inf), w[0].since)
        )

    def add(self, waiter: Waiter) -> None:
        self.size += 1
        if waiter.ahead:
            self.ahead.append(waiter)
        elif waiter.batch and not waiter.aged:
            self.batch.append(waiter)
        else:
            self._take_turns(waiter)

    def take(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out; False if it is not here."""
        if waiter.ahead:
            found = _drop(self.ahead, waiter)
        elif waiter.batch and not waiter.aged:
            found = _drop(self.batch, waiter)
        else:
            waiters = self.turns.get(waiter.client)
            found = waiters is not None and _drop(waiters, waiter)
            if found and not waiters:
                del self.turns[waiter.client]
        if found:
            self.size -= 1
        return found

    def went(self, waiter: Waiter) -> None:
        """``waiter`` was dispatched: its client's turn is taken now, after every other."""
        served = self.served
        served.pop(waiter.client, None)
        self.taken += 1
        served[waiter.client] = self.taken
        if len(served) > REMEMBERED_CLIENTS:
            del served[next(iter(served))]

    def age(self, now: float) -> None:
        """Batch work that has waited ``BATCH_AGE`` takes turns from now on."""
        batch = self.batch
        while batch and batch[0].since + BATCH_AGE <= now:
            waiter = batch.popleft()
            waiter.aged = True
            self._take_turns(waiter)

    def _take_turns(self, waiter: Waiter) -> None:
        waiters = self.turns.get(waiter.client)
        if waiters is None:
            self.turns[waiter.client] = deque((waiter,))
        elif waiters[-1].since <= waiter.since:
            waiters.append(waiter)
        else:  # an aged batch request, older than some of its client's: its place by age
            index = next(i for i, w in enumerate(waiters) if w.since > waiter.since)
            waiters.insert(index, waiter)


def _drop(waiters: deque[Waiter], waiter: Waiter) -> bool:
    if waiters and waiters[0] is waiter:
        waiters.popleft()  # the usual case: the first leaves
        return True
    try:
        waiters.remove(waiter)
    except ValueError:
        return False
    return True


@attrs.define(eq=False)
class SlotQueue:
    """One facade's waiting requests, bounded by ``depth`` new arrivals (``--queue-depth``)."""

    clock: IReactorTime
    depth: int
    #: Called with every waiter that leaves the queue and how long it waited (metrics).
    on_leave: Callable[[Waiter, float], None] | None = None
    #: Called when a waiter may go where it could not before: its patience for its preferred
    #: node ran out (it may go anywhere), or its hold did (it may go to a full engine).
    on_patience: Callable[[], None] | None = None
    _lines: dict[str, _Line] = attrs.Factory(dict)
    _count: int = 0
    _timer: IDelayedCall | None = None
    _due: float | None = None

    def __len__(self) -> int:
        return self._count

    def is_full(self) -> bool:
        """No room for a new arrival (a failover always finds room: it was admitted)."""
        return self._count >= self.depth

    def oldest_since(self) -> float | None:
        """When the longest-waiting request began to wait, None when nobody waits."""
        heads = [waiter.since for line in self._lines.values() for waiter in line]
        return min(heads) if heads else None

    def clients(self) -> int:
        """How many clients have a request waiting (for status: never who)."""
        return len({waiter.client for line in self._lines.values() for waiter in line})

    def batch_waiting(self) -> int:
        """Batch requests still yielding to every other."""
        return sum(len(line.batch) for line in self._lines.values())

    def ahead_of(self, model: str) -> int:
        """How many requests for ``model`` wait now."""
        line = self._lines.get(model)
        return len(line) if line is not None else 0

    def add(self, waiter: Waiter) -> Waiter:
        self._lines.setdefault(waiter.model, _Line()).add(waiter)
        self._count += 1
        self._arm(self._due_of(waiter))
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out without calling it (its request ended); False if not here."""
        line = self._lines.get(waiter.model)
        if line is None or not line.take(waiter):
            return False
        self._left(waiter, line)
        return True

    def models(self) -> list[str]:
        """The models with waiters, the one whose first waiter came earliest first."""
        firsts = [(line.first(), model) for model, line in self._lines.items()]
        return [
            model for first, model in sorted(((w.since, m) for w, m in firsts if w is not None))
        ]

    def wake_first(self, model: str, may_go: Callable[[Waiter], bool] | None = None) -> bool:
        """Dispatch ``model``'s next waiter in turn that ``may_go`` (one waiting for its
        preferred node may not go elsewhere); False when none may."""
        line = self._lines.get(model)
        if line is None:
            return False
        line.age(self.clock.seconds())
        for waiter in line:
            if may_go is None or may_go(waiter):
                break
        else:
            return False
        line.take(waiter)
        line.went(waiter)
        self._left(waiter, line)
        waiter.wake()
        return True

    def hold(self, model: str, seconds: float) -> None:
        """Bound the wait of ``model``'s waiters that have no bound yet (a node of theirs was
        found shared after they began to wait): ``seconds`` from when each began."""
        line = self._lines.get(model)
        if line is None:
            return
        due = None
        for waiter in line:
            if waiter.hold_until is None and not waiter.forced and waiter.prefer is None:
                waiter.hold_until = waiter.since + seconds
                due = waiter.hold_until if due is None else min(due, waiter.hold_until)
        if due is not None:
            self._arm(due)

    def work_for(self, node_id: str) -> float:
        """The seconds of work the waiters for ``node_id`` in particular are expected to
        hold its slots (the spill rule's queue ahead). O(waiters), asked only when a
        conversation's node is full while another owner is free."""
        return sum(w.work for line in self._lines.values() for w in line if w.prefer == node_id)

    def close(self) -> None:
        cancel_pending(self._timer)
        self._timer = self._due = None

    # The one deadline timer.

    def _left(self, waiter: Waiter, line: _Line) -> None:
        # An emptied line stays (one per model): it remembers whose turn was taken last.
        self._count -= 1
        if self.on_leave is not None:
            self.on_leave(waiter, self.clock.seconds() - waiter.since)
        if not self._count:
            self.close()

    def _arm(self, deadline: float) -> None:
        if self._due is not None and self._due <= deadline:
            return
        cancel_pending(self._timer)
        self._due = deadline
        self._timer = self.clock.callLater(
            max(0.0, deadline - self.clock.seconds()), self._expire_due
        )

    @staticmethod
    def _due_of(waiter: Waiter) -> float:
        due = waiter.deadline
        if waiter.patience_until is not None:
            due = min(due, waiter.patience_until)
        if waiter.hold_until is not None:
            due = min(due, waiter.hold_until)
        return due

    def _expire_due(self) -> None:
        self._timer = self._due = None
        now = self.clock.seconds()
        waiters = [w for line in self._lines.values() for w in line]
        impatient = False
        for waiter in waiters:
            if waiter.patience_until is not None and waiter.patience_until <= now:
                waiter.prefer = waiter.patience_until = None
                impatient = True
            if waiter.hold_until is not None and waiter.hold_until <= now:
                waiter.hold_until, waiter.forced = None, True
                impatient = True
        for waiter in [w for w in waiters if w.deadline <= now]:
            if self.remove(waiter):
                waiter.expire()
        earliest = min(
            (self._due_of(w) for line in self._lines.values() for w in line), default=None
        )
        if earliest is not None:
            self._arm(earliest)
        if impatient and self.on_patience is not None:
            self.on_patience()
