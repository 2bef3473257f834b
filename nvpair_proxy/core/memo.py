"""One bounded memo: a value made once per key and reused, with a bound on how many are kept.

The proxy remembers what it would otherwise make per request: a node's ``scheme://host:port``,
a request URI's origin and target, a Connection value's skip set, a node as admitted. In
normal use the keys are a handful (a fleet's nodes, its routes, ``keep-alive``), so a memo
that reaches its bound is being churned, by hostile input or a fleet that keeps changing.
It then forgets everything at once: a hit stays a plain ``dict.get`` with no recency to
update, which is what the per-request path pays, and the handful of real keys come back on
their next use.
"""

from __future__ import annotations

from typing import Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Memo(dict[K, V]):
    """A dict of values made once, forgotten all together when ``limit`` are kept.

    Read it as a dict (``get``, ``in``, ``len``); add through :meth:`remember`, the one
    place the bound is kept. A dict itself, not a wrapper: a hit is the dict's own ``get``.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def remember(self, key: K, value: V) -> V:
        """Keep ``value`` under ``key`` and return it; a full memo is emptied first."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value
