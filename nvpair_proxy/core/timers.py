"""Stopping a delayed call that may already have run.

Every timeout here races its own callback: a deadline can fire in the same reactor turn as
the event that should stop it. Twisted raises ``AlreadyCalled`` or ``AlreadyCancelled`` on a
second ``cancel``, so each stop asks ``active()`` first; this is that check, written once.
"""

from __future__ import annotations

from twisted.internet.interfaces import IDelayedCall


def cancel_pending(call: IDelayedCall | None) -> None:
    """Cancel ``call`` unless there is none, or it already ran or was cancelled."""
    if call is not None and call.active():
        call.cancel()
