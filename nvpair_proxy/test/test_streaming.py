"""Real sockets end to end: client -> proxy facade -> simulated engine node.

These are the tests where a real socket is the point: HTTP framing, chunked encoding, pooled
connections and multi-megabyte bodies as the kernel delivers them. The engines' clock is a
frozen ``Clock`` so their bodies are deterministic and comparable byte for byte.
"""

from __future__ import annotations

import json
import random

from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.server import Site

from nvpair_proxy.facade.facade import facade_site, make_facade
from nvpair_proxy.facade.listener import DemuxFactory
from nvpair_proxy.http.requestbody import BytesProducer
from nvpair_proxy.nodes.discovery import make_node
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.request.dispatch import Bounds
from nvpair_proxy.routing.reservations import ReservationMap
from nvpair_proxy.testing import RecordingEmitter
from nvpair_proxy.testing.simfleet import SimNode, SimNodeResource

ENGINES = load_engines()


class EndToEndTests(TestCase):
    def setUp(self):
        self.pools = []

    def _pool(self):
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.pools.append(pool)
        self.addCleanup(pool.closeCachedConnections)
        return pool

    def _node(self, node: SimNode):
        port = reactor.listenTCP(0, Site(SimNodeResource(node, Clock())), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        node.port = port.getHost().port
        return node

    def _proxy(self, engine_id: str, nodes):
        engine = ENGINES[engine_id]
        self.emitter = RecordingEmitter()
        facade = make_facade(
            engine,
            clock=reactor,
            agent=Agent(reactor, pool=self._pool()),
            emitter=self.emitter,
            run_id="0" * 16,
            random=random.random,
            bounds=Bounds(),
            reservations=ReservationMap(),
        )
        for sim in nodes:
            facade.router.put_manual(
                make_node(
                    engine,
                    id=sim.node_id,
                    port=sim.port,
                    addresses=["127.0.0.1"],
                    models=sim.models,
                )
            )
        port = reactor.listenTCP(
            0, DemuxFactory(facade_site(facade, reactor)), interface="127.0.0.1"
        )
        self.addCleanup(port.stopListening)
        self.facade = facade
        return port.getHost().port

    @inlineCallbacks
    def _post(self, port: int, path: str, body: dict):
        agent = Agent(reactor, pool=self._pool())
        data = json.dumps(body).encode()
        response = yield agent.request(
            b"POST",
            f"http://127.0.0.1:{port}{path}".encode(),
            Headers({b"content-type": [b"application/json"]}),
            BytesProducer(data),
        )
        content = yield readBody(response)
        return response, content

    @inlineCallbacks
    def test_multi_megabyte_sse_stream_is_byte_exact(self):
        node = self._node(
            SimNode("gpu-a", "lmstudio", models=["qwen"], tokens=96, chunk_size=48 * 1024)
        )
        proxy = self._proxy("lmstudio", [node])
        body = {"model": "qwen", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        direct, direct_body = yield self._post(node.port, "/v1/chat/completions", body)
        via, via_body = yield self._post(proxy, "/v1/chat/completions", body)
        self.assertGreater(len(direct_body), 4 * 1024 * 1024)
        self.assertEqual(via.code, 200)
        # The node numbers its completions; the second request is number 2.
        self.assertEqual(via_body, direct_body.replace(b"chatcmpl-gpu-a-1", b"chatcmpl-gpu-a-2"))
        self.assertTrue(via_body.endswith(b"data: [DONE]\n\n"))
        self.assertEqual(via.headers.getRawHeaders(b"x-sim-node"), [b"gpu-a"])
        completed = [p["workloadInfo"] for m, p in self.emitter.sent if m == "workload:completed"]
        self.assertEqual(len(completed), 1)
        self.assertEqual(completed[0]["stats"]["completionTokens"], 96)

    @inlineCallbacks
    def test_ndjson_stream_is_byte_exact_and_fails_over_from_a_503(self):
        busy = self._node(SimNode("gpu-a", "ollama", models=["llama3:latest"], status=503))
        good = self._node(SimNode("gpu-b", "ollama", models=["llama3:latest"], tokens=20))
        proxy = self._proxy("ollama", [busy, good])
        body = {"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}
        direct, direct_body = yield self._post(good.port, "/api/chat", body)
        via, via_body = yield self._post(proxy, "/api/chat", body)
        self.assertEqual(via.code, 200)
        self.assertEqual(via_body, direct_body)
        self.assertEqual(via.headers.getRawHeaders(b"content-type"), [b"application/x-ndjson"])
        self.assertEqual(busy.served, [("POST", "/api/chat")])
        lines = [json.loads(line) for line in via_body.splitlines()]
        self.assertTrue(lines[-1]["done"])
        events = [
            (m, p["workloadInfo"].get("scheduledOn"))
            for m, p in self.emitter.sent
            if m.startswith("workload:")
        ]
        self.assertEqual(
            events,
            [
                ("workload:submitted", None),
                ("workload:submitted", "gpu-a"),
                ("workload:submitted", "gpu-b"),
                ("workload:started", "gpu-b"),
                ("workload:completed", "gpu-b"),
            ],
        )

    @inlineCallbacks
    def test_truncated_upstream_reaches_the_client_as_a_truncation(self):
        node = self._node(
            SimNode("gpu-a", "ollama", models=["llama3:latest"], tokens=10, die_after_tokens=3)
        )
        proxy = self._proxy("ollama", [node])
        agent = Agent(reactor, pool=self._pool())
        response = yield agent.request(
            b"POST",
            f"http://127.0.0.1:{proxy}/api/chat".encode(),
            Headers(),
            BytesProducer(json.dumps({"model": "llama3"}).encode()),
        )
        from twisted.web.client import PartialDownloadError, ResponseFailed

        try:
            yield readBody(response)
        except (PartialDownloadError, ResponseFailed):
            pass
        else:
            self.fail("a truncated stream was delivered as complete")
        terminal = [
            p["workloadInfo"]["state"]
            for m, p in self.emitter.sent
            if m in ("workload:completed", "workload:errored")
        ]
        self.assertEqual(terminal, ["completed"])

    @inlineCallbacks
    def test_llamacpp_model_lists_cover_the_whole_fleet(self):
        a = self._node(SimNode("gpu-a", "llamacpp", models=["m1", "m2"], loaded=["m1"]))
        b = self._node(SimNode("gpu-b", "llamacpp", models=["m2"], loaded=["m2"]))
        proxy = self._proxy("llamacpp", [a, b])
        agent = Agent(reactor, pool=self._pool())
        for path in (b"/models", b"/v1/models"):
            response = yield agent.request(b"GET", b"http://127.0.0.1:%d%s" % (proxy, path))
            data = json.loads((yield readBody(response)))
            self.assertEqual(response.code, 200)
            self.assertEqual(data["object"], "list")
            self.assertEqual([m["id"] for m in data["data"]], ["m1", "m2"])

    @inlineCallbacks
    def test_the_facade_listens_on_ipv4_and_ipv6_loopback(self):
        import socket as socketlib

        from nvpair_proxy.facade.listener import listen_everywhere

        if not socketlib.has_ipv6:
            raise SkipTest("no IPv6")
        node = self._node(SimNode("gpu-a", "ollama", models=["llama3:latest"], tokens=1))
        self._proxy("ollama", [node])
        listening = listen_everywhere(reactor, 0, DemuxFactory(facade_site(self.facade, reactor)))
        self.addCleanup(listening.stopListening)
        port = listening.getHost().port
        agent = Agent(reactor, pool=self._pool())
        for host in (b"127.0.0.1", b"[::1]"):
            response = yield agent.request(b"GET", b"http://%s:%d/api/tags" % (host, port))
            body = json.loads((yield readBody(response)))
            self.assertEqual(response.code, 200, host)
            self.assertEqual([m["name"] for m in body["models"]], ["llama3:latest"])
