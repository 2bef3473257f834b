"""A Broker wired as ``broker_tree`` wires it (the Facades node of the service tree,
running), on fakes: facades on a MemoryReactorClock with a FakeAgent, a listen seam that can be
told which ports are taken, a temporary state directory, and the real RpcLink framer over a
StringTransport. The broker tests, the hostile-link properties and the trust tests drive it."""

from __future__ import annotations

import errno
import json
import os

from twisted.internet.error import CannotListenError, ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.broker.broker import Broker
from nvpair_proxy.broker.rpc import RpcLink
from nvpair_proxy.facade.facade import make_facade
from nvpair_proxy.facade.facadeservice import Facades
from nvpair_proxy.fleet.inventory import Prober
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.routing.reservations import ReservationMap
from nvpair_proxy.test.world import assert_answered, connect, request_bytes
from nvpair_proxy.testing import FakeAgent

ENGINES = load_engines()


# The listen seam.


def _clash(a: str, b: str) -> bool:
    """Two binds on one port collide on the same address, or when either is the wildcard."""
    return a == b or "::" in (a, b)


class Listening:
    """An IListeningPort stand-in that knows whether it was stopped."""

    def __init__(self, owner: "FakeListen", port: int, interface: str, factory, fake) -> None:
        self.owner, self.port, self.interface, self.factory = owner, port, interface, factory
        self.fake = fake
        self.stopped = False

    def getHost(self):
        return self.fake.getHost()

    def stopListening(self):
        self.stopped = True
        self.owner.active.remove(self)


class FakeListen:
    """``listen(port, factory, interface)`` over MemoryReactorClock.listenTCP.

    A port stays taken while it is listening (so two facades can lose a bind race to each
    other), and ``occupy`` marks ports another process holds.
    """

    def __init__(self, reactor: MemoryReactorClock) -> None:
        self.reactor = reactor
        self.occupied: list[tuple[int, str]] = []
        self.active: list[Listening] = []
        self.calls: list[tuple[int, str]] = []

    def occupy(self, port: int, interface: str = "::") -> None:
        self.occupied.append((port, interface))

    def __call__(self, port: int, factory, interface: str) -> Listening:
        self.calls.append((port, interface))
        taken = self.occupied + [(one.port, one.interface) for one in self.active]
        if any(p == port and _clash(i, interface) for p, i in taken):
            raise CannotListenError(
                interface, port, OSError(errno.EADDRINUSE, "Address already in use")
            )
        fake = self.reactor.listenTCP(port, factory, interface=interface)
        listening = Listening(self, port, interface, factory, fake)
        self.active.append(listening)
        return listening

    def on(self, port: int, interface: str = "::") -> Listening | None:
        for listening in self.active:
            if listening.port == port and listening.interface == interface:
                return listening
        return None


class Proxy:
    """A Broker wired as ``broker_tree`` wires it, on fakes."""

    def __init__(
        self,
        test: SynchronousTestCase,
        *,
        is_local=None,
        state_dir: str | None = None,
        make_facade=None,
        on_shutdown=None,
        directory=None,
    ) -> None:
        self.reactor = MemoryReactorClock()
        self.agent = FakeAgent()
        self.reservations = ReservationMap()
        if state_dir is None:
            state_dir = test.mktemp()
            os.makedirs(state_dir)
        self.state_dir = state_dir
        self.listen = FakeListen(self.reactor)
        self.shutdowns: list[bytes] = []
        self.clients: list = []  # the chats' client connections
        self.link = RpcLink(lambda method, params: self.broker.dispatch(method, params))
        self.transport = StringTransport()
        self.link.framer.makeConnection(self.transport)
        self.facades = Facades(
            make_facade=make_facade or self.make_facade,
            listen=self.listen,
            make_prober=self.make_prober,
            clock=self.reactor,
            admission=True,
            directory=directory,
        )
        self.facades.startService()
        test.addCleanup(self.assert_quiet, test)
        self.broker = Broker(
            engines=ENGINES,
            emitter=self.link,
            reservations=self.reservations,
            state_dir=state_dir,
            facades=self.facades,
            on_shutdown=on_shutdown or (lambda: self.shutdowns.append(self.transport.value())),
            after_answer=self.link.after_answer.append,
            is_local=is_local or (lambda address: False),
        )

    def make_facade(self, engine):
        return make_facade(
            engine,
            clock=self.reactor,
            agent=self.agent,
            emitter=self.link,
            run_id="0123456789abcdef",
            random=lambda: 0.5,
            reservations=self.reservations,
        )

    def assert_quiet(self, test: SynchronousTestCase) -> None:
        """As World's check: no upstream request unanswered and no response left open when
        the test ends; then the facades stop as the tree stops them, and no timer remains."""
        assert_answered(test, self.agent)
        if self.facades.running:
            test.successResultOf(self.facades.stopService())
        test.assertEqual(self.reactor.getDelayedCalls(), [])

    def make_prober(self, facade, should_probe):
        return Prober(facade.engine, facade.router, self.agent, self.reactor, should_probe)

    # Talking to it.

    def raw(self, data: bytes) -> bytes:
        """Feed bytes to the link; the bytes it wrote back."""
        self.link.framer.dataReceived(data)
        out = self.transport.value()
        self.transport.clear()
        return out

    def feed(self, data: bytes) -> list[dict]:
        out = self.raw(data)
        if not out:
            return []
        assert out.endswith(b"\n"), out
        return [json.loads(line) for line in out[:-1].split(b"\n")]

    def call(self, method: str, params=None, message_id=1) -> list[dict]:
        message = {"jsonrpc": "2.0", "id": message_id, "method": method}
        if params is not None:
            message["params"] = params
        return self.feed(json.dumps(message).encode() + b"\n")

    def tell(self, method: str, params=None) -> list[dict]:
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        return self.feed(json.dumps(message).encode() + b"\n")

    def result(self, method: str, params=None):
        """The result of a request that must succeed (notifications before it discarded)."""
        lines = self.call(method, params, message_id="r")
        assert lines and lines[-1].get("id") == "r", lines
        assert "result" in lines[-1], lines[-1]
        return lines[-1]["result"]

    def enable(self, engine: str = "ollama", **params) -> int:
        return self.result("facade/enable", {"engine": engine, **params})["port"]

    def snapshot(self, nodes: list, engine: str = "ollama") -> list[dict]:
        return self.tell(f"{engine}:discovery:nodes", {"nodes": nodes})

    def owners(self, model: str = "llama3", engine: str = "ollama") -> list[str]:
        return self.result(f"{engine}:node/model-owners", {"model": model})["nodes"]

    def listed(self, engine: str = "ollama") -> list[dict]:
        return self.result(f"{engine}:nodes/list")["nodes"]

    def add(
        self,
        node_id: str,
        address: str = "10.0.0.1",
        models=("llama3:latest",),
        port: int = 11434,
        engine: str = "ollama",
    ) -> None:
        params = {"id": node_id, "host": node_id, "port": port, "addresses": [address]}
        if models is not None:
            params["models"] = list(models)
        self.result(f"{engine}:node/add-manual", params)

    def chat(self, port: int, model: str = "llama3") -> list[dict]:
        """A client's inference request through the facade's listener; the events it sent."""
        protocol = connect(self.listen.on(port).factory).protocol
        self.clients.append(protocol)
        protocol.dataReceived(request_bytes("POST", "/api/chat", {"model": model, "stream": True}))
        return self.feed(b"")

    def end_chats(self) -> None:
        """The chats end as their nodes and clients would end them: every upstream chat still
        waiting is answered whole, then every client connection closes."""
        for record in self.agent.requests:
            if record.pending and record.uri.endswith(b"/api/chat"):
                record.respond(
                    200,
                    {"Content-Type": "application/x-ndjson"},
                    body=b'{"done":true}\n',
                    finish=True,
                )
        for protocol in self.clients:
            protocol.connectionLost(Failure(ConnectionDone()))
        self.clients.clear()

    def persisted(self, name: str = "proxy-port.json") -> bytes:
        with open(os.path.join(self.state_dir, name), "rb") as handle:
            return handle.read()

    def persist(self, content: bytes | str, name: str = "proxy-port.json") -> None:
        if isinstance(content, str):
            content = content.encode()
        with open(os.path.join(self.state_dir, name), "wb") as handle:
            handle.write(content)
