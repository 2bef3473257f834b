"""HTTPS and keyed engines in a standalone fleet (issue 11): real TLS servers on loopback with a
test CA, the proxy's facade on a real port, the nodes file as an operator writes it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase

from nvpair_proxy.fleet.inventory import Prober
from nvpair_proxy.http.client import Client
from nvpair_proxy.request.dispatch import Bounds
from nvpair_proxy.standalone.engineaccess import EngineAgents
from nvpair_proxy.standalone.nodesfile import NodesFileError, load_nodes_file
from nvpair_proxy.test.support import LogCapture
from nvpair_proxy.test.tlsfleet import CALLER_KEY, ENGINE_KEY, ENGINES, TLSFleet, write
from nvpair_proxy.testing.certs import TestCA


class HTTPSEngineTests(TestCase):
    @inlineCallbacks
    def test_an_engine_serving_the_right_certificate_is_reached_by_its_dns_name(self):
        fleet = TLSFleet(self)
        engine = fleet.engine("a", tls=fleet.ca.issue(dns=("localhost",)), address="localhost")
        fleet.start()
        status, body = yield fleet.chat()
        self.assertEqual((status, json.loads(body)["message"]["content"]), (200, "hi from a"))
        self.assertEqual([(m, p) for m, p, _ in engine.seen], [(b"POST", b"/api/chat")])

    @inlineCallbacks
    def test_a_certificate_for_another_host_is_refused_and_failed_over_warned_once(self):
        logs = LogCapture(self)
        fleet = TLSFleet(self)
        wrong = fleet.engine("a", tls=fleet.ca.issue(dns=("engine.example",)))
        fleet.engine("b", tls=fleet.ca.issue(ips=("127.0.0.1",)))
        fleet.start()
        for _ in range(2):
            status, body = yield fleet.chat()
            self.assertEqual((status, json.loads(body)["message"]["content"]), (200, "hi from b"))
        self.assertEqual(wrong.seen, [])
        warnings = [e for e in logs.at("warn") if e.get("node") == "a"]
        self.assertEqual(len(warnings), 1)
        self.assertIn("does not name the host", warnings[0]["why"])

    @inlineCallbacks
    def test_an_expired_certificate_is_refused_as_a_transport_failure(self):
        fleet = TLSFleet(self)
        expired = fleet.engine("a", tls=fleet.ca.issue(ips=("127.0.0.1",), expired=True))
        fleet.start(Bounds(max_attempts=1))
        status, body = yield fleet.chat()
        self.assertEqual(status, 502)
        self.assertIn("upstream error: TLS: certificate verify failed", json.loads(body)["error"])
        self.assertEqual(expired.seen, [])

    @inlineCallbacks
    def test_a_certificate_from_another_ca_is_refused(self):
        fleet = TLSFleet(self)
        stranger = fleet.engine("a", tls=TestCA("other").issue(ips=("127.0.0.1",)))
        fleet.start(Bounds(max_attempts=1))
        status, _ = yield fleet.chat()
        self.assertEqual((status, stranger.seen), (502, []))

    @inlineCallbacks
    def test_an_engine_behind_mutual_tls_gets_the_client_certificate(self):
        fleet = TLSFleet(self)
        client_ca = TestCA("clients")
        cert_pem, key_pem = client_ca.issue(client=True)
        cert_file = write(fleet.folder, "client.pem", cert_pem)
        key_file = write(fleet.folder, "client.key", key_pem)
        engine = fleet.engine(
            "a",
            tls=fleet.ca.issue(ips=("127.0.0.1",)),
            client_ca=client_ca,
            extra=f'cert_file = "{cert_file}"\nkey_file = "{key_file}"\n',
        )
        fleet.start()
        status, _ = yield fleet.chat()
        self.assertEqual((status, len(engine.seen)), (200, 1))

    @inlineCallbacks
    def test_an_engine_behind_mutual_tls_refuses_a_proxy_without_a_certificate(self):
        fleet = TLSFleet(self)
        engine = fleet.engine("a", tls=fleet.ca.issue(ips=("127.0.0.1",)), client_ca=TestCA())
        fleet.start(Bounds(max_attempts=1))
        status, _ = yield fleet.chat()
        self.assertEqual((status, engine.seen), (502, []))


class KeyedEngineTests(TestCase):
    @inlineCallbacks
    def test_a_keyed_engine_gets_its_key_and_never_the_callers(self):
        fleet = TLSFleet(self)
        keyed = fleet.engine(
            "a", tls=fleet.ca.issue(ips=("127.0.0.1",)), extra=f'api_key = "{ENGINE_KEY}"\n'
        )
        fleet.start()
        status, _ = yield fleet.chat(
            {"Authorization": f"Bearer {CALLER_KEY}", "X-Api-Key": CALLER_KEY}
        )
        self.assertEqual(status, 200)
        [(_, _, headers)] = keyed.seen
        self.assertEqual(headers.getRawHeaders(b"authorization"), [f"Bearer {ENGINE_KEY}".encode()])
        self.assertIsNone(headers.getRawHeaders(b"x-api-key"))
        self.assertNotIn(CALLER_KEY.encode(), repr(list(headers.getAllRawHeaders())).encode())

    @inlineCallbacks
    def test_the_key_goes_to_its_engine_only(self):
        fleet = TLSFleet(self)
        fleet.engine("a", extra=f'api_key = "{ENGINE_KEY}"\n')
        plain = fleet.engine("b")
        fleet.start()
        status, body = yield fleet.request(b"GET", "/api/tags")
        self.assertEqual(status, 200)
        [(_, _, headers)] = plain.seen
        self.assertIsNone(headers.getRawHeaders(b"authorization"))
        [(_, _, headers)] = fleet.engines["a"].seen
        self.assertEqual(headers.getRawHeaders(b"authorization"), [f"Bearer {ENGINE_KEY}".encode()])

    @inlineCallbacks
    def test_inventory_probes_use_the_tls_and_key_settings(self):
        fleet = TLSFleet(self)
        engine = fleet.engine(
            "a",
            tls=fleet.ca.issue(ips=("127.0.0.1",)),
            models=False,
            extra=f'api_key = "{ENGINE_KEY}"\n',
        )
        fleet.start()
        facade = fleet.facade
        prober = Prober(
            facade.engine,
            facade.router,
            fleet.agents.agent,
            reactor,
            lambda node: True,
            agent_for=facade.upstreams.agent_for,
        )
        [node] = facade.router.nodes.routable()
        yield prober.probe(node)
        self.assertEqual(facade.router.nodes.routable()[0].models, frozenset({"llama3:latest"}))
        [(_, path, headers)] = engine.seen
        self.assertEqual(
            (path, headers.getRawHeaders(b"authorization")),
            (b"/api/tags", [f"Bearer {ENGINE_KEY}".encode()]),
        )


class NodesFileAccessTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.folder, True)
        self.ca = TestCA()

    def load(self, extra: str):
        path = write(
            self.folder,
            "nodes.toml",
            (
                '[[node]]\nid = "a"\naddress = "engine.lan"\n[node.engines.ollama]\nport = 443\n'
                + extra
            ).encode(),
        )
        return load_nodes_file(path, ENGINES)

    def error(self, extra: str) -> str:
        with self.assertRaises(NodesFileError) as caught:
            self.load(extra)
        return str(caught.exception)

    def test_https_with_a_relative_ca_file_and_a_dns_address(self):
        write(self.folder, "ca.pem", self.ca.pem)
        [node] = self.load('scheme = "https"\nca_file = "ca.pem"\n').nodes["ollama"]
        self.assertEqual((node.scheme, node.addresses), ("https", ("engine.lan",)))
        self.assertEqual(node.access.tls.ca_file, os.path.join(self.folder, "ca.pem"))

    def test_a_ca_file_that_is_not_pem_names_the_file(self):
        bad = write(self.folder, "ca.pem", b"not a certificate")
        self.assertIn(
            f"ca_file {bad}: no PEM certificate",
            self.error('scheme = "https"\nca_file = "ca.pem"\n'),
        )

    def test_a_missing_ca_file_names_the_file(self):
        self.assertIn("ca_file", self.error('scheme = "https"\nca_file = "nowhere.pem"\n'))

    def test_a_key_file_that_does_not_match_names_the_file(self):
        cert_pem, _ = self.ca.issue(client=True)
        _, other_key = self.ca.issue(client=True)
        write(self.folder, "c.pem", cert_pem)
        key = write(self.folder, "c.key", other_key)
        self.assertIn(
            f"key_file {key}: does not match",
            self.error('scheme = "https"\ncert_file = "c.pem"\nkey_file = "c.key"\n'),
        )

    def test_tls_files_need_https(self):
        self.assertIn("needs scheme", self.error('ca_file = "ca.pem"\n'))

    def test_load_tls_refuses_a_certificate_without_its_key_before_reading_it(self):
        # The nodes file refuses the pair half-given; so does loading it, rather than trying
        # to open no key file.
        from nvpair_proxy.standalone.engineaccess import AccessError, load_tls

        with self.assertRaises(AccessError) as caught:
            load_tls(None, os.path.join(self.folder, "nowhere.pem"), None)
        self.assertEqual(str(caught.exception), "fields 'cert_file' and 'key_file' go together")

    def test_a_bad_api_key_is_refused_without_showing_it(self):
        text = self.error('api_key = "two words"\n')
        self.assertIn("api_key", text)
        self.assertNotIn("two words", text)

    def test_the_key_is_not_in_a_nodes_repr(self):
        [node] = self.load(f'api_key = "{ENGINE_KEY}"\n').nodes["ollama"]
        self.assertNotIn(ENGINE_KEY, repr(node))
        self.assertEqual(node.access.api_key, ENGINE_KEY)


class RetainTests(SynchronousTestCase):
    """A TLS configuration no node uses any more gives up its client and idle connections."""

    def test_clients_of_configurations_no_node_uses_are_dropped(self):
        from twisted.internet.defer import succeed
        from twisted.internet.testing import MemoryReactorClock

        from nvpair_proxy.nodes.discovery import Node
        from nvpair_proxy.standalone.engineaccess import EngineAccess, load_tls

        folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, folder, True)
        configs = [
            load_tls(write(folder, f"ca{i}.pem", TestCA(f"ca{i}").pem), None, None)
            for i in range(2)
        ]
        nodes = [
            Node(
                id=f"n{i}",
                name=f"n{i}",
                port=443,
                addresses=("10.0.0.1",),
                scheme="https",
                access=EngineAccess(tls),
            )
            for i, tls in enumerate(configs)
        ]
        agents = EngineAgents(MemoryReactorClock(), Client(MemoryReactorClock()), 5.0, 90.0)
        kept, dropped = (agents.for_node(node).agent for node in nodes)
        closed = []

        class Idle:
            key, idle_until = (b"https", b"10.0.0.1", 443), 0.0

            def close_idle(self):
                closed.append(self)
                return succeed(None)

        dropped.pool.give(Idle())
        agents.retain({configs[0]})
        self.assertEqual((len(closed), dropped.pool.idle_count()), (1, 0))
        self.assertIs(agents.for_node(nodes[0]).agent, kept)
        self.assertIsNot(agents.for_node(nodes[1]).agent, dropped, "a fresh client if it returns")
        # A request that was still on the dropped client finishes into its pool later; the
        # shutdown closes that pool too.
        late = Idle()
        dropped.pool.give(late)
        self.successResultOf(agents.close())
        self.assertEqual((closed[-1], dropped.pool.idle_count()), (late, 0))


class TLSWarningTests(SynchronousTestCase):
    """A certificate failure is warned once per node per change of its reason (issue 11)."""

    def test_a_new_reason_warns_a_repeat_does_not_and_a_recovery_resets(self):
        logs = LogCapture(self)
        agents = EngineAgents(None, None, 5.0, 5.0)

        def warned() -> list[tuple[str, str]]:
            return [(e["node"], e["why"]) for e in logs.at("warn")]

        agents.tls_failed("a", "x")
        agents.tls_failed("a", "y")
        self.assertEqual(warned(), [("a", "x"), ("a", "y")])
        agents.tls_failed("a", "y")
        agents.tls_failed("b", "y")  # another node's problem is its own
        self.assertEqual(warned(), [("a", "x"), ("a", "y"), ("b", "y")])
        agents.tls_worked("a")
        self.assertEqual([e["node"] for e in logs.at("info")], ["a"])
        agents.tls_failed("a", "y")
        agents.tls_failed("b", "y")
        self.assertEqual(warned(), [("a", "x"), ("a", "y"), ("b", "y"), ("a", "y")])
