"""The admin listener (issue 12): metrics equal what was reported, /status, the page, bounds."""

from __future__ import annotations

import json
import re
from collections import Counter
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.admin import AdminResource, loopback_host, status_page
from nvpair_proxy.options import admin_address
from nvpair_proxy.metrics import registry, scrape
from nvpair_proxy.options import Options
from nvpair_proxy.recorder import Recorder
from nvpair_proxy.server import BoundedSite
from nvpair_proxy.status import ProcessView, status
from nvpair_proxy.testing import loopback
from nvpair_proxy.test.world import Response, WorldTestCase, request_bytes

NDJSON = {"Content-Type": "application/x-ndjson"}
MARKER = "PROMPT-MARKER-4e1d9b"


def tree(world, running: bool = True):
    """The parts of the service tree the admin listener reads, around one World facade."""
    service = SimpleNamespace(facade=world.facade,
                              listening=SimpleNamespace(getHost=lambda: SimpleNamespace(port=11435)))
    runtime = SimpleNamespace(reservations=world.reservations,
                              activity=world.facade.reporter.activity)
    return SimpleNamespace(facades=[service], runtime=runtime, running=running)


def view_of(world, recorder: Recorder) -> ProcessView:
    return ProcessView(root=tree(world), recorder=recorder, mode="standalone",
                       clock=world.clock.seconds, started=world.clock.seconds())


def scraped(view: ProcessView) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape, by name and sorted labels."""
    samples = {}
    for family in text_string_to_metric_families(scrape(registry(view)).decode()):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def total(samples: dict, name: str, **labels) -> float:
    return sum(value for (sample, key), value in samples.items()
               if sample == name and all((k, v) in key for k, v in labels.items()))


def admin_get(view: ProcessView, path: str, host: str = "127.0.0.1:9464",
              method: str = "GET") -> Response:
    site = BoundedSite(AdminResource(view, registry(view), status_page()), reactor=None,
                       timeout=None)
    protocol = site.buildProtocol(loopback())
    transport = StringTransport(peerAddress=loopback())
    protocol.makeConnection(transport)
    protocol.dataReceived(request_bytes(method, path, headers={"Host": host}))
    return Response(transport.value())


class ScenarioTests(WorldTestCase):
    """A scripted scenario: failovers, a cancel, 502s, a model list and a rejection; the scrape
    then equals what the link was told, exactly."""

    def scenario(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
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
        w.agent.last.respond(200, NDJSON, body=(
            b'{"message":{"content":"hi"},"done":false}\n'
            b'{"done":true,"prompt_eval_count":11,"eval_count":7,"eval_duration":700000000}\n'),
            finish=True)
        self.assertEqual(first.response().status, 200)

        # 2. One 500, then a non-streaming answer.
        second = w.send("POST", "/api/chat", dict(body, stream=False))
        w.agent.last.respond(500, length=0, finish=True)
        w.clock.advance(1)
        w.agent.last.respond(200, {"Content-Type": "application/json"}, body=(
            b'{"done":true,"prompt_eval_count":5,"eval_count":3}'), finish=True)
        self.assertEqual(second.response().status, 200)

        # 3. The client leaves while its attempt runs: cancelled.
        third = w.send("POST", "/api/chat", body)
        third.disconnect()

        # 4. Nobody has the model: a local 502, no dispatch.
        self.assertEqual(w.send("POST", "/api/chat", dict(body, model="nope")).response().status,
                         502)

        # 5. Five transport failures: the fifth answers 502.
        fifth = w.send("POST", "/api/generate", {"model": "llama3", "prompt": MARKER})
        for _ in range(5):
            w.agent.last.refuse()
            w.clock.advance(8)
        self.assertEqual(fifth.response().status, 502)

        # 6. The fleet's model list, and 7. a rejected identity probe.
        tags = w.send("GET", "/api/tags")
        for record in w.agent.requests[-3:]:
            record.respond(200, {"Content-Type": "application/json"},
                           body=b'{"models":[{"name":"llama3:latest"}]}', finish=True)
        self.assertEqual(tags.response().status, 200)
        probe = w.send("GET", "/api/version", headers={"X-NVPAIR-Engine-Identity-Probe": "1"})
        self.assertEqual(probe.response().status, 409)
        return w, recorder

    def test_scraped_counters_equal_the_reported_events(self):
        w, recorder = self.scenario()
        samples = scraped(view_of(w, recorder))
        requests = [params for method, params in w.emitter.sent if method == "ollama:proxy/request"]
        workloads = [info for method, info in w.emitter.workload()
                     if method in ("workload:completed", "workload:errored")]
        dispatched = [r for r in w.agent.requests if b"/api/tags" not in r.uri]
        started = [info for method, info in w.emitter.workload() if method == "workload:started"]

        self.assertEqual(total(samples, "nvpair_proxy_requests_total"), len(requests))
        self.assertEqual(
            {(dict(k)["route"], dict(k)["outcome"]): v for (n, k), v in samples.items()
             if n == "nvpair_proxy_requests_total"},
            {("inference", "completed"): 2, ("inference", "cancelled"): 1,
             ("inference", "failed"): 2, ("models", "completed"): 1, ("other", "rejected"): 1})
        states = Counter(info["state"] for info in workloads)
        for state in ("completed", "cancelled"):
            self.assertEqual(total(samples, "nvpair_proxy_requests_total", route="inference",
                                   outcome=state), states[state])
        self.assertEqual(
            {dict(k)["reason"]: v for (n, k), v in samples.items()
             if n == "nvpair_proxy_request_errors_total"},
            {"client_gone": 1, "no_owner": 1, "transport": 1, "identity_probe": 1})

        # Every dispatch is one upstream request here (one address per node).
        self.assertEqual(total(samples, "nvpair_proxy_dispatches_total"), len(dispatched))
        hosts = Counter(r.uri.split(b"/")[2].split(b":")[0].decode() for r in dispatched)
        for node, address in (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")):
            self.assertEqual(total(samples, "nvpair_proxy_dispatches_total", node=node),
                             hosts[address])
        self.assertEqual(total(samples, "nvpair_proxy_dispatches_total", result="committed"),
                         len(started))
        self.assertEqual(
            Counter({dict(k)["result"]: v for (n, k), v in samples.items()
                     if n == "nvpair_proxy_dispatches_total"}.keys()),
            Counter(["committed", "refused_status", "transport", "cancelled"]))
        self.assertEqual(total(samples, "nvpair_proxy_dispatches_total", result="refused_status"), 2)
        self.assertEqual(total(samples, "nvpair_proxy_dispatches_total", result="transport"), 6)
        self.assertEqual(total(samples, "nvpair_proxy_dispatches_total", result="cancelled"), 1)
        # A failover is every dispatch after a request's first: 2 + 1 + 0 + 4.
        self.assertEqual(total(samples, "nvpair_proxy_failovers_total"), 7)

        for node in ("a", "b", "c"):
            done = [i for i in workloads if i.get("scheduledOn") == node and "stats" in i]
            self.assertEqual(total(samples, "nvpair_proxy_generated_tokens_total", node=node),
                             sum(i["stats"]["completionTokens"] for i in done))
            self.assertEqual(total(samples, "nvpair_proxy_prompt_tokens_total", node=node),
                             sum(i["stats"]["promptTokens"] for i in done))
            with_ttfb = [p for p in requests if p.get("node_id") == node and "ttfb_ms" in p]
            self.assertEqual(total(samples, "nvpair_proxy_ttfb_seconds_count", node=node),
                             len(with_ttfb))
            self.assertAlmostEqual(total(samples, "nvpair_proxy_ttfb_seconds_sum", node=node),
                                   sum(p["ttfb_ms"] for p in with_ttfb) / 1000, places=2)
        self.assertEqual(total(samples, "nvpair_proxy_generated_tokens_total"), 10)
        self.assertEqual(total(samples, "nvpair_proxy_prompt_tokens_total"), 16)
        self.assertEqual(total(samples, "nvpair_proxy_request_duration_seconds_count"),
                         len(requests))
        self.assertEqual(total(samples, "nvpair_proxy_requests_in_flight"), 0)
        self.assertEqual(total(samples, "nvpair_proxy_nodes", engine="ollama"), 3)

    def test_labels_are_bounded_vocabularies_never_models_paths_or_clients(self):
        w, recorder = self.scenario()
        text = scrape(registry(view_of(w, recorder))).decode()
        allowed = {"engine", "node", "route", "outcome", "result", "reason", "le", "version",
                   "mode", "python", "twisted"}
        for name in re.findall(r"[{,]([a-z_]+)=", text):
            self.assertIn(name, allowed)
        for forbidden in ("llama3", "/api/", "127.0.0.1", "nope", MARKER):
            self.assertNotIn(forbidden, text)

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


class StatusTests(WorldTestCase):
    def test_status_schema(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
        w.add("a", addresses=("10.0.0.1", "10.0.1.1"))
        w.chat()
        w.agent.last.respond(200, NDJSON, body=b'{"done":true,"eval_count":2}\n', finish=True)
        document = json.loads(admin_get(view_of(w, recorder), "/status").body)
        self.assertEqual(set(document), {
            "schema", "version", "mode", "now", "uptime_s", "broker_link_up", "cluster_pins",
            "reservations", "engines", "nodes", "recent"})
        self.assertEqual((document["schema"], document["mode"], document["broker_link_up"],
                          document["cluster_pins"]), (1, "standalone", None, None))
        engine, = document["engines"]
        self.assertEqual(set(engine), {
            "engine", "port", "pin", "nodes", "in_flight", "waiting_for_owner", "held",
            "cooling", "requests", "reasons", "dispatches", "failovers", "prompt_tokens",
            "completion_tokens"})
        self.assertEqual((engine["engine"], engine["port"], engine["requests"],
                          engine["dispatches"]),
                         ("ollama", 11435, {"completed": 1}, {"committed": 1}))
        node, = document["nodes"]
        self.assertEqual(node, {"id": "a", "name": "a", "addresses": ["10.0.0.1", "10.0.1.1"],
                                "engines": [{"engine": "ollama", "port": 11434,
                                             "models": ["llama3:latest"], "state": "ready"}],
                                "last_activity": 0.0, "reservations": 0, "in_flight": 0,
                                "held": False, "cooling": False})
        recent, = document["recent"]
        self.assertEqual(recent, {
            "time": 0.0, "engine": "ollama", "route": "inference", "model": "llama3",
            "node": "a", "outcome": "completed", "status": 200, "ttfb_ms": 0,
            "duration_ms": 0, "dispatches": 1, "prompt_tokens": None, "completion_tokens": 2})

    def test_the_last_100_requests_newest_first(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
        for index in range(105):
            w.clock.advance(1)
            w.send("POST", "/api/chat", {"model": f"m{index}"})
        recent = status(view_of(w, recorder))["recent"]
        self.assertEqual(len(recent), 100)
        self.assertEqual((recent[0]["model"], recent[-1]["model"]), (None, None))
        self.assertEqual((recent[0]["time"], recent[-1]["time"]), (105.0, 6.0))
        self.assertEqual(recent[0]["outcome"], "failed")

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
        self.assertNotRegex(page, r"https?://")
        self.assertNotRegex(page, r"<(link|img|iframe)\b|<script[^>]*\bsrc=")
        self.assertNotIn("innerHTML", page)
        headings = re.findall(r"<th[^>]*>([^<]+)</th>", page)
        self.assertEqual(headings, [
            "node", "addresses", "engines", "models", "last activity", "reservations",
            "in flight", "busy / cooling",
            "time", "engine", "route", "model", "node", "outcome", "status", "TTFB", "duration",
            "tokens in / out"])
        self.assertIn('id="engines"', page)

    def test_endpoints_and_their_answers(self):
        recorder = Recorder()
        w = self.world(recorder=recorder)
        view = view_of(w, recorder)
        self.assertEqual((admin_get(view, "/healthz").status, admin_get(view, "/healthz").body),
                         (200, b"ok\n"))
        metrics = admin_get(view, "/metrics")
        self.assertTrue(metrics.header("content-type").startswith("text/plain; version="))
        self.assertIn(b"nvpair_proxy_build_info{", metrics.body)
        self.assertIn(b"process_cpu_seconds_total", metrics.body)
        self.assertEqual(admin_get(view, "/nope").status, 404)
        self.assertEqual(admin_get(view, "/status", method="POST").status, 405)
        view.root.running = False
        self.assertEqual(admin_get(view, "/healthz").status, 503)

    def test_a_foreign_host_header_is_refused(self):
        """A page that rebinds its name to 127.0.0.1 still sends its own name as Host."""
        recorder = Recorder()
        w = self.world(recorder=recorder)
        view = view_of(w, recorder)
        self.assertEqual(admin_get(view, "/status", host="evil.example:9464").status, 403)
        for host in ("localhost:9464", "127.0.0.1", "[::1]:9464", "LOCALHOST", "[::1]",
                     "[::ffff:127.0.0.1]:9464"):
            self.assertTrue(loopback_host(host.encode()), host)
        for host in (b"", b"10.0.0.1:9464", b"example.com", b"127.0.0.1.nip.io",
                     b"[::ffff:10.0.0.1]:9464", b"localhost.evil:9464", b"[127.0.0.1]:9464"):
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
        for value, shown in (("0.0.0.0:9464", "0.0.0.0"), ("192.168.1.5:9464", "192.168.1.5"),
                             ("[::]:9464", "::"), ("example.com:9464", "example.com")):
            with self.assertRaises(SystemExit) as caught:
                Options().parseOptions(["--engine", "ollama", "--admin", value])
            self.assertEqual(caught.exception.code,
                             f"nvpair-proxy: --admin: {shown} is not a loopback address; the "
                             f"admin listener serves this machine only (use 127.0.0.1 or ::1)")

    def test_a_malformed_admin_address_names_the_flag(self):
        for value in ("9464", "127.0.0.1", "127.0.0.1:x", "127.0.0.1:70000", ":9464",
                      "::1:9464", "[127.0.0.1]:9464", "127.0.0.1:\u00b2"):
            with self.assertRaises(SystemExit) as caught:
                Options().parseOptions(["--admin", value])
            self.assertEqual(caught.exception.code,
                             f"nvpair-proxy: --admin: want HOST:PORT, e.g. 127.0.0.1:9464 "
                             f"(got {value!r})")


class TreeTests(SynchronousTestCase):
    """The admin listener in both trees, on a MemoryReactorClock."""

    def setUp(self):
        from nvpair_proxy import logs
        self.addCleanup(logs.set_level, logs.level_name())
        self.addCleanup(logs.set_access_log, False)

    def test_standalone_tree_binds_the_admin_listener_on_loopback(self):
        from twisted.internet.testing import MemoryReactorClock
        from nvpair_proxy.service import standalone_tree
        options = Options()
        options.parseOptions(["--engine", "ollama:1300", "--admin", "127.0.0.1:9464"])
        reactor = MemoryReactorClock()
        root = standalone_tree(options, reactor)
        self.assertEqual([s.name for s in root], ["runtime", "admin", "standalone", "facades"])
        root.privilegedStartService()
        self.assertEqual([(t[0], t[3]) for t in reactor.tcpServers],
                         [(9464, "127.0.0.1"), (1300, "::")])
        self.assertIs(root.facades["ollama"].facade.reporter.recorder, root.runtime.recorder)

    def test_without_admin_there_is_no_recorder(self):
        from twisted.internet.testing import MemoryReactorClock
        from nvpair_proxy.service import standalone_tree
        options = Options()
        options.parseOptions(["--engine", "ollama:1300"])
        root = standalone_tree(options, MemoryReactorClock())
        root.privilegedStartService()
        self.assertIsNone(root.runtime.recorder)
        self.assertIsNone(root.facades["ollama"].facade.reporter.recorder)

    def test_broker_tree_has_the_admin_listener_and_reports_the_link(self):
        from twisted.internet.testing import MemoryReactorClock
        from nvpair_proxy import service
        self.patch(service, "claim_stdout", lambda: 99)
        options = Options()
        options.parseOptions(["--admin", "[::1]:9464"])
        reactor = MemoryReactorClock()
        root = service.broker_tree(options, reactor)
        self.assertEqual([s.name for s in root], ["runtime", "admin", "link", "facades"])
        admin = root.getServiceNamed("admin")
        admin.privilegedStartService()
        self.assertEqual([(t[0], t[3]) for t in reactor.tcpServers], [(9464, "::1")])
        document = status(admin.view)
        self.assertEqual((document["mode"], document["broker_link_up"], document["engines"]),
                         ("broker", False, []))
        self.assertIn('nvpair_proxy_broker_link_up 0.0', scrape(registry(admin.view)).decode())


