"""The forwarding-loop guard: ``Via`` (docs/references.md#forwarding-loop).

The self check (selfcheck.py) catches a node that is this facade by address. Every other loop
(two standalone proxies whose nodes files name each other's facades, a chain through proxies
we do not know, a name that resolves to us) passes through some process twice. So every
request we forward carries ``Via: 1.1 nvpair-<token>`` after whatever ``Via`` it came with
(RFC 9110 7.6.3), and a request that arrives carrying our own token has been here before: it
is answered 508 at once, and a 508 from upstream is never retried, since retrying cannot fix a
configuration.

The token is fixed for the process and random (not the run id, which every workload event
shows the broker), so no client can name another process's token by reading an event.
"""

from __future__ import annotations

import secrets

import attrs
from twisted.web.http_headers import Headers

VIA = b"Via"


def new_token() -> str:
    return secrets.token_hex(8)


@attrs.frozen
class LoopGuard:
    """One process's ``Via`` hop: what it adds to what it forwards, and how it knows its own."""

    token: str = attrs.Factory(new_token)
    received_by: bytes = attrs.field(init=False)
    hop: bytes = attrs.field(init=False)

    @received_by.default
    def _received_by(self) -> bytes:
        return b"nvpair-" + self.token.encode("ascii")

    @hop.default
    def _hop(self) -> bytes:
        return b"1.1 " + self.received_by

    def seen(self, headers: Headers) -> bool:
        """Whether a request already passed through this process: one ``Via`` entry (of any
        line, comma-separated) was received by us."""
        values = headers.getRawHeaders(VIA)
        if not values:
            return False  # the usual case: one lookup
        for value in values:
            for entry in value.split(b","):
                parts = entry.split()
                if len(parts) >= 2 and parts[1] == self.received_by:
                    return True
        return False

    def stamp(self, headers: Headers) -> Headers:
        """``headers`` with our hop after the ``Via`` entries they carry (in place)."""
        values = headers.getRawHeaders(VIA)
        headers.setRawHeaders(VIA, [b", ".join([*values, self.hop]) if values else self.hop])
        return headers
