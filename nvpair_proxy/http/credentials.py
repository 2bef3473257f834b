"""The credentials a request presents: Bearer tokens and X-Api-Key values.

Read by the LAN key gate (lan/apikeys.py), which admits a LAN client by its key, and by fair
share (routing/clients.py), which takes turns across clients named by their keys. Plain
bookkeeping on headers: a key is never logged, shown or kept as text.
"""

from __future__ import annotations

from twisted.web.http_headers import Headers

CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")


def presented(headers: Headers) -> list[bytes]:
    """Every key a request presents: Bearer credentials and X-Api-Key values."""
    keys = []
    for value in headers.getRawHeaders(b"authorization", []):
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            keys.append(token.strip())
    for value in headers.getRawHeaders(b"x-api-key", []):
        if value.strip():
            keys.append(value.strip())
    return keys
