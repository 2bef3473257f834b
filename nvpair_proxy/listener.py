"""One port per facade, demultiplexed on the connection's first byte (spec 7, design 1).

``0x16`` (a TLS ClientHello) goes to the mutual-TLS ingress when this node is a cluster
member; anything else is plaintext HTTP, served only to loopback peers. A LAN peer speaking
plaintext still gets an HTTP answer (403 ``loopback-only``) rather than a silent close, so a
misconfigured client learns why. The gate ships with the first listener: never an open relay.
"""

from __future__ import annotations

from typing import Callable

from twisted.internet.interfaces import IAddress
from twisted.internet.protocol import Factory, Protocol, ServerFactory
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from .answers import LOOPBACK_ONLY, send_error
from .constants import SERVER_HEADER_READ_TIMEOUT
from .deadline import expect_request_line
from .logs import logger
from .discovery import is_loopback
from .facade import BoundedRequest, report_rejection

TLS_HANDSHAKE = 0x16

log = logger()


class LoopbackOnly(Resource):
    """What a non-loopback plaintext peer gets, whatever it asked (preflights included)."""

    isLeaf = True

    def __init__(self, facade=None) -> None:
        super().__init__()
        self.facade = facade

    def render(self, request: Request):
        code, text = LOOPBACK_ONLY
        if self.facade is not None:
            report_rejection(self.facade, request.method, request.path, 403, code)
        send_error(request, 403, text, code=code)
        return NOT_DONE_YET


class _Demux(Protocol):
    def __init__(self, factory: "DemuxFactory", addr: IAddress) -> None:
        self.factory, self.addr = factory, addr
        self.inner: Protocol | None = None
        self.timer = None

    def connectionMade(self) -> None:
        # Until a request line arrives (after a TLS handshake, if any): one header read.
        self.timer = self.factory.clock.callLater(SERVER_HEADER_READ_TIMEOUT,
                                                  self.transport.abortConnection)
        expect_request_line(self.transport, self._stop_timer)

    def _stop_timer(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None

    def dataReceived(self, data: bytes) -> None:
        if self.inner is None:
            try:
                inner = self.factory.choose(data[0], self.addr)
                if inner is not None:
                    inner.makeConnection(self.transport)
            except Exception:
                log.failure("could not accept a connection from {peer}", peer=self.addr)
                inner = None
            if inner is None:
                self._stop_timer()
                self.transport.abortConnection()
                return
            self.inner = inner
        self.inner.dataReceived(data)

    def connectionLost(self, reason: Failure) -> None:
        self._stop_timer()
        if self.inner is not None:
            self.inner.connectionLost(reason)


class DemuxFactory(ServerFactory):
    """Builds the per-connection demultiplexer over a facade's Site.

    ``tls`` is a factory for the mTLS ingress, or a callable returning None while this node
    is not a cluster member (then a ClientHello is refused by closing).
    """

    noisy = False

    def __init__(self, site: Site, gate: Site | None = None,
                 tls: Callable[[], Factory | None] = lambda: None) -> None:
        self.site = site
        self.clock = site.reactor
        self.gate = gate or _gate_site(site)
        self.tls = tls

    def buildProtocol(self, addr: IAddress) -> Protocol:
        return _Demux(self, addr)

    def choose(self, first: int, addr: IAddress) -> Protocol | None:
        if first == TLS_HANDSHAKE:
            tls = self.tls()
            return tls.buildProtocol(addr) if tls is not None else None
        if is_loopback(getattr(addr, "host", "")):
            return self.site.buildProtocol(addr)
        return self.gate.buildProtocol(addr)


def _gate_site(site: Site) -> Site:
    """The same limits as the facade (body size, header read, idle), a 403 for everything."""
    gate = Site(LoopbackOnly(getattr(site.resource, "facade", None)), timeout=site.timeOut,
                reactor=site.reactor)
    gate.requestFactory = BoundedRequest
    gate.noisy = False
    return gate


def listen_everywhere(reactor, port: int, factory: ServerFactory, interface: str = "::"):
    """Listen on every address, IPv4 and IPv6 (dual stack), else IPv4 only."""
    from twisted.internet.error import CannotListenError
    try:
        return reactor.listenTCP(port, factory, interface=interface)
    except CannotListenError as exc:
        if interface != "::" or "Address family not supported" not in str(exc.socketError):
            raise
        return reactor.listenTCP(port, factory, interface="0.0.0.0")
