"""Fakes with the real APIs, for tests (style: fakes over mocks).

``RecordingEmitter`` is the tests' view of the link: every notification, in order.

``FakeAgent`` is an IAgent whose every request waits for the test to answer it: respond with
headers, stream body chunks, end the body cleanly or break it, or fail the connection. Its
body transport records pause/resume/stop so backpressure and aborts are observable.
"""

from __future__ import annotations

import json

import attrs
from twisted.internet import error as ierror
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IResponse
from zope.interface import implementer

from ..core.interfaces import IEmitter


class FakeBodyTransport:
    """The push producer a real response gives its body protocol."""

    def __init__(self) -> None:
        self.paused = False
        self.stopped = False
        self.pauses = 0

    def pauseProducing(self) -> None:
        self.paused = True
        self.pauses += 1

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        self.stopped = True


@implementer(IResponse)
class FakeResponse:
    """A response whose body the test writes; data before deliverBody is buffered."""

    version = (b"HTTP", 1, 1)
    previousResponse = None
    request = None

    def __init__(self, owner: "FakeRequest", code: int, headers: Headers, length) -> None:
        self.owner, self.code, self.headers, self.length = owner, code, headers, length
        self.phrase = {200: b"OK", 404: b"Not Found", 503: b"Service Unavailable"}.get(
            code, b"Status"
        )
        self.transport = FakeBodyTransport()
        self.protocol = None
        self._buffer: list[bytes] = []
        self._ended: Failure | None = None

    def deliverBody(self, protocol) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)
        for data in self._buffer:
            protocol.dataReceived(data)
        self._buffer = []
        if self._ended is not None:
            protocol.connectionLost(self._ended)
        elif self.transport.stopped:
            self._lose(Failure(ResponseFailed([Failure(ierror.ConnectionAborted())])))

    def setPreviousResponse(self, response) -> None:
        pass

    def write(self, data: bytes) -> None:
        if self.transport.stopped:
            return
        if self.protocol is None:
            self._buffer.append(data)
        else:
            self.protocol.dataReceived(data)

    def finish(self) -> None:
        self._lose(Failure(ResponseDone()))

    def break_off(self) -> None:
        self._lose(Failure(ResponseFailed([Failure(ierror.ConnectionLost())])))

    def _lose(self, reason: Failure) -> None:
        if self._ended is not None:
            return
        self._ended = reason
        if self.protocol is not None:
            self.protocol.connectionLost(reason)


@attrs.define(eq=False)
class FakeRequest:
    method: bytes
    uri: bytes
    headers: Headers
    body: bytes | None
    deferred: Deferred
    response: FakeResponse | None = None
    cancelled: bool = False

    def respond(
        self,
        code: int = 200,
        headers: dict | Headers | None = None,
        body: bytes | None = None,
        length=UNKNOWN_LENGTH,
        finish: bool = False,
    ) -> FakeResponse:
        raw = (
            headers
            if isinstance(headers, Headers)
            else Headers({k.encode(): [v.encode()] for k, v in (headers or {}).items()})
        )
        self.response = FakeResponse(self, code, raw, length)
        if body:
            self.response.write(body)
        if finish:
            self.response.finish()
        self.deferred.callback(self.response)
        return self.response

    def refuse(self) -> None:
        self.deferred.errback(ierror.ConnectionRefusedError("Connection refused"))

    def fail(self, exc: Exception | None = None) -> None:
        self.deferred.errback(exc or ResponseFailed([Failure(ierror.ConnectionLost())]))

    @property
    def pending(self) -> bool:
        return not self.deferred.called


@implementer(IAgent)
class FakeAgent:
    """Records every request; each waits until the test answers it."""

    def __init__(self) -> None:
        self.requests: list[FakeRequest] = []

    def request(self, method, uri, headers=None, bodyProducer=None) -> Deferred:
        body = None
        if bodyProducer is not None:
            sink = StringTransport()
            bodyProducer.startProducing(sink)
            body = sink.value()

        def cancel(d: Deferred) -> None:
            # The request was sent (it is recorded), so a cancel fails it with CancelledError
            # as the proxy's Client does, not ConnectingCancelledError (test_contracts).
            record.cancelled = True

        d: Deferred[IResponse] = Deferred(cancel)
        record = FakeRequest(method, uri, headers or Headers(), body, d)
        self.requests.append(record)
        return d

    @property
    def last(self) -> FakeRequest:
        return self.requests[-1]

    def hosts(self) -> list[str]:
        return [r.uri.split(b"/")[2].decode() for r in self.requests]


def loopback(port: int = 40000):
    return IPv4Address("TCP", "127.0.0.1", port)


def lan(port: int = 40000):
    return IPv4Address("TCP", "192.168.1.20", port)


def mapped_loopback(port: int = 40000):
    return IPv6Address("TCP", "::ffff:127.0.0.1", port)


@implementer(IEmitter)
class RecordingEmitter:
    """Keeps every notification in order; the tests' view of the link."""

    listening = True

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def notify(self, method: str, params: dict, engine: str | None = None) -> None:
        self.sent.append((f"{engine}:{method}" if engine else method, params))

    def notify_json(self, method: str, params: str, engine: str | None = None) -> None:
        self.notify(method, json.loads(params), engine)

    def methods(self, prefix: str = "") -> list[str]:
        return [m for m, _ in self.sent if m.startswith(prefix)]

    def workload(self) -> list[tuple[str, dict]]:
        return [(m, p["workloadInfo"]) for m, p in self.sent if m.startswith("workload:")]
