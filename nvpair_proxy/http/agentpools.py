"""One pooled client per TLS configuration, so no connection is reused across configurations.

A connection verified against one engine CA, or against one peer's pin, must never carry a
request meant for another: the pool keys connections by origin only, not by how they were
verified. So each configuration (an engine's
:class:`~nvpair_proxy.standalone.engineaccess.EngineTLS`,
a pinned peer) gets its own :class:`~nvpair_proxy.http.client.Client` with its own pool, made on
first use. A configuration that goes (a node removed, a CA rotated, a pin replaced) retires
its pool: idle connections close now, and those still busy close as they come back.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

import attrs
from twisted.internet.defer import Deferred, DeferredList
from twisted.web.iweb import IPolicyForHTTPS

from .client import Client
from .pool import ConnectionPool

K = TypeVar("K", bound=Hashable)


@attrs.define(eq=False)
class AgentPools(Generic[K]):
    """The client of each configuration ``K`` in use; all closed at shutdown."""

    reactor: object
    connect_timeout: float
    idle_timeout: float
    max_idle_per_host: int
    keepalive: float = 0.0
    _clients: dict[K, Client] = attrs.Factory(dict)

    def get(self, key: K, policy: Callable[[], IPolicyForHTTPS]) -> Client:
        """The client of ``key``, made with TLS ``policy()`` the first time it is asked for."""
        client = self._clients.get(key)
        if client is None:
            pool = ConnectionPool(
                self.reactor,
                max_idle_per_host=self.max_idle_per_host,
                idle_timeout=self.idle_timeout,
            )
            client = self._clients[key] = Client(
                self.reactor,
                pool,
                connect_timeout=self.connect_timeout,
                tls=policy(),
                keepalive=self.keepalive,
            )
        return client

    def retire(self, key: K) -> None:
        """``key``'s configuration is gone: retire its pool; asked for again, it gets a new one."""
        client = self._clients.pop(key, None)
        if client is not None:
            client.pool.retire()

    def retain(self, keep: Callable[[K], bool]) -> None:
        """Retire every configuration ``keep`` refuses."""
        for key in [key for key in self._clients if not keep(key)]:
            self.retire(key)

    def close(self) -> Deferred:
        """Close every idle connection of every client; fires when they are all gone."""
        return DeferredList(
            [client.pool.closeCachedConnections() for client in self._clients.values()]
        )
