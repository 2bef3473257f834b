"""Late binding: requests wait here, in the proxy, for a free slot on any owner.

A request sent to an engine whose slots are all busy waits inside that engine, where nothing
can move it even when another node frees first (those queues are invisible and
un-retargetable: docs/references.md#engine-queues). One queue in front of several servers
beats a queue per server, so when every owner with a known slot count is full a request waits
in its facade's queue instead, and is dispatched to the first owner that frees
(docs/decisions.md#late-binding).

Waiting costs no attempt and holds no reservation. Requests wait in arrival order per model,
with failovers ahead of new arrivals. The whole queue keeps one timer, for the earliest
deadline: waiting is never a timer per request.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

import attrs
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from ..core.timers import cancel_pending


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


@attrs.define(eq=False)
class _Line:
    """One model's waiters: failovers first, then new arrivals, each in arrival order."""

    ahead: deque[Waiter] = attrs.Factory(deque)
    behind: deque[Waiter] = attrs.Factory(deque)

    def __len__(self) -> int:
        return len(self.ahead) + len(self.behind)

    def first(self) -> Waiter | None:
        return self.ahead[0] if self.ahead else self.behind[0] if self.behind else None

    def __iter__(self) -> Iterator[Waiter]:
        yield from self.ahead
        yield from self.behind


@attrs.define(eq=False)
class SlotQueue:
    """One facade's waiting requests, bounded by ``depth`` new arrivals (``--queue-depth``)."""

    clock: IReactorTime
    depth: int
    #: Called with every waiter that leaves the queue and how long it waited (metrics).
    on_leave: Callable[[Waiter, float], None] | None = None
    #: Called when a waiter's patience for its preferred node ran out: it may go anywhere now.
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

    def add(self, waiter: Waiter) -> Waiter:
        line = self._lines.setdefault(waiter.model, _Line())
        (line.ahead if waiter.ahead else line.behind).append(waiter)
        self._count += 1
        self._arm(self._due_of(waiter))
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out without calling it (its request ended); False if not here."""
        line = self._lines.get(waiter.model)
        if line is None:
            return False
        for side in (line.ahead, line.behind):
            try:
                side.remove(waiter)
            except ValueError:
                continue
            self._left(waiter, line)
            return True
        return False

    def models(self) -> list[str]:
        """The models with waiters, the one whose first waiter came earliest first."""
        firsts = [(line.first(), model) for model, line in self._lines.items()]
        return [
            model for first, model in sorted(((w.since, m) for w, m in firsts if w is not None))
        ]

    def wake_first(self, model: str, may_go: Callable[[Waiter], bool] | None = None) -> bool:
        """Dispatch ``model``'s first waiter that ``may_go`` (one waiting for its preferred
        node may not go elsewhere); False when none may."""
        line = self._lines.get(model)
        if line is None:
            return False
        for waiter in line:
            if may_go is None or may_go(waiter):
                break
        else:
            return False
        (line.ahead if waiter.ahead else line.behind).remove(waiter)
        self._left(waiter, line)
        waiter.wake()
        return True

    def waiting_for(self, node_id: str) -> int:
        """How many waiters wait for ``node_id`` in particular."""
        return sum(1 for line in self._lines.values() for w in line if w.prefer == node_id)

    def close(self) -> None:
        cancel_pending(self._timer)
        self._timer = self._due = None

    # The one deadline timer.

    def _left(self, waiter: Waiter, line: _Line) -> None:
        self._count -= 1
        if not line:
            del self._lines[waiter.model]
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
        if waiter.patience_until is not None:
            return min(waiter.deadline, waiter.patience_until)
        return waiter.deadline

    def _expire_due(self) -> None:
        self._timer = self._due = None
        now = self.clock.seconds()
        waiters = [w for line in self._lines.values() for w in line]
        impatient = False
        for waiter in waiters:
            if waiter.patience_until is not None and waiter.patience_until <= now:
                waiter.prefer = waiter.patience_until = None
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
