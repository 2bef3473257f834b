"""Hostile HTTP on a facade port: each request is answered cleanly (a 4xx, or the connection
closed), the process stays up, and another client is served normally afterwards.

The deadlines (10 s to a request line, 10 s more for the headers) are driven in memory on a
``Clock`` with clients that keep trickling bytes; the running process is checked once that a
slow-loris connection really is closed. Everything else is sent over loopback sockets to a
real ``twistd nvpair-proxy`` (standalone, simulated engine), because what twisted.web does
with the raw bytes of a real connection is the point.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time

from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.cluster.trust import ClusterDirectory, tls_ingress
from nvpair_proxy.core.constants import MAX_REQUEST_BODY
from nvpair_proxy.facade.listener import DemuxFactory
from nvpair_proxy.test.support import broker_channel, start_fleet, start_standalone
from nvpair_proxy.test.world import World, WorldTestCase
from nvpair_proxy.testing import lan
from nvpair_proxy.testing.certs import make_certificate, write_admission, write_identity
from nvpair_proxy.testing.processes import drain, exchange, free_port, nodes_toml, status_of

GOOD = b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
CHAT = json.dumps({"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}).encode()


# A TLS record announcing a 200-byte ClientHello, and only its first 50 bytes.
CLIENT_HELLO_HALF = bytes.fromhex("16030100c8010000c40303") + bytes(range(40))


def post(headers: bytes, body: bytes = b"") -> bytes:
    return b"POST /api/chat HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + body


# Each is answered 400 and closed, or closed without an answer; none reaches an engine.
REFUSED = {
    "request line without a target": b"GET\r\n\r\n",
    "request line with four parts": b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n",
    "unknown HTTP version": b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    "NUL in the method": b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n",
    "fold before any header": b"GET /api/tags HTTP/1.1\r\n folded: x\r\n\r\n",
    "folded Content-Length": post(b"Content-Length: 2\r\n 5\r\n", b"{}"),
    "duplicate equal Content-Length": post(b"Content-Length: 2\r\nContent-Length: 2\r\n", b"{}"),
    "conflicting Content-Length": post(b"Content-Length: 2\r\nContent-Length: 5\r\n", b"{}"),
    "Content-Length list": post(b"Content-Length: 2, 5\r\n", b"{}"),
    "negative Content-Length": post(b"Content-Length: -2\r\n", b"{}"),
    "signed Content-Length": post(b"Content-Length: +2\r\n", b"{}"),
    "Transfer-Encoding with Content-Length": post(
        b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n"
    ),
    "Content-Length with Transfer-Encoding": post(
        b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n", b"2\r\n{}\r\n0\r\n\r\n"
    ),
    "chunked not last": post(b"Transfer-Encoding: chunked, gzip\r\n", b"2\r\n{}\r\n0\r\n\r\n"),
    "unknown coding": post(b"Transfer-Encoding: gzip, chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n"),
    "chunk-size line over 1 KiB": post(
        b"Transfer-Encoding: chunked\r\n", b"f" * 2000 + b"\r\n{}\r\n0\r\n\r\n"
    ),
    "negative chunk size": post(b"Transfer-Encoding: chunked\r\n", b"-2\r\n{}\r\n0\r\n\r\n"),
    "0x chunk size": post(b"Transfer-Encoding: chunked\r\n", b"0x2\r\n{}\r\n0\r\n\r\n"),
    "100 KiB header": b"GET /api/tags HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 102400 + b"\r\n\r\n",
    "100 KiB of headers": b"GET /api/tags HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(100))
    + b"\r\n",
    "5000 headers": b"GET /api/tags HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: v\r\n" % i for i in range(5000))
    + b"\r\n",
    "header without a colon": b"GET /api/tags HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n",
    "space before the colon": post(b"Content-Length : 2\r\n", b"{}"),
    "NUL in a header value": b"GET /api/tags HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "garbage after the first byte": b"G\x00\xff\xfe\x01garbage\r\n\r\n",
    "binary garbage": bytes(range(1, 256)) + b"\r\n\r\n",
    "TLS ClientHello cut in half": CLIENT_HELLO_HALF,
}


class TCPStringTransport(StringTransport):
    """What HTTPChannel asks of a TCP transport once TLS hands it one."""

    def setTcpNoDelay(self, enabled: bool) -> None:
        pass


class InMemoryTests(WorldTestCase):
    """The parts of hostile HTTP that are about time or about what reaches the engine."""

    def test_request_line_trickled_a_byte_a_second_is_closed_at_ten_seconds(self) -> None:
        w = self.world()
        slow = w.connect()
        for index, byte in enumerate(b"GET /api/tags HTTP/1.1"[:10]):
            slow.protocol.dataReceived(bytes([byte]))
            self.assertFalse(slow.transport.disconnecting, index)
            w.site_clock.advance(0.999)
        self.assertFalse(slow.transport.disconnecting)
        w.site_clock.advance(0.01)
        self.assertTrue(slow.transport.disconnecting)
        self.assertEqual(slow.raw(), b"")

    def test_headers_trickled_a_byte_a_second_are_closed_ten_seconds_after_the_line(self):
        w = self.world()
        slow = w.connect()
        w.site_clock.advance(5)  # the request line's own deadline ends with the line
        slow.protocol.dataReceived(b"GET /api/tags HTTP/1.1\r\n")
        for index, byte in enumerate(b"X-Slow: abcdefghij"[:10]):
            self.assertFalse(slow.transport.disconnecting, index)
            slow.protocol.dataReceived(bytes([byte]))
            w.site_clock.advance(0.999)
        self.assertFalse(slow.transport.disconnecting)
        w.site_clock.advance(0.01)
        self.assertTrue(slow.transport.disconnecting)
        self.assertEqual(w.agent.requests, [])
        # Another client is unaffected.
        w.add("a")
        client = w.chat()
        w.agent.last.respond(200, body=b'{"done":true}\n', finish=True)
        self.assertEqual(client.response().status, 200)

    def test_an_overflowing_chunk_size_still_meets_the_body_limit(self) -> None:
        w = self.world()
        w.add("a")
        client = w.connect()
        client.protocol.dataReceived(post(b"Transfer-Encoding: chunked\r\n", b"f" * 40 + b"\r\n"))
        piece = b"x" * (1 << 20)
        for _ in range(MAX_REQUEST_BODY // len(piece)):
            client.protocol.dataReceived(piece)
        self.assertEqual(client.raw(), b"")
        client.protocol.dataReceived(b"x")
        self.assertEqual(client.response().status, 413)
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(w.agent.requests, [])

    def test_obsolete_folding_is_unfolded_before_forwarding(self) -> None:
        # RFC 9112 5.2 lets a server replace each obs-fold with a space instead of a 400;
        # twisted.web does, so no CR or LF can reach the engine inside a header.
        w = self.world()
        w.add("a")
        client = w.connect()
        client.protocol.dataReceived(
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\nX-A: one\r\n"
            b"\t two\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
        )
        self.assertEqual(w.agent.last.headers.getRawHeaders(b"x-a"), [b"one two"])
        w.agent.last.respond(200, body=b'{"done":true}\n', finish=True)
        self.assertEqual(client.response().status, 200)

    def member_connection(self, w: World):
        """A LAN peer on a facade port of a cluster member (the mTLS ingress is offered)."""
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        write_identity(folder, *make_certificate("node-a"))
        write_admission(folder)
        directory = ClusterDirectory(folder)
        directory.refresh()
        factory = DemuxFactory(w.site, tls=tls_ingress(directory, w.site, w.site_clock))
        peer = lan()
        protocol = factory.buildProtocol(peer)
        transport = TCPStringTransport(peerAddress=peer)
        protocol.makeConnection(transport)
        return protocol, transport

    def test_half_a_client_hello_is_closed_at_ten_seconds(self) -> None:
        w = self.world()
        protocol, transport = self.member_connection(w)
        protocol.dataReceived(CLIENT_HELLO_HALF)
        w.site_clock.advance(9.9)
        self.assertFalse(transport.disconnecting)
        w.site_clock.advance(0.1)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(w.agent.requests, [])

    def test_garbage_after_the_handshake_byte_is_closed_at_once(self) -> None:
        w = self.world()
        protocol, transport = self.member_connection(w)
        protocol.dataReceived(b"\x16" + b"\xff" * 64)
        self.assertTrue(transport.disconnecting or transport.disconnected)
        self.assertEqual(w.agent.requests, [])

    def test_refused_requests_never_reach_an_engine(self) -> None:
        for name, data in REFUSED.items():
            w = self.world()
            w.add("a")
            client = w.connect()
            client.protocol.dataReceived(data)
            self.assertTrue(client.transport.disconnecting, name)
            self.assertIn(status_of(client.raw()), (None, 400), name)
            self.assertEqual(w.agent.requests, [], name)


class AgainstTheProcessTests(SynchronousTestCase):
    """One fleet and one proxy per test; every wait is bounded."""

    def setUp(self) -> None:
        fleet = start_fleet(
            self,
            '[[node]]\nid = "small"\ndialect = "ollama"\n'
            'models = ["llama3:latest"]\ntokens = 3\n\n'
            '[[node]]\nid = "big"\ndialect = "ollama"\n'
            'models = ["big:latest"]\ntokens = 4000\nchunk_size = 4096\n',
        )
        nodes = os.path.abspath(self.mktemp())
        with open(nodes, "w") as handle:
            handle.write(
                nodes_toml(
                    [
                        ("gpu-a", "ollama", fleet["small"], ["llama3:latest"]),
                        ("gpu-big", "ollama", fleet["big"], ["big:latest"]),
                    ]
                )
            )
        self.port = free_port()
        self.proc = start_standalone(self, ["--engine", f"ollama:{self.port}", "--nodes", nodes])
        self.fleet = fleet

    def served(self) -> dict[str, int]:
        """How many requests each simulated engine has served."""
        counts = {}
        for node_id, port in self.fleet.items():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("GET", "/_sim/state")
                counts[node_id] = json.loads(conn.getresponse().read())["served_count"]
            finally:
                conn.close()
        return counts

    def assert_serving(self) -> None:
        """The process is up and a normal client gets its whole answer."""
        self.assertIsNone(self.proc.poll())
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            conn.request(
                "POST", "/api/chat", body=CHAT, headers={"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        self.assertEqual(response.status, 200, body[:300])
        self.assertTrue(json.loads(body.splitlines()[-1])["done"])

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))

    def test_malformed_requests_are_refused_and_others_served(self) -> None:
        self.assert_serving()
        for name, data in REFUSED.items():
            received, closed = exchange(self.port, data)
            self.assertTrue(closed, name)
            self.assertIn(status_of(received), (None, 400), (name, received[:200]))
            self.assert_serving()

    def test_a_chunk_size_past_64_bits_meets_the_body_limit(self) -> None:
        # 24 hex digits fit the 1 KiB chunk-size line but no 64-bit integer: the body limit,
        # counted as the bytes arrive, is what ends it (413, or closed), not the size.
        served = self.served()
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(post(b"Transfer-Encoding: chunked\r\n", b"f" * 24 + b"\r\n"))
            piece = b"x" * (1 << 20)
            for _ in range(MAX_REQUEST_BODY // len(piece)):
                sock.sendall(piece)  # the whole limit is taken in: nothing refused early
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                pass
            received, closed = drain(sock)
        self.assertTrue(closed)
        self.assertIn(status_of(received), (413, None), received[:200])
        self.assertEqual(self.served(), served)
        self.assert_serving()

    def test_folded_header_is_served_as_one_header(self) -> None:
        received, _ = exchange(
            self.port,
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\nX-A: one\r\n"
            b" two\r\nConnection: close\r\nContent-Length: %d"
            b"\r\n\r\n%s" % (len(CHAT), CHAT),
        )
        self.assertEqual(status_of(received), 200, received[:300])
        self.assert_serving()

    def test_slow_loris_connections_are_closed_by_the_deadlines(self) -> None:
        # One bounded wait covers both: a trickled request line and trickled headers.
        line = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        headers = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        self.addCleanup(line.close)
        self.addCleanup(headers.close)
        began = time.monotonic()
        line.sendall(b"GET /api/ta")
        headers.sendall(b"GET /api/tags HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        closed: dict[str, float] = {}
        self.assert_serving()
        while len(closed) < 2 and time.monotonic() - began < 20:
            for name, sock in (("line", line), ("headers", headers)):
                if name in closed:
                    continue
                try:
                    sock.sendall(b"a")
                    sock.settimeout(0.5)
                    if sock.recv(4096) == b"":
                        closed[name] = time.monotonic() - began
                except socket.timeout:
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    closed[name] = time.monotonic() - began
        self.assertEqual(sorted(closed), ["headers", "line"], closed)
        for name, after in closed.items():
            self.assertGreater(after, 9.0, name)
            self.assertLess(after, 15.0, name)
        self.assert_serving()

    def test_a_client_that_never_reads_holds_no_memory_and_blocks_no_one(self) -> None:
        before = self.rss_kib()
        body = json.dumps({"model": "big", "messages": [{"role": "user", "content": "hi"}]})
        stuck = []
        for _ in range(3):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(5)
            sock.connect(("127.0.0.1", self.port))
            self.addCleanup(sock.close)
            sock.sendall(
                b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body.encode())
            )
            stuck.append(sock)
        # Each stream is 16 MiB; with backpressure only a few MiB per client are in flight.
        self.assert_serving()
        # Wait until backpressure reached the engine for all three streams: every buffer on
        # the way is full, so whatever the proxy would hold it now holds.
        conn = http.client.HTTPConnection("127.0.0.1", self.fleet["big"], timeout=20)
        conn.request("GET", "/_sim/stalled?count=3")
        self.assertGreaterEqual(json.loads(conn.getresponse().read())["stalled"], 3)
        conn.close()
        self.assert_serving()
        grown = self.rss_kib() - before
        self.assertLess(grown, 40 * 1024, f"RSS grew {grown} KiB with 3 clients not reading")
        for sock in stuck:
            sock.close()
        self.assert_serving()


class AgainstTheClusterProcessTests(SynchronousTestCase):
    """A broker-mode process with a cluster directory, so its facade port speaks TLS too: the
    TLS side of the first-byte demux, against the real listener."""

    def setUp(self) -> None:
        fleet = start_fleet(
            self,
            '[[node]]\nid = "local"\ndialect = "ollama"\nmodels = ["llama3:latest"]\ntokens = 3\n',
        )
        cluster = os.path.abspath(self.mktemp())
        os.makedirs(cluster)
        write_identity(cluster, *make_certificate("node-self"))
        write_admission(cluster)
        self.link = broker_channel(self, ["--cluster-dir", cluster])
        for _ in range(5):
            self.port = free_port()
            answer = self.link.call(
                "facade/enable",
                {"engine": "ollama", "port": self.port, "ignorePersistedPort": True},
            )
            if "result" in answer:
                break
        self.assertEqual(answer["result"]["port"], self.port)
        added = self.link.call(
            "ollama:node/add-manual",
            {
                "id": "m-local",
                "host": "local",
                "port": fleet["local"],
                "addresses": ["127.0.0.1"],
                "models": ["llama3:latest"],
            },
        )
        self.assertEqual(added["result"], {"added": True})

    def assert_serving(self) -> None:
        self.assertIsNone(self.link.proc.poll())
        received, _ = exchange(
            self.port,
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT),
        )
        self.assertEqual(status_of(received), 200, received[:300])
        self.assertIn(b'"done":true', received)

    def test_half_a_client_hello_is_closed_by_the_deadline_and_blocks_no_one(self) -> None:
        self.assert_serving()
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            began = time.monotonic()
            sock.sendall(CLIENT_HELLO_HALF)
            self.assert_serving()  # served while the half handshake hangs
            received, closed = drain(sock, 15.0)
            after = time.monotonic() - began
        self.assertTrue(closed)
        self.assertNotIn(b"HTTP/", received)
        self.assertGreater(after, 9.0)
        self.assertLess(after, 15.0)
        self.assert_serving()

    def test_garbage_after_the_handshake_byte_is_closed_at_once(self) -> None:
        received, closed = exchange(self.port, b"\x16" + b"\xff" * 64, timeout=5.0)
        self.assertTrue(closed)
        self.assertNotIn(b"HTTP/", received)
        self.assert_serving()
