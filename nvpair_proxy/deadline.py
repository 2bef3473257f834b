"""The header-read deadline of a connection, handed from the listener to the HTTP request.

A connection gets 10 s (protocol 7) from accept to a complete request line, whether it
speaks plaintext or first a TLS handshake; the request then gets 10 s more for its headers.
The listener starts the first deadline and the request line ends it, so a peer trickling a
handshake or half a request line cannot hold a connection for the idle timeout.
"""

from __future__ import annotations

from typing import Callable
from weakref import WeakKeyDictionary

_pending: "WeakKeyDictionary[object, Callable[[], None]]" = WeakKeyDictionary()


def expect_request_line(transport, cancel: Callable[[], None]) -> None:
    """Register the deadline of a freshly accepted connection."""
    _pending[transport] = cancel


def request_line_received(transport) -> None:
    """End the connection's first deadline; ``transport`` is the HTTP channel's, which sits
    on the accepted one directly (plaintext) or through the TLS layer."""
    for _ in range(3):
        try:
            cancel = _pending.pop(transport, None)
        except TypeError:  # None, or a transport that cannot be weakly referenced
            cancel = None
        if cancel is not None:
            cancel()
            return
        transport = getattr(transport, "transport", None)
