"""Hop-by-hop header handling (RFC 9110 7.6.1), both directions.

A proxy that forwards ``Connection`` or ``Transfer-Encoding`` breaks the framing of the next
hop; one that forgets the headers *named* in ``Connection`` leaks per-connection state.
"""

from __future__ import annotations

from twisted.web.http_headers import Headers

HOP_BY_HOP = frozenset(name.lower() for name in (
    b"Connection", b"Keep-Alive", b"Proxy-Authenticate", b"Proxy-Authorization",
    b"Proxy-Connection", b"TE", b"Trailer", b"Transfer-Encoding", b"Upgrade"))


def end_to_end(headers: Headers, drop: tuple[bytes, ...] = ()) -> Headers:
    """A copy without hop-by-hop headers, those named in Connection, and ``drop``."""
    return copy_end_to_end(headers, Headers(), drop)


def copy_end_to_end(headers: Headers, into: Headers, drop: tuple[bytes, ...] = ()) -> Headers:
    """Add ``headers``' end-to-end headers to ``into`` (one pass, no copy in between)."""
    skip = HOP_BY_HOP
    connection = headers.getRawHeaders(b"connection")
    if connection or drop:
        named = {token.strip().lower() for value in connection or () for token in value.split(b",")
                 if token.strip()}
        skip = skip | named | {name.lower() for name in drop}
    for name, values in headers.getAllRawHeaders():
        if name.lower() not in skip:
            into.setRawHeaders(name, list(values))
    return into
