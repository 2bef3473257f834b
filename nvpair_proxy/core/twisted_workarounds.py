"""The one place the proxy touches private Twisted attributes, and why
(docs/references.md#twisted-workarounds).

The first upstream behaviour worked around, in ``twisted.web.http.HTTPChannel`` (Twisted 26.10):
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

The second, in ``twisted.web.http._ChunkedTransferDecoder`` (Twisted 26.10): the lines of a
chunked body's trailer section are kept in ``_trailerHeaders`` without being parsed or checked,
and no public hook sees them. So ``0\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n`` ends one
request, its "trailers" a request line and a header, where a strict parser refuses the
trailer (h11) and a front end that ends the body at the last chunk forwards a second request
we never answer: the two disagree on how many requests the connection carried.
``trailer_lines`` reads them (through the channel's ``_transferDecoder``, also private) so
``server.BoundedChannel`` refuses a line that is not a field line. Delete it when Twisted
validates trailer fields or exposes them.

The third, in ``twisted.internet.tcp.Port.doRead`` (Twisted 26.10), is about descriptors: on
``EMFILE`` its accept loop closes a reserved ``/dev/null`` descriptor, accepts every waiting
client into that slot and closes it at once, logging three info lines per client ("EMFILE
encountered; releasing reserved file descriptor.", "EMFILE recovery: Closed socket from ...",
"Re-reserving ..."): measured against the running proxy at a limit of 128, 300 clients made
about 500 such lines and 186 clients were closed unanswered. On ``ENFILE``, ``ENOBUFS``,
``ENOMEM``, or ``EMFILE`` once the reserve is gone, it logs "Could not accept new connection"
and returns with the socket still readable, so the reactor calls it straight back: a busy loop
with a line per turn. No hook sees an accept's result, so ``guard_accepts`` replaces the port's
listening ``socket`` (public, but read inside ``doRead``) with one whose ``accept`` consults
``core.acceptguard`` first, and wraps the port's ``connectionLost`` so the guard's timer ends
with the port (docs/decisions.md#descriptor-limit). No upstream ticket found: the reserved
descriptor is Twisted's deliberate design; what we change is how a proxy should treat the
clients beyond the limit (wait in the backlog, not be closed). Delete it when ``Port`` lets a
caller pause accepting on exhaustion.

Five more upstream behaviours of ``HTTPChannel`` are worked around in ``server.BoundedChannel``
through public hooks (``lineReceived``, ``headerReceived``, ``checkPersistence``), none private
(the framings refused are listed with their reasons in docs/decisions.md#request-framing):

- the request target: ``_parseRequestLine`` accepts any printable target and ``Request`` keeps
  it as ``uri``, so ``7/api/version``, ``*`` or an absolute URL reached the resource as is, and
  a ``#fragment`` stayed in ``request.path``. A proxy that appended that to a node's origin
  dialled another port, and classified a path the engine never saw. BoundedChannel rewrites
  the request line to the origin-form path we send (``target.py``) or answers 400.
- ``Transfer-Encoding``: ``_maybeChooseTransferDecoder`` ignores ``identity`` (a request with
  it and no length has no body, so its body is read as the next request) and accepts it
  before ``chunked``. RFC 9112 6.3 wants anything but a single final ``chunked`` refused: 400
  and a close.
- control characters: ``headerReceived`` refuses CR, LF and NUL in a field but keeps every
  other control character, a vertical tab or form feed included, and the proxy forwarded it;
  a strict parser (h11) refuses the line, others read it as whitespace. RFC 9110 5.5 makes
  them invalid: 400 and a close.
- obsolete line folding: ``lineReceived`` joins a folded line to the header before it, so
  ``Content-Length:\r\n 68`` framed a 68-byte body where a parser that does not unfold reads
  an empty length. A folded ``Content-Length`` or ``Transfer-Encoding`` is answered 400 and
  a close; other folded headers are unfolded (RFC 9112 5.2 allows either).
- ``Connection``: ``checkPersistence`` splits the first ``Connection`` line on spaces, so
  ``close, te`` (the token read as ``close,``) kept the connection open for a pipelined next
  request. Ours reads every line as the comma-separated list RFC 9110 7.6.1 defines.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet import tcp
from twisted.web.http import HTTPChannel
from twisted.web.server import Request


def channel_paused(request: Request) -> bool:
    """Whether the client connection has asked the request's channel to stop producing (and
    not yet to resume): a producer registered now must be paused by its registrant."""
    return request.channel is not None and bool(request.channel._waitingForTransport)


def trailer_lines(channel: HTTPChannel) -> list[bytes]:
    """The trailer section's lines of the chunked request body just read, as received: empty
    when the body was not chunked. Valid only until the channel's ``allContentReceived`` runs."""
    decoder = getattr(channel, "_transferDecoder", None)
    return [bytes(line) for line in getattr(decoder, "_trailerHeaders", ())]


def guard_accepts(port: tcp.Port, wrap: Callable[[Any], Any], on_close: Callable[[], None]) -> None:
    """Route a listening port's accepts through ``wrap(its socket)``; ``on_close`` runs when
    the port stops listening."""
    port.socket = wrap(port.socket)
    lost = port.connectionLost

    def connection_lost(reason) -> None:
        on_close()
        lost(reason)

    port.connectionLost = connection_lost  # type: ignore[method-assign]
