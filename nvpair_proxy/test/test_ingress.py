"""What reaches the facade at all: the loopback gate, the identity probe, the body limit,
hop-by-hop headers and backpressure (protocol 5, design decisions 10 and 16)."""

from __future__ import annotations

import json

from nvpair_proxy.core.constants import MAX_REQUEST_BODY
from nvpair_proxy.test.world import Response, WorldTestCase
from nvpair_proxy.testing import lan, mapped_loopback

LOOPBACK_ONLY = {
    "error": "plaintext requests are accepted only from loopback; cluster peers "
    "must use the mTLS ingress",
    "code": "loopback-only",
}


class LoopbackGateTests(WorldTestCase):
    def test_plaintext_from_a_lan_peer_gets_403_loopback_only_and_nothing_is_dialled(self):
        w = self.world()
        w.add("a")
        client = w.send("POST", "/api/chat", {"model": "llama3"}, peer=lan())
        response = client.response()
        self.assertEqual((response.status, response.json()), (403, LOOPBACK_ONLY))
        self.assertEqual(response.header("x-content-type-options"), "nosniff")
        self.assertIsNone(response.header("access-control-allow-origin"))
        self.assertEqual(w.agent.requests, [])

    def test_a_lan_preflight_is_refused_too(self):
        w = self.world()
        client = w.send(
            "OPTIONS",
            "/v1/chat/completions",
            peer=lan(),
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        self.assertEqual(client.response().status, 403)

    def test_ipv4_mapped_loopback_is_loopback(self):
        w = self.world()
        w.add("a")
        w.send("POST", "/api/chat", {"model": "llama3"}, peer=mapped_loopback())
        self.assertEqual(len(w.agent.requests), 1)
        w.agent.last.respond(200, length=0, finish=True)

    def test_a_tls_hello_is_refused_while_this_node_is_not_a_cluster_member(self):
        w = self.world()
        client = w.connect(lan())
        protocol, transport = client.protocol, client.transport
        protocol.dataReceived(b"\x16\x03\x01\x00\xa5")
        self.assertEqual(transport.value(), b"")
        self.assertTrue(transport.disconnecting)


class IdentityProbeTests(WorldTestCase):
    def test_probe_header_gets_409_naming_the_engine(self):
        w = self.world("lmstudio")
        client = w.send("GET", "/v1/models", headers={"X-NVPAIR-Engine-Identity-Probe": "1"})
        response = client.response()
        self.assertEqual(response.status, 409)
        self.assertEqual(response.json()["code"], "proxy-facade")
        self.assertIn("lmstudio", response.json()["error"])
        self.assertEqual(w.agent.requests, [])


class BodyLimitTests(WorldTestCase):
    def test_a_declared_length_over_32_mib_is_413_before_the_body_arrives(self):
        w = self.world()
        w.add("a")
        client = w.connect()
        protocol, transport = client.protocol, client.transport
        protocol.dataReceived(
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
            % (MAX_REQUEST_BODY + 1)
        )
        response = Response(transport.value())
        self.assertEqual(
            (response.status, response.json()),
            (413, {"error": "request body exceeds 32 MiB limit"}),
        )
        self.assertTrue(transport.disconnecting)
        self.assertEqual(w.agent.requests, [])

    def test_a_chunked_body_over_32_mib_is_413(self):
        w = self.world()
        w.add("a")
        client = w.connect()
        protocol, transport = client.protocol, client.transport
        protocol.dataReceived(
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * (1024 * 1024)
        for _ in range(33):
            protocol.dataReceived(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.assertEqual(Response(transport.value()).status, 413)
        self.assertEqual(w.agent.requests, [])

    def test_exactly_32_mib_is_accepted_and_forwarded_intact(self):
        w = self.world()
        w.add("a")
        body = b'{"model":"llama3","pad":"' + b"x" * (MAX_REQUEST_BODY - 27) + b'"}'
        self.assertEqual(len(body), MAX_REQUEST_BODY)
        w.send("POST", "/api/chat", body)
        self.assertEqual(len(w.agent.requests), 1)
        self.assertEqual(w.agent.last.body, body)
        w.agent.last.respond(200, length=0, finish=True)


class HeaderTests(WorldTestCase):
    def test_hop_by_hop_headers_are_removed_both_ways_and_host_is_the_target(self):
        w = self.world()
        w.add("a")
        client = w.send(
            "POST",
            "/api/chat",
            {"model": "llama3"},
            headers={
                "Connection": "keep-alive, X-Secret-Hop",
                "X-Secret-Hop": "1",
                "Keep-Alive": "300",
                "TE": "trailers",
                "Proxy-Authorization": "Basic x",
                "Authorization": "Bearer t",
                "X-Custom": "kept",
            },
        )
        sent = w.agent.last.headers
        for name in (
            b"connection",
            b"x-secret-hop",
            b"keep-alive",
            b"te",
            b"proxy-authorization",
            b"host",
            b"content-length",
        ):
            self.assertFalse(sent.hasHeader(name), name)
        self.assertEqual(sent.getRawHeaders(b"authorization"), [b"Bearer t"])
        self.assertEqual(sent.getRawHeaders(b"x-custom"), [b"kept"])
        self.assertFalse(
            any(n.lower().startswith(b"x-forwarded") for n, _ in sent.getAllRawHeaders())
        )
        # Design 16: our hop, and nothing else, is added.
        token = w.facade.upstreams.loop_guard.token
        self.assertEqual(sent.getRawHeaders(b"via"), [b"1.1 nvpair-" + token.encode()])
        w.agent.last.respond(
            200,
            {
                "Connection": "close, X-Up-Hop",
                "X-Up-Hop": "1",
                "Keep-Alive": "5",
                "X-Engine": "kept",
            },
            body=b"ok",
            finish=True,
        )
        response = client.response()
        self.assertIsNone(response.header("x-up-hop"))
        self.assertIsNone(response.header("keep-alive"))
        self.assertEqual(response.header("x-engine"), "kept")

    def test_a_long_connection_value_is_honoured_but_not_cached(self):
        from nvpair_proxy.core.memo import Memo
        from nvpair_proxy.http import hopbyhop

        self.patch(hopbyhop, "_SKIP", Memo(hopbyhop.MAX_CACHED))

        def cached(value: str) -> bool:
            return any(
                value.encode() in part
                for key in hopbyhop._SKIP
                for part in key
                if isinstance(part, tuple)
            )

        w = self.world()
        w.add("a")
        short = "keep-alive, X-Short-Hop"
        long = "keep-alive, " + ", ".join(f"X-Hop-{i:03}" for i in range(30))
        self.assertGreater(len(long), hopbyhop.MAX_CACHED_VALUE)
        for value, hop in ((short, "X-Short-Hop"), (long, "X-Hop-029"), (long, "X-Hop-000")):
            w.send(
                "POST",
                "/api/chat",
                {"model": "llama3"},
                headers={"Connection": value, hop: "1", "X-Custom": "kept"},
            )
            sent = w.agent.last.headers
            self.assertFalse(sent.hasHeader(hop.encode()), hop)
            self.assertFalse(sent.hasHeader(b"connection"))
            self.assertEqual(sent.getRawHeaders(b"x-custom"), [b"kept"])
            w.agent.last.respond(200, length=0, finish=True)
        self.assertEqual((cached(short), cached(long)), (True, False))

    def test_the_cache_of_connection_values_stays_within_its_bound(self):
        from twisted.web.http_headers import Headers

        from nvpair_proxy.core.memo import Memo
        from nvpair_proxy.http import hopbyhop

        self.patch(hopbyhop, "_SKIP", Memo(8))
        sizes = []
        for index in range(20):
            hop = b"X-Hop-%d" % index
            headers = Headers(
                {b"Connection": [b"keep-alive, " + hop], hop: [b"1"], b"X-Custom": [b"kept"]}
            )
            sent = hopbyhop.end_to_end(headers)
            self.assertFalse(sent.hasHeader(hop), index)  # honoured whether cached or not
            self.assertEqual(sent.getRawHeaders(b"x-custom"), [b"kept"])
            sizes.append(len(hopbyhop._SKIP))
        self.assertEqual(max(sizes), 8)  # filled to its bound, never past it

    def test_repeated_headers_are_kept(self):
        w = self.world()
        w.add("a")
        client = w.send("GET", "/api/ps")
        from twisted.web.http_headers import Headers

        w.agent.last.respond(200, Headers({b"set-cookie": [b"a=1", b"b=2"]}), length=0, finish=True)
        self.assertEqual(client.response().headers["set-cookie"], ["a=1", "b=2"])


class BackpressureTests(WorldTestCase):
    def test_a_paused_client_pauses_the_upstream_read_and_resuming_resumes_it(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        upstream = w.agent.last.respond(200, {"Content-Type": "application/x-ndjson"})
        upstream.write(b'{"done":false}\n')
        self.assertFalse(upstream.transport.paused)
        client.pause()
        self.assertTrue(upstream.transport.paused)
        client.resume()
        self.assertFalse(upstream.transport.paused)
        upstream.write(json.dumps({"done": True}).encode() + b"\n")
        upstream.finish()
        self.assertEqual(client.response().body, b'{"done":false}\n{"done": true}\n')
        w.assert_quiet(self)


class ServerTimeoutTests(WorldTestCase):
    def test_headers_must_arrive_within_ten_seconds_of_the_request_line(self):
        w = self.world()
        client = w.connect()
        protocol, transport = client.protocol, client.transport
        protocol.dataReceived(b"POST /api/chat HTTP/1.1\r\nHost: x\r\n")
        w.site_clock.advance(9.9)
        protocol.dataReceived(b"X-Slow: 1\r\n")
        self.assertFalse(transport.disconnecting)
        w.site_clock.advance(0.2)
        self.assertTrue(transport.disconnecting)

    def test_complete_headers_cancel_the_header_timer_and_idle_timeout_is_90s(self):
        w = self.world()
        w.add("a")
        client = w.send("GET", "/api/ps")
        w.site_clock.advance(60)
        self.assertFalse(client.transport.disconnecting)
        w.agent.last.respond(200, body=b"{}", length=2, finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(w.site.timeOut, 90)
        w.site_clock.advance(90)
        self.assertTrue(client.transport.disconnecting)


class RejectionReportTests(WorldTestCase):
    def _reports(self, w):
        return [(p["status"], p["error"]) for m, p in w.emitter.sent if m == "ollama:proxy/request"]

    def test_the_probe_the_gate_and_the_body_limit_are_reported(self):
        w = self.world()
        w.send("GET", "/", headers={"X-NVPAIR-Engine-Identity-Probe": "1"})
        w.send("GET", "/api/tags", peer=lan())
        client = w.connect()
        client.protocol.dataReceived(
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\nExpect: 100-continue"
            b"\r\nContent-Length: %d\r\n\r\n" % (MAX_REQUEST_BODY + 1)
        )
        self.assertEqual([s for s, _ in self._reports(w)], [409, 403, 413])
        self.assertEqual(self._reports(w)[2][1], "request body exceeds 32 MiB limit")
        self.assertNotIn(b"100 Continue", client.raw())

    def test_the_gate_has_the_body_limit_and_header_timeout_too(self):
        w = self.world()
        client = w.connect(lan())
        client.protocol.dataReceived(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_REQUEST_BODY + 1)
        )
        self.assertEqual(client.response().status, 413)
        slow = w.connect(lan())
        slow.protocol.dataReceived(b"GET / HTTP/1.1\r\n")
        w.site_clock.advance(10)
        self.assertTrue(slow.transport.disconnecting)

    def test_a_connection_that_never_speaks_is_closed_after_ten_seconds(self):
        w = self.world()
        silent = w.connect()
        w.site_clock.advance(9.9)
        self.assertFalse(silent.transport.disconnecting)
        w.site_clock.advance(0.1)
        self.assertTrue(silent.transport.disconnecting)


class ModelListTests(WorldTestCase):
    def test_fan_out_strips_credentials_and_content_coding_and_merges_first_wins(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send(
            "GET",
            "/api/tags",
            headers={
                "Authorization": "Bearer t",
                "Cookie": "c=1",
                "Accept-Encoding": "gzip",
                "X-Kept": "1",
            },
        )
        for record in w.agent.requests:
            for name in (b"authorization", b"cookie", b"accept-encoding"):
                self.assertFalse(record.headers.hasHeader(name))
            self.assertEqual(record.headers.getRawHeaders(b"x-kept"), [b"1"])
        w.agent.requests[0].respond(
            200, body=b'{"models":[{"name":"llama3:latest","size":1}]}', finish=True
        )
        w.agent.requests[1].respond(
            200,
            body=b'{"models":[{"name":"llama3:latest","size":2},{"model":"mistral:latest"}]}',
            finish=True,
        )
        self.assertEqual(
            client.response().json(),
            {"models": [{"name": "llama3:latest", "size": 1}, {"model": "mistral:latest"}]},
        )
        self.assertEqual(
            [m for m, _ in w.emitter.sent], ["ollama:proxy/request-started", "ollama:proxy/request"]
        )
        self.assertEqual(w.emitter.sent[0][1]["target"], "cluster")

    def test_nothing_valid_is_503_and_502_with_an_origin(self):
        for headers, status in (({}, 503), ({"Origin": "http://app.example"}, 502)):
            w = self.world()
            w.add("a")
            client = w.send("GET", "/api/tags", headers=headers)
            w.agent.last.respond(
                200, {"Access-Control-Allow-Origin": "*"}, body=b"not json", finish=True
            )
            self.assertEqual(
                (client.response().status, client.response().json()),
                (status, {"error": "model inventory unavailable"}),
            )

    def test_half_a_request_line_is_closed_after_ten_seconds(self):
        w = self.world()
        slow = w.connect()
        slow.protocol.dataReceived(b"GET /api/tags HT")
        w.site_clock.advance(9.9)
        self.assertFalse(slow.transport.disconnecting)
        w.site_clock.advance(0.1)
        self.assertTrue(slow.transport.disconnecting)


class FrontDoorTests(WorldTestCase):
    """The facade decides once what a request is (``facade.decide``): a refusal, a preflight,
    a model list or a forward, each with its one handler."""

    def counting(self, w):
        """Count the engine's route classifications from here on."""
        calls = []

        class Counting:
            def __init__(self, engine) -> None:
                self.engine = engine

            def __getattr__(self, name):
                return getattr(self.engine, name)

            def classify(self, method, path):
                calls.append((method, path))
                return self.engine.classify(method, path)

        w.facade.engine = Counting(w.facade.engine)
        return calls

    def test_a_forwarded_request_is_classified_once(self):
        w = self.world()
        w.add("a")
        calls = self.counting(w)
        client = w.chat()
        w.agent.last.respond(
            200, {"Content-Type": "application/x-ndjson"}, b'{"done":true}\n', finish=True
        )
        self.assertEqual(client.response().status, 200)
        self.assertEqual(calls, [(b"POST", b"/api/chat")])

    def test_a_refusal_is_classified_once_and_reported_with_its_route(self):
        w = self.world()
        calls = self.counting(w)
        w.send("POST", "/api/chat", {"model": "m"}, headers={"X-NVPAIR-Engine-Identity-Probe": "1"})
        self.assertEqual(calls, [(b"POST", b"/api/chat")])
        reported = [p for m, p in w.emitter.sent if m == "ollama:proxy/request"]
        self.assertEqual([(p["status"], p["path"]) for p in reported], [(409, "/api/chat")])
