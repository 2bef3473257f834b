"""The seams of the system: what the request path reports through, and to whom.

The core never imports the broker or the plugin; it holds an IEmitter, which is the broker
link in broker mode, the log in standalone mode, and a recorder in tests.
"""

from __future__ import annotations

from zope.interface import Interface


class IEmitter(Interface):
    def notify(method: str, params: dict, engine: str | None = None) -> None:
        """Send one notification; ``engine`` addresses a facade-scoped one (spec 4)."""
