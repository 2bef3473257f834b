"""The admin listener (issue 12): metrics equal what was reported, /status, the page, bounds."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import attrs
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy import __version__
from nvpair_proxy.admin.admin import AdminResource, loopback_host, status_page
from nvpair_proxy.admin.metrics import registry, scrape
from nvpair_proxy.admin.recorder import REASONS, Recorder, reason
from nvpair_proxy.admin.status import ProcessView, status
from nvpair_proxy.core.constants import MAX_REQUEST_BODY
from nvpair_proxy.core.views import InFlightView
from nvpair_proxy.http import answers
from nvpair_proxy.http.answers import Reason
from nvpair_proxy.http.server import BoundedSite
from nvpair_proxy.nodes.selfcheck import self_reason
from nvpair_proxy.process.options import Options, admin_address
from nvpair_proxy.request import events
from nvpair_proxy.test.support import by_labels, gate, request_ended, scraped, total
from nvpair_proxy.test.world import (
    Response,
    WorldStatus,
    WorldTestCase,
    request_bytes,
    serve_all,
    view_of,
)
from nvpair_proxy.testing import lan, loopback

NDJSON = {"Content-Type": "application/x-ndjson"}
# The gauges /metrics reads from the tree at scrape time (not the recorder's counts).
STATE_GAUGES = tuple(
    f"nvpair_proxy_{name}{{"
    for name in (
        "requests_in_flight",
        "requests_waiting_for_owner",
        "nodes",
        "nodes_busy_held",
        "nodes_cooling",
        "node_requests_in_flight",
        "reservations",
    )
)
MARKER = "PROMPT-MARKER-4e1d9b"


# The scenario's nodes by address, and what its events say without the recorder.
NODES = {b"10.0.0.1": "a", b"10.0.0.2": "b", b"10.0.0.3": "c"}
EARLY = (Reason.NO_OWNER.text, Reason.NO_CANDIDATE.text, Reason.ALL_OWNERS_BUSY.text)
ERROR_TEXTS = (
    (Reason.CLIENT_GONE.text, "client_gone"),
    (Reason.NO_OWNER.text, "no_owner"),
    ("upstream error: ", "transport"),
    (answers.FACADE_FOR, "identity_probe"),
)


def route_of(world, params: dict) -> str:
    route = world.engine.classify(params["method"].encode(), params["path"].encode())
    return events.route_class(route)


def outcome_of(params: dict) -> str:
    """A finished request's outcome from its proxy/request: 499 is a cancel; an error with no
    target, other than the dispatch loop's own answers, is an answer before routing."""
    if params["status"] == 499:
        return "cancelled"
    if params["target"] == "" and params.get("error") not in EARLY:
        return "rejected"
    return "completed" if params["status"] < 400 else "failed"


def dispatch_result(record) -> str:
    """How the fake engine ended one upstream request of the request path."""
    if record.cancelled:
        return "cancelled"
    if record.response is None:
        return "transport"
    if record.response.code >= 500:
        return "refused_status"
    return "no_content" if record.response.transport.stopped else "committed"


def admin_get(
    view: ProcessView, path: str, host: str = "127.0.0.1:9464", method: str = "GET"
) -> Response:
    site = BoundedSite(
        AdminResource(view, registry(view), status_page()), reactor=None, timeout=None
    )
    protocol = site.buildProtocol(loopback())
    transport = StringTransport(peerAddress=loopback())
    protocol.makeConnection(transport)
    protocol.dataReceived(request_bytes(method, path, headers={"Host": host}))
    return Response(transport.value())


class ScenarioTests(WorldTestCase):
    """A scripted scenario: failovers, a cancel, 502s, a stall, a model list and a rejection;
    the scrape then equals what the link was told, exactly."""

    def scenario(self):
        recorder = Recorder()
        w = self.world(recorder=recorder, response_timeout=60)
        w.add("a", addresses=("10.0.0.1",))
        w.add("b", addresses=("10.0.0.2",))
        w.add("c", addresses=("10.0.0.3",))
        body = {"model": "llama3", "messages": [{"role": "user", "content": MARKER}]}

        # 1. A 503, then a transport error, then a streamed completion with token stats.
        first = w.send("POST", "/api/chat", body)
        w.agent.last.respond(503, length=0, finish=True)
        w.agent.last.refuse()
        w.clock.advance(1)
        w.clock.advance(30)
        w.agent.last.respond(
            200,
            NDJSON,
            body=(
                b'{"message":{"content":"hi"},"done":false}\n'
                b'{"done":true,"prompt_eval_count":11,"eval_count":7,"eval_duration":700000000}\n'
            ),
            finish=True,
        )
        self.assertEqual(first.response().status, 200)

        # 2. One 500, then a non-streaming answer.
        second = w.send("POST", "/api/chat", dict(body, stream=False))
        w.agent.last.respond(500, length=0, finish=True)
        w.clock.advance(1)
        w.agent.last.respond(
            200,
            {"Content-Type": "application/json"},
            body=(b'{"done":true,"prompt_eval_count":5,"eval_count":3}'),
            finish=True,
        )
        self.assertEqual(second.response().status, 200)

        # 3. The client leaves while its attempt runs: cancelled.
        third = w.send("POST", "/api/chat", body)
        third.disconnect()

        # 4. Nobody has the model: a local 502, no dispatch.
        self.assertEqual(
            w.send("POST", "/api/chat", dict(body, model="nope")).response().status, 502
        )

        # 5. Five transport failures: the fifth answers 502.
        fifth = w.send("POST", "/api/generate", {"model": "llama3", "prompt": MARKER})
        for _ in range(5):
            w.agent.last.refuse()
            w.clock.advance(8)
        self.assertEqual(fifth.response().status, 502)

        # 6. A stall: the first node sends headers, then nothing for the whole first-content
        #    budget (the response cap, 60 s here); the request fails over to the next node,
        #    and the stalled one cools for 30 s.
        sixth = w.send("POST", "/api/chat", body)
        stalled = w.agent.last
        stalled.respond(200, NDJSON)
        w.clock.advance(60)
        self.assertIsNot(w.agent.last, stalled)
        w.agent.last.respond(200, NDJSON, body=b'{"done":true,"eval_count":1}\n', finish=True)
        self.assertEqual(sixth.response().status, 200)

        # 7. The fleet's model list, and 8. a rejected identity probe.
        tags = w.send("GET", "/api/tags")
        for record in w.agent.requests[-3:]:
            record.respond(
                200,
                {"Content-Type": "application/json"},
                body=b'{"models":[{"name":"llama3:latest"}]}',
                finish=True,
            )
        self.assertEqual(tags.response().status, 200)
        probe = w.send("GET", "/api/version", headers={"X-NVPAIR-Engine-Identity-Probe": "1"})
        self.assertEqual(probe.response().status, 409)
        return w, recorder

    def test_scraped_counters_equal_the_reported_events(self):
        w, recorder = self.scenario()
        view = view_of(w, recorder)
        samples = scraped(view)
        requests = [params for method, params in w.emitter.sent if method == "ollama:proxy/request"]
        workloads = [
            info
            for method, info in w.emitter.workload()
            if method in ("workload:completed", "workload:errored")
        ]
        states = Counter(info["state"] for info in workloads)
        early = [p for p in requests if p["target"] == "" and p.get("error") in EARLY]

        # Requests by route and outcome, each read from its proxy/request alone.
        ends = Counter((route_of(w, p), outcome_of(p)) for p in requests)
        self.assertEqual(
            by_labels(samples, "nvpair_proxy_requests_total", "route", "outcome"), ends
        )
        # Inference outcomes against the workload events: a failed request is a
        # workload:errored one, or one answered before any workload existed (no owner).
        self.assertEqual(ends["inference", "completed"], states["completed"])
        self.assertEqual(ends["inference", "cancelled"], states["cancelled"])
        self.assertEqual(ends["inference", "failed"], states["failed"] + len(early))
        self.assertEqual(
            ends,
            {
                ("inference", "completed"): 3,
                ("inference", "cancelled"): 1,
                ("inference", "failed"): 2,
                ("models", "completed"): 1,
                ("other", "rejected"): 1,
            },
        )

        # Reasons: each request that did not complete, by the proxy's text it ended with.
        reasons = Counter()
        for p in requests:
            if outcome_of(p) != "completed":
                reasons[
                    next(name for text, name in ERROR_TEXTS if p["error"].startswith(text))
                ] += 1
        self.assertEqual(by_labels(samples, "nvpair_proxy_request_errors_total", "reason"), reasons)
        self.assertEqual(set(reasons), {"client_gone", "no_owner", "transport", "identity_probe"})

        # Dispatches: every upstream request of the request path (the model list's are the
        # fleet's, not dispatches), by node and by how the fake engine answered it.
        dispatched = [r for r in w.agent.requests if b"/api/tags" not in r.uri]
        results = Counter(
            (NODES[r.uri.split(b"/")[2].split(b":")[0]], dispatch_result(r)) for r in dispatched
        )
        self.assertEqual(
            by_labels(samples, "nvpair_proxy_dispatches_total", "node", "result"), results
        )
        self.assertEqual(
            {result for _, result in results},
            {"committed", "refused_status", "transport", "no_content", "cancelled"},
        )
        started = [info for method, info in w.emitter.workload() if method == "workload:started"]
        self.assertEqual(
            total(samples, "nvpair_proxy_dispatches_total", result="committed"), len(started)
        )
        # A failover is every dispatch after a request's first.
        placed = {info["id"] for _, info in w.emitter.workload() if info.get("scheduledOn")}
        self.assertEqual(
            total(samples, "nvpair_proxy_failovers_total"), len(dispatched) - len(placed)
        )

        # The stalled node cools (30 s, and no time passed since).
        (stalled,) = [node for node, result in results if result == "no_content"]
        self.assertEqual(total(samples, "nvpair_proxy_nodes_cooling", engine="ollama"), 1)
        document = status(view)
        self.assertEqual(document["engines"][0]["cooling"], [stalled])
        self.assertEqual([n["id"] for n in document["nodes"] if n["cooling"]], [stalled])

        for node in ("a", "b", "c"):
            done = [i for i in workloads if i.get("scheduledOn") == node and "stats" in i]
            self.assertEqual(
                total(samples, "nvpair_proxy_generated_tokens_total", node=node),
                sum(i["stats"]["completionTokens"] for i in done),
            )
            self.assertEqual(
                total(samples, "nvpair_proxy_prompt_tokens_total", node=node),
                sum(i["stats"].get("promptTokens", 0) for i in done),
            )
            with_ttfb = [p for p in requests if p.get("node_id") == node and "ttfb_ms" in p]
            self.assertEqual(
                total(samples, "nvpair_proxy_ttfb_seconds_count", node=node), len(with_ttfb)
            )
            self.assertAlmostEqual(
                total(samples, "nvpair_proxy_ttfb_seconds_sum", node=node),
                sum(p["ttfb_ms"] for p in with_ttfb) / 1000,
                places=2,
            )
        self.assertEqual(total(samples, "nvpair_proxy_generated_tokens_total"), 11)
        self.assertEqual(total(samples, "nvpair_proxy_prompt_tokens_total"), 16)
        self.assertEqual(
            total(samples, "nvpair_proxy_request_duration_seconds_count"), len(requests)
        )
        self.assertEqual(total(samples, "nvpair_proxy_requests_in_flight"), 0)
        self.assertEqual(total(samples, "nvpair_proxy_nodes", engine="ollama"), 3)

    def test_labels_are_bounded_vocabularies_never_models_paths_or_clients(self):
        w, recorder = self.scenario()
        text = scrape(registry(view_of(w, recorder))).decode()
        allowed = {
            "engine",
            "node",
            "route",
            "outcome",
            "result",
            "reason",
            "le",
            "version",
            "mode",
            "python",
            "twisted",
        }
        for name in re.findall(r"[{,]([a-z_]+)=", text):
            self.assertIn(name, allowed)
        for forbidden in ("llama3", "/api/", "127.0.0.1", "nope", MARKER):
            self.assertNotIn(forbidden, text)

    def test_latency_buckets_reach_the_cases_that_hurt_and_stay_few(self):
        """A cold load or a long context on a small GPU takes minutes to its first byte: a
        histogram whose buckets stop at seconds flattens exactly those in histogram_quantile."""
        w, recorder = self.scenario()
        recorder.queue_left("ollama", 250.0)
        samples = scraped(view_of(w, recorder))
        for family in ("ttfb_seconds", "request_duration_seconds", "queue_wait_seconds"):
            bounds = sorted(
                {
                    float(dict(key)["le"])
                    for (name, key), _ in samples.items()
                    if name == f"nvpair_proxy_{family}_bucket"
                }
            )
            self.assertEqual(bounds[-1], float("inf"), family)
            self.assertGreaterEqual(bounds[-2], 300.0, family)
            self.assertLessEqual(len(bounds), 16, family)
        self.assertEqual(total(samples, "nvpair_proxy_queue_wait_seconds_bucket", le="120.0"), 0)
        self.assertEqual(total(samples, "nvpair_proxy_queue_wait_seconds_bucket", le="300.0"), 1)

    def test_a_node_that_left_the_fleet_leaves_the_scrape(self):
        w, recorder = self.scenario()
        view = view_of(w, recorder)
        self.assertIn('node="b"', scrape(registry(view)).decode())
        w.remove("b")
        text = scrape(registry(view)).decode()
        self.assertNotIn('node="b"', text)
        self.assertIn('node="a"', text)
        self.assertNotIn("b", [node["id"] for node in status(view)["nodes"]])
        self.assertNotIn("b", recorder.last_request)

    def test_status_never_contains_a_prompt(self):
        w, recorder = self.scenario()
        view = view_of(w, recorder)
        for path in ("/status", "/metrics", "/"):
            response = admin_get(view, path)
            self.assertEqual(response.status, 200, path)  # an error page would prove nothing
            self.assertNotIn(MARKER.encode(), response.body)

    def test_in_flight_waiting_held_and_reservations_read_from_the_tree(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
        w.add("a")
        view = view_of(w, recorder)
        client = w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        samples = scraped(view)
        self.assertEqual(total(samples, "nvpair_proxy_requests_in_flight"), 1)
        self.assertEqual(total(samples, "nvpair_proxy_nodes_busy_held"), 1)
        w.remove("a")
        w.clock.advance(1)
        samples = scraped(view)
        self.assertEqual(total(samples, "nvpair_proxy_requests_waiting_for_owner"), 1)
        self.assertEqual(status(view)["engines"][0]["waiting_for_owner"], 1)
        w.add("a")
        w.clock.advance(2)
        self.assertEqual(status(view)["nodes"][0]["in_flight"], 1)
        self.assertEqual(status(view)["nodes"][0]["reservations"], 1)
        self.assertEqual(total(scraped(view), "nvpair_proxy_reservations", node="a"), 1)
        w.agent.last.respond(200, body=b'{"done":true}\n', finish=True)
        self.assertEqual(client.response().status, 200)
        samples = scraped(view)
        self.assertEqual(total(samples, "nvpair_proxy_requests_in_flight"), 0)
        self.assertEqual(total(samples, "nvpair_proxy_reservations"), 0)


class ReasonTests(WorldTestCase):
    """Why a request did not complete: the answer's code first, then the proxy's text, then
    the status, and ``other`` last; every reason of the vocabulary can occur."""

    def test_answers_before_routing_each_count_under_their_own_reason(self):
        """Through the real listener and facade: the LAN gate's 401 and 403s, the 413, the
        identity probe's 409 and the 503 of a stopping facade."""
        recorder = Recorder()
        keyed = self.world(lan=gate(Clock(), cidrs="192.168.1.0/24"), recorder=recorder)
        keyed.add("a")
        keyless = self.world(recorder=recorder)  # no keys: a LAN peer is loopback-only
        body = {"model": "llama3", "messages": [{"role": "user", "content": MARKER}]}
        outside = IPv4Address("TCP", "10.9.9.9", 40000)
        statuses = [
            keyed.send("POST", "/api/chat", body, peer=lan()).response().status,
            keyed.send("POST", "/api/chat", body, peer=outside).response().status,
            keyless.send("POST", "/api/chat", body, peer=lan()).response().status,
            keyed.send("GET", "/api/tags", headers={"X-NVPAIR-Engine-Identity-Probe": "1"})
            .response()
            .status,
        ]
        too_large = keyed.connect()
        too_large.protocol.dataReceived(
            b"POST /api/chat HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n" % (MAX_REQUEST_BODY + 1)
        )
        statuses.append(too_large.response().status)
        keyed.facade.shutdown()
        statuses.append(keyed.send("POST", "/api/chat", body).response().status)
        self.assertEqual(statuses, [401, 403, 403, 409, 413, 503])
        self.assertEqual(keyed.agent.requests, [])

        view = view_of(keyed, recorder)
        expected = {
            "unauthorized": 1,
            "source_not_allowed": 1,
            "loopback_only": 1,
            "identity_probe": 1,
            "body_too_large": 1,
            "shutting_down": 1,
        }
        samples = scraped(view)
        self.assertEqual(
            by_labels(samples, "nvpair_proxy_request_errors_total", "reason"), expected
        )
        self.assertEqual(
            by_labels(samples, "nvpair_proxy_requests_total", "outcome"), {"rejected": 6}
        )
        (engine,) = json.loads(admin_get(view, "/status").body)["engines"]
        self.assertEqual((engine["reasons"], engine["requests"]), (expected, {"rejected": 6}))

    def test_every_reason_is_its_text_and_its_label_and_the_operations_doc_names_each_label(self):
        """A request's end carries a Reason: its label is what is counted (no text is read
        back), and the metrics vocabulary of docs/operations.md is exactly the labels."""
        for member in answers.Reason:
            ended = request_ended(outcome="failed", status=599, reason=member)
            self.assertEqual(reason(ended), member.label, member)
        # Wire texts are protocol 5's and 4's, whole or as the fixed start of a detailed one.
        self.assertEqual(
            answers.Reason.TRANSPORT.says("Connection refused"),
            "upstream error: Connection refused",
        )
        self.assertEqual(answers.Reason.UPSTREAM_STATUS.says(500), "upstream returned HTTP 500")
        self.assertEqual(
            answers.Reason.IDENTITY_PROBE.says("lmstudio"),
            "this port is the nvpair-proxy facade for lmstudio",
        )
        # An engine's own answer, relayed with no reason of ours: its status, else other.
        for status_code, expected in ((401, "unauthorized"), (418, "other"), (499, "client_gone")):
            ended = request_ended(route="models", outcome="failed", status=status_code)
            self.assertEqual(reason(ended), expected)
        completed = request_ended()
        self.assertIsNone(reason(completed))
        operations = open(
            os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md"),
            encoding="utf-8",
        ).read()
        row = next(
            line
            for line in operations.splitlines()
            if line.startswith("| `nvpair_proxy_request_errors_total`")
        )
        named = set(re.findall(r"`([a-z_]+)`", row.split("`reason`", 1)[1]))
        self.assertEqual(named, set(REASONS))
        self.assertEqual(len(REASONS), 27)


class StatusTests(WorldTestCase):
    def test_status_schema(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
        w.add("a", addresses=("10.0.0.1", "10.0.1.1"))
        w.chat()
        w.agent.last.respond(200, NDJSON, body=b'{"done":true,"eval_count":2}\n', finish=True)
        document = json.loads(admin_get(view_of(w, recorder), "/status").body)
        self.assertEqual(
            set(document),
            {
                "schema",
                "version",
                "mode",
                "now",
                "uptime_s",
                "broker_link_up",
                "cluster_pins",
                "reservations",
                "engines",
                "nodes",
                "recent",
                "history",
            },
        )
        self.assertEqual(
            (
                document["schema"],
                document["mode"],
                document["broker_link_up"],
                document["cluster_pins"],
            ),
            (1, "standalone", None, None),
        )
        (engine,) = document["engines"]
        self.assertEqual(
            set(engine),
            {
                "engine",
                "port",
                "pin",
                "nodes",
                "in_flight",
                "waiting_for_owner",
                "held",
                "cooling",
                "queued",
                "oldest_wait_s",
                "clients_waiting",
                "batch_waiting",
                "affinity_keys",
                "requests",
                "reasons",
                "dispatches",
                "failovers",
                "prompt_tokens",
                "completion_tokens",
                "prompt_reused_share",
                "slots",
            },
        )
        self.assertEqual(
            (
                engine["engine"],
                engine["port"],
                engine["requests"],
                engine["dispatches"],
                engine["slots"],
            ),
            ("ollama", 11435, {"completed": 1}, {"committed": 1}, None),
        )
        (node,) = document["nodes"]
        self.assertEqual(
            node,
            {
                "id": "a",
                "name": "a",
                "addresses": ["10.0.0.1", "10.0.1.1"],
                "engines": [
                    {
                        "engine": "ollama",
                        "port": 11434,
                        "models": ["llama3:latest"],
                        "state": "ready",
                        "cache": None,
                    }
                ],
                "last_activity": 0.0,
                "reservations": 0,
                "in_flight": 0,
                "held": False,
                "cooling": False,
            },
        )
        (recent,) = document["recent"]
        self.assertEqual(
            recent,
            {
                "time": 0.0,
                "engine": "ollama",
                "route": "inference",
                "model": "llama3",
                "node": "a",
                "outcome": "completed",
                "status": 200,
                "ttfb_ms": 0,
                "duration_ms": 0,
                "dispatches": 1,
                "prompt_tokens": None,
                "completion_tokens": 2,
                "placement": "priority",
                "waited_ms": 0,
            },
        )

    def test_a_whole_status_document_and_the_state_gauges_are_pinned(self):
        """Every field of ``/status`` and every gauge read from the tree, for a fleet with a
        pin, a held node, a cooling node, this facade among the nodes, one request streaming
        on a node, one waiting for its attempt's answer and one finished."""
        recorder = Recorder()
        w = self.world(recorder=recorder)
        w.facade.router.check_self(lambda node: node.id == "self")
        w.add("a", addresses=("10.0.0.1", "10.0.1.1"))
        w.add("b", addresses=("10.0.0.2",))
        w.add("c", models=("mistral:7b",), addresses=("10.0.0.3",))
        w.add("self", addresses=("127.0.0.1",), port=11435)
        done = w.chat()
        w.agent.last.respond(
            200,
            NDJSON,
            body=b'{"done":true,"prompt_eval_count":3,"prompt_eval_duration":9000000,"eval_count":2}\n',
            finish=True,
        )
        self.assertEqual(done.response().status, 200)
        w.clock.advance(5)
        streaming = w.chat()
        upstream = w.agent.last.respond(200, NDJSON)
        upstream.write(b'{"message":{"content":"hi"},"done":false}\n')
        w.clock.advance(1)
        waiting = w.chat(model="mistral:7b")
        w.facade.router.answered("b", 503)
        w.facade.router.stalled("c")
        w.facade.router.set_pin("a")
        view = view_of(w, recorder)
        answer = admin_get(view, "/status")
        expected = {
            "schema": 1,
            "version": __version__,
            "mode": "standalone",
            "now": 6.0,
            "uptime_s": 0.0,
            "broker_link_up": None,
            "cluster_pins": None,
            "reservations": 2,
            "engines": [
                {
                    "engine": "ollama",
                    "port": 11435,
                    "pin": "a",
                    "nodes": 3,
                    "in_flight": 2,
                    "waiting_for_owner": 0,
                    "held": ["b"],
                    "cooling": ["c"],
                    "queued": 0,
                    "oldest_wait_s": None,
                    "clients_waiting": 0,
                    "batch_waiting": 0,
                    "affinity_keys": None,
                    "requests": {"completed": 1},
                    "reasons": {},
                    "dispatches": {"committed": 2},
                    "failovers": 0,
                    "prompt_tokens": 3,
                    "completion_tokens": 2,
                    # three tokens, estimated (Ollama): too few to have come from a cache
                    "prompt_reused_share": 0.0,
                    "slots": None,
                }
            ],
            "nodes": [
                {
                    "id": "a",
                    "name": "a",
                    "addresses": ["10.0.0.1", "10.0.1.1"],
                    "engines": [
                        {
                            "engine": "ollama",
                            "port": 11434,
                            "models": ["llama3:latest"],
                            "state": "ready",
                            "cache": {
                                "reused": 0,
                                "read": 3,
                                "share": 0.0,
                                "source": "estimated",
                                "models": {"llama3": {"reused": 0, "read": 3, "share": 0.0}},
                            },
                        }
                    ],
                    "last_activity": 5.0,
                    "reservations": 1,
                    "in_flight": 1,
                    "held": False,
                    "cooling": False,
                },
                {
                    "id": "b",
                    "name": "b",
                    "addresses": ["10.0.0.2"],
                    "engines": [
                        {
                            "engine": "ollama",
                            "port": 11434,
                            "models": ["llama3:latest"],
                            "state": "held",
                            "cache": None,
                        }
                    ],
                    "last_activity": None,
                    "reservations": 0,
                    "in_flight": 0,
                    "held": True,
                    "cooling": False,
                },
                {
                    "id": "c",
                    "name": "c",
                    "addresses": ["10.0.0.3"],
                    "engines": [
                        {
                            "engine": "ollama",
                            "port": 11434,
                            "models": ["mistral:7b"],
                            "state": "cooling",
                            "cache": None,
                        }
                    ],
                    "last_activity": None,
                    "reservations": 1,
                    "in_flight": 1,
                    "held": False,
                    "cooling": True,
                },
                {
                    "id": "self",
                    "name": "self",
                    "addresses": ["127.0.0.1"],
                    "engines": [
                        {
                            "engine": "ollama",
                            "port": 11435,
                            "models": ["llama3:latest"],
                            "state": "excluded",
                            "excluded": self_reason("ollama", 11435),
                            "cache": None,
                        }
                    ],
                    "last_activity": None,
                    "reservations": 0,
                    "in_flight": 0,
                    "held": False,
                    "cooling": False,
                },
            ],
            "recent": [
                {
                    "time": 0.0,
                    "engine": "ollama",
                    "route": "inference",
                    "model": "llama3",
                    "node": "a",
                    "outcome": "completed",
                    "status": 200,
                    "ttfb_ms": 0,
                    "duration_ms": 0,
                    "dispatches": 1,
                    "prompt_tokens": 3,
                    "completion_tokens": 2,
                    "placement": "priority",
                    "waited_ms": 0,
                }
            ],
            "history": {"interval_s": 10.0, "samples": []},
        }
        self.maxDiff = None
        self.assertEqual(json.loads(answer.body), expected)
        self.assertEqual(answer.body, json.dumps(expected, sort_keys=True).encode() + b"\n")
        state = [
            line
            for line in scrape(registry(view)).decode().splitlines()
            if line.startswith(STATE_GAUGES)
        ]
        self.assertEqual(
            state,
            [
                'nvpair_proxy_requests_in_flight{engine="ollama"} 2.0',
                'nvpair_proxy_requests_waiting_for_owner{engine="ollama"} 0.0',
                'nvpair_proxy_nodes{engine="ollama"} 3.0',
                'nvpair_proxy_nodes_busy_held{engine="ollama"} 1.0',
                'nvpair_proxy_nodes_cooling{engine="ollama"} 1.0',
                'nvpair_proxy_node_requests_in_flight{engine="ollama",node="a"} 1.0',
                'nvpair_proxy_node_requests_in_flight{engine="ollama",node="c"} 1.0',
                'nvpair_proxy_reservations{node="a"} 1.0',
                'nvpair_proxy_reservations{node="c"} 1.0',
            ],
        )
        upstream.write(b'{"done":true}\n')
        upstream.finish()
        serve_all(self, w, streaming, waiting)

    def test_a_snapshot_is_the_process_at_one_moment(self):
        """What the owners hand the admin listener are frozen values: a request admitted
        after a snapshot is not in it, and nothing read from one can change the process."""
        w = self.world()
        w.add("a")
        source = WorldStatus(w)
        before = source.snapshot()
        client = w.chat()
        after = source.snapshot()
        self.assertEqual((before.facades[0].in_flight, dict(before.reservations)), ((), {}))
        self.assertEqual(
            after.facades[0].in_flight, (InFlightView(node="a", waiting_for_owner=False),)
        )
        self.assertEqual(dict(after.reservations), {"a": 1})
        self.assertEqual(after.facades[0].routing.routable, ("a",))
        with self.assertRaises(attrs.exceptions.FrozenInstanceError):
            after.facades[0].routing.pin = "a"
        serve_all(self, w, client)
        self.assertEqual(after.facades[0].in_flight[0].node, "a")
        self.assertEqual(source.snapshot().facades[0].in_flight, ())

    def test_the_last_100_requests_newest_first(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
        for index in range(105):
            w.clock.advance(1)
            w.send("POST", "/api/chat", {"model": f"m{index}"})
        recent = status(view_of(w, recorder))["recent"]
        self.assertEqual(len(recent), 100)
        # No node advertises them: answered 502 before a workload existed, model still shown.
        self.assertEqual((recent[0]["model"], recent[-1]["model"]), ("m104", "m5"))
        self.assertEqual((recent[0]["time"], recent[-1]["time"]), (105.0, 6.0))
        self.assertEqual(recent[0]["outcome"], "failed")

    def test_a_busy_503_and_a_no_owner_502_show_the_requested_model(self):
        """Both are answered before a workload exists; the row names the model as the client
        spelled it, and the scrape still never does."""
        recorder = Recorder()
        w = self.world(recorder=recorder)
        w.add("a")
        first = w.chat()
        w.agent.last.respond(503, length=0, finish=True)  # a says it is full: held
        busy = w.chat(model="llama3")
        nobody = w.chat(model="Nope-Model")
        self.assertEqual((busy.response().status, nobody.response().status), (503, 502))
        view = view_of(w, recorder)
        self.assertEqual(
            [(r["model"], r["status"], r["node"], r["dispatches"]) for r in status(view)["recent"]],
            [("Nope-Model", 502, None, 0), ("llama3", 503, None, 0)],
        )
        text = scrape(registry(view)).decode()
        self.assertNotIn("llama3", text)
        self.assertNotIn("Nope-Model", text)
        serve_all(self, w, first)

    def test_the_page_is_self_contained_and_polls_status(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
        response = admin_get(view_of(w, recorder), "/")
        self.assertEqual(response.status, 200)
        self.assertEqual(response.header("content-type"), "text/html; charset=utf-8")
        self.assertIn("default-src 'none'", response.header("content-security-policy"))
        page = response.body.decode()
        self.assertIn('fetch("status"', page)
        self.assertIn("POLL_MS = 2000", page)
        # The one URL is SVG's namespace name, which is never fetched.
        self.assertEqual(page.count('"http://www.w3.org/2000/svg"'), 1)
        self.assertNotRegex(page.replace('"http://www.w3.org/2000/svg"', ""), r"https?://")
        self.assertNotRegex(page, r"<(link|img|iframe)\b|<script[^>]*\bsrc=")
        self.assertNotIn("innerHTML", page)
        headings = re.findall(r"<th[^>]*>([^<]+)</th>", page)
        self.assertEqual(
            headings,
            [
                "node",
                "addresses",
                "engine",
                "models",
                "slots",
                "prompt reused",
                "last activity",
                "reservations",
                "in flight",
                "busy / cooling",
                "time",
                "engine",
                "route",
                "model",
                "node",
                "outcome",
                "status",
                "TTFB",
                "duration",
                "tokens in / out",
                "placement",
            ],
        )
        self.assertIn('id="engines"', page)
        self.assertIn('facts.push(["local slots", slotsText(e.slots)])', page)
        # A fleet of hundreds of nodes scrolls in its box under a header kept in view, one
        # row per node and engine.
        self.assertIn('<div class="scroll" id="fleet-box">', page)
        self.assertRegex(page, r"\.scroll \{[^}]*overflow: auto")
        self.assertIn("position: sticky", page)
        self.assertIn('{"data-node": n.id, "data-engine": e.engine', page)

    def test_endpoints_and_their_answers(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
        view = view_of(w, recorder)
        self.assertEqual(
            (admin_get(view, "/healthz").status, admin_get(view, "/healthz").body), (200, b"ok\n")
        )
        metrics = admin_get(view, "/metrics")
        self.assertTrue(metrics.header("content-type").startswith("text/plain; version="))
        self.assertIn(b"nvpair_proxy_build_info{", metrics.body)
        self.assertIn(b"process_cpu_seconds_total", metrics.body)
        self.assertEqual(admin_get(view, "/nope").status, 404)
        self.assertEqual(admin_get(view, "/status", method="POST").status, 405)
        view.source.running = False
        self.assertEqual(admin_get(view, "/healthz").status, 503)

    def test_a_foreign_host_header_is_refused(self):
        """A page that rebinds its name to 127.0.0.1 still sends its own name as Host."""
        recorder = Recorder()
        w = self.world(recorder=recorder)
        view = view_of(w, recorder)
        self.assertEqual(admin_get(view, "/status", host="evil.example:9464").status, 403)
        for host in (
            "localhost:9464",
            "127.0.0.1",
            "[::1]:9464",
            "LOCALHOST",
            "[::1]",
            "[::ffff:127.0.0.1]:9464",
        ):
            self.assertTrue(loopback_host(host.encode()), host)
        for host in (
            b"",
            b"10.0.0.1:9464",
            b"example.com",
            b"127.0.0.1.nip.io",
            b"[::ffff:10.0.0.1]:9464",
            b"localhost.evil:9464",
            b"[127.0.0.1]:9464",
        ):
            self.assertFalse(loopback_host(host), host)


class AdminAddressTests(SynchronousTestCase):
    def test_loopback_addresses_are_accepted(self):
        self.assertEqual(admin_address("127.0.0.1:9464"), ("127.0.0.1", 9464))
        self.assertEqual(admin_address("localhost:9464"), ("127.0.0.1", 9464))
        self.assertEqual(admin_address("[::1]:0"), ("::1", 0))
        self.assertEqual(admin_address("127.0.0.2:9464"), ("127.0.0.2", 9464))
        # A mapped loopback is bound as the IPv4 address inside it, as an alias is.
        self.assertEqual(admin_address("[::ffff:127.0.0.1]:9464"), ("127.0.0.1", 9464))

    def test_a_non_loopback_admin_address_stops_start_up_with_one_line(self):
        for value, shown in (
            ("0.0.0.0:9464", "0.0.0.0"),
            ("192.168.1.5:9464", "192.168.1.5"),
            ("[::]:9464", "::"),
            ("example.com:9464", "example.com"),
        ):
            with self.assertRaises(SystemExit) as caught:
                Options().parseOptions(["--engine", "ollama", "--admin", value])
            self.assertEqual(
                caught.exception.code,
                f"nvpair-proxy: --admin: {shown} is not a loopback address; the "
                f"admin listener serves this machine only (use 127.0.0.1 or ::1)",
            )

    def test_a_malformed_admin_address_names_the_flag(self):
        for value in (
            "9464",
            "127.0.0.1",
            "127.0.0.1:x",
            "127.0.0.1:70000",
            ":9464",
            "::1:9464",
            "[127.0.0.1]:9464",
            "127.0.0.1:\u00b2",
        ):
            with self.assertRaises(SystemExit) as caught:
                Options().parseOptions(["--admin", value])
            self.assertEqual(
                caught.exception.code,
                f"nvpair-proxy: --admin: want HOST:PORT, e.g. 127.0.0.1:9464 (got {value!r})",
            )


class TreeTests(SynchronousTestCase):
    """The admin listener in both trees, on a MemoryReactorClock."""

    def setUp(self):
        from nvpair_proxy.core import logs

        self.addCleanup(logs.set_level, logs.level_name())
        self.addCleanup(logs.set_access_log, False)

    def test_standalone_tree_binds_the_admin_listener_on_loopback(self):
        from twisted.internet.testing import MemoryReactorClock

        from nvpair_proxy.process.service import standalone_tree

        options = Options()
        options.parseOptions(["--engine", "ollama:1300", "--admin", "127.0.0.1:9464"])
        reactor = MemoryReactorClock()
        root = standalone_tree(options.config, reactor)
        self.assertEqual([s.name for s in root], ["runtime", "admin", "standalone", "facades"])
        root.privilegedStartService()
        self.assertEqual(
            [(t[0], t[3]) for t in reactor.tcpServers], [(9464, "127.0.0.1"), (1300, "::")]
        )
        self.assertIs(root.facades["ollama"].facade.reporter.recorder, root.runtime.recorder)

    def test_without_admin_there_is_no_recorder(self):
        from twisted.internet.testing import MemoryReactorClock

        from nvpair_proxy.process.service import standalone_tree

        options = Options()
        options.parseOptions(["--engine", "ollama:1300"])
        root = standalone_tree(options.config, MemoryReactorClock())
        root.privilegedStartService()
        self.assertIsNone(root.runtime.recorder)
        self.assertIsNone(root.facades["ollama"].facade.reporter.recorder)

    def broker_tree(self, *arguments: str):
        """A broker tree with the admin listener bound on a MemoryReactorClock."""
        from twisted.internet.testing import MemoryReactorClock

        from nvpair_proxy.process import link, service

        self.patch(link, "claim_stdout", lambda: 99)
        options = Options()
        options.parseOptions(["--admin", "[::1]:9464", *arguments])
        reactor = MemoryReactorClock()
        root = service.broker_tree(options.config, reactor)
        admin = root.getServiceNamed("admin")
        admin.privilegedStartService()
        return root, admin, reactor

    def test_broker_tree_has_the_admin_listener_and_reports_the_link(self):
        root, admin, reactor = self.broker_tree()
        self.assertEqual([s.name for s in root], ["runtime", "admin", "link", "facades"])
        self.assertEqual([(t[0], t[3]) for t in reactor.tcpServers], [(9464, "::1")])
        document = status(admin.view)
        self.assertEqual(
            (
                document["mode"],
                document["broker_link_up"],
                document["engines"],
                document["cluster_pins"],
            ),
            ("broker", False, [], None),
        )
        text = scrape(registry(admin.view)).decode()
        self.assertIn("nvpair_proxy_broker_link_up 0.0", text)
        self.assertNotIn("nvpair_proxy_cluster_pins", text)

    def test_broker_healthz_follows_the_link(self):
        root, admin, _ = self.broker_tree()
        root.running = True  # the process serves: only the link is in question
        link = root.getServiceNamed("link")
        answer = admin_get(admin.view, "/healthz")
        self.assertEqual((answer.status, answer.body), (503, b"broker link down\n"))
        link.link.framer.makeConnection(StringTransport())
        link.running = True
        answer = admin_get(admin.view, "/healthz")
        self.assertEqual((answer.status, answer.body), (200, b"ok\n"))
        self.assertEqual(total(scraped(admin.view), "nvpair_proxy_broker_link_up"), 1)
        self.assertIs(status(admin.view)["broker_link_up"], True)
        link.link.framer.transport.disconnected = True  # as a transport is once its peer left
        self.assertEqual(admin_get(admin.view, "/healthz").status, 503)
        self.assertEqual(total(scraped(admin.view), "nvpair_proxy_broker_link_up"), 0)
        root.running = False
        answer = admin_get(admin.view, "/healthz")
        self.assertEqual((answer.status, answer.body), (503, b"stopping\n"))

    def test_cluster_pins_count_the_live_pins_of_a_member(self):
        from nvpair_proxy.testing.certs import make_certificate, write_identity, write_pin

        folder = self.mktemp()
        os.makedirs(folder)
        root, admin, _ = self.broker_tree("--cluster-dir", folder)
        directory = root.facades.directory
        for peer in ("node-b", "node-c"):
            write_pin(folder, peer, make_certificate(peer)[0])
        directory.refresh()
        # Pins without our own identity: not a member, so no pin is live.
        self.assertEqual(status(admin.view)["cluster_pins"], 0)
        self.assertEqual(total(scraped(admin.view), "nvpair_proxy_cluster_pins"), 0)
        write_identity(folder, *make_certificate("node-a"))
        directory.refresh()
        self.assertEqual(status(admin.view)["cluster_pins"], 2)
        self.assertEqual(total(scraped(admin.view), "nvpair_proxy_cluster_pins"), 2)
        os.unlink(os.path.join(folder, "trusted", "node-c.json"))
        directory.refresh()
        self.assertEqual(total(scraped(admin.view), "nvpair_proxy_cluster_pins"), 1)

    def test_the_local_engines_slots_show_on_status(self):
        """Issue 8: node/set-local-backend's slots, kept where /status can show them."""
        root, admin, _ = self.broker_tree()
        framer = root.getServiceNamed("link").link.framer
        framer.makeConnection(StringTransport())

        def call(method: str, params: dict) -> dict:
            framer.transport.clear()
            framer.dataReceived(
                json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode()
                + b"\n"
            )
            return json.loads(framer.transport.value().splitlines()[-1])

        self.assertIn("result", call("facade/enable", {"engine": "ollama", "port": 11435}))
        self.assertEqual(status(admin.view)["engines"][0]["slots"], None)
        backend = {
            "engine": "ollama",
            "port": 11434,
            "slots": {"default": 4, "models": {"llama3": 2, "mistral:7b": 0}},
        }
        self.assertEqual(call("ollama:node/set-local-backend", backend)["result"], {"ok": True})
        (engine,) = status(admin.view)["engines"]
        self.assertEqual(
            (engine["engine"], engine["slots"]),
            ("ollama", {"default": 4, "models": {"llama3:latest": 2}}),
        )
        # A backend named without slots clears them, as nodes/list shows.
        call("ollama:node/set-local-backend", {"engine": "ollama", "port": 11434})
        self.assertIsNone(status(admin.view)["engines"][0]["slots"])


class SchedulerStatusTests(WorldTestCase):
    """Standalone placement on /status and /metrics: the queue per facade, each node's slots
    and warm models as its engine reported them, and how long requests waited."""

    def test_the_queue_and_each_engines_report_show_on_status_and_metrics(self):
        from nvpair_proxy.routing.enginetruth import EngineTruth, Slots

        recorder = Recorder()
        w = self.world(recorder=recorder, scheduling=True, queue_depth=10)
        w.add("a", addresses=("10.0.0.1",))
        w.add("b", addresses=("10.0.0.2",))
        w.facade.router.set_truth(
            "a", EngineTruth(read_at=0, slots=Slots(1, 0), warm=frozenset({"llama3:latest"}))
        )
        w.facade.router.set_truth("b", EngineTruth(read_at=0, slots=Slots(2, 2)))
        first = w.chat()
        stream = w.agent.last.respond(200, NDJSON)
        waiting = w.chat()
        # Within the bounded hold: b's busy slots are another's (docs/decisions.md#fair-share).
        w.clock.advance(0.75)
        view = view_of(w, recorder)
        document = json.loads(admin_get(view, "/status").body)
        (engine,) = document["engines"]
        self.assertEqual((engine["queued"], engine["oldest_wait_s"]), (1, 0.75))
        reports = {node["id"]: node["engines"][0]["engine_report"] for node in document["nodes"]}
        self.assertEqual(
            reports["a"],
            {
                "slots_total": 1,
                "slots_busy": 1,
                "ours": 1,
                "reported_busy": 0,
                "warm": ["llama3:latest"],
                "read_age_s": 0.75,
                "service_s": None,
                "prompt_tokens_per_second": None,
                "prompt_bytes_per_token": None,
            },
        )
        self.assertEqual(
            reports["b"],
            {
                "slots_total": 2,
                "slots_busy": 2,
                "ours": 0,
                "reported_busy": 2,
                "warm": None,
                "read_age_s": 0.75,
                "service_s": None,
                "prompt_tokens_per_second": None,
                "prompt_bytes_per_token": None,
            },
        )
        samples = scraped(view)
        self.assertEqual(total(samples, "nvpair_proxy_queue_depth", engine="ollama"), 1)
        self.assertEqual(
            by_labels(samples, "nvpair_proxy_node_slots", "node", "state"),
            Counter({("a", "busy"): 1, ("a", "total"): 1, ("b", "busy"): 2, ("b", "total"): 2}),
        )
        stream.write(b'{"done":true}\n')
        stream.finish()
        w.clock.advance(0)
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.assertEqual((first.response().status, waiting.response().status), (200, 200))
        samples = scraped(view)
        self.assertEqual(total(samples, "nvpair_proxy_queue_wait_seconds_count"), 1)
        self.assertEqual(total(samples, "nvpair_proxy_queue_wait_seconds_bucket", le="0.5"), 0)
        self.assertEqual(total(samples, "nvpair_proxy_queue_wait_seconds_bucket", le="1.0"), 1)
        self.assertEqual(total(samples, "nvpair_proxy_queue_depth"), 0)
