"""A dispatch is counted once (docs/decisions.md#sent-once): a request written to an engine is
never written again by the proxy's client, whatever happens to the connection after.

Each facade here runs the proxy's own upstream client (client.py) dialling through a
``MemoryReactorClock``; the engine's end of each connection is an in-memory wire that records
every byte and answers as the test says, so what the engine received is counted exactly.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.request

from twisted.internet import error as ierror
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.http.client import Client
from nvpair_proxy.test.support import Wire, read_answer, start_fleet, start_standalone
from nvpair_proxy.test.world import WorldTestCase
from nvpair_proxy.testing.processes import DEADLINE, free_port, nodes_toml

PULL = {"model": "llama3", "stream": False}
PULLED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n"
    b'{"status":"success"}'
)
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
# llama-server's streamed answer: keep-alive by its headers, yet it closes right after.
EVENTS = (b'data: {"choices":[{"delta":{"content":"hi"},"index":0}]}\n\n', b"data: [DONE]\n\n")
SSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Keep-Alive: timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%b\r\n" % (len(event), event) for event in EVENTS)
    + b"0\r\n\r\n"
)


class Engine:
    """The engine's end of every connection the client dialled, in dial order."""

    def __init__(self, reactor: MemoryReactorClock) -> None:
        self.reactor = reactor
        self.wires: list[Wire] = []
        self.received: list[bytes] = []  # per wire, everything it was sent

    def accept(self) -> None:
        """Pick up the connections dialled since the last look."""
        while len(self.wires) < len(self.reactor.tcpClients):
            self.wires.append(Wire(self.reactor, len(self.wires)))
            self.received.append(b"")

    def read(self, index: int) -> bytes:
        """What wire ``index`` was sent since the last read."""
        self.accept()
        data = self.wires[index].sent()
        self.received[index] += data
        return data

    def requests(self, index: int | None = None) -> int:
        """Request lines received, on one wire or on all."""
        self.accept()
        for i in range(len(self.wires)):
            self.read(i)
        chosen = self.received if index is None else [self.received[index]]
        return sum(data.count(b" HTTP/1.1\r\n") for data in chosen)

    def next_request(self, clock) -> Wire:
        """The wire the next dispatch was written on, letting the dispatch clock run a second
        at a time (failover waits out a busy node's hold) for at most a minute."""
        for _ in range(60):
            self.accept()
            for index in range(len(self.wires)):
                if self.read(index):
                    return self.wires[index]
            clock.advance(1)
        raise AssertionError("no dispatch within a minute")


class SentOnceTests(WorldTestCase):
    def world_with_client(self, engine: str = "ollama", **kwargs):
        reactor = MemoryReactorClock()
        w = self.world(engine, agent=Client(reactor), **kwargs)
        return w, Engine(reactor)

    def second_pull_dropped(self, w, engine):
        """A pull answered on the first node's connection, then a second pull on that pooled
        connection, which the engine reads and drops unanswered: the second's client."""
        first = w.send("POST", "/api/pull", PULL)
        engine.read(0)
        engine.wires[0].reply(PULLED)
        self.assertEqual(first.response().status, 200)
        second = w.send("POST", "/api/pull", PULL)
        self.assertTrue(engine.read(0).startswith(b"POST /api/pull "), "on the pooled one")
        engine.wires[0].close(ierror.ConnectionLost)
        return second

    def test_a_pull_read_and_dropped_on_a_reused_connection_is_sent_once_and_answered_502(self):
        w, engine = self.world_with_client()
        w.add("a")
        second = self.second_pull_dropped(w, engine)
        response = second.response()
        self.assertEqual(response.status, 502)
        self.assertTrue(response.json()["error"].startswith("upstream error: "), response.body)
        self.assertEqual(
            (engine.requests(), len(engine.wires)),
            (2, 1),
            "the engine got the second pull once; nothing was dialled again",
        )

    def test_a_pull_read_and_dropped_goes_to_the_next_candidate_and_never_back(self):
        w, engine = self.world_with_client()
        w.add("a", addresses=("10.0.0.1",))
        w.add("b", addresses=("10.0.0.2",))
        second = self.second_pull_dropped(w, engine)  # a read it, then dropped it
        w.clock.advance(0)
        self.assertTrue(engine.read(1).startswith(b"POST /api/pull "), "then b")
        engine.wires[1].reply(PULLED)
        self.assertEqual(second.response().status, 200)
        dialled = [host for host, *_ in w.agent.reactor.tcpClients]
        self.assertEqual(dialled, ["10.0.0.1", "10.0.0.2"], "a was not dialled again")
        self.assertEqual(
            (engine.requests(0), engine.requests(1)),
            (2, 1),
            "each candidate got the second pull at most once",
        )

    def test_a_fifth_attempt_read_and_dropped_ends_502_after_exactly_5_dispatches(self):
        w, engine = self.world_with_client()
        w.add("a")
        client = w.chat()
        for _ in range(4):
            engine.next_request(w.clock).reply(BUSY)
        engine.next_request(w.clock).close(ierror.ConnectionLost)
        response = client.response()
        self.assertEqual(response.status, 502)
        self.assertTrue(response.json()["error"].startswith("upstream error: "), response.body)
        self.assertEqual(engine.requests(), 5, "the dispatch budget is what the engine saw")
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "failed"))

    def test_a_request_woken_by_a_llama_server_stream_end_is_served_on_its_first_dispatch(self):
        w, engine = self.world_with_client("llamacpp", scheduling=True, queue_depth=10)
        w.add("a", models=("m",), port=8080, slots=1)
        chat = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        first = w.send("POST", "/v1/chat/completions", chat)
        woken = w.send("POST", "/v1/chat/completions", chat)
        self.assertEqual(engine.requests(), 1, "the second waits for the only slot")
        engine.wires[0].reply(SSE)
        w.clock.advance(0)
        engine.wires[0].close()  # llama-server closes right after the stream
        w.clock.advance(0)
        self.assertEqual(first.response().status, 200)
        self.assertEqual(
            (engine.requests(0), len(engine.wires)),
            (1, 2),
            "the woken request was never written on the stream's connection",
        )
        engine.read(1)
        engine.wires[1].reply(SSE)
        self.assertEqual(woken.response().status, 200)
        self.assertIn(b"[DONE]", woken.response().body)
        self.assertEqual(engine.requests(), 2, "each request reached the engine once")


def _post(port: int, path: str, body: dict) -> socket.socket:
    """A request on its own connection, sent whole; the answer is read later."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    sock.sendall(
        b"POST %b HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%b"
        % (path.encode(), len(payload), payload)
    )
    return sock


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=DEADLINE) as answer:
        return answer.read()


class SentOnceProcessTests(SynchronousTestCase):
    """The same over real sockets: ``twistd nvpair-proxy`` in front of the simulated fleet,
    whose llama.cpp closes after every stream as the real one does, and whose Ollama can read
    a request and drop it (``drop_after_read``)."""

    def nodes(self, node: str, engine: str, port: int, models: list[str], slots=None) -> str:
        path = self.mktemp() + ".toml"
        with open(path, "w") as handle:
            handle.write(nodes_toml([(node, engine, port, models)], slots))
        return path

    def test_requests_woken_by_llama_server_stream_ends_all_go_on_their_first_dispatch(self):
        fleet = start_fleet(
            self,
            '[[node]]\nid = "gpu-c"\ndialect = "llamacpp"\nmodels = ["m"]\n'
            "slots = 1\ntokens = 3\ntoken_delay = 0.02\n",
        )
        port, admin = free_port(), free_port()
        nodes = self.nodes("gpu-c", "llamacpp", fleet["gpu-c"], ["m"], {("gpu-c", "llamacpp"): 1})
        start_standalone(
            self,
            ["--engine", f"llamacpp:{port}", "--nodes", nodes, "--admin", f"127.0.0.1:{admin}"],
        )
        chat = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        sockets = [_post(port, "/v1/chat/completions", chat) for _ in range(5)]
        answers = [read_answer(sock) for sock in sockets]
        self.assertEqual([a.split(b"\r\n", 1)[0] for a in answers], [b"HTTP/1.1 200 OK"] * 5)
        self.assertTrue(all(b"data: [DONE]" in a for a in answers))
        state = json.loads(_get(fleet["gpu-c"], "/_sim/state"))
        self.assertEqual(state["served_count"], 5, "each request reached the engine once")
        metrics = _get(admin, "/metrics").decode()
        dispatched = re.findall(
            r'^nvpair_proxy_dispatches_total\{[^}]*result="([a-z_-]+)"\} (\d+)', metrics, re.M
        )
        self.assertEqual(dispatched, [("committed", "5")], "no dispatch failed")

    def test_a_pull_the_engine_read_and_dropped_on_a_reused_connection_is_not_sent_again(self):
        fleet = start_fleet(
            self, '[[node]]\nid = "gpu-a"\ndialect = "ollama"\nmodels = ["llama3:latest"]\n'
        )
        port = free_port()
        nodes = self.nodes("gpu-a", "ollama", fleet["gpu-a"], ["llama3:latest"])
        start_standalone(self, ["--engine", f"ollama:{port}", "--nodes", nodes])
        pull = {"model": "llama3", "stream": False}
        # The simulated Ollama has no /api/pull: its 404 is passed through, and the connection
        # it came on stays in the proxy's pool.
        first = read_answer(_post(port, "/api/pull", pull))
        self.assertTrue(first.startswith(b"HTTP/1.1 404 "), first)
        fault = urllib.request.Request(
            f"http://127.0.0.1:{fleet['gpu-a']}/_sim/fault",
            data=b'{"drop_after_read": true}',
            method="POST",
        )
        urllib.request.urlopen(fault, timeout=DEADLINE).close()
        answer = read_answer(_post(port, "/api/pull", pull))
        head, _, body = answer.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 502 "), head)
        self.assertTrue(json.loads(body)["error"].startswith("upstream error: "), body)
        state = json.loads(_get(fleet["gpu-a"], "/_sim/state"))
        self.assertEqual(state["dropped"], 1, "the engine read the pull once")
