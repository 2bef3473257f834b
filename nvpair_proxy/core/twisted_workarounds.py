"""The one place the proxy touches a private Twisted attribute, and why
(docs/references.md#twisted-workarounds).

The upstream behaviour worked around, in ``twisted.web.http.HTTPChannel`` (Twisted 26.10):
``pauseProducing`` sets ``_waitingForTransport`` and pauses only the producer registered at that
moment; ``registerProducer`` stores a new push producer without looking at that flag. So a
producer registered while the client's send buffer is full (``pauseProducing`` came first) is
never paused: the transport asks only once and will not ask again until it has resumed the
channel, the producer streams into a client that reads nothing, and the upstream body piles up
in memory instead of stalling the upstream socket. The paused state is readable only as
``_waitingForTransport``.

No upstream ticket found: the installed Twisted source and tests name none, and the tickets
HTTPChannel's docstrings cite are about other problems (#8868 is why the channel pauses its
transport at all; #8488 is about which reactor TimeoutMixin uses). Delete this module when
``HTTPChannel.registerProducer`` pauses a push producer registered while the channel is paused.

Three more upstream behaviours of ``HTTPChannel`` are worked around in ``server.BoundedChannel``
through public hooks (``lineReceived``, ``headerReceived``, ``checkPersistence``), none private:

- the request target: ``_parseRequestLine`` accepts any printable target and ``Request`` keeps
  it as ``uri``, so ``7/api/version``, ``*`` or an absolute URL reached the resource as is, and
  a ``#fragment`` stayed in ``request.path``. A proxy that appended that to a node's origin
  dialled another port, and classified a path the engine never saw. BoundedChannel rewrites
  the request line to the origin-form path we send (``target.py``) or answers 400.
- ``Transfer-Encoding``: ``_maybeChooseTransferDecoder`` ignores ``identity`` (a request with
  it and no length has no body, so its body is read as the next request) and accepts it
  before ``chunked``. RFC 9112 6.3 wants anything but a single final ``chunked`` refused: 400
  and a close.
- ``Connection``: ``checkPersistence`` splits the first ``Connection`` line on spaces, so
  ``close, te`` (the token read as ``close,``) kept the connection open for a pipelined next
  request. Ours reads every line as the comma-separated list RFC 9110 7.6.1 defines.
"""

from __future__ import annotations

from twisted.web.server import Request


def channel_paused(request: Request) -> bool:
    """Whether the client connection has asked the request's channel to stop producing (and
    not yet to resume): a producer registered now must be paused by its registrant."""
    return request.channel is not None and bool(request.channel._waitingForTransport)
