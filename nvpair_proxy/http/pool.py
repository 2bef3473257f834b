"""Idle upstream connections, by origin: what the client (client.py) reuses.

Newest first, at most ``max_idle_per_host`` per origin, closed after ``idle_timeout`` by one
timer for the whole pool (re-armed for the oldest connection left), not one per connection:
Twisted's pool kept a timer per idle connection, and the soak's idle pending calls fell from
49 to 4 without them. A connection here needs only ``key``, ``idle_since`` and
``close_idle()``.
"""

from __future__ import annotations

from typing import Protocol

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IDelayedCall

from ..core import constants
from ..core.timers import cancel_pending


class Idle(Protocol):
    """What the pool needs of a connection."""

    key: tuple
    idle_since: float

    def close_idle(self) -> Deferred: ...


class ConnectionPool:
    """Idle connections by origin, newest first; one timer closes those idle too long."""

    def __init__(self, clock, *, max_idle_per_host: int = 256,
                 idle_timeout: float = constants.POOL_IDLE_TIMEOUT) -> None:
        self.clock, self.max_idle_per_host, self.idle_timeout = clock, max_idle_per_host, idle_timeout
        self._idle: dict[tuple, list[Idle]] = {}
        self._sweep: IDelayedCall | None = None

    def take(self, key: tuple) -> Idle | None:
        idle = self._idle.get(key)
        return idle.pop() if idle else None

    def give(self, connection: Idle) -> None:
        idle = self._idle.get(connection.key)
        if idle is None:
            idle = self._idle[connection.key] = []
        if len(idle) >= self.max_idle_per_host:
            connection.close_idle()
            return
        connection.idle_since = self.clock.seconds()
        idle.append(connection)
        if self._sweep is None:
            self._sweep = self.clock.callLater(self.idle_timeout, self._expire)

    def retire(self) -> Deferred:
        """No longer used (a TLS configuration or a pin went away): close the idle
        connections now, and each one still in use when it comes back."""
        self.max_idle_per_host = 0
        return self.closeCachedConnections()

    def forget(self, connection: Idle) -> None:
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def idle_count(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    def _expire(self) -> None:
        self._sweep = None
        now = self.clock.seconds()
        oldest_kept = None
        for key, idle in list(self._idle.items()):
            stale = [c for c in idle if now - c.idle_since >= self.idle_timeout]
            if stale:
                idle[:] = [c for c in idle if now - c.idle_since < self.idle_timeout]
                for connection in stale:
                    connection.close_idle()
            if not idle:
                del self._idle[key]
            elif oldest_kept is None or idle[0].idle_since < oldest_kept:
                oldest_kept = idle[0].idle_since
        if oldest_kept is not None:
            self._sweep = self.clock.callLater(
                max(0.0, oldest_kept + self.idle_timeout - now), self._expire)

    def closeCachedConnections(self) -> Deferred:
        """Close every idle connection (the name is ``HTTPConnectionPool``'s, whose place
        this takes); fires when they are all gone."""
        cancel_pending(self._sweep)
        self._sweep = None
        idle = [c for connections in self._idle.values() for c in connections]
        self._idle.clear()
        return DeferredList([connection.close_idle() for connection in idle])
