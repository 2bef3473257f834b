"""Safety against the running process (README "Routing: self and loops"): a node that is our
own facade, two proxies naming each other, and each target and framing case, with what a raw
engine received. Every wait is bounded; traffic stays on loopback.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.test.support import broker_channel, start_standalone
from nvpair_proxy.testing.processes import exchange, free_port, nodes_toml, status_of, wait_until

CHAT = json.dumps({"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}).encode()
LOOP = {"error": "forwarding loop: this request already passed through this proxy"}


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# "An immediate answer": a loop that ran until the client gave up would take the client's 20 s.
# A generous bound on a hang, not a benchmark: the answer takes milliseconds; 5 s leaves room
# for a loaded machine.
IMMEDIATE = 5.0


def timed_chat(port: int) -> tuple[tuple[int, dict], float]:
    """post_chat's answer, and the seconds it took."""
    started = time.monotonic()
    answer = post_chat(port)
    return answer, time.monotonic() - started


def post_chat(port: int, path: str = "/api/chat") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", path, body=CHAT, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


class ProcessCase(SynchronousTestCase):
    def write(self, text: str) -> str:
        path = os.path.abspath(self.mktemp())
        with open(path, "w") as handle:
            handle.write(text)
        return path


class SelfAndLoopTests(ProcessCase):
    def test_a_nodes_file_naming_our_own_facade_is_answered_at_once_and_warned_once(self):
        port, admin = free_port(), free_port()
        log = os.path.abspath(self.mktemp())
        nodes = self.write(nodes_toml([("me", "ollama", port, ["llama3:latest"])]))
        proc = start_standalone(
            self,
            ["--engine", f"ollama:{port}", "--nodes", nodes, "--admin", f"127.0.0.1:{admin}"],
            logfile=log,
        )
        resting = descriptors(proc.pid)
        answer, took = timed_chat(port)
        self.assertEqual(
            answer, (502, {"error": "no available node advertises the requested model"})
        )
        self.assertLess(took, IMMEDIATE)
        self.assertLessEqual(descriptors(proc.pid), resting + 2)
        conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=10)
        conn.request("GET", "/status")
        [node] = json.loads(conn.getresponse().read())["nodes"]
        conn.close()
        [engine] = node["engines"]
        self.assertEqual((node["id"], engine["state"]), ("me", "excluded"))
        self.assertIn(f"own ollama facade (port {port})", engine["excluded"])
        warned = wait_until(
            log,
            lambda: [
                line
                for line in open(log, encoding="utf-8")
                if "node me is left out of the ollama fleet" in line
            ],
        )
        self.assertEqual(len(warned), 1)
        self.assertIn(f"port {port}", warned[0])

    def test_two_proxies_whose_nodes_files_name_each_other_answer_508(self):
        port_a, port_b = free_port(), free_port()
        nodes_a = self.write(nodes_toml([("b", "ollama", port_b, ["llama3:latest"])]))
        nodes_b = self.write(nodes_toml([("a", "ollama", port_a, ["llama3:latest"])]))
        a = start_standalone(self, ["--engine", f"ollama:{port_a}", "--nodes", nodes_a])
        b = start_standalone(self, ["--engine", f"ollama:{port_b}", "--nodes", nodes_b])
        resting = descriptors(a.pid) + descriptors(b.pid)
        answer, took = timed_chat(port_a)
        self.assertEqual(answer, (508, LOOP))
        self.assertLess(took, IMMEDIATE)
        conn = http.client.HTTPConnection("127.0.0.1", port_b, timeout=20)
        conn.request("GET", "/api/tags")
        self.assertEqual(conn.getresponse().status, 503)  # B's only node is A: a loop, skipped
        conn.close()
        # One cycle: each process holds at most its pooled connection and one client.
        self.assertLessEqual(descriptors(a.pid) + descriptors(b.pid), resting + 6)

    def test_a_broker_manual_node_at_our_own_port_is_no_candidate(self):
        broker = broker_channel(self)
        port = free_port()
        self.assertEqual(
            broker.call("facade/enable", {"engine": "ollama", "port": port})["result"]["port"], port
        )
        broker.call(
            "ollama:node/add-manual",
            {
                "id": "self",
                "host": "self",
                "port": port,
                "addresses": ["127.0.0.1"],
                "models": ["llama3:latest"],
            },
        )
        self.assertEqual(
            broker.call("ollama:node/model-owners", {"model": "llama3"})["result"], {"nodes": []}
        )
        resting = descriptors(broker.proc.pid)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.request("GET", "/api/version")
        response = conn.getresponse()
        self.assertEqual(
            (response.status, json.loads(response.read())),
            (502, {"error": "no active node selected or available"}),
        )
        conn.close()
        self.assertLessEqual(descriptors(broker.proc.pid), resting + 2)


class RawEngine:
    """An engine that records each request's exact bytes and answers 200, closing after it."""

    def __init__(self, test) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(20)
        test.addCleanup(self.sock.close)
        self.port = self.sock.getsockname()[1]

    def serve_one(self) -> bytes:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(20)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b'Content-Length: 14\r\nConnection: close\r\n\r\n{"done":true}\n'
            )
            return head + b"\r\n\r\n" + body


class TargetAndFramingTests(ProcessCase):
    def setUp(self) -> None:
        self.engine = RawEngine(self)
        self.port = free_port()
        nodes = self.write(nodes_toml([("raw", "ollama", self.engine.port, ["llama3:latest"])]))
        start_standalone(self, ["--engine", f"ollama:{self.port}", "--nodes", nodes])

    def through(self, data: bytes) -> tuple[bytes, bytes]:
        """Send ``data``; (what the engine received, what the client received)."""
        client = socket.create_connection(("127.0.0.1", self.port), timeout=20)
        with client:
            client.sendall(data)
            received = self.engine.serve_one()
            answer = b""
            while True:
                chunk = client.recv(65536)
                if not chunk:
                    break
                answer += chunk
                if answer.endswith(b'{"done":true}\n'):
                    break
        return received, answer

    def test_each_case_is_refused_or_reaches_the_engine_as_exactly_the_request_we_read(self):
        refused = [
            b"GET 7/api/version HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET 1/api/version HTTP/1.1\r\nHost: x\r\n\r\n",
            b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
            b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: x\r\n\r\n" % self.engine.port,
            b"POST /api/chat#x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(CHAT), CHAT),
            b"GET /api/\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n",
            b"POST /api%%2Fchat HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(CHAT), CHAT),
            b"GET /api%5cversion HTTP/1.1\r\nHost: x\r\n\r\n",
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n"
            b"GET /api/smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
        ]
        for data in refused:
            answer, closed = exchange(self.port, data)
            self.assertEqual((status_of(answer), closed), (400, True), data)
            self.assertIn(b'{"error": "invalid request', answer, data)
        # Nothing of those reached the engine: the next request it sees is this one.
        received, answer = self.through(
            b"GET http://127.0.0.1:1/api/version?x=1 HTTP/1.1\r\n"
            b"Host: evil\r\nVia: 1.0 front\r\n\r\n"
        )
        lines = received.split(b"\r\n")
        self.assertEqual(lines[0], b"GET /api/version?x=1 HTTP/1.1")
        self.assertIn(b"Host: 127.0.0.1:%d" % self.engine.port, lines)
        [via] = [line for line in lines if line.lower().startswith(b"via:")]
        self.assertRegex(via, rb"^Via: 1\.0 front, 1\.1 nvpair-[0-9a-f]{16}$")
        self.assertEqual(status_of(answer), 200)
        received, answer = self.through(
            b"POST /api/%%63hat HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
        )
        self.assertEqual(received.split(b"\r\n")[0], b"POST /api/chat HTTP/1.1")
        self.assertTrue(received.endswith(b"\r\n\r\n" + CHAT))
        # Dot segments, escaped or not, are resolved before we classify: none reaches the engine.
        received, answer = self.through(
            b"POST /x/%%2e%%2E/api/./chat HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
        )
        self.assertEqual(received.split(b"\r\n")[0], b"POST /api/chat HTTP/1.1")
        self.assertEqual(status_of(answer), 200)

    def test_connection_close_with_other_tokens_closes_and_serves_no_pipelined_request(self):
        received, answer = self.through(
            b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: close, te\r\nTE: trailers\r\n"
            b"\r\nGET /api/pipelined HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        self.assertEqual(received.split(b"\r\n")[0], b"GET /api/version HTTP/1.1")
        self.assertIn(b"\r\nConnection: close\r\n", answer.split(b"\r\n\r\n")[0] + b"\r\n")
        received, _ = self.through(b"GET /api/ps HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(received.split(b"\r\n")[0], b"GET /api/ps HTTP/1.1")
