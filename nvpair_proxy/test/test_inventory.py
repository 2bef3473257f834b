"""Inventory probing (design 4, decision 15)."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.fleet.inventory import Prober
from nvpair_proxy.nodes.discovery import make_node
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.routing.router import Router
from nvpair_proxy.testing import FakeAgent

OLLAMA = load_engines()["ollama"]


class ProberTests(SynchronousTestCase):
    def setUp(self):
        self.clock, self.agent = Clock(), FakeAgent()
        self.router = Router(engine=OLLAMA, clock=self.clock)
        for node_id, address in (("good", "10.0.0.1"), ("bad", "gpu b.lan")):
            self.router.put_manual(make_node(OLLAMA, id=node_id, port=11434, addresses=[address]))
        real = self.agent.request

        def request(method, uri, headers=None, body=None):
            if b" " in uri:
                raise ValueError("Invalid URI")
            return real(method, uri, headers, body)

        self.agent.request = request
        self.prober = Prober(OLLAMA, self.router, self.agent, self.clock, lambda node: True)
        self.addCleanup(lambda: self.prober.running and self.prober.stopService())

    def models(self, node_id):
        return self.router.nodes.get(node_id).models

    def test_a_probe_fills_the_inventory_and_a_failed_one_empties_it(self):
        self.prober.startService()
        self.assertEqual(self.agent.last.uri, b"http://10.0.0.1:11434/api/tags")
        self.agent.last.respond(200, body=b'{"models":[{"name":"llama3"}]}', finish=True)
        self.assertEqual(self.models("good"), frozenset({"llama3:latest"}))
        self.assertEqual(self.models("bad"), frozenset())
        self.clock.advance(5)
        self.agent.last.respond(503, finish=True)
        self.assertEqual(self.models("good"), frozenset())

    def test_a_probe_result_reaches_the_routers_candidates(self):
        self.prober.startService()
        self.agent.last.respond(200, body=b'{"models":[{"name":"llama3"}]}', finish=True)
        self.assertEqual([n.id for n in self.router.candidates("llama3:latest")], ["good"])

    def test_one_unusable_address_does_not_stop_the_probing_of_the_rest(self):
        self.prober.startService()
        self.agent.last.respond(200, body=b'{"models":[]}', finish=True)
        self.clock.advance(5)
        self.assertEqual(len(self.agent.requests), 2)
        self.agent.last.respond(200, body=b'{"models":[]}', finish=True)

    def test_a_probe_that_never_answers_times_out_after_ten_seconds(self):
        self.prober.startService()
        self.clock.advance(5)
        self.assertEqual(len(self.agent.requests), 1)
        self.clock.advance(5)
        self.assertTrue(self.agent.requests[0].cancelled)
        self.assertEqual(self.models("good"), frozenset())
