"""Graceful drain (docs/operations.md#restarts): on SIGTERM a standalone proxy stops accepting,
answers /healthz 503, closes idle connections, lets admitted requests finish (queued ones
included) for up to ``--drain-timeout``, then cancels what remains and exits 0; a second
SIGTERM stops at once. Real processes on loopback: the signal, the listening socket and the
exit status are the point."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from nvpair_proxy.http.server import BoundedChannel, BoundedSite
from nvpair_proxy.test.support import start_fleet, start_standalone
from nvpair_proxy.testing.processes import free_port, nodes_toml

MODEL = "tiny"
CHAT = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def fleet_toml(tokens: int, token_delay: float) -> str:
    return (
        f'[[node]]\nid = "gpu"\ndialect = "llamacpp"\nmodels = ["{MODEL}"]\nslots = 1\n'
        f"tokens = {tokens}\ntoken_delay = {token_delay}\n"
    )


class DrainingProxy:
    """A standalone llama.cpp facade over one one-slot simulated node, logging at debug."""

    def __init__(self, test: SynchronousTestCase, tokens: int, token_delay: float, *flags: str):
        fleet = start_fleet(test, fleet_toml(tokens, token_delay))
        nodes = os.path.abspath(test.mktemp())
        with open(nodes, "w") as handle:
            handle.write(
                nodes_toml([("gpu", "llamacpp", fleet["gpu"], [MODEL])], {("gpu", "llamacpp"): 1})
            )
        self.port, self.admin = free_port(), free_port()
        self.log = os.path.abspath(test.mktemp())
        self.proc = start_standalone(
            test,
            ["--engine", f"llamacpp:{self.port}", "--nodes", nodes]
            + ["--admin", f"127.0.0.1:{self.admin}", *flags],
            logfile=self.log,
        )
        self.test = test

    def stream(self) -> http.client.HTTPResponse:
        """A streamed chat whose head has arrived (it holds the node's slot, or waits)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        self.test.addCleanup(conn.close)
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(CHAT), {"Content-Type": "application/json"}
        )
        return conn

    def idle_connection(self) -> socket.socket:
        """A keep-alive connection that was answered once and now sits idle."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.test.addCleanup(sock.close)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(65536)
        self.test.assertIn(b" 200 ", head.split(b"\r\n", 1)[0])
        return sock

    def drain_began(self, idle: socket.socket) -> None:
        """The drain closed the idle connection: listening has stopped by then."""
        while True:
            chunk = idle.recv(65536)  # the rest of the models answer, then the close
            if not chunk:
                return

    def queued(self, count: int) -> None:
        """Until the facade holds ``count`` requests in its queue (bounded: 500 reads of
        /status, each a round trip, no sleep)."""
        for _ in range(500):
            conn = http.client.HTTPConnection("127.0.0.1", self.admin, timeout=10)
            try:
                conn.request("GET", "/status")
                engines = json.loads(conn.getresponse().read())["engines"]
            finally:
                conn.close()
            if engines[0]["queued"] >= count:
                return
        self.test.fail(f"{count} requests never queued")

    def healthz(self) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.admin, timeout=10)
        try:
            conn.request("GET", "/healthz")
            answer = conn.getresponse()
            return answer.status, answer.read().decode().strip()
        finally:
            conn.close()

    def refused(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
        except ConnectionRefusedError:
            return True
        return False

    def terminal_events(self) -> dict[str, list[str]]:
        """Each workload's terminal events, by workload id, from the log."""
        seen: dict[str, list[str]] = {}
        with open(self.log, encoding="utf-8") as handle:
            for line in handle:
                for name in ("workload:completed", "workload:errored"):
                    marker = f"event {name} "
                    if marker in line:
                        params = json.loads(line.split(marker, 1)[1])
                        info = params.get("workloadInfo", params)
                        seen.setdefault(info["id"], []).append(name)
        return seen


def read_stream(response: http.client.HTTPResponse) -> tuple[bool, bytes]:
    """Read an SSE answer to its end: whether it ended with ``[DONE]``, and the tail."""
    body = b""
    try:
        while True:
            chunk = response.read1(65536)
            if not chunk:
                break
            body += chunk
    except (http.client.IncompleteRead, ConnectionError):
        pass
    return b"data: [DONE]" in body, body[-200:]


class DrainTests(SynchronousTestCase):
    def test_sigterm_lets_a_stream_and_a_queued_request_finish_then_exits_zero(self):
        proxy = DrainingProxy(self, 25, 0.1, "--drain-timeout", "30")
        idle = proxy.idle_connection()
        first = proxy.stream()
        running = first.getresponse()  # its head: it holds the node's one slot
        self.assertEqual(running.status, 200)
        second = proxy.stream()  # waits in the proxy's queue for that slot
        proxy.queued(1)
        proxy.proc.send_signal(signal.SIGTERM)
        proxy.drain_began(idle)
        self.assertTrue(proxy.refused(), "the facade port still accepts while draining")
        self.assertEqual(proxy.healthz(), (503, "draining"))
        self.assertEqual(read_stream(running)[0], True, "the running stream was cut")
        queued = second.getresponse()
        self.assertEqual(queued.status, 200)
        self.assertEqual(queued.getheader("connection"), "close")
        self.assertEqual(read_stream(queued)[0], True, "the queued request was not served")
        self.assertEqual(proxy.proc.wait(timeout=30), 0)
        events = proxy.terminal_events()
        self.assertEqual(sorted(events.values()), [["workload:completed"]] * 2)

    def test_a_second_sigterm_stops_at_once(self):
        proxy = DrainingProxy(self, 600, 0.05, "--drain-timeout", "60")
        idle = proxy.idle_connection()
        running = proxy.stream().getresponse()
        proxy.proc.send_signal(signal.SIGTERM)
        proxy.drain_began(idle)
        proxy.proc.send_signal(signal.SIGTERM)
        self.assertEqual(proxy.proc.wait(timeout=15), 0)
        self.assertEqual(read_stream(running)[0], False)
        self.assertEqual(list(proxy.terminal_events().values()), [["workload:errored"]])

    def test_the_drain_timeout_cancels_what_remains(self):
        proxy = DrainingProxy(self, 600, 0.05, "--drain-timeout", "1")
        running = proxy.stream().getresponse()
        proxy.proc.send_signal(signal.SIGTERM)
        self.assertEqual(proxy.proc.wait(timeout=15), 0)
        self.assertEqual(read_stream(running)[0], False)
        self.assertEqual(list(proxy.terminal_events().values()), [["workload:errored"]])
        with open(proxy.log, encoding="utf-8") as handle:
            self.assertIn("drain timeout (1s): cancelling 1 requests", handle.read())

    def test_a_zero_drain_timeout_stops_at_once_as_before(self):
        proxy = DrainingProxy(self, 600, 0.05, "--drain-timeout", "0")
        running = proxy.stream().getresponse()
        proxy.proc.send_signal(signal.SIGTERM)
        self.assertEqual(proxy.proc.wait(timeout=15), 0)
        self.assertEqual(read_stream(running)[0], False)
        with open(proxy.log, encoding="utf-8") as handle:
            self.assertNotIn("draining", handle.read())


class ChannelDrainTests(SynchronousTestCase):
    """A connection told to drain: closed at once when idle; else its answer says
    Connection: close and the connection ends with it."""

    def channel(self) -> tuple[BoundedChannel, StringTransport]:
        site = BoundedSite(Resource(), reactor=Clock(), timeout=None)
        channel = site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        return channel, transport

    def test_an_idle_connection_closes_at_once(self):
        channel, transport = self.channel()
        channel.drain()
        self.assertTrue(transport.disconnecting)

    def test_a_busy_connection_closes_after_its_answer(self):
        channel, transport = self.channel()
        channel.dataReceived(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        transport.clear()
        # Resource() answers 404 for /x at once: send the head of a second request, left
        # waiting, so the drain finds the connection busy.
        channel.dataReceived(b"GET /y HTTP/1.1\r\nHost: x\r\n")
        self.assertFalse(transport.disconnecting)
        channel.drain()
        self.assertFalse(transport.disconnecting, "a request being read is not cut")
        channel.dataReceived(b"\r\n")
        head = transport.value().split(b"\r\n\r\n", 1)[0].lower()
        self.assertIn(b"connection: close", head)
        self.assertTrue(transport.disconnecting)
