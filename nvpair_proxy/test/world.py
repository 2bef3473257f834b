"""A facade wired to fakes in a few lines: a Clock, a FakeAgent, a recording emitter.

Requests enter through the real listener demux and HTTP channel over a StringTransport, so
tests see the bytes a client would see.
"""

from __future__ import annotations

import json

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from nvpair_proxy.admin.status import ProcessView
from nvpair_proxy.core.interfaces import IStatusSource
from nvpair_proxy.core.views import ProcessSnapshot
from nvpair_proxy.facade.facade import facade_site, make_facade
from nvpair_proxy.facade.listener import DemuxFactory
from nvpair_proxy.nodes.discovery import make_node
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.request.dispatch import Bounds
from nvpair_proxy.routing.reservations import ReservationMap
from nvpair_proxy.routing.tickets import Policy
from nvpair_proxy.testing import FakeAgent, RecordingEmitter, loopback

ENGINES = load_engines()


class Response:
    """A parsed HTTP/1.1 response as the client received it (chunked decoded)."""

    def __init__(self, raw: bytes) -> None:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split(b" ")[1])
        self.headers: dict[str, list[str]] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            self.headers.setdefault(name.decode().lower(), []).append(value.strip().decode())
        self.complete = True
        if self.header("transfer-encoding") == "chunked":
            self.body, self.complete = _dechunk(rest)
        else:
            self.body = rest

    def header(self, name: str) -> str | None:
        values = self.headers.get(name.lower())
        return values[0] if values else None

    def json(self):
        return json.loads(self.body)


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    out = []
    while data:
        size_line, sep, data = data.partition(b"\r\n")
        if not sep:
            return b"".join(out), False
        size = int(size_line, 16)
        if size == 0:
            return b"".join(out), True
        if len(data) < size + 2:
            out.append(data[:size])
            return b"".join(out), False
        out.append(data[:size])
        data = data[size + 2 :]
    return b"".join(out), False


class Client:
    def __init__(self, transport: StringTransport, protocol) -> None:
        self.transport, self.protocol = transport, protocol

    def raw(self) -> bytes:
        return self.transport.value()

    def response(self) -> Response:
        return Response(self.transport.value())

    def answered(self) -> bool:
        return b"\r\n\r\n" in self.transport.value()

    def disconnect(self) -> None:
        from twisted.internet.error import ConnectionDone
        from twisted.python.failure import Failure

        self.protocol.connectionLost(Failure(ConnectionDone()))

    def pause(self) -> None:
        """The client stops reading: the transport pauses its producer, as a full socket does."""
        self.transport.producer.pauseProducing()

    def resume(self) -> None:
        self.transport.producer.resumeProducing()


def request_bytes(
    method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None
) -> bytes:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def connect(factory, peer=None) -> Client:
    """A client connection to ``factory`` (a listener's), from loopback unless ``peer``,
    in memory, with nothing sent yet."""
    peer = peer or loopback()
    protocol = factory.buildProtocol(peer)
    transport = StringTransport(peerAddress=peer)
    protocol.makeConnection(transport)
    return Client(transport, protocol)


class World:
    def __init__(
        self,
        engine: str = "ollama",
        *,
        response_timeout: float = 1800.0,
        reservations: ReservationMap | None = None,
        clock: Clock | None = None,
        agent: FakeAgent | None = None,
        emitter: RecordingEmitter | None = None,
        lan=None,
        recorder=None,
        scheduling: bool = False,
        queue_depth: int | None = None,
        affinity: bool = False,
        spill_keeps: bool = False,
        placement_header: bool = False,
    ) -> None:
        """``scheduling`` and ``queue_depth`` are standalone placement and late binding."""
        self.engine = ENGINES[engine]
        self.clock = clock or Clock()
        self.site_clock = Clock()
        self.agent = agent or FakeAgent()
        self.emitter = emitter or RecordingEmitter()
        self.reservations = reservations if reservations is not None else ReservationMap()
        self.facade = make_facade(
            self.engine,
            clock=self.clock,
            agent=self.agent,
            emitter=self.emitter,
            run_id="0123456789abcdef",
            random=lambda: 0.5,
            bounds=Bounds(response_timeout=response_timeout),
            reservations=self.reservations,
            recorder=recorder,
            policy=Policy(
                ranking=scheduling,
                queue_depth=queue_depth,
                affinity=affinity,
                spill_keeps=spill_keeps,
                placement_header=placement_header,
            ),
        )
        self.site = facade_site(self.facade, reactor=self.site_clock)
        self.factory = DemuxFactory(self.site, lan=lan)

    def add(
        self,
        node_id: str,
        models=("llama3:latest",),
        addresses=("10.0.0.1",),
        port: int = 11434,
        manual: bool = True,
        **extra,
    ):
        node = make_node(
            self.engine,
            id=node_id,
            port=port,
            addresses=list(addresses),
            models=models,
            source="manual" if manual else "discovered",
            **extra,
        )
        if manual:
            self.facade.router.put_manual(node)
        else:
            self.facade.router.replace_discovered(
                list(self.facade.router.nodes.discovered.values()) + [node]
            )
        return node

    def remove(self, node_id: str) -> None:
        self.facade.router.remove_manual(node_id)

    def connect(self, peer=None) -> Client:
        """A client connection through the listener, with nothing sent yet."""
        return connect(self.factory, peer)

    def send(self, method: str, path: str, body=None, headers=None, peer=None) -> Client:
        client = self.connect(peer)
        client.protocol.dataReceived(request_bytes(method, path, body, headers))
        return client

    def chat(self, model: str = "llama3", stream: bool = True, path: str = "/api/chat") -> Client:
        return self.send(
            "POST",
            path,
            {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]},
        )

    def workload_events(self) -> list[tuple[str, str, str | None]]:
        return [(m, info["state"], info.get("scheduledOn")) for m, info in self.emitter.workload()]

    def assert_quiet(self, test) -> None:
        """No timer left on the dispatch clock and no upstream request left open."""
        test.assertEqual(self.clock.getDelayedCalls(), [])
        assert_answered(test, self.agent)


def assert_answered(test, agent) -> None:
    """Every request a FakeAgent recorded was answered or given up, and no response body is
    left streaming: work a test started and never finished fails it."""
    for record in getattr(agent, "requests", ()):
        if record.pending:
            test.fail(f"upstream request {record.uri!r} still pending")
        response = record.response
        if response is not None and response._ended is None and not response.transport.stopped:
            test.fail(f"upstream response of {record.uri!r} left open")


class WorldTestCase(SynchronousTestCase):
    """Every world a test builds is checked when the test ends: no timer left on the dispatch
    clock, no upstream request or response left open."""

    def world(self, *args, **kwargs) -> World:
        w = World(*args, **kwargs)
        self.addCleanup(w.assert_quiet, self)
        return w

    def streaming(self):
        """One node, one streaming chat whose NDJSON headers arrived and nothing else yet."""
        w = self.world()
        w.add("a")
        client = w.chat()
        return w, client, w.agent.last.respond(200, {"Content-Type": "application/x-ndjson"})


NDJSON = {"Content-Type": "application/x-ndjson"}


def serve(request) -> None:
    """Commit a request with one streamed frame and its end."""
    upstream = request.respond(200, NDJSON)
    upstream.write(b'{"done":true}\n')
    upstream.finish()


def serve_all(test, w, *clients) -> None:
    """Serve every dispatch, pending or to come, until each client has its 200."""
    for _ in range(10):
        for request in list(w.agent.requests):
            if request.pending:
                serve(request)
        w.clock.advance(8)
    for client in clients:
        test.assertEqual(client.response().status, 200, client.raw())


@implementer(IStatusSource)
class WorldStatus:
    """The process as the admin listener reads it, around one World's facade: what the
    service tree's snapshot holds in a real process, with the facade on port 11435 and no
    broker link or cluster directory (standalone mode). ``running`` False is a stopping
    process."""

    def __init__(self, world: World, running: bool = True) -> None:
        self.world, self.running = world, running

    def snapshot(self) -> ProcessSnapshot:
        world = self.world
        facade = world.facade
        return ProcessSnapshot(
            running=self.running,
            facades=(facade.view(port=11435),),
            reservations=dict(world.reservations.reservations),
            streamed=facade.reporter.activity.last_seen(),
        )


def view_of(world: World, recorder) -> ProcessView:
    """The admin listener's view of ``world`` (standalone mode), with ``recorder``'s counts."""
    return ProcessView(
        source=WorldStatus(world),
        recorder=recorder,
        mode="standalone",
        clock=world.clock.seconds,
        started=world.clock.seconds(),
    )
