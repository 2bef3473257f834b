"""Who a waiting request belongs to, and whether it is background work: what fair share
(slotqueue.py) takes turns by (docs/decisions.md#fair-share).

A client is the API key it presented, on loopback too, else its source address. Either is
kept only as a 16-byte digest, made when the request first waits (a request that never waits
costs nothing here): never logged, shown, or made a label.
"""

from __future__ import annotations

import hashlib

from ..http.credentials import presented
from ..http.server import BoundedRequest

#: ``X-NVPAIR-Priority: batch``: the request waits behind every other of its model, until it
#: has waited ``BATCH_AGE`` seconds; then it takes turns like any other. Not forwarded.
PRIORITY_HEADER = b"x-nvpair-priority"
BATCH = b"batch"
BATCH_AGE = 30.0


def client_of(request: BoundedRequest) -> bytes:
    """The digest naming ``request``'s client: the one the LAN key gate kept before it removed
    the key from the headers, else that of the first key presented, else that of the source
    address."""
    if request.client_digest is not None:
        return request.client_digest
    keys = presented(request.requestHeaders)
    if keys:
        return hashlib.sha256(b"key\0" + keys[0]).digest()[:16]
    host = getattr(request.getClientAddress(), "host", "") or ""
    return hashlib.sha256(b"address\0" + host.encode()).digest()[:16]


def is_batch(request: BoundedRequest) -> bool:
    """Whether the request asked to yield to every other (``X-NVPAIR-Priority: batch``)."""
    values = request.requestHeaders.getRawHeaders(PRIORITY_HEADER)
    return values is not None and any(v.strip().lower() == BATCH for v in values)
