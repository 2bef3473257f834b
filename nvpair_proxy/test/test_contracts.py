"""The fakes keep the real APIs (issue 9, item 4).

Every seam with a real and a fake implementation is checked with ``verifyObject``, and the
upstream agent, the seam the whole request path stands on, runs one contract mixin against
Twisted's real ``Agent`` (serving an in-memory resource through ``treq.testing``), the proxy's
own ``Client`` (client.py, against twisted.web's server over in-memory transports) and the
``FakeAgent`` the dispatch tests use: what the attempt relies on (status, headers, the body in
order, a clean end versus a broken one, the request as sent, a refused dial, a cancel) must
hold for all three.
"""

from __future__ import annotations

from treq.testing import RequestTraversalAgent
from twisted.internet.defer import CancelledError
from twisted.internet.error import ConnectError, ConnectionRefusedError
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import Agent, ResponseNeverReceived
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site
from twisted.web.test.requesthelper import DummyRequest
from zope.interface.verify import verifyObject

from nvpair_proxy.admin.recorder import Recorder
from nvpair_proxy.core.interfaces import (
    IAttemptSink,
    IBodySink,
    IConductor,
    IEmitter,
    IHealth,
    IOwners,
    IPeek,
    IPlacement,
    IRequestRecorder,
    IStatusSource,
    ITicket,
    ITruthSink,
    IWaitSink,
)
from nvpair_proxy.facade.ingress import LocalBackend
from nvpair_proxy.http.client import Client
from nvpair_proxy.http.relay import clean_end
from nvpair_proxy.http.requestbody import BytesProducer
from nvpair_proxy.nodes.discovery import Node
from nvpair_proxy.process.service import ProcessService
from nvpair_proxy.request.events import LogEmitter
from nvpair_proxy.routing.affinity import AffinityTable
from nvpair_proxy.routing.reservations import ReservationMap
from nvpair_proxy.routing.router import Router
from nvpair_proxy.routing.slotqueue import SlotQueue
from nvpair_proxy.routing.tickets import PASS, Brokered, Direct, LateBinding, Standalone
from nvpair_proxy.test.support import Collect, Outcomes, Wire, attempt
from nvpair_proxy.test.world import ENGINES, World, WorldStatus
from nvpair_proxy.testing import FakeAgent, FakeResponse, RecordingEmitter

URL = b"http://10.0.0.1:11434/api/chat"


def cancelled(failure: Failure) -> bool:
    """A CancelledError as the caller sees it: itself (the proxy's Client, the fake), or as
    the one reason of Agent's ResponseNeverReceived once the request was on the wire."""
    if failure.check(ResponseNeverReceived):
        return [r.type for r in failure.value.reasons] == [CancelledError]
    return failure.check(CancelledError) is not None


def refuse_dial(reactor: MemoryReactorClock) -> None:
    """The last connection attempt on ``reactor`` is refused, as a closed port refuses it.
    Agent's HostnameEndpoint reports only once its 0.3 s attempt loop has looked again."""
    factory = reactor.tcpClients[-1][2]
    factory.clientConnectionFailed(
        reactor.connectors[-1], Failure(ConnectionRefusedError("Connection refused"))
    )
    reactor.advance(1)


class Interfaces(SynchronousTestCase):
    def test_each_implementation_provides_its_interface(self):
        node = Node(id="a", name="a", port=1, addresses=("127.0.0.1",))
        request = DummyRequest([b"api", b"chat"])
        request.path = b"/api/chat"  # as twisted.web's Request sets it on receipt
        exchange = World().facade.exchange(request)
        streaming = World()
        streaming.add("a")
        streaming.chat()
        upstream = streaming.agent.last.respond(200, {"Content-Type": "application/x-ndjson"})
        upstream.write(b'{"done":false}\n')
        (committed,) = streaming.facade.in_flight
        self.addCleanup(upstream.finish)
        router = Router(engine=ENGINES["ollama"], clock=Clock())
        for interface, implementation in (
            (IAgent, FakeAgent()),
            (IAgent, Agent(MemoryReactorClock())),
            (IAgent, Client(MemoryReactorClock())),
            (IEmitter, RecordingEmitter()),
            (IEmitter, LogEmitter()),
            (IOwners, router),
            (IHealth, router),
            (ITruthSink, router),
            (IOwners, LocalBackend(node)),
            (IPlacement, Direct()),
            (IPlacement, Brokered(router, ReservationMap())),
            (IPlacement, Standalone(router, ReservationMap(), AffinityTable())),
            (IPlacement, LateBinding(router, ReservationMap(), SlotQueue(Clock(), 10))),
            (ITicket, PASS),
            (ITicket, Brokered(router, ReservationMap()).make("m", None, 0)),
            (ITicket, Standalone(router, ReservationMap()).make("m", b"key", 10)),
            (IReactorTime, Clock()),
            (IBodySink, committed.stream),
            (IPushProducer, committed.stream),
            (IConductor, exchange),
            (IConductor, committed),
            (IAttemptSink, committed.dispatch),
            (IAttemptSink, Outcomes()),
            (IWaitSink, committed.dispatch),
            (IPeek, attempt(FakeAgent(), Clock())),
            (IRequestRecorder, Recorder()),
            (IStatusSource, ProcessService(MemoryReactorClock())),
            (IStatusSource, WorldStatus(World())),
        ):
            self.assertTrue(
                verifyObject(interface, implementation),
                f"{type(implementation).__name__} vs {interface.__name__}",
            )

    def test_a_fake_response_provides_iresponse(self):
        agent = FakeAgent()
        agent.request(b"GET", URL)
        self.assertTrue(verifyObject(IResponse, agent.last.respond(200)))

    def test_a_client_response_provides_iresponse(self):
        reactor = MemoryReactorClock()
        d = Client(reactor).request(b"GET", URL)
        Wire(reactor).reply(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertTrue(verifyObject(IResponse, self.successResultOf(d)))


class AgentContract:
    """What the attempt relies on from any IAgent. Subclasses say how the far end answers:
    ``answer(status, headers, chunks, clean)`` sets up the reply (``status`` None: it takes
    the request and never answers), ``pump()`` lets it happen, and ``received()`` is the
    request as the far end saw it (method, path, body); ``refusing()`` gives an agent whose
    dial ``refuse()`` refuses."""

    def test_status_headers_and_body_arrive_in_order_then_a_clean_end(self):
        agent = self.answer(201, {b"X-Engine": b"one"}, [b"hel", b"lo"], clean=True)
        d = agent.request(
            b"POST",
            URL,
            Headers({b"Content-Type": [b"application/json"]}),
            BytesProducer(b'{"model":"m"}'),
        )
        self.pump()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 201)
        self.assertEqual(response.headers.getRawHeaders(b"x-engine"), [b"one"])
        body = Collect()
        response.deliverBody(body)
        self.pump()
        self.assertEqual(b"".join(body.chunks), b"hello")
        self.assertTrue(clean_end(body.reason), body.reason)
        self.assertEqual(self.received(), (b"POST", b"/api/chat", b'{"model":"m"}'))

    def test_a_body_broken_off_does_not_end_cleanly(self):
        agent = self.answer(200, {b"Content-Length": b"100"}, [b"partial"], clean=False)
        d = agent.request(b"GET", URL)
        self.pump()
        body = Collect()
        self.successResultOf(d).deliverBody(body)
        self.pump()
        self.assertEqual(b"".join(body.chunks), b"partial")
        self.assertIsNotNone(body.reason)
        self.assertFalse(clean_end(body.reason))

    def test_a_refused_dial_fails_the_request_with_a_connect_error(self):
        d = self.refusing().request(b"GET", URL)
        self.assertNoResult(d)
        self.refuse()
        failure = self.failureResultOf(d, ConnectionRefusedError)
        self.assertIsInstance(failure.value, ConnectError)  # the attempt's dial errors

    def test_a_cancel_before_the_response_fails_with_cancelled_error(self):
        agent = self.answer(None, {}, [], clean=False)
        d = agent.request(b"POST", URL, None, BytesProducer(b'{"model":"m"}'))
        self.pump()
        self.assertEqual(self.received(), (b"POST", b"/api/chat", b'{"model":"m"}'))
        self.assertNoResult(d)
        d.cancel()
        self.pump()
        failure = self.failureResultOf(d)
        self.assertTrue(cancelled(failure), failure)


def engine_resource(test, status, headers, chunks, clean) -> Resource:
    """A twisted.web resource answering as the contract's ``answer`` says."""

    class Engine(Resource):
        isLeaf = True

        def render(self, request):
            test.seen = (request.method, request.path, request.content.read())
            if status is None:
                return NOT_DONE_YET
            request.setResponseCode(status)
            for name, value in headers.items():
                request.responseHeaders.setRawHeaders(name, [value])
            for chunk in chunks:
                request.write(chunk)
            if clean:
                request.finish()
            else:
                request.channel.transport.loseConnection()
            return NOT_DONE_YET

    return Engine()


class RealAgentContract(AgentContract, SynchronousTestCase):
    def answer(self, status, headers, chunks, clean):
        self.agent = RequestTraversalAgent(engine_resource(self, status, headers, chunks, clean))
        return self.agent

    def pump(self):
        self.agent.flush()

    def received(self):
        return self.seen

    def refusing(self):
        # The in-memory agent always connects: a refused dial needs Agent's own endpoint.
        self.reactor = MemoryReactorClock()
        return Agent(self.reactor)

    def refuse(self):
        refuse_dial(self.reactor)


class ClientContract(AgentContract, SynchronousTestCase):
    """The proxy's own client (client.py) against twisted.web's server, over in-memory
    transports: the same bytes a socket would carry."""

    def answer(self, status, headers, chunks, clean):
        self.reactor = MemoryReactorClock()
        self.site = Site(
            engine_resource(self, status, headers, chunks, clean), reactor=self.reactor
        )  # its idle timers on the memory reactor
        self.pumps: list = []
        return Client(self.reactor)

    def pump(self):
        while len(self.pumps) < len(self.reactor.tcpClients):
            factory = self.reactor.tcpClients[len(self.pumps)][2]
            client, server = factory.buildProtocol(None), self.site.buildProtocol(None)
            self.pumps.append(
                iosim.connect(
                    server, iosim.makeFakeServer(server), client, iosim.makeFakeClient(client)
                )
            )
        for pump in self.pumps:
            pump.flush()

    def received(self):
        return self.seen

    def refusing(self):
        self.reactor = MemoryReactorClock()
        return Client(self.reactor)

    def refuse(self):
        refuse_dial(self.reactor)


class FakeAgentContract(AgentContract, SynchronousTestCase):
    def answer(self, status, headers, chunks, clean):
        self.reply = (status, headers, chunks, clean)
        self.agent = FakeAgent()
        self.response: FakeResponse | None = None
        return self.agent

    def pump(self):
        record = self.agent.last
        status, headers, chunks, clean = self.reply
        if status is None:
            return
        if self.response is None:
            self.response = record.respond(status, Headers({k: [v] for k, v in headers.items()}))
        elif self.response.protocol is not None and self.response._ended is None:
            for chunk in chunks:
                self.response.write(chunk)
            self.response.finish() if clean else self.response.break_off()

    def received(self):
        record = self.agent.last
        return record.method, record.uri.split(b"11434", 1)[1], record.body

    def refusing(self):
        self.agent = FakeAgent()
        return self.agent

    def refuse(self):
        self.agent.last.refuse()
