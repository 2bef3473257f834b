"""Hop-by-hop header handling (RFC 9110 7.6.1), both directions.

A proxy that forwards ``Connection`` or ``Transfer-Encoding`` breaks the framing of the next
hop; one that forgets the headers *named* in ``Connection`` leaks per-connection state.
"""

from __future__ import annotations

from twisted.web.http_headers import Headers

from ..core.memo import Memo

HOP_BY_HOP = frozenset(
    name.lower()
    for name in (
        b"Connection",
        b"Keep-Alive",
        b"Proxy-Authenticate",
        b"Proxy-Authorization",
        b"Proxy-Connection",
        b"TE",
        b"Trailer",
        b"Transfer-Encoding",
        b"Upgrade",
    )
)


def _canonical(names) -> frozenset[bytes]:
    """Header names as ``Headers.getAllRawHeaders`` gives them (its documented canonical
    capitalization), so the per-request pass compares names without lower-casing each."""
    probe = Headers()
    for name in names:
        try:
            probe.setRawHeaders(name, [b""])
        except ValueError:  # not a token: no header can carry that name anyway
            continue
    return frozenset(name for name, _ in probe.getAllRawHeaders())


# Skip sets by ``drop`` and Connection value (``keep-alive`` on most requests). A Connection
# value is the client's: at most MAX_CACHED are kept, and only values of at most
# MAX_CACHED_VALUE bytes, so hostile values cannot pin much memory; a longer value is worked
# out for its own request only.
MAX_CACHED = 1024
MAX_CACHED_VALUE = 256
_SKIP: Memo[tuple, frozenset[bytes]] = Memo(MAX_CACHED)


def end_to_end(headers: Headers, drop: tuple[bytes, ...] = ()) -> Headers:
    """A copy without hop-by-hop headers, those named in Connection, and ``drop``."""
    return copy_end_to_end(headers, Headers(), drop)


def copy_end_to_end(headers: Headers, into: Headers, drop: tuple[bytes, ...] = ()) -> Headers:
    """Add ``headers``' end-to-end headers to ``into`` (one pass, no copy in between)."""
    connection = headers.getRawHeaders(b"connection")
    key = (drop, tuple(connection)) if connection else drop
    skip = _SKIP.get(key)
    if skip is None:
        named = (
            token.strip()
            for value in connection or ()
            for token in value.split(b",")
            if token.strip()
        )
        skip = _canonical([*HOP_BY_HOP, *drop, *named])
        if sum(map(len, connection or ())) <= MAX_CACHED_VALUE:
            _SKIP.remember(key, skip)
    for name, values in headers.getAllRawHeaders():
        if name not in skip:
            into.setRawHeaders(name, values)
    return into
