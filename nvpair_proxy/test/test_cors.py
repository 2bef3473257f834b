"""Browser policy (spec 5.8, protocol 5 and 7): preflights fan out to every engine and get the
intersection of what the responding engines allow; model lists with an Origin need every
responding engine's agreement; the proxy's own errors grant nothing."""

from __future__ import annotations

from twisted.web.http_headers import Headers

from nvpair_proxy.test.world import WorldTestCase
from nvpair_proxy.testing import FakeAgent

ORIGIN = "http://app.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type",
}
LIST_A = b'{"models":[{"name":"llama3:latest"}]}'
LIST_B = b'{"models":[{"name":"mistral:latest"}]}'
MERGED = {"models": [{"name": "llama3:latest"}, {"name": "mistral:latest"}]}


def cors_headers(response) -> dict[str, list[str]]:
    return {
        name: values
        for name, values in response.headers.items()
        if name.startswith("access-control-")
    }


def allowing(**extra) -> dict:
    """An engine's answer allowing ORIGIN (echoed), with more headers."""
    return {"Access-Control-Allow-Origin": ORIGIN, **extra}


class PreflightDetectionTests(WorldTestCase):
    def test_an_options_without_preflight_headers_is_routed_normally(self):
        for headers in ({}, {"Origin": ORIGIN}, {"Access-Control-Request-Method": "POST"}):
            w = self.world()
            w.add("a"), w.add("b", addresses=("10.0.0.2",))
            client = w.send(
                "OPTIONS", "/api/chat", headers={"Authorization": "Bearer t", **headers}
            )
            self.assertEqual(len(w.agent.requests), 1, headers)
            sent = w.agent.last
            self.assertEqual(
                (sent.method, sent.uri), (b"OPTIONS", b"http://10.0.0.1:11434/api/chat")
            )
            self.assertEqual(sent.headers.getRawHeaders(b"authorization"), [b"Bearer t"])
            sent.respond(200, {"Allow": "GET, POST"}, length=0, finish=True)
            self.assertEqual(client.response().status, 200)
            self.assertEqual(client.response().header("allow"), "GET, POST")
            self.assertEqual(w.emitter.sent[-1][1]["target"], "10.0.0.1:11434")

    def test_a_preflight_goes_to_every_routable_node_with_its_path_and_query(self):
        w = self.world()
        w.add("b", addresses=("10.0.0.2",)), w.add("a"), w.add("c", addresses=("10.0.0.3",))
        w.send("OPTIONS", "/v1/chat/completions?x=1", headers=PREFLIGHT)
        self.assertEqual(
            [(r.method, r.uri) for r in w.agent.requests],
            [
                (b"OPTIONS", b"http://10.0.0.1:11434/v1/chat/completions?x=1"),
                (b"OPTIONS", b"http://10.0.0.2:11434/v1/chat/completions?x=1"),
                (b"OPTIONS", b"http://10.0.0.3:11434/v1/chat/completions?x=1"),
            ],
        )
        for record in w.agent.requests:
            record.respond(204, allowing(), finish=True)


class PreflightFanOutTests(WorldTestCase):
    def test_caller_credentials_and_hop_by_hop_headers_never_fan_out(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        w.send(
            "OPTIONS",
            "/api/chat",
            headers={
                **PREFLIGHT,
                "Authorization": "Bearer t",
                "Cookie": "s=1",
                "Proxy-Authorization": "Basic x",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "1",
                "Keep-Alive": "5",
                "X-Kept": "yes",
            },
        )
        self.assertEqual(len(w.agent.requests), 2)
        for record in w.agent.requests:
            sent = record.headers
            for name in (
                b"authorization",
                b"cookie",
                b"proxy-authorization",
                b"connection",
                b"x-hop",
                b"keep-alive",
                b"host",
                b"content-length",
            ):
                self.assertFalse(sent.hasHeader(name), name)
            self.assertEqual(sent.getRawHeaders(b"origin"), [ORIGIN.encode()])
            self.assertEqual(sent.getRawHeaders(b"access-control-request-method"), [b"POST"])
            self.assertEqual(
                sent.getRawHeaders(b"access-control-request-headers"), [b"content-type"]
            )
            self.assertEqual(sent.getRawHeaders(b"x-kept"), [b"yes"])
            self.assertIsNone(record.body)
            record.respond(204, allowing(), finish=True)

    def test_eight_at_a_time(self):
        w = self.world()
        for i in range(10):
            w.add(f"n{i}", addresses=(f"10.0.0.{i + 1}",))
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        self.assertEqual(len(w.agent.requests), 8)
        w.agent.requests[3].respond(204, allowing(), finish=True)
        self.assertEqual(len(w.agent.requests), 9)
        self.assertEqual(w.agent.last.uri, b"http://10.0.0.9:11434/api/chat")
        w.agent.requests[0].refuse()
        self.assertEqual(len(w.agent.requests), 10)
        for record in w.agent.requests:
            if record.pending:
                record.respond(204, allowing(), finish=True)
        self.assertEqual(client.response().status, 204)

    def test_ten_seconds_overall_then_the_unanswered_are_skipped_and_the_rest_never_asked(self):
        w = self.world()
        for i in range(10):
            w.add(f"n{i}", addresses=(f"10.0.0.{i + 1}",))
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.clock.advance(9)
        w.agent.requests[0].respond(204, allowing(**{"Access-Control-Max-Age": "600"}), finish=True)
        self.assertEqual(len(w.agent.requests), 9)
        w.clock.advance(1)
        self.assertEqual(len(w.agent.requests), 9)
        self.assertTrue(all(r.cancelled for r in w.agent.requests[1:]))
        response = client.response()
        self.assertEqual(response.status, 204)
        self.assertEqual(response.header("access-control-max-age"), "60")

    def test_policy_is_never_cached(self):
        w = self.world()
        w.add("a")
        first = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.agent.last.respond(204, allowing(), finish=True)
        second = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        self.assertEqual(len(w.agent.requests), 2)
        w.agent.last.respond(403, finish=True)
        self.assertEqual((first.response().status, second.response().status), (204, 403))

    def test_a_client_that_leaves_cancels_the_fan_out(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.agent.requests[0].respond(204, allowing(), finish=True)
        client.disconnect()
        self.assertTrue(w.agent.requests[1].cancelled)
        self.assertEqual(w.emitter.sent[-1][0], "ollama:proxy/request")
        self.assertEqual(w.emitter.sent[-1][1]["status"], 499)


class OneResponderTests(WorldTestCase):
    def test_the_only_target_answer_is_passed_through_unchanged(self):
        w = self.world()
        w.add("a")
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.agent.last.respond(
            204,
            {
                "Access-Control-Allow-Origin": "*",
                "Access-Control-Allow-Methods": "GET, POST, PUT",
                "Access-Control-Allow-Headers": "*",
                "Access-Control-Max-Age": "600",
                "X-Engine": "ollama",
            },
            finish=True,
        )
        response = client.response()
        self.assertEqual(response.status, 204)
        self.assertEqual(
            cors_headers(response),
            {
                "access-control-allow-origin": ["*"],
                "access-control-allow-methods": ["GET, POST, PUT"],
                "access-control-allow-headers": ["*"],
                "access-control-max-age": ["600"],
            },
        )
        self.assertEqual(response.header("x-engine"), "ollama")
        self.assertIsNone(response.header("content-type"))

    def test_a_single_denial_is_passed_through_with_its_missing_headers_and_body(self):
        for status, headers, body in (
            (200, {}, b""),
            (403, {"Content-Type": "text/plain"}, b"forbidden origin"),
            (200, {"Access-Control-Allow-Origin": "http://other.example"}, b""),
        ):
            w = self.world()
            w.add("a")
            client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
            w.agent.last.respond(status, headers, body=body, finish=True)
            response = client.response()
            self.assertEqual(response.status, status)
            self.assertEqual(response.body, body)
            self.assertEqual(response.header("content-type"), headers.get("Content-Type"))
            self.assertEqual(
                response.header("access-control-allow-origin"),
                headers.get("Access-Control-Allow-Origin"),
            )
            self.assertIsNone(response.header("access-control-max-age"))

    def test_the_only_target_answer_reaches_the_browser_byte_for_byte(self):
        w = self.world()
        w.add("a")
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.agent.last.respond(
            200,
            {
                "Access-Control-Allow-Origin": ORIGIN,
                "Access-Control-Allow-Methods": "POST",
                "X-Engine": "ollama",
                "Content-Type": "text/plain",
            },
            body=b"ok",
            finish=True,
        )
        # Twisted's own Server and Date lines aside, the bytes are the engine's answer.
        lines = [
            line
            for line in client.raw().split(b"\r\n")
            if not line.startswith((b"Server: ", b"Date: "))
        ]
        self.assertEqual(
            b"\r\n".join(lines),
            (
                b"HTTP/1.1 200 OK\r\n"
                b"Access-Control-Allow-Origin: http://app.example\r\n"
                b"Access-Control-Allow-Methods: POST\r\n"
                b"X-Engine: ollama\r\n"
                b"Content-Type: text/plain\r\n"
                b"Content-Length: 2\r\n\r\nok"
            ),
        )
        self.assertEqual(w.emitter.sent[-1][1]["node_id"], "a")


class OneOfSeveralRespondersTests(WorldTestCase):
    """When several targets were asked the answer is the fleet's, even if one responded."""

    def test_two_targets_one_unavailable_one_allowing_is_synthesized(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        a, b = w.agent.requests
        a.refuse()
        b.respond(
            200,
            allowing(
                **{
                    "Access-Control-Allow-Methods": "GET, POST",
                    "Access-Control-Allow-Headers": "Content-Type, X-A",
                    "Access-Control-Max-Age": "600",
                    "X-Engine": "ollama",
                    "Content-Type": "text/plain",
                }
            ),
            body=b"ok",
            finish=True,
        )
        response = client.response()
        self.assertEqual((response.status, response.body), (204, b""))
        self.assertEqual(
            cors_headers(response),
            {
                "access-control-allow-origin": [ORIGIN],
                "access-control-allow-methods": ["GET, POST"],
                "access-control-allow-headers": ["Content-Type, X-A"],
                "access-control-max-age": ["60"],
            },
        )
        self.assertEqual(
            (response.header("x-engine"), response.header("content-type"), response.header("vary")),
            (None, None, "Origin"),
        )
        self.assertNotIn("node_id", w.emitter.sent[-1][1])

    def test_credentials_of_the_only_responder_are_kept(self):
        w = self.world()
        for i, node in enumerate("abcd"):
            w.add(node, addresses=(f"10.0.0.{i + 1}",))
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        a, b, c, d = w.agent.requests
        a.refuse()
        b.respond(503, body=b"busy", finish=True)
        d.respond(
            204,
            allowing(
                **{"Access-Control-Max-Age": "600", "Access-Control-Allow-Credentials": "true"}
            ),
            finish=True,
        )
        w.clock.advance(10)
        self.assertTrue(c.cancelled)
        response = client.response()
        self.assertEqual(response.status, 204)
        self.assertEqual(
            cors_headers(response),
            {
                "access-control-allow-origin": [ORIGIN],
                "access-control-max-age": ["60"],
                "access-control-allow-credentials": ["true"],
            },
        )

    def test_a_denial_by_the_only_responder_is_passed_through_unchanged(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        a, b = w.agent.requests
        a.respond(
            204, {"Access-Control-Allow-Origin": "http://other.example"}, body=None, finish=True
        )
        b.fail()
        response = client.response()
        self.assertEqual(response.status, 204)
        self.assertEqual(
            cors_headers(response), {"access-control-allow-origin": ["http://other.example"]}
        )
        self.assertEqual(w.emitter.sent[-1][1]["node_id"], "a")


class IntersectionTests(WorldTestCase):
    def preflight(self, *answers, preflight=PREFLIGHT):
        w = self.world()
        for i in range(len(answers)):
            w.add(f"n{i}", addresses=(f"10.0.0.{i + 1}",))
        client = w.send("OPTIONS", "/v1/chat/completions", headers=preflight)
        for record, (status, headers) in zip(w.agent.requests, answers):
            record.respond(status, headers, body=b"ignored" if status == 200 else None, finish=True)
        return w, client.response()

    def test_every_responder_allowing_gives_a_synthesized_answer_with_the_intersection(self):
        _, response = self.preflight(
            (
                204,
                {
                    "Access-Control-Allow-Origin": "*",
                    "Access-Control-Allow-Methods": "GET, POST, PUT",
                    "Access-Control-Allow-Headers": "content-type, x-a",
                    "Access-Control-Max-Age": "600",
                    "Vary": "Origin",
                },
            ),
            (
                200,
                {
                    "Access-Control-Allow-Origin": ORIGIN,
                    "Access-Control-Allow-Credentials": "true",
                    "Access-Control-Allow-Methods": "POST, PUT, DELETE",
                    "Access-Control-Allow-Headers": "Content-Type, X-A, x-b",
                    "Vary": "Access-Control-Request-Headers",
                },
            ),
        )
        self.assertEqual(response.status, 204)
        self.assertEqual(
            cors_headers(response),
            {
                "access-control-allow-origin": [ORIGIN],
                "access-control-allow-methods": ["POST, PUT"],
                "access-control-allow-headers": ["content-type, x-a"],
                "access-control-max-age": ["60"],
            },
        )
        self.assertEqual(response.header("vary"), "Origin, Access-Control-Request-Headers")
        self.assertEqual(response.body, b"")
        self.assertIsNone(response.header("content-type"))

    def test_credentials_and_private_network_are_allowed_only_when_all_allow_them(self):
        both = {
            "Access-Control-Allow-Credentials": "true",
            "Access-Control-Allow-Private-Network": "true",
        }
        _, response = self.preflight((204, allowing(**both)), (204, allowing(**both)))
        self.assertEqual(
            cors_headers(response),
            {
                "access-control-allow-origin": [ORIGIN],
                "access-control-allow-credentials": ["true"],
                "access-control-allow-private-network": ["true"],
                "access-control-max-age": ["60"],
            },
        )
        _, response = self.preflight((204, allowing(**both)), (204, allowing()))
        self.assertEqual(
            cors_headers(response),
            {"access-control-allow-origin": [ORIGIN], "access-control-max-age": ["60"]},
        )

    def test_a_wildcard_covers_everything_but_authorization_and_only_without_credentials(self):
        _, response = self.preflight(
            (
                204,
                {
                    "Access-Control-Allow-Origin": "*",
                    "Access-Control-Allow-Methods": "*",
                    "Access-Control-Allow-Headers": "*",
                },
            ),
            (
                204,
                allowing(
                    **{
                        "Access-Control-Allow-Methods": "GET, POST",
                        "Access-Control-Allow-Headers": "Authorization, X-B",
                    }
                ),
            ),
        )
        self.assertEqual(response.header("access-control-allow-methods"), "GET, POST")
        self.assertEqual(response.header("access-control-allow-headers"), "X-B")
        wild = {
            "Access-Control-Allow-Origin": "*",
            "Access-Control-Allow-Methods": "*",
            "Access-Control-Allow-Headers": "*, authorization",
        }
        _, response = self.preflight(
            (204, wild), (204, {**wild, "Access-Control-Allow-Headers": "*"})
        )
        self.assertEqual(response.header("access-control-allow-methods"), "*")
        self.assertEqual(response.header("access-control-allow-headers"), "*")
        literal = allowing(
            **{"Access-Control-Allow-Credentials": "true", "Access-Control-Allow-Methods": "*"}
        )
        _, response = self.preflight(
            (204, literal),
            (204, {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": "*"}),
        )
        self.assertIsNone(response.header("access-control-allow-methods"))

    def test_nothing_in_common_omits_the_header(self):
        _, response = self.preflight(
            (204, allowing(**{"Access-Control-Allow-Methods": "PUT"})),
            (204, allowing(**{"Access-Control-Allow-Methods": "DELETE"})),
        )
        self.assertIsNone(response.header("access-control-allow-methods"))
        self.assertEqual(response.header("access-control-allow-origin"), ORIGIN)

    def test_a_denial_by_any_responder_wins_and_is_passed_through_unchanged(self):
        denials = (
            (403, {"Content-Type": "text/plain"}, b"nope"),
            (401, {"WWW-Authenticate": "Bearer"}, b""),
            (204, {}, b""),
            (204, {"Access-Control-Allow-Origin": "http://other.example"}, b""),
            (204, {"Access-Control-Allow-Origin": f"{ORIGIN}, http://other.example"}, b""),
            (404, allowing(), b"no such route"),
        )
        for status, headers, body in denials:
            w = self.world()
            w.add("a"), w.add("b", addresses=("10.0.0.2",)), w.add("c", addresses=("10.0.0.3",))
            client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
            a, b, c = w.agent.requests
            a.respond(204, allowing(**{"Access-Control-Allow-Methods": "POST"}), finish=True)
            b.respond(status, headers, body=body, finish=True)
            c.respond(204, allowing(), finish=True)
            response = client.response()
            self.assertEqual((response.status, response.body), (status, body), status)
            self.assertEqual(
                {
                    k: v
                    for k, v in response.headers.items()
                    if k not in ("date", "server", "content-length")
                },
                {k.lower(): [v] for k, v in headers.items()},
            )
            self.assertEqual(w.emitter.sent[-1][1]["node_id"], "b")

    def test_the_first_denial_in_candidate_order_is_the_one_shown(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        w.facade.router.set_pin("b")
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        b, a = w.agent.requests
        self.assertEqual(b.uri, b"http://10.0.0.2:11434/api/chat")
        a.respond(403, body=b"a says no", finish=True)
        b.respond(401, body=b"b says no", finish=True)
        self.assertEqual((client.response().status, client.response().body), (401, b"b says no"))

    def test_unavailable_targets_are_skipped(self):
        w = self.world()
        for i, node in enumerate("abcd"):
            w.add(node, addresses=(f"10.0.0.{i + 1}",))
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        a, b, c, d = w.agent.requests
        a.fail()
        b.respond(502, finish=True)
        c.respond(204, allowing(**{"Access-Control-Allow-Methods": "POST, PUT"}), finish=True)
        d.respond(204, allowing(**{"Access-Control-Allow-Methods": "POST"}), finish=True)
        response = client.response()
        self.assertEqual(
            (
                response.status,
                response.header("access-control-allow-methods"),
                response.header("access-control-max-age"),
            ),
            (204, "POST", "60"),
        )


class NoResponderTests(WorldTestCase):
    def test_no_responder_is_502_without_any_cors_header(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.agent.requests[0].refuse()
        w.agent.requests[1].respond(503, allowing(), finish=True)
        response = client.response()
        self.assertEqual(
            (response.status, response.json()), (502, {"error": "no engine answered the preflight"})
        )
        self.assertEqual(cors_headers(response), {})
        self.assertEqual(response.header("x-content-type-options"), "nosniff")
        self.assertIsNone(response.header("vary"))

    def test_no_engine_at_all_is_502_and_nothing_is_dialled(self):
        w = self.world()
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        response = client.response()
        self.assertEqual(
            (response.status, response.json()),
            (502, {"error": "no active node selected or available"}),
        )
        self.assertEqual(cors_headers(response), {})
        self.assertEqual(w.agent.requests, [])

    def test_targets_that_never_answer_are_502_after_ten_seconds(self):
        w = self.world()
        w.add("a")
        client = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.clock.advance(9.9)
        self.assertFalse(client.answered())
        w.clock.advance(0.1)
        self.assertTrue(w.agent.last.cancelled)
        self.assertEqual(client.response().status, 502)


class PreflightReportingTests(WorldTestCase):
    def test_a_fan_out_is_reported_as_cluster_and_takes_no_reservation_and_no_workload(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        w.reservations.set_priority(1, ["a", "b"])
        w.send("OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
        self.assertEqual(w.reservations.reservations, {})
        w.clock.advance(0.25)
        for record in w.agent.requests:
            record.respond(204, allowing(), finish=True)
        self.assertEqual(
            w.emitter.sent,
            [
                (
                    "ollama:proxy/request-started",
                    {
                        "id": "1",
                        "method": "OPTIONS",
                        "path": "/v1/chat/completions",
                        "target": "cluster",
                    },
                ),
                (
                    "ollama:proxy/request",
                    {
                        "id": "1",
                        "method": "OPTIONS",
                        "path": "/v1/chat/completions",
                        "target": "cluster",
                        "status": 204,
                        "duration_ms": 250,
                    },
                ),
            ],
        )
        self.assertEqual(w.emitter.workload(), [])

    def test_a_passed_through_answer_names_its_node_and_a_502_its_error(self):
        w = self.world()
        w.add("a")
        w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.agent.last.respond(403, finish=True)
        w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        w.agent.last.refuse()
        self.assertEqual(
            [(m, p.get("node_id"), p.get("status"), p.get("error")) for m, p in w.emitter.sent],
            [
                ("ollama:proxy/request-started", "a", None, None),
                ("ollama:proxy/request", "a", 403, None),
                ("ollama:proxy/request", None, 502, "no engine answered the preflight"),
            ],
        )


class ModelListOriginTests(WorldTestCase):
    def model_list(self, *answers, path="/api/tags", headers=None, engine="ollama"):
        w = self.world(engine)
        for i in range(len(answers)):
            w.add(f"n{i}", addresses=(f"10.0.0.{i + 1}",))
        client = w.send("GET", path, headers={"Origin": ORIGIN} if headers is None else headers)
        for record, answer in zip(w.agent.requests, answers):
            if answer is None:
                record.refuse()
            else:
                status, answer_headers, body = answer
                record.respond(status, answer_headers, body=body, finish=True)
        return w, client.response()

    def test_every_engine_allowing_gives_the_merged_list_with_the_combined_headers(self):
        _, response = self.model_list(
            (200, {"Access-Control-Allow-Origin": "*", "Vary": "Origin"}, LIST_A),
            (
                200,
                allowing(**{"Access-Control-Allow-Credentials": "true", "Vary": "Accept, origin"}),
                LIST_B,
            ),
        )
        self.assertEqual((response.status, response.json()), (200, MERGED))
        self.assertEqual(cors_headers(response), {"access-control-allow-origin": [ORIGIN]})
        self.assertEqual(response.header("vary"), "Origin, Accept")
        self.assertEqual(response.header("content-type"), "application/json")

    def test_credentials_are_allowed_only_when_every_engine_allows_them(self):
        creds = allowing(**{"Access-Control-Allow-Credentials": "true"})
        _, response = self.model_list((200, creds, LIST_A), (200, creds, LIST_B))
        self.assertEqual(
            cors_headers(response),
            {"access-control-allow-origin": [ORIGIN], "access-control-allow-credentials": ["true"]},
        )
        self.assertEqual(response.header("vary"), "Origin")

    def test_a_denial_by_any_engine_is_403_granting_nothing(self):
        denials = (
            (200, {}, LIST_B),
            (
                200,
                {"Access-Control-Allow-Origin": "http://other.example", "Vary": "Origin"},
                LIST_B,
            ),
            (401, {"WWW-Authenticate": "Bearer"}, b"login first"),
            (403, {}, b"forbidden"),
        )
        for denial in denials:
            w, response = self.model_list((200, allowing(), LIST_A), denial)
            self.assertEqual(
                (response.status, response.json()),
                (403, {"error": "origin not allowed by every engine"}),
            )
            # Protocol 5: the proxy's own error carries no CORS permission header.
            self.assertEqual(cors_headers(response), {})
            self.assertEqual(response.header("vary"), "Origin")
            self.assertIsNone(response.header("www-authenticate"))
            self.assertEqual(
                [(p["status"], p.get("node_id")) for _, p in w.emitter.sent], [(403, "n1")]
            )

    def test_a_denial_wins_over_an_invalid_inventory(self):
        _, response = self.model_list(
            (302, allowing(Location="/elsewhere"), b""), (200, {}, LIST_B)
        )
        self.assertEqual(response.status, 403)

    def test_an_invalid_inventory_is_502_without_a_partial_list_keeping_the_approved_headers(self):
        for invalid in (
            (302, allowing(Location="http://10.0.0.9/api/tags"), b""),
            (200, allowing(), b"not json"),
            (200, allowing(), b'{"data":[]}'),
            (404, allowing(), b"not found"),
        ):
            w, response = self.model_list((200, allowing(), LIST_A), invalid)
            self.assertEqual(
                (response.status, response.json()), (502, {"error": "model inventory unavailable"})
            )
            self.assertEqual(cors_headers(response), {"access-control-allow-origin": [ORIGIN]})
            self.assertEqual(response.header("vary"), "Origin")
            self.assertEqual(response.header("x-content-type-options"), "nosniff")
            self.assertEqual(len(w.agent.requests), 2)

    def test_an_invalid_inventory_without_every_approval_is_502_without_cors_headers(self):
        _, response = self.model_list((200, allowing(), LIST_A), (404, {}, b"not found"))
        self.assertEqual(response.status, 502)
        self.assertEqual(cors_headers(response), {})
        self.assertIsNone(response.header("vary"))

    def test_unavailable_engines_are_skipped(self):
        _, response = self.model_list(None, (503, {}, b"busy"), (200, allowing(), LIST_B))
        self.assertEqual(
            (response.status, response.json()), (200, {"models": [{"name": "mistral:latest"}]})
        )
        self.assertEqual(response.header("access-control-allow-origin"), ORIGIN)

    def test_no_responding_engine_is_502_without_cors_headers(self):
        _, response = self.model_list(None, (500, allowing(), b""))
        self.assertEqual(
            (response.status, response.json()), (502, {"error": "model inventory unavailable"})
        )
        self.assertEqual(cors_headers(response), {})

    def test_the_openai_list_follows_the_same_rules(self):
        _, response = self.model_list(
            (200, allowing(), b'{"object":"list","data":[{"id":"m1"}]}'),
            (200, allowing(), b'{"object":"list","data":[{"id":"m2"},{"id":"m1"}]}'),
            path="/v1/models",
            engine="llamacpp",
        )
        self.assertEqual(response.json(), {"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})
        self.assertEqual(response.header("access-control-allow-origin"), ORIGIN)


class ModelListWithoutOriginTests(WorldTestCase):
    def test_credentials_and_hop_by_hop_headers_are_stripped_and_vary_is_kept(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send(
            "GET",
            "/api/tags",
            headers={
                "Authorization": "Bearer t",
                "Cookie": "s=1",
                "Proxy-Authorization": "Basic x",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "1",
                "TE": "trailers",
            },
        )
        for record in w.agent.requests:
            for name in (
                b"authorization",
                b"cookie",
                b"proxy-authorization",
                b"connection",
                b"x-hop",
                b"te",
            ):
                self.assertFalse(record.headers.hasHeader(name), name)
        w.agent.requests[0].respond(200, {"Vary": "Accept-Encoding"}, body=LIST_A, finish=True)
        w.agent.requests[1].respond(
            200, Headers({b"Vary": [b"Origin", b"accept-encoding"]}), body=LIST_B, finish=True
        )
        response = client.response()
        self.assertEqual((response.status, response.json()), (200, MERGED))
        self.assertEqual(response.header("vary"), "Accept-Encoding, Origin")
        self.assertEqual(cors_headers(response), {})

    def test_a_redirect_is_not_followed_and_is_not_an_inventory(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("GET", "/api/tags")
        w.agent.requests[0].respond(301, {"Location": "http://10.0.0.9/api/tags"}, finish=True)
        w.agent.requests[1].respond(200, body=LIST_B, finish=True)
        self.assertEqual(len(w.agent.requests), 2)
        self.assertEqual(client.response().json(), {"models": [{"name": "mistral:latest"}]})

    def test_without_an_origin_a_refusal_is_only_a_missing_inventory(self):
        w = self.world()
        w.add("a")
        client = w.send("GET", "/api/tags")
        w.agent.last.respond(403, body=b"forbidden", finish=True)
        self.assertEqual(client.response().status, 503)


class FanOutTransportTests(WorldTestCase):
    def test_preflights_and_model_lists_dial_each_node_through_its_own_agent(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        peer = FakeAgent()
        w.facade.upstreams.agent_for_node = lambda node: peer if node.id == "b" else w.agent
        preflight = w.send("OPTIONS", "/api/chat", headers=PREFLIGHT)
        listing = w.send("GET", "/api/tags")
        self.assertEqual(w.agent.hosts(), ["10.0.0.1:11434", "10.0.0.1:11434"])
        self.assertEqual(peer.hosts(), ["10.0.0.2:11434", "10.0.0.2:11434"])
        for agent in (w.agent, peer):
            agent.requests[0].respond(204, allowing(), finish=True)
            agent.requests[1].respond(200, body=LIST_A, finish=True)
        self.assertEqual((preflight.response().status, listing.response().status), (204, 200))
        self.assertFalse(any(record.pending for record in peer.requests))
