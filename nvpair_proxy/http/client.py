"""The proxy's HTTP/1.1 client for engines and peers: an ``IAgent`` with its own keep-alive pool.

Why not ``twisted.web.client.Agent``, which twisted-notes recommends and which served until
the CPU work (docs/references.md#bare-proxy-cpu): in a profile of a proxied JSON request
(``bench/overhead``, C=16) Agent's own per-request machinery was about a third of the proxy's CPU,
and its response parser another tenth: the URI parsed through ``urllib``, a fresh endpoint per
request with the host IDNA-encoded, a chain of Deferreds, a timer per idle connection, and a head
read line by line through a state dispatcher. This client does the same job for what engines and
peers speak:

- an endpoint per origin, made once (TLS through the same ``IPolicyForHTTPS`` Agent takes,
  asked at every new connection; TCP keepalive on every connection, ``KeepAliveEndpoint``);
- the request head and an in-memory body written in one call (any other producer's body is
  read whole first, so a connection never carries a request half written);
- the response head parsed in one pass (``responsewire``) and the body handed straight on;
- one timer per pool for idle connections, not one per connection (``pool.py``); idle
  connections are aborted, never closed gracefully (over TLS that waits on the peer);
- a request written is never written again (docs/decisions.md#sent-once): a pooled
  connection is used only while its server still keeps it, as far as can be known before
  writing (its ``Keep-Alive`` timeout, a peek at its socket), and one that carried a stream is
  pooled only after the stream's end was told, never to the request that end wakes.

What the attempt relies on is kept exactly: ``IAgent`` and ``IResponse``; connect errors as
the endpoint raises them; ``ResponseNeverReceived`` before any response byte,
``ResponseFailed`` after, ``ResponseDone`` or ``PotentialDataLoss`` for a body that ended as
framed; cancellation; and no automatic retry (the pools had ``retryAutomatically`` off).
"""

from __future__ import annotations

import enum
import math
import socket
from typing import Callable, cast

from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.interfaces import (
    IConsumer,
    IPushProducer,
    IStreamClientEndpoint,
    ITCPTransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    BrowserLikePolicyForHTTPS,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import (
    UNKNOWN_LENGTH,
    IAgent,
    IBodyProducer,
    IClientRequest,
    IPolicyForHTTPS,
    IResponse,
)
from zope.interface import implementer

from ..core import constants
from ..core.memo import Memo
from .pool import ConnectionPool
from .requestbody import BytesProducer
from .responsewire import (
    CHUNKED,
    LENGTH,
    MAX_HEAD,
    UNTIL_CLOSE,
    ChunkedBody,
    WireError,
    body_framing,
    find_head_end,
    keep_alive_for,
    parse_head,
    persistent,
)

# Headers the client writes itself: the caller's are not relayed (a body is framed by us,
# and whether the connection persists is ours to say). A caller's Host is kept, as Agent does.
_OURS = frozenset({b"Content-Length", b"Transfer-Encoding", b"Connection"})


# How every body that ended as framed ends: one value, made once (a Failure per response was a
# measurable share of a request's CPU). It carries no traceback, and nothing it is handed to
# changes it: consumers only ask what it is (``relay.clean_end``).
_BODY_DONE = Failure(ResponseDone("Response body fully received"))


class State(enum.Enum):
    """Where a connection is in carrying one exchange at a time, and what moves it on.

    - ``CONNECTING``: the endpoint is dialling. ``connectionMade`` moves it to ``IDLE``.
    - ``IDLE``: connected and carrying nothing, just made or in the pool. ``send`` moves it
      to ``WAITING``. A byte from the server moves it to ``CLOSED`` (a server that speaks
      out of turn is not trusted with another request), as does ``close_idle`` (the pool's
      cap or timer) and the connection's loss, which also takes it out of the pool.
    - ``WAITING``: a request is written and no byte of its response came yet. The first byte
      moves it to ``HEAD``; a cancel, or the connection's loss (``ResponseNeverReceived``),
      to ``CLOSED``.
    - ``HEAD``: the response head is arriving, interim (1xx) answers included. A whole final
      head moves it to ``BODY`` as the response is handed to the caller; a head that cannot
      be framed, a cancel, or the connection's loss (``ResponseFailed``) to ``CLOSED``.
    - ``BODY``: the body is read and handed on. Its framed end moves it to ``IDLE`` and back
      to the pool if the response lets the connection persist and no byte followed (after
      a chunked body only once its end was told, and not at all for an origin that closes
      after streams), else to ``CLOSED``; so do broken framing (``ResponseFailed``) and the
      connection's loss (the
      end of a body framed by the close: ``PotentialDataLoss``; of any other,
      ``ResponseFailed``). The consumer's ``stopProducing`` moves it to ``STOPPED``.
    - ``STOPPED``: the consumer wanted no more, so the connection was aborted and nothing
      more is read. Its loss moves it to ``CLOSED`` and ends the body (``ResponseFailed``,
      whatever the framing: the body did not end as framed).
    - ``CLOSED``: aborted by the client, or lost; final. Nothing is read or sent once
      aborted, though the loss may still be on its way.
    """

    CONNECTING = "connecting"
    IDLE = "idle"
    WAITING = "waiting"
    HEAD = "head"
    BODY = "body"
    STOPPED = "stopped"
    CLOSED = "closed"


# Module names, read per chunk without an attribute lookup; compared with ``is``.
CONNECTING, IDLE, WAITING, HEAD, BODY, STOPPED, CLOSED = State

# A server that closes an idle connection this soon after a streamed answer ended closes
# after streams (llama-server does, at once); a keep-alive timeout is seconds at least.
STREAM_CLOSE_WINDOW = 1.0

# A look at an idle socket that reads nothing and never blocks (``_Connection.peer_gone``).
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT

# Origins remembered; a fleet has a handful, so reaching this means something churns.
_MAX_ORIGINS = 4096
# Request URIs remembered with their origin and target (query strings make more of them).
_MAX_ROUTES = 4096


class Origin:
    """Where requests to one ``scheme://host:port`` go: made once, reused by every request.

    For https the TLS connection creator is asked of the policy at every new connection, as
    Agent did: the pinned-peer policy reads this node's current identity then (trust.py).
    """

    __slots__ = ("key", "host", "port", "host_header", "tcp", "tls", "factory")

    def __init__(
        self,
        key: tuple,
        host: bytes,
        port: int,
        host_header: bytes,
        tcp,
        tls: IPolicyForHTTPS | None,
        pool: "ConnectionPool",
    ) -> None:
        self.key, self.host, self.port, self.host_header = key, host, port, host_header
        self.tcp, self.tls = tcp, tls
        self.factory = _ConnectionFactory(pool, key)

    def endpoint(self):
        if self.tls is None:
            return self.tcp
        return wrapClientTLS(self.tls.creatorForNetloc(self.host, self.port), self.tcp)


@implementer(IAgent)
class Client:
    """``IAgent.request`` over pooled HTTP/1.1 connections (see the module docstring)."""

    def __init__(
        self,
        reactor,
        pool: "ConnectionPool | None" = None,
        *,
        connect_timeout: float = constants.DIAL_TIMEOUT,
        tls: IPolicyForHTTPS | None = None,
        keepalive: float = 0.0,
    ) -> None:
        self.reactor, self.connect_timeout, self.keepalive = reactor, connect_timeout, keepalive
        self.pool = pool if pool is not None else ConnectionPool(reactor)
        self.tls = tls
        self._origins: Memo[bytes, Origin] = Memo(_MAX_ORIGINS)
        self._routes: Memo[bytes, tuple[Origin, bytes]] = Memo(_MAX_ROUTES)

    def request(
        self,
        method: bytes,
        uri: bytes,
        headers: Headers | None = None,
        bodyProducer: IBodyProducer | None = None,
    ) -> Deferred:
        if bodyProducer is not None and not isinstance(bodyProducer, BytesProducer):
            return self._read_body_first(method, uri, headers, bodyProducer)
        origin, path = self._route(uri)
        outgoing = Outgoing(
            method,
            uri,
            path,
            origin.host_header,
            headers,
            bodyProducer.body if bodyProducer else None,
        )
        connection = self._pooled(origin.key)
        dial = _Dial()
        result: Deferred[IResponse] = Deferred(dial.cancel)
        if connection is not None:
            dial.connection = connection
            connection.send(outgoing, result)
            return result
        self._dial(dial, origin, outgoing, result)
        return result

    def _pooled(self, key: tuple) -> "_Connection | None":
        """A pooled connection that can carry a request, or None: dial a new one.

        A request once written is never sent again (docs/decisions.md#sent-once): the engine
        may have read it, and a pull or a generation must not start twice. So what can be
        known before writing is asked here, never after: a connection its server already
        closed, or spoke on unasked, is dropped and the next one tried. (The pool has already
        dropped those past their server's ``Keep-Alive`` timeout.)
        """
        pool = self.pool
        while True:
            # The pool holds only what this client gave it, so it hands back _Connections.
            connection = cast("_Connection | None", pool.take(key))
            if connection is None or not connection.peer_gone():
                return connection
            connection.close_idle()

    def _dial(
        self, dial: "_Dial", origin: Origin, outgoing: "Outgoing", result: Deferred[IResponse]
    ) -> None:
        dial.connection = None
        connecting = dial.connecting = origin.endpoint().connect(origin.factory)
        connecting.addCallbacks(
            dial.connected, dial.failed, callbackArgs=(outgoing, result), errbackArgs=(result,)
        )

    def _read_body_first(
        self, method: bytes, uri: bytes, headers: Headers | None, producer: IBodyProducer
    ) -> Deferred:
        """A body from any other producer is read whole, then sent as an in-memory one: a
        connection never carries a request half written (the proxy's own bodies are already
        in memory; this is for other callers of the IAgent)."""
        self._route(uri)  # a bad URI is refused before anything is produced
        parts: list[bytes] = []
        sending: list[Deferred] = []

        def cancel(_) -> None:
            if sending:
                sending[0].cancel()
            else:
                producer.stopProducing()

        result: Deferred[IResponse] = Deferred(cancel)

        def produced(_) -> None:
            if result.called:
                return
            body = b"".join(parts)
            if producer.length is not UNKNOWN_LENGTH and producer.length != len(body):
                result.errback(
                    Failure(
                        RequestTransmissionFailed(
                            [
                                Failure(
                                    ValueError(
                                        f"the body producer wrote {len(body)} bytes, "
                                        f"not {producer.length}"
                                    )
                                )
                            ]
                        )
                    )
                )
                return
            sent = self.request(method, uri, headers, BytesProducer(body))
            sending.append(sent)
            sent.addCallbacks(
                lambda response: None if result.called else result.callback(response),
                lambda failure: None if result.called else result.errback(failure),
            )

        def failed(failure: Failure) -> None:
            if not result.called:
                result.errback(Failure(RequestTransmissionFailed([failure])))

        producer.startProducing(_Collect(parts)).addCallbacks(produced, failed)
        return result

    def _route(self, uri: bytes) -> tuple[Origin, bytes]:
        """The origin and request target of ``uri``; remembered, since a fleet's requests
        go to a handful of nodes on a handful of routes."""
        routed = self._routes.get(uri)
        if routed is None:
            routed = self._routes.remember(uri, self._split(uri))
        return routed

    def _split(self, uri: bytes) -> tuple[Origin, bytes]:
        start = uri.find(b"://")
        slash = uri.find(b"/", start + 3) if start > 0 else -1
        if slash < 0:
            base, path = uri, b"/"
        else:
            base, path = uri[:slash], uri[slash:]
            if b"#" in path:
                path = path.split(b"#", 1)[0]
            if b" " in path or b"\r" in path or b"\n" in path:
                raise ValueError("a request target cannot contain whitespace")
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origin(base)
        return origin, path

    def _origin(self, base: bytes) -> Origin:
        parsed = URI.fromBytes(base)
        if parsed.scheme not in (b"http", b"https") or not parsed.host:
            raise ValueError(f"unsupported URI {base!r}")
        host, port = parsed.host, parsed.port
        text = host.decode("ascii")
        endpoint: IStreamClientEndpoint
        if isIPv6Address(text):
            endpoint = TCP6ClientEndpoint(self.reactor, text, port, timeout=self.connect_timeout)
            named = b"[" + host + b"]"
        elif isIPAddress(text):
            endpoint = TCP4ClientEndpoint(self.reactor, text, port, timeout=self.connect_timeout)
            named = host
        else:
            endpoint = HostnameEndpoint(self.reactor, host, port, timeout=self.connect_timeout)
            named = host
        if self.keepalive > 0:
            endpoint = KeepAliveEndpoint(endpoint, self.keepalive)
        policy = None
        if parsed.scheme == b"https":
            policy = self.tls if self.tls is not None else BrowserLikePolicyForHTTPS()
        default = (parsed.scheme, port) in ((b"http", 80), (b"https", 443))
        origin = Origin(
            (parsed.scheme, host, port),
            host,
            port,
            named if default else b"%b:%d" % (named, port),
            endpoint,
            policy,
            self.pool,
        )
        return self._origins.remember(base, origin)


@implementer(IStreamClientEndpoint)
class KeepAliveEndpoint:
    """A TCP endpoint whose connections probe an idle peer (under TLS, if any).

    Without it a peer whose host died or whose link was cut after commit holds the request
    until the client gives up: nothing arrives, and a socket without keepalive never asks.
    ``TCP_USER_TIMEOUT`` bounds unacknowledged data the same way (a request sent into a dead
    link, or a body an engine leaves unread that long). A live engine that is merely silent still
    answers the probes;
    ``--stream-idle-timeout`` is for that.
    """

    def __init__(
        self, endpoint, seconds: float, probes: int = constants.UPSTREAM_KEEPALIVE_PROBES
    ) -> None:
        self.endpoint, self.probes = endpoint, probes
        self.seconds = max(1, math.ceil(seconds))

    def connect(self, factory) -> Deferred:
        return self.endpoint.connect(factory).addCallback(self._probe)

    def _probe(self, protocol):
        transport = protocol.transport
        if not ITCPTransport.providedBy(transport):
            return protocol  # in memory (tests): nothing to set
        transport.setTcpKeepAlive(True)
        handle = transport.getHandle()
        for name, value in (
            ("TCP_KEEPIDLE", self.seconds),
            ("TCP_KEEPINTVL", self.seconds),
            ("TCP_KEEPCNT", self.probes),
            ("TCP_USER_TIMEOUT", 1000 * self.seconds * (1 + self.probes)),
        ):
            option = getattr(socket, name, None)
            if option is not None:
                handle.setsockopt(socket.IPPROTO_TCP, option, value)
        return protocol


class Outgoing:
    """One request as the client sends it, made once in ``Client.request`` and handed whole to
    the connection that carries it: its method, absolute URI and origin-form ``path``, the
    Host header its origin gives, the caller's headers and the body (None: none)."""

    __slots__ = ("method", "uri", "path", "host_header", "headers", "body")

    def __init__(
        self,
        method: bytes,
        uri: bytes,
        path: bytes,
        host_header: bytes,
        headers: Headers | None,
        body: bytes | None,
    ) -> None:
        self.method, self.uri, self.path, self.host_header = method, uri, path, host_header
        self.headers, self.body = headers, body


# What a connection has sent before its first request: nothing (a stand-in, never read).
_NOTHING_SENT = Outgoing(b"", b"", b"", b"", None, None)


class _Dial:
    """A request waiting for a new connection: what a cancel has to stop."""

    __slots__ = ("connecting", "connection")

    def __init__(self) -> None:
        self.connecting: Deferred | None = None
        self.connection: _Connection | None = None

    def cancel(self, result: Deferred) -> None:
        if self.connection is not None:
            self.connection.cancel(result)
        elif self.connecting is not None:
            self.connecting.cancel()

    def connected(self, connection: "_Connection", outgoing: "Outgoing", result: Deferred) -> None:
        self.connecting = None
        if result.called:
            # Cancelled while dialling: never used, so nothing says how long its server keeps
            # it idle; closed rather than pooled for the pool's 90 s.
            connection.close_idle()
            return
        self.connection = connection
        connection.send(outgoing, result)

    def failed(self, failure: Failure, result: Deferred) -> None:
        self.connecting = None
        if not result.called:
            result.errback(failure)


class _ConnectionFactory(Factory):
    noisy = False  # no "Starting factory" line per origin

    def __init__(self, pool: "ConnectionPool", key: tuple) -> None:
        self.pool, self.key = pool, key
        # What this origin's server was seen to do (``_Connection.connectionLost``): close
        # a connection right after a streamed answer, as llama-server does.
        self.closes_after_streams = False

    def buildProtocol(self, addr) -> "_Connection":
        return _Connection(self)


@implementer(IConsumer)
class _Collect:
    """The consumer another producer's body is read into."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def registerProducer(self, producer, streaming) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass


def _socket_of(transport) -> socket.socket | None:
    """The socket under a connection's transport: its own (TCP), the one under it (TLS over
    TCP: ``ProtocolWrapper.transport``), or None (in memory)."""
    for layer in (transport, getattr(transport, "transport", None)):
        handle = getattr(layer, "getHandle", None)
        if handle is not None:
            found = handle()
            if isinstance(found, socket.socket):
                return found
    return None


class _IConnectionTransport(ITCPTransport, IPushProducer):
    """What a connection uses of its transport, for the type checker: a TCP connection's, or
    TLS over one (``ITLSTransport`` is an ``ITCPTransport``); both pause and resume reading."""


class _Connection(Protocol):
    """One connection to an origin: idle in the pool, or carrying one exchange at a time.

    ``state`` is a ``State`` (its docstring says what moves a connection out of each). What
    belongs to one exchange is set only in some states: ``result`` in ``WAITING`` and
    ``HEAD``; ``response`` is the caller's in ``BODY`` and ``STOPPED``, a stand-in otherwise.
    """

    transport: _IConnectionTransport  # set by makeConnection, before connectionMade

    def __init__(self, origin: "_ConnectionFactory") -> None:
        self.origin, self.pool, self.key = origin, origin.pool, origin.key
        self.state = CONNECTING
        self.result: Deferred[IResponse] | None = None
        # A stand-in between responses, so the per-chunk path calls it without a check.
        self.response: ClientResponse | _NoResponse = _NO_RESPONSE
        self.sent: Outgoing = _NOTHING_SENT
        self.head = b""
        self.scanned = 0  # how far into ``head`` the end of the head was already looked for
        self.framing = LENGTH
        self.remaining = 0
        self.chunked = ChunkedBody(_ignore)  # restarted for each chunked response
        # Whether this response lets the connection carry another request: a property of the
        # response, decided by its head and read only at its end, not a step of the exchange.
        self.keep = False
        # How long the server keeps the connection idle, by its ``Keep-Alive`` (less a margin).
        self.keep_for = math.inf
        # When a streamed (chunked) answer ended and left the connection idle: a close by
        # the server soon after says it closes after streams, whether it is still idle then,
        # seen by the peek before a reuse, or carrying the next request unanswered. None once
        # an answer's first byte arrives.
        self.streamed_at: float | None = None
        # Whether the consumer paused the socket: orthogonal to the body's progress, since
        # bytes already read still arrive and the body can end while paused.
        self.paused = False
        self.idle_until = 0.0  # set by the pool
        self.closed: list[Deferred[None]] = []
        self.socket: socket.socket | None = None

    def connectionMade(self) -> None:
        self.state = IDLE
        # Found once: what ``peer_gone`` peeks at before each reuse (None in memory).
        self.socket = _socket_of(self.transport)

    # Sending.

    def send(self, outgoing: "Outgoing", result: Deferred[IResponse]) -> None:
        """Write ``outgoing`` whole, in one call: it is never written again
        (docs/decisions.md#sent-once)."""
        self.state, self.result = WAITING, result
        self.sent = outgoing
        headers, body = outgoing.headers, outgoing.body
        head = [outgoing.method, b" ", outgoing.path, b" HTTP/1.1\r\n"]
        if headers is None or not headers.hasHeader(b"host"):
            head += (b"Host: ", outgoing.host_header, b"\r\n")
        if headers is not None:
            for name, values in headers.getAllRawHeaders():
                if name in _OURS:
                    continue
                for value in values:
                    head += (name, b": ", value, b"\r\n")
        if body is None:
            head.append(b"\r\n")
        else:  # from a BytesProducer: Client.request reads any other body whole first
            head += (b"Content-Length: %d\r\n\r\n" % len(body), body)
        self.transport.writeSequence(head)

    def cancel(self, result: Deferred[IResponse]) -> None:
        """The caller gave up on the response (a deadline, or it left)."""
        if self.result is result:
            self.result = None
            self._close()

    # Receiving.

    def dataReceived(self, data: bytes) -> None:
        state = self.state
        if state is BODY:
            self._body(data)
        elif state is HEAD:
            self._head(data)
        elif state is WAITING:
            self.state, self.streamed_at = HEAD, None
            self._head(data)
        elif state is IDLE:
            # A server that speaks out of turn is not trusted with another request.
            self.pool.forget(self)
            self._close()

    def _head(self, data: bytes) -> None:
        buffer = self.head + data if self.head else data
        position = 0  # where the head being read starts (interim answers come before it)
        while True:
            found = find_head_end(buffer, max(position, self.scanned))
            if found is None:
                if len(buffer) - position > MAX_HEAD:
                    self._unframeable(Failure(WireError("response head too large")))
                    return
                buffer = buffer[position:]
                self.head, self.scanned = buffer, max(0, len(buffer) - 3)
                return
            end, after = found
            self.head, self.scanned = b"", 0
            try:
                if end - position > MAX_HEAD:
                    raise WireError("response head too large")
                head = parse_head(buffer[position:end])
                framing, length = body_framing(head, self.sent.method)
                if head.code == 101 or head.code < 100:
                    raise WireError(f"unexpected status {head.code}")
            except WireError:
                self._unframeable(Failure())
                return
            position = after
            if head.code >= 200:
                break
            if position == len(buffer):  # an interim answer (100, 103): the real one follows
                return
        buffer = buffer[position:]
        keep = self.keep = persistent(head, framing)
        if keep:
            self.keep_for = keep_alive_for(head)
        if framing != LENGTH:
            # A length beside a coding is not this body's (RFC 9112 6.3): never relayed.
            head.fields.pop(b"content-length", None)
        self.framing, self.remaining = framing, length
        # parse_head admits only token names, so Headers takes every field it returns.
        response = self.response = ClientResponse(
            self, head, length if framing == LENGTH else UNKNOWN_LENGTH, self.sent
        )
        if framing == CHUNKED:
            self.chunked.restart(response.data)
        self.state = BODY
        result, self.result = self.result, None
        if result is None:
            # Never: a cancel closes the connection, and a closed one reads nothing.
            raise RuntimeError("a response head read with no request waiting for it")
        result.callback(response)
        if self.state is not BODY:  # the caller stopped the body, or the connection went
            return
        if framing == LENGTH and length == 0:
            self._complete(buffer)
        elif buffer:
            self._body(buffer)

    def _body(self, data: bytes) -> None:
        framing = self.framing
        if framing == LENGTH:
            remaining = self.remaining
            if len(data) < remaining:
                self.remaining = remaining - len(data)
                self.response.data(data)
                return
            self.remaining = 0
            self.response.data(data[:remaining])
            if self.state is BODY:
                self._complete(data[remaining:])
        elif framing == CHUNKED:
            try:
                rest = self.chunked.feed(data)
            except WireError:
                self._broken_body(Failure())
                return
            if rest is not None and self.state is BODY:
                self._complete(rest)
        else:
            self.response.data(data)

    def _complete(self, rest: bytes) -> None:
        """The body ended as framed: back to the pool if the connection may persist.

        After a streamed (chunked) answer the body's end is told first and the connection
        pooled only then, so the request that end wakes (late binding frees a slot and sends
        the next waiter at once) never gets it: llama-server closes its connection right
        after a stream, whatever its headers say, and a request written on it would be lost
        (docs/decisions.md#sent-once). An origin seen doing that is not pooled after streams
        at all.
        """
        response = self._release()
        streamed = self.framing == CHUNKED
        if not self.keep or rest:
            self._close()
        else:
            self.state = IDLE
            if self.paused:
                self.paused = False
                self.transport.resumeProducing()
            if not streamed:
                self.pool.give(self, self.keep_for)
        emptied = self.pool.emptied
        if response is not None:
            response.end(_BODY_DONE)
        if streamed and self.state is IDLE:
            if self.origin.closes_after_streams or self.pool.emptied != emptied:
                self._close()  # or the pool closed every idle connection meanwhile: this too
            else:
                self.streamed_at = self.pool.clock.seconds()
                self.pool.give(self, self.keep_for)

    def _unframeable(self, failure: Failure) -> None:
        result, self.result = self.result, None
        self._close()
        if result is not None and not result.called:
            result.errback(Failure(ResponseFailed([failure])))

    def _broken_body(self, failure: Failure) -> None:
        response = self._release()
        self._close()
        if response is not None:
            response.end(Failure(ResponseFailed([failure])))

    def _release(self) -> ClientResponse | None:
        """Let go of the response whose body is ending: its consumer can no longer touch
        this connection, which may go on to carry someone else's request."""
        response, self.response = self.response, _NO_RESPONSE
        self.chunked.deliver = _ignore
        if isinstance(response, _NoResponse):
            return None
        response.detach()
        return response

    # The consumer's hold on the body (through ``BodyTransport``).

    def pause(self) -> None:
        if not self.paused and self.state is BODY:
            self.paused = True
            self.transport.pauseProducing()

    def resume(self) -> None:
        if self.paused and self.state is BODY:
            self.paused = False
            self.transport.resumeProducing()

    def stop(self) -> None:
        """The consumer wants no more: the connection cannot be reused, so it is aborted."""
        response = self.response
        if self.state is BODY and isinstance(response, ClientResponse):
            self.state = STOPPED
            response.silence()
            self.transport.abortConnection()

    # Closing.

    def _close(self) -> None:
        """Abort, never a graceful close: over TLS that waits for the peer's close_notify,
        which a peer may never send (Twisted's own pool aborts its idle connections too)."""
        if self.state is CLOSED:
            return
        self.state = CLOSED
        self.transport.abortConnection()

    def close_idle(self) -> Deferred[None]:
        """Close a connection the pool held; fires once it is gone."""
        waiter: Deferred[None] = Deferred()
        self.closed.append(waiter)
        self._close()
        return waiter

    def peer_gone(self) -> bool:
        """Whether the server already closed this idle connection, or sent bytes unasked
        (a TLS close_notify among them), though the reactor has not told us yet: a transport
        already closing (the TLS layer closes as it reads a close_notify), or a peek at the
        socket, which reads nothing. A close seen here soon after a stream teaches the origin
        as one seen on the connection's loss would."""
        transport = self.transport
        if getattr(transport, "disconnecting", False):
            gone = True
        else:
            handle = self.socket
            if handle is None:
                return False  # in memory: no socket to ask
            try:
                handle.recv(1, _PEEK)  # b"": closed; bytes: spoke out of turn
                gone = True
            except BlockingIOError:
                return False
            except OSError:
                gone = True  # reset
        self._closed_after_stream()
        return gone

    def _closed_after_stream(self) -> None:
        """The server closed this connection: if that came within ``STREAM_CLOSE_WINDOW`` of
        a stream's end on it, its origin closes after streams."""
        streamed_at = self.streamed_at
        if (
            streamed_at is not None
            and self.pool.clock.seconds() - streamed_at <= STREAM_CLOSE_WINDOW
        ):
            self.origin.closes_after_streams = True

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        state, self.state = self.state, CLOSED
        if state is IDLE:
            self.pool.forget(self)
        if state is IDLE or state is WAITING:
            # Closed by the server (an abort of ours has made it CLOSED already).
            self._closed_after_stream()
        result, self.result = self.result, None
        if result is not None and not result.called:
            # Never sent again (docs/decisions.md#sent-once): the server may have read it.
            wrapper = ResponseFailed if state is HEAD else ResponseNeverReceived
            result.errback(Failure(wrapper([reason])))
        response = self._release()
        if response is not None:
            if self.framing == UNTIL_CLOSE and state is BODY:
                response.end(Failure(PotentialDataLoss()))
            else:
                response.end(Failure(ResponseFailed([reason])))
        closed, self.closed = self.closed, []
        for waiter in closed:
            waiter.callback(None)


@implementer(IClientRequest)
class ClientRequest:
    """The request a response answers (``IResponse.request``), made only when asked for."""

    def __init__(self, method: bytes, absoluteURI: bytes, headers: Headers | None) -> None:
        self.method, self.absoluteURI = method, absoluteURI
        self.headers = headers if headers is not None else Headers()


@implementer(IPushProducer)
class BodyTransport:
    """What a body consumer sees as its transport: pause, resume, stop. Once the body has
    ended every call is a no-op, so a consumer can never touch a connection that went back
    to the pool and carries someone else's request."""

    __slots__ = ("connection",)

    def __init__(self, connection: _Connection) -> None:
        self.connection: _Connection | None = connection

    def pauseProducing(self) -> None:
        if self.connection is not None:
            self.connection.pause()

    def resumeProducing(self) -> None:
        if self.connection is not None:
            self.connection.resume()

    def stopProducing(self) -> None:
        if self.connection is not None:
            self.connection.stop()

    abortConnection = loseConnection = stopProducing


@implementer(IResponse)
class ClientResponse:
    """A response whose body is held until ``deliverBody``, then handed straight on."""

    previousResponse = None

    def __init__(self, connection: _Connection, head, length, sent: "Outgoing") -> None:
        self.version = (b"HTTP", 1, 1 if head.version == b"HTTP/1.1" else 0)
        self.code, self.phrase = head.code, head.phrase
        self.headers = Headers(head.fields)
        self.length = length
        self.transport = BodyTransport(connection)
        self._sent = sent
        self._protocol: Protocol | None = None
        # The protocol's dataReceived, once it is delivered to.
        self._sink: Callable[[bytes], None] | None = None
        self._held: list[bytes] = []
        self._ended: Failure | None = None

    @property
    def request(self) -> ClientRequest:
        sent = self._sent
        return ClientRequest(sent.method, sent.uri, sent.headers)

    def setPreviousResponse(self, response: IResponse) -> None:
        self.previousResponse = response

    def deliverBody(self, protocol: Protocol) -> None:
        if self._protocol is not None:
            raise RuntimeError("the body was already delivered")
        self._protocol = protocol
        protocol.makeConnection(self.transport)
        held, self._held = self._held, []
        if self._sink is None:
            self._sink = protocol.dataReceived
            for data in held:
                protocol.dataReceived(data)
        if self._ended is not None:
            protocol.connectionLost(self._ended)

    def data(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink(data)
        elif data:
            self._held.append(data)

    def silence(self) -> None:
        """The consumer stopped the body: nothing more reaches it but its end."""
        self._held = []
        self._sink = _ignore

    def detach(self) -> None:
        self.transport.connection = None

    def end(self, reason: Failure) -> None:
        if self._protocol is not None:
            self._protocol.connectionLost(reason)
        else:
            self._ended = reason


def _ignore(data: bytes) -> None:
    pass


class _NoResponse:
    """What a connection holds as its response between responses. Only ``BODY`` reads a
    body, so ``data`` is never called; it is there so that the per-chunk path calls the
    response without first asking whether there is one."""

    __slots__ = ()

    def data(self, data: bytes) -> None:
        pass


_NO_RESPONSE = _NoResponse()
