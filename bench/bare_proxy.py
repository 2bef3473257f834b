"""The bare Twisted reverse proxy: bench/overhead's baseline (no routing, no events, no stats).

Every request goes to one engine through an ``Agent`` with a persistent ``HTTPConnectionPool``
(256 per host); the response's body is delivered straight into ``request.write``, with the
engine connection registered as the request's (streaming) producer for backpressure.
Usage: python bench/bare_proxy.py LISTEN_PORT ENGINE_PORT; prints "bare ready PORT".
"""

from __future__ import annotations

import sys

from twisted.internet import reactor
from twisted.internet.defer import succeed
from twisted.internet.protocol import Protocol
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site
from zope.interface import implementer

HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"host",
    b"content-length",
}


@implementer(IBodyProducer)
class Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.length = data, len(data)

    def startProducing(self, consumer):
        consumer.write(self.data)
        return succeed(None)

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass


class Relay(Protocol):
    def __init__(self, request) -> None:
        self.request, self.gone = request, False

    def connectionMade(self) -> None:
        self.request.registerProducer(self.transport, True)

    def dataReceived(self, data: bytes) -> None:
        if not self.gone:
            self.request.write(data)

    def connectionLost(self, reason) -> None:
        if not self.gone:
            self.request.unregisterProducer()
            self.request.finish()


class Proxy(Resource):
    isLeaf = True

    def __init__(self, agent: Agent, base: bytes) -> None:
        super().__init__()
        self.agent, self.base = agent, base

    def render(self, request):
        headers = Headers()
        for name, values in request.requestHeaders.getAllRawHeaders():
            if name.lower() not in HOP:
                headers.setRawHeaders(name, values)
        body = request.content.read()
        producer = Bytes(body) if body or request.method == b"POST" else None
        d = self.agent.request(request.method, self.base + request.uri, headers, producer)
        relay = [None]
        state = {"gone": False}

        def respond(response):
            request.setResponseCode(response.code, response.phrase)
            for name, values in response.headers.getAllRawHeaders():
                if name.lower() not in HOP or name.lower() == b"content-length":
                    request.responseHeaders.setRawHeaders(name, values)
            relay[0] = Relay(request)
            response.deliverBody(relay[0])

        def failed(failure):
            if relay[0] is None and not state["gone"]:
                request.setResponseCode(502)
                request.finish()

        def gone(_):
            state["gone"] = True
            if relay[0] is not None:
                relay[0].gone = True
                if relay[0].transport is not None:
                    relay[0].transport.stopProducing()
            else:
                d.cancel()

        d.addCallbacks(respond, failed)
        request.notifyFinish().addErrback(gone)
        return NOT_DONE_YET


def main() -> None:
    listen_port, engine_port = int(sys.argv[1]), int(sys.argv[2])
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = 256
    agent = Agent(reactor, pool=pool)
    site = Site(Proxy(agent, b"http://127.0.0.1:%d" % engine_port))
    site.log = lambda request: None  # no access log: ours writes none in standalone info mode
    port = reactor.listenTCP(listen_port, site, interface="127.0.0.1")
    print(f"bare ready {port.getHost().port}", flush=True)
    reactor.run()


if __name__ == "__main__":
    main()
