"""One port per facade, demultiplexed on the connection's first byte
(docs/references.md#listener-personalities).

``0x16`` (a TLS ClientHello) goes to the mutual-TLS ingress when this node is a cluster
member; anything else is plaintext HTTP, served only to loopback peers. A LAN peer speaking
plaintext still gets an HTTP answer (403 ``loopback-only``) rather than a silent close, so a
misconfigured client learns why. The gate ships with the first listener: never an open relay.
With opt-in API keys (``apikeys.py``) the gate serves a LAN request that presents a valid key
as it serves loopback, and answers the others 403 or 401 (docs/references.md#lan-keys).
"""

from __future__ import annotations

from typing import Callable, cast

from twisted.internet.interfaces import IAddress, ITCPTransport
from twisted.internet.protocol import Protocol, ServerFactory, connectionDone
from twisted.protocols.policies import WrappingFactory
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from ..core.acceptguard import listen_tcp
from ..core.constants import SERVER_HEADER_READ_TIMEOUT
from ..core.logs import logger
from ..core.timers import cancel_pending
from ..core.validate import is_loopback
from ..http.answers import send_error
from ..http.server import BoundedChannel, BoundedRequest, BoundedSite, Rejected
from ..lan.apikeys import LanGate, Verdict, answer_for
from ..routing.clients import client_of

TLS_HANDSHAKE = 0x16

log = logger()


class LoopbackOnly(Resource):
    """What a non-loopback plaintext peer gets, whatever it asked (preflights included):
    403, or with LAN keys configured, the facade (``serve``) when a valid key came along."""

    isLeaf = True

    def __init__(
        self, on_rejected: Rejected, lan: LanGate | None = None, serve: Resource | None = None
    ) -> None:
        super().__init__()
        self.on_rejected, self.lan, self.serve = on_rejected, lan, serve

    def render(self, request: BoundedRequest):
        verdict = Verdict.LOOPBACK_ONLY
        if self.lan is not None:
            verdict = self.lan.decide(request.getClientAddress().host, request.requestHeaders)
        refusal = answer_for(verdict)
        if refusal is None:  # only a LanGate lets a LAN peer through
            assert self.lan is not None and self.serve is not None
            request.client_digest = client_of(request)  # named by its key, which goes now
            self.lan.admit(request.requestHeaders)
            return self.serve.render(request)
        status, reason, text, challenge = refusal
        self.on_rejected(request.method, request.path, status, reason)
        if challenge is not None:
            request.responseHeaders.setRawHeaders(b"WWW-Authenticate", [challenge])
        send_error(request, status, text, code=reason.text)
        return NOT_DONE_YET


class _Demux(Protocol):
    """One accepted connection until its first byte, then the protocol that byte chose.

    It runs the accept deadline (docs/references.md#server-timeouts: a complete request line within
    10 s of accept, a TLS handshake included) on the accepted transport, the only one that exists
    before the handshake, and hands the HTTP channel it builds the callback that ends it.
    """

    transport: ITCPTransport  # the accepted TCP connection, before any TLS

    def __init__(self, factory: "DemuxFactory", addr: IAddress | None) -> None:
        self.factory, self.addr = factory, addr
        self.inner: Protocol | None = None
        #: The HTTP channel the first byte chose (under TLS, the one the TLS layer wraps).
        self.channel: BoundedChannel | None = None
        self.timer = None

    def connectionMade(self) -> None:
        self.factory.connections.add(self)
        # Until a request line arrives (after a TLS handshake, if any): one header read.
        self.timer = self.factory.clock.callLater(
            SERVER_HEADER_READ_TIMEOUT, self.transport.abortConnection
        )

    def drain(self) -> None:
        """The process drains: a connection is served what it asks, then closed. One just
        accepted, that has sent nothing yet, is a client about to ask (it connected before
        the port closed): its first request is served too (``dataReceived`` marks its channel
        draining), within the header deadline that bounds any connection's first request."""
        if self.channel is not None:
            self.channel.drain()

    def _stop_timer(self) -> None:
        cancel_pending(self.timer)
        self.timer = None

    def dataReceived(self, data: bytes) -> None:
        if self.inner is None:
            try:
                inner, self.channel = self.factory.choose(data[0], self.addr, self._stop_timer)
                if inner is not None:
                    inner.makeConnection(self.transport)
                    if self.factory.draining and self.channel is not None:
                        self.channel.draining = True
            except Exception:
                log.failure("could not accept a connection from {peer}", peer=self.addr)
                inner = None
            if inner is None:
                self._stop_timer()
                self.transport.abortConnection()
                return
            self.inner = inner
        self.inner.dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.factory.connections.discard(self)
        self._stop_timer()
        if self.inner is not None:
            self.inner.connectionLost(reason)


class DemuxFactory(ServerFactory):
    """Builds the per-connection demultiplexer over a facade's Site.

    ``tls`` returns the mTLS ingress (a TLS factory wrapping a BoundedSite), or None while
    this node is not a cluster member (then a ClientHello is refused by closing).
    """

    noisy = False

    def __init__(
        self,
        site: BoundedSite,
        tls: Callable[[], WrappingFactory | None] = lambda: None,
        lan: LanGate | None = None,
    ) -> None:
        self.site = site
        self.clock = site.reactor
        self.gate = _gate_site(site, lan)
        self.tls = tls
        #: Every open connection, so a drain can close the idle ones and finish the others.
        self.connections: set[_Demux] = set()
        self.draining = False

    def buildProtocol(self, addr: IAddress | None) -> Protocol:
        return _Demux(self, addr)

    def drain(self) -> None:
        """The process stops gracefully (docs/operations.md#restarts): idle connections
        close now, busy ones after their answers."""
        self.draining = True
        for connection in list(self.connections):
            connection.drain()

    def choose(
        self, first: int, addr: IAddress | None, request_line_seen: Callable[[], None]
    ) -> tuple[Protocol | None, BoundedChannel | None]:
        """The protocol for a connection whose first byte is ``first``, and its HTTP
        channel, which calls ``request_line_seen`` at its first request line."""
        if first == TLS_HANDSHAKE:
            tls = self.tls()
            if tls is None:
                return None, None
            protocol = tls.buildProtocol(addr)
            # The TLS layer wraps the ingress's channel, which its BoundedSite built.
            channel = cast(BoundedChannel, protocol.wrappedProtocol)
        elif is_loopback(getattr(addr, "host", "")):
            protocol = channel = self.site.buildProtocol(addr)
        else:
            protocol = channel = self.gate.buildProtocol(addr)
        channel.expect_request_line(request_line_seen)
        return protocol, channel


def _gate_site(site: BoundedSite, lan: LanGate | None) -> BoundedSite:
    """The same limits as the facade (body size, header read, idle), a 403 for everything
    (or the facade behind a valid key), reported where the facade's own refusals go."""
    return BoundedSite(
        LoopbackOnly(site.on_rejected, lan, site.resource),
        reactor=site.reactor,
        timeout=site.timeOut,
        on_rejected=site.on_rejected,
    )


def listen_everywhere(reactor, port: int, factory: ServerFactory, interface: str = "::"):
    """Listen on every address, IPv4 and IPv6 (dual stack), else IPv4 only."""
    from twisted.internet.error import CannotListenError

    try:
        return listen_tcp(reactor, port, factory, interface, "facade")
    except CannotListenError as exc:
        if interface != "::" or "Address family not supported" not in str(exc.socketError):
            raise
        return listen_tcp(reactor, port, factory, "0.0.0.0", "facade")
