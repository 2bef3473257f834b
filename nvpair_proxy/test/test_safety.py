"""Safety (README "Routing: self and loops"): no request comes back to us without end, the
target we are sent never moves where we dial, and one model is one record.

In memory, through a facade's real listener and channel, on fakes; standalone mode's self
node through the tree the plugin builds, on a MemoryReactorClock, with the real address check;
the same cases against the running process, with what a raw engine received, are in
``test_safety_process``.
"""

from __future__ import annotations

import os
import socket

from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from nvpair_proxy.core import logs
from nvpair_proxy.nodes.selfcheck import SelfCheck, is_local_address
from nvpair_proxy.process.options import Options
from nvpair_proxy.process.service import standalone_tree
from nvpair_proxy.test.support import LogCapture
from nvpair_proxy.test.world import WorldTestCase, request_bytes

OWN_PORT = 11435


def primary_ipv4() -> str:
    """This host's primary IPv4 address: the source of a route to TEST-NET-1 (a UDP connect
    sends nothing); SkipTest when there is no such route or it is loopback."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))
        address = probe.getsockname()[0]
    except OSError as exc:
        raise SkipTest(f"no IPv4 route off this host: {exc}")
    finally:
        probe.close()
    if address == "0.0.0.0" or address.startswith("127."):
        raise SkipTest(f"no IPv4 address off loopback (route source {address})")
    return address


class LoopGuardTests(WorldTestCase):
    def test_what_engines_receive_carries_our_via_after_the_clients(self):
        w = self.world()
        w.add("a")
        w.send("POST", "/api/chat", {"model": "llama3"}, headers={"Via": "1.0 front, 1.1 edge"})
        hop = w.facade.upstreams.loop_guard.hop
        self.assertEqual(
            w.agent.last.headers.getRawHeaders(b"via"), [b"1.0 front, 1.1 edge, " + hop]
        )
        w.agent.last.respond(200, body=b'{"done":true}\n', finish=True)

    def test_a_request_carrying_our_own_token_is_508_at_once(self):
        w = self.world()
        w.add("a")
        hop = w.facade.upstreams.loop_guard.hop.decode()
        for path, body in (("/api/chat", {"model": "llama3"}), ("/api/tags", None)):
            w.emitter.sent.clear()
            client = w.send(
                "POST" if body else "GET", path, body, headers={"Via": f"1.1 someone, {hop}"}
            )
            response = client.response()
            self.assertEqual(
                (response.status, response.json()),
                (508, {"error": "forwarding loop: this request already passed through this proxy"}),
            )
            self.assertEqual(response.header("content-type"), "application/json")
            self.assertEqual(w.agent.requests, [], path)
            self.assertEqual([m for m, _ in w.emitter.sent], ["ollama:proxy/request"], path)
            self.assertEqual(w.emitter.sent[0][1]["status"], 508)

    def test_another_proxys_token_is_forwarded_not_refused(self):
        w = self.world()
        w.add("a")
        client = w.send(
            "POST", "/api/chat", {"model": "llama3"}, headers={"Via": "1.1 nvpair-0000000000000000"}
        )
        w.agent.last.respond(200, body=b'{"done":true}\n', finish=True)
        self.assertEqual(client.response().status, 200)

    def test_an_upstream_508_is_not_retried(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.chat(stream=False)
        w.agent.last.respond(508, body=b'{"error":"forwarding loop"}', finish=True)
        self.assertEqual(client.response().status, 508)
        self.assertEqual(len(w.agent.requests), 1)
        self.assertEqual(w.workload_events()[-1][0], "workload:errored")


class SelfNodeTests(WorldTestCase):
    def world_with_self(self, is_local=lambda address: address == "192.168.1.50"):
        w = self.world()
        ports = {OWN_PORT}
        w.facade.router.check_self(SelfCheck(lambda: ports, is_local))
        return w, ports

    def test_a_node_at_the_facades_own_port_is_never_dialled(self):
        w, _ = self.world_with_self()
        w.add("me", addresses=("127.0.0.1",), port=OWN_PORT)
        w.add("me-by-lan", addresses=("192.168.1.50",), port=OWN_PORT)
        client = w.chat()
        self.assertEqual(
            (client.response().status, client.response().json()),
            (502, {"error": "no available node advertises the requested model"}),
        )
        self.assertEqual(w.agent.requests, [])

    def test_the_engine_beside_the_facade_is_served(self):
        w, _ = self.world_with_self()
        w.add("me", addresses=("127.0.0.1",), port=OWN_PORT)
        w.add("engine", addresses=("127.0.0.1",), port=11434)
        w.chat()
        self.assertEqual(w.agent.last.uri, b"http://127.0.0.1:11434/api/chat")
        w.agent.last.respond(200, body=b'{"done":true}\n', finish=True)

    def test_the_check_follows_the_facades_port(self):
        w, ports = self.world_with_self()
        w.add("me", addresses=("127.0.0.1",), port=OWN_PORT)
        self.assertEqual(w.facade.router.routable(), [])
        ports.clear()
        ports.add(12000)
        w.facade.router.recheck_self()
        self.assertEqual([n.id for n in w.facade.router.routable()], ["me"])


class LocalAddressTests(SynchronousTestCase):
    """The real check (selfcheck.is_local_address), which the other tests replace by a stub."""

    def test_loopback_is_local_and_test_net_is_not(self):
        self.assertIs(is_local_address("127.0.0.1"), True)
        self.assertIs(is_local_address("192.0.2.1"), False)  # TEST-NET-1: never on a host

    def test_the_hosts_primary_address_is_local(self):
        self.assertIs(is_local_address(primary_ipv4()), True)


def node_toml(node_id: str, address: str, port: int) -> str:
    return (
        f'[[node]]\nid = "{node_id}"\naddress = "{address}"\n'
        f'[node.engines.ollama]\nport = {port}\nmodels = ["llama3:latest"]\n'
    )


class StandaloneSelfTests(SynchronousTestCase):
    """Standalone mode as the plugin builds it (standalone_tree on a MemoryReactorClock, the
    real self check and nodes-file watch): which nodes-file nodes are this facade, and the
    warning that names them, once per change."""

    def setUp(self) -> None:
        self.addCleanup(logs.set_level, logs.level_name())
        self.folder = os.path.abspath(self.mktemp())
        os.makedirs(self.folder)
        self.nodes = os.path.join(self.folder, "nodes.toml")
        self.stamp = 10**18

    def write(self, *nodes: str) -> None:
        """The nodes file, with a new mtime each time (so every write is a change)."""
        with open(self.nodes, "w") as handle:
            handle.write("".join(nodes))
        self.stamp += 10**9
        os.utime(self.nodes, ns=(self.stamp, self.stamp))

    def start(self):
        options = Options()
        options.parseOptions(
            ["--engine", f"ollama:{OWN_PORT}", "--nodes", self.nodes, "--state-dir", self.folder]
        )
        self.reactor = MemoryReactorClock()
        root = standalone_tree(options.config, self.reactor)
        root.privilegedStartService()
        return root

    def test_a_node_at_this_hosts_address_on_the_facades_port_is_dropped(self):
        address = primary_ipv4()
        self.write(node_toml("me-by-lan", address, OWN_PORT), node_toml("engine", address, 11434))
        router = self.start().facades["ollama"].facade.router
        self.assertEqual([n.id for n in router.routable()], ["engine"])
        self.assertEqual(
            [(n.id, n.local) for n in router.nodes.all()], [("engine", False), ("me-by-lan", True)]
        )

    def test_the_self_node_is_warned_about_once_per_change(self):
        me, other = node_toml("me", "127.0.0.1", OWN_PORT), node_toml("other", "10.0.0.9", 11434)
        self.write(me)
        log = LogCapture(self, level="info")
        root = self.start()
        watcher = root.getServiceNamed("standalone").watcher
        watcher.startService()
        self.addCleanup(watcher.stopService)

        def warnings() -> list[str]:
            return [formatEvent(e) for e in log.at("warn")]

        def reloads() -> int:
            return sum("nodes file reloaded" in formatEvent(e) for e in log.at("info"))

        once = [
            f"node me is left out of the ollama fleet: it is this proxy's own ollama facade "
            f"(port {OWN_PORT}); a request sent there would come back here"
        ]
        self.assertEqual(warnings(), once)
        self.write(me, other)  # another node: the self node did not change
        self.reactor.advance(2)
        self.assertEqual(reloads(), 1)
        self.assertEqual(warnings(), once)
        self.write(node_toml("me", "127.0.0.1", 11434), other)  # moved away: not self
        self.reactor.advance(2)
        self.assertEqual(warnings(), once)
        self.write(me, other)  # and back: a change, warned again
        self.reactor.advance(2)
        self.assertEqual(reloads(), 3)
        self.assertEqual(warnings(), once * 2)


class ModelListDedupeTests(WorldTestCase):
    def test_ollama_native_list_is_one_record_per_normalised_name(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("GET", "/api/tags")
        w.agent.requests[0].respond(
            200, body=b'{"models":[{"name":"shared","size":1}]}', finish=True
        )
        w.agent.requests[1].respond(
            200,
            body=b'{"models":[{"name":"shared:latest","size":2},'
            b'{"model":"own:latest","name":"x"}]}',
            finish=True,
        )
        self.assertEqual(
            client.response().json(),
            {"models": [{"name": "shared", "size": 1}, {"model": "own:latest", "name": "x"}]},
        )

    def test_openai_lists_dedupe_by_id_exactly(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("GET", "/v1/models")
        w.agent.requests[0].respond(
            200, body=b'{"object":"list","data":[{"id":"shared"},{"id":"x","n":1}]}', finish=True
        )
        w.agent.requests[1].respond(
            200,
            body=b'{"object":"list","data":[{"id":"shared:latest"},{"id":"x","n":2}]}',
            finish=True,
        )
        self.assertEqual(
            client.response().json(),
            {
                "object": "list",
                "data": [{"id": "shared"}, {"id": "x", "n": 1}, {"id": "shared:latest"}],
            },
        )


class TargetAndFramingTests(WorldTestCase):
    """The target is a path and nothing else moves where we dial (twisted_workarounds)."""

    def refused(self, w, data: bytes) -> dict:
        client = w.connect()
        client.protocol.dataReceived(data)
        response = client.response()
        self.assertEqual(response.status, 400, data)
        self.assertTrue(client.transport.disconnecting, data)
        self.assertEqual(w.agent.requests, [], data)
        return response.json()

    def test_a_target_that_is_not_a_path_is_refused(self):
        w = self.world()
        w.add("a", port=2000)
        for target in (
            b"7/api/version",
            b"1/api/chat",
            b"*",
            b"ftp://x/api/tags",
            b"/api/chat#x",
            b"/api/chat\x80",
            b"/api/\xffchat",
        ):
            body = self.refused(w, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            self.assertTrue(body["error"].startswith("invalid request target: "), body)
        body = self.refused(w, b"CONNECT 127.0.0.1:2000 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(body, {"error": "invalid request target: CONNECT is not supported"})

    def test_an_escaped_slash_or_backslash_in_the_path_is_refused(self):
        # Gin and cpp-httplib decode the path before routing: /api%2Fchat would be served as
        # /api/chat while we classified it as no route (no model filter, workload or gate).
        w = self.world()
        w.add("a")
        for target in (
            b"/api%2Fchat",
            b"/api%2fchat",
            b"/api%5Cchat",
            b"/api%5cchat",
            b"http://x/v1%2Fchat/completions",
            b"/x/..%2Fapi/chat?q=1",
        ):
            body = self.refused(w, request_bytes("POST", target.decode(), {"model": "llama3"}))
            self.assertEqual(
                body, {"error": "invalid request target: an escaped / or \\ in the path"}, target
            )
        # In the query it is data, not a separator: sent as it came.
        client = w.connect()
        client.protocol.dataReceived(request_bytes("GET", "/api/tags?next=%2Fa%5Cb"))
        self.assertEqual(w.agent.last.uri, b"http://10.0.0.1:11434/api/tags?next=%2Fa%5Cb")
        w.agent.last.respond(200, body=b'{"models":[]}', finish=True)
        self.assertEqual(client.response().status, 200)

    def test_an_absolute_form_target_sends_its_path_to_the_nodes_own_origin(self):
        w = self.world()
        w.add("a", port=2000)
        client = w.connect()
        client.protocol.dataReceived(
            request_bytes("POST", "http://10.9.9.9:7/api/chat?x=1", {"model": "llama3"})
        )
        self.assertEqual(w.agent.last.uri, b"http://10.0.0.1:2000/api/chat?x=1")
        self.assertEqual(w.workload_events()[0][1], "queued")  # routed as inference
        w.agent.last.respond(200, body=b'{"done":true}\n', finish=True)
        self.assertEqual(client.response().status, 200)

    def test_the_path_classified_is_the_path_sent(self):
        w = self.world()
        w.add("a")
        for target, sent in (
            (b"/api/%63hat", b"/api/chat"),
            (b"/x/../api/./chat", b"/api/chat"),
            (b"/x/%2e%2E/api/%2e/chat", b"/api/chat"),
            (b"/x/.%2e/api/chat", b"/api/chat"),
        ):
            w.emitter.sent.clear()
            client = w.connect()
            client.protocol.dataReceived(
                request_bytes("POST", target.decode(), {"model": "llama3"})
            )
            self.assertEqual(w.agent.last.uri, b"http://10.0.0.1:11434" + sent)
            self.assertEqual(w.workload_events()[0][1], "queued", target)
            w.agent.last.respond(200, body=b'{"done":true}\n', finish=True)
            self.assertEqual(client.response().status, 200)

    def test_a_transfer_coding_other_than_chunked_is_400_and_the_rest_is_never_read(self):
        w = self.world()
        w.add("a")
        smuggled = b"GET /api/version HTTP/1.1\r\nHost: x\r\n\r\n"
        for coding in (b"identity", b"chunked, identity", b"gzip", b"chunked\x0b"):
            body = self.refused(
                w,
                b"POST /api/chat HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                + coding
                + b"\r\n\r\n"
                + smuggled,
            )
            self.assertEqual(
                body,
                {"error": "invalid request framing: a transfer coding other than a single chunked"},
                coding,
            )
        self.refused(
            w,
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        )

    def test_connection_close_among_other_tokens_closes_after_the_answer(self):
        w = self.world()
        w.add("a")
        client = w.connect()
        client.protocol.dataReceived(
            b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: keep-alive,close, te\r\n\r\n"
            b"GET /api/ps HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        w.agent.last.respond(200, body=b"{}", finish=True)
        self.assertEqual(client.response().header("connection"), "close")
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual([r.uri for r in w.agent.requests], [b"http://10.0.0.1:11434/api/version"])
