"""The HTTP server side of every port, built on Twisted's public hooks
(docs/references.md#proxy-answers, #server-timeouts).

A client gets no more time and no more memory than a well-behaved one needs, so a peer that
trickles cannot hold a connection for the 90 s idle timeout and one that floods cannot fill
the disk:

- the request line must be complete 10 s after the connection was accepted, a TLS handshake
  included. The listener's demux runs that deadline, because only it is there from accept and
  through the handshake; the channel ends it, because only the channel sees the request line.
  The demux hands its callback to the channel it builds (``expect_request_line``).
- the headers must follow within 10 s of each request line (the channel);
- the body may not exceed 32 MiB (the request): 413 at once, nothing of the excess kept.

And it reads a request's target and framing one way only, the way an engine behind us and a
front end before us would (twisted_workarounds lists what twisted.web does otherwise):

- the target becomes the origin-form path we send and classify (target.py); one that has none
  is answered 400 and the connection closes;
- ``Transfer-Encoding`` other than a single ``chunked`` is answered 400 and the connection
  closes (RFC 9112 6.3), so no byte of a body can be read as a request of its own;
- a control character other than HTAB in a header field (RFC 9110 5.5), a ``Content-Length`` or
  ``Transfer-Encoding`` continued by obsolete line folding (RFC 9112 5.2), and a trailer line
  that is no field line or names a framing header (RFC 9112 7.1.2) are answered 400 and the
  connection closes: each is read one way by twisted.web and another by a strict parser
  (docs/decisions.md#request-framing);
- ``Connection`` is a comma-separated list: ``close, te`` closes the connection after the answer.

The Site builds this channel through its ``protocol`` attribute and is given, by whoever builds
the Site, the reporter a 413 goes to, so a request never looks for the facade it belongs to.
"""

from __future__ import annotations

import re
from typing import Callable

from twisted.internet.interfaces import IAddress, IDelayedCall, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from ..core import constants
from ..core.interfaces import IConductor
from ..core.logs import log_access
from ..core.timers import cancel_pending
from ..core.twisted_workarounds import trailer_lines
from .answers import BODY_TOO_LARGE, Reason, raw_error
from .target import BadTarget, origin_form

# method, request target (query included), status, reason, its detail
Rejected = Callable[..., None]

# What a header field may not hold: a control character other than HTAB (RFC 9110 5.5). CR, LF
# and NUL twisted.web refuses itself; a vertical tab or form feed it keeps, and forwards.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# A field line (RFC 9110 5.1): a token, a colon, a value; for trailer lines, which twisted.web
# keeps unread.
_FIELD_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[^\x00-\x08\x0a-\x1f\x7f]*")
_FRAMING = (b"content-length", b"transfer-encoding")


def _not_reported(
    method: bytes, target: bytes, status: int, reason: Reason, detail: str = ""
) -> None:
    """A Site built without a reporter: the 413 is still answered, only not reported."""


class BoundedChannel(HTTPChannel):
    """An HTTP/1.1 connection that ends the accept deadline and runs the header deadline.

    Only the connection's first request line ends the accept deadline; after a response, the
    wait for the next request is the Site's idle timeout. Every request line starts a header
    deadline, ended by the blank line that closes the headers.
    """

    header_timeout = constants.SERVER_HEADER_READ_TIMEOUT
    # Set before any of our code runs: the Site sets ``site`` as it builds the channel, and
    # the methods below run only while connected, over TCP or TLS (both abort).
    site: BoundedSite
    transport: ITCPTransport

    def __init__(self) -> None:
        super().__init__()
        # Method and target of the request being read, for a 413 given before Twisted sets
        # them on the request (it does so only once the whole body has arrived).
        self.request_line: tuple[bytes, bytes] = (b"", b"")
        self._between_requests = True
        self._request_line_seen: Callable[[], None] | None = None
        self._header_timer: IDelayedCall | None = None
        self._refused = False
        # Whether the last header line read was Content-Length or Transfer-Encoding, which an
        # obs-fold may not continue.
        self._framing_line = False
        self._host: IAddress | None = None
        self._peer: IAddress | None = None
        #: The process drains (``drain``): each request is answered with Connection: close.
        self.draining = False

    def getHost(self) -> IAddress:
        """This connection's local address, read once: twisted.web asks for it with every
        request (``Request.__init__``), and a TCP transport asks the kernel each time
        (getsockname(2)), which was 4 % of a proxied keep-alive request's CPU."""
        host = self._host
        if host is None:
            host = self._host = self.transport.getHost()
        return host

    def getPeer(self) -> IAddress:
        """The client's address, made once per connection (a TCP transport builds a new
        address object each time it is asked, once per request)."""
        peer = self._peer
        if peer is None:
            peer = self._peer = self.transport.getPeer()
        return peer

    def expect_request_line(self, seen: Callable[[], None]) -> None:
        """Call ``seen`` once, when the connection's first request line is complete."""
        self._request_line_seen = seen

    def lineReceived(self, line: bytes) -> None:
        if self._refused:
            return
        # Twisted skips one blank line before a request, and ignores everything after a
        # request that closes the connection: neither is a request line.
        request_line = self._between_requests and line != b"" and self.persistent
        if request_line:
            self._between_requests = False
            rewritten = self._got_request_line(line)
            if rewritten is None:
                return
            line = rewritten
        elif not self._between_requests and line:
            if line[:1] in (b" ", b"\t"):
                if self._framing_line:
                    self.refuse(Reason.BAD_FRAMING, "a folded Content-Length or Transfer-Encoding")
                    return
            else:
                self._framing_line = line.partition(b":")[0].lower() in _FRAMING
        super().lineReceived(line)

    def _got_request_line(self, line: bytes) -> bytes | None:
        """The request line with its target in origin form, or None when it was refused."""
        parts = line.split(b" ")
        if len(parts) == 3:
            method, target, version = parts
            self.request_line = (method, target)
            try:
                path = origin_form(method, target)
            except BadTarget as why:
                self.refuse(Reason.BAD_TARGET, str(why))
                return None
            if path != target:
                line = b" ".join((method, path, version))
                self.request_line = (method, path)
        seen, self._request_line_seen = self._request_line_seen, None
        if seen is not None:
            seen()
        self._header_timer = self.callLater(self.header_timeout, self._headers_too_slow)
        return line

    def headerReceived(self, line: bytes) -> bool:
        name, colon, value = line.partition(b":")
        # Length first: most header lines are decided without lower-casing their name.
        if (
            colon
            and len(name) == 17
            and name.lower() == b"transfer-encoding"
            and value.strip(b" \t").lower() != b"chunked"
        ):
            self.refuse(Reason.BAD_FRAMING, "a transfer coding other than a single chunked")
            return False
        if _CONTROL.search(line):
            self.refuse(Reason.BAD_FRAMING, "a control character in a header field")
            return False
        return super().headerReceived(line)

    def drain(self) -> None:
        """The process is stopping gracefully: close the connection now when it is idle
        between requests, else once the request it serves (and any it already read) has
        been answered, each answer saying ``Connection: close`` if its head is not sent yet
        (docs/operations.md#restarts)."""
        self.draining = True
        if not self.requests and self._between_requests:
            self.transport.loseConnection()
            return
        self.persistent = False
        for request in self.requests:
            if not request.startedWriting:
                request.responseHeaders.setRawHeaders(b"Connection", [b"close"])

    def checkPersistence(self, request: Request, version: bytes) -> bool:
        """Twisted's, but ``Connection`` read as the comma-separated list it is; none while
        the process drains."""
        if self.draining:
            request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
            return False
        tokens = {
            token.strip().lower()
            for value in request.requestHeaders.getRawHeaders(b"connection", ())
            for token in value.split(b",")
        }
        if version != b"HTTP/1.1":
            return False
        if b"close" in tokens:
            request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
            return False
        return True

    def refuse(self, reason: Reason, detail: str) -> None:
        """400 with the body of the proxy's own answers (docs/references.md#proxy-answers),
        reported, and the connection closed: nothing after a head we will not read can be trusted to
        be where it seems."""
        self._refused = True
        self._stop_header_timer()
        method, target = self.request_line
        self.site.on_rejected(method, target, 400, reason, detail)
        self.transport.write(raw_error(400, reason.says(detail)))
        self.transport.loseConnection()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self.transport.abortConnection()

    def _stop_header_timer(self) -> None:
        cancel_pending(self._header_timer)
        self._header_timer = None

    def allHeadersReceived(self) -> None:
        self._stop_header_timer()
        super().allHeadersReceived()

    def allContentReceived(self) -> None:
        # Before the request is processed: a pipelined request may be parsed from inside it.
        self._between_requests = True
        self._framing_line = False
        for line in trailer_lines(self):
            if not _FIELD_LINE.fullmatch(line) or line.partition(b":")[0].lower() in _FRAMING:
                # The request is never processed: a line a strict parser refuses, or one that
                # reads as a request line to a front end that ended the body at ``0\r\n``.
                self.refuse(Reason.BAD_FRAMING, "a trailer line that is not a field")
                return
        super().allContentReceived()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_header_timer()
        super().connectionLost(reason)


class BoundedRequest(Request):
    """A request whose body may not exceed 32 MiB (docs/references.md#body-limit), chunked bodies
    included.

    twisted.web has no limit of its own and reads the body before ``render``; over the limit
    we answer 413 at once, close, and keep none of the excess.

    ``client_gone`` turns true when the client leaves before the response is finished, as
    ``notifyFinish`` reports it, so whoever answers later knows not to write to nobody.
    ``conduct`` names the one object told of the end instead, without a Deferred per request
    (docs/references.md#bare-proxy-cpu): it hears ``response_finished`` or ``client_gone``,
    once, and is let go of then.
    """

    max_body = constants.MAX_REQUEST_BODY
    channel: BoundedChannel  # what a BoundedSite's channels build (``requestFactory``)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client_gone = False
        self._received = 0
        self._rejected = False
        self._conductor: IConductor | None = None
        #: The digest naming the client for fair share, when something read it before the
        #: request reached its facade (the LAN key gate, which removes the key it admitted).
        self.client_digest: bytes | None = None

    def conduct(self, conductor: IConductor) -> None:
        """Tell ``conductor`` how this request's response ends."""
        self._conductor = conductor

    def finish(self) -> None:
        super().finish()
        conductor, self._conductor = self._conductor, None
        if conductor is not None:
            conductor.response_finished()

    def connectionLost(self, reason: Failure) -> None:
        # What notifyFinish reports as an error, without a Deferred per request
        # (docs/references.md#bare-proxy-cpu).
        gone = not self.finished
        if gone:
            self.client_gone = True
        conductor, self._conductor = self._conductor, None
        if self.producer is not None and self.channel is not None:
            # Nothing can be produced for a connection that is gone: the producer (a
            # request's stream, which names this request) is let go of here, by the request
            # and its channel, rather than kept while they live.
            self.unregisterProducer()
        super().connectionLost(reason)
        if gone and conductor is not None:
            conductor.client_gone()

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self.max_body:
            self._reject()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._rejected:
            return
        self._received += len(data)
        if self._received > self.max_body:
            self._reject()
            return
        super().handleContentChunk(data)

    def process(self):
        if self._rejected:
            return
        return super().process()

    def _reject(self) -> None:
        self._rejected = True
        self.content = None
        # Answered now, so no "100 Continue" may follow the final answer.
        self.requestHeaders.removeHeader(b"expect")
        method, target = self.channel.request_line
        self.channel.site.on_rejected(method, target, 413, Reason.BODY_TOO_LARGE)
        transport = self.channel.transport
        transport.write(raw_error(413, BODY_TOO_LARGE))
        transport.loseConnection()


class BoundedSite(Site):
    """A Site whose connections are BoundedChannels carrying BoundedRequests.

    ``on_rejected`` receives the answers given before a request reaches a resource (the 413),
    as ``(method, target, status, error)``.
    """

    # Twisted types ``protocol`` as its HTTP/1.1-or-2 wrapper; ours serves HTTP/1.1 only.
    protocol = BoundedChannel  # type: ignore[assignment]
    requestFactory = BoundedRequest
    displayTracebacks = False
    noisy = False

    def __init__(
        self,
        resource: IResource,
        *,
        reactor,
        timeout: float | None,
        on_rejected: Rejected = _not_reported,
    ) -> None:
        # We never read request.args: parsing a POST's Content-Type through the email
        # package cost a fifth of a request's CPU (the profile behind
        # docs/references.md#bare-proxy-cpu).
        super().__init__(resource, timeout=timeout, reactor=reactor, parsePOSTFormSubmission=False)
        self.on_rejected = on_rejected

    def log(self, request: http.Request) -> None:
        """twisted.web's per-request line: off unless ``--access-log`` (logs.py)."""
        log_access(request)
