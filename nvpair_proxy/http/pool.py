"""Idle upstream connections, by origin: what the client (client.py) reuses.

Newest first, at most ``max_idle_per_host`` per origin, each kept for ``idle_timeout`` or for
as long as its server said it keeps it (``Keep-Alive: timeout``, less a margin: the client
says how long), whichever is shorter. One timer for the whole pool closes them (re-armed for
the first connection left to expire), not one per connection: Twisted's pool kept a timer per
idle connection, and the soak's idle pending calls fell from 49 to 4 without them. A
connection past its time is never handed out, even before the timer has closed it. A
connection here needs only ``key``, ``idle_until`` and ``close_idle()``.
"""

from __future__ import annotations

import math
from typing import Protocol

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IDelayedCall

from ..core import constants
from ..core.timers import cancel_pending


class Idle(Protocol):
    """What the pool needs of a connection; ``idle_until`` is the pool's to set."""

    key: tuple
    idle_until: float

    def close_idle(self) -> Deferred: ...


class ConnectionPool:
    """Idle connections by origin, newest first; one timer closes those idle too long."""

    def __init__(
        self,
        clock,
        *,
        max_idle_per_host: int = 256,
        idle_timeout: float = constants.POOL_IDLE_TIMEOUT,
    ) -> None:
        self.clock, self.max_idle_per_host, self.idle_timeout = (
            clock,
            max_idle_per_host,
            idle_timeout,
        )
        self._idle: dict[tuple, list[Idle]] = {}
        self._sweep: IDelayedCall | None = None
        #: How many times every idle connection was closed (``closeCachedConnections``): a
        #: connection that was idle in all but name then (client.py tells a stream's end
        #: before pooling its connection) is closed too, not pooled after.
        self.emptied = 0

    def take(self, key: tuple) -> Idle | None:
        """The newest connection of ``key`` still within its time; any past it are closed."""
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self.clock.seconds()
        while idle:
            connection = idle.pop()
            if connection.idle_until > now:
                return connection
            connection.close_idle()
        return None

    def give(self, connection: Idle, keep_for: float = math.inf) -> None:
        """Keep ``connection`` idle for at most ``keep_for`` seconds (the server's word),
        never beyond the pool's own timeout; one that may not be kept at all is closed."""
        limit = min(self.idle_timeout, keep_for)
        idle = self._idle.get(connection.key)
        if idle is None:
            idle = self._idle[connection.key] = []
        if len(idle) >= self.max_idle_per_host or limit <= 0:
            connection.close_idle()
            return
        connection.idle_until = until = self.clock.seconds() + limit
        idle.append(connection)
        sweep = self._sweep
        if sweep is None:
            self._sweep = self.clock.callLater(limit, self._expire)
        elif until < sweep.getTime():
            sweep.reset(limit)

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
        first_left = math.inf
        for key, idle in list(self._idle.items()):
            stale = [c for c in idle if c.idle_until <= now]
            if stale:
                idle[:] = [c for c in idle if c.idle_until > now]
                for connection in stale:
                    connection.close_idle()
            if not idle:
                del self._idle[key]
            else:
                first_left = min(first_left, min(c.idle_until for c in idle))
        if first_left < math.inf:
            self._sweep = self.clock.callLater(max(0.0, first_left - now), self._expire)

    def closeCachedConnections(self) -> Deferred:
        """Close every idle connection (the name is ``HTTPConnectionPool``'s, whose place
        this takes); fires when they are all gone."""
        cancel_pending(self._sweep)
        self._sweep = None
        self.emptied += 1
        idle = [c for connections in self._idle.values() for c in connections]
        self._idle.clear()
        return DeferredList([connection.close_idle() for connection in idle])
