"""Reservations through real facades: bursts spread, claims follow attempts (spec 3.1, 5, 6)."""

from __future__ import annotations

from collections import Counter

from twisted.internet.task import Clock

from nvpair_proxy.routing.reservations import Rank, ReservationMap
from nvpair_proxy.test.world import WorldTestCase
from nvpair_proxy.testing import FakeAgent


def three_nodes(world, port: int = 11434, models=("llama3:latest",)):
    for index, name in enumerate("abc"):
        world.add(name, models=models, addresses=(f"10.0.0.{index + 1}",), port=port)


def targets(agent: FakeAgent) -> Counter:
    return Counter(r.uri.split(b"/")[2].split(b":")[0].decode() for r in agent.requests)


class SpreadTests(WorldTestCase):
    def test_six_concurrent_requests_over_three_equal_nodes_spread_two_each(self):
        w = self.world()
        three_nodes(w)
        for _ in range(6):
            w.chat()
        self.assertEqual(targets(w.agent), Counter({"10.0.0.1": 2, "10.0.0.2": 2, "10.0.0.3": 2}))
        self.assertEqual(dict(w.reservations.reservations), {"a": 2, "b": 2, "c": 2})
        for record in w.agent.requests:
            record.respond(200, length=0, finish=True)
        self.assertEqual(dict(w.reservations.reservations), {})

    def _mixed_burst(self, shared: bool) -> Counter:
        clock, agent = Clock(), FakeAgent()
        one = ReservationMap()
        ollama = self.world("ollama", reservations=one, clock=clock, agent=agent)
        lmstudio = self.world(
            "lmstudio", reservations=one if shared else ReservationMap(), clock=clock, agent=agent
        )
        three_nodes(ollama)
        three_nodes(lmstudio, port=1234, models=("qwen",))
        ollama.chat()
        ollama.chat()
        lmstudio.send("POST", "/v1/chat/completions", {"model": "qwen"})
        spread = targets(agent)
        for record in agent.requests:
            record.respond(200, length=0, finish=True)
        return spread

    def test_a_mixed_burst_through_two_facades_spreads_over_the_shared_nodes(self):
        self.assertEqual(
            self._mixed_burst(shared=True), Counter({"10.0.0.1": 1, "10.0.0.2": 1, "10.0.0.3": 1})
        )

    def test_without_one_shared_map_the_same_burst_piles_onto_one_node(self):
        self.assertEqual(self._mixed_burst(shared=False), Counter({"10.0.0.1": 2, "10.0.0.2": 1}))

    def test_scheduler_pending_steers_the_choice(self):
        w = self.world()
        three_nodes(w)
        w.reservations.set_priority(
            1, ["a", "b", "c"], [Rank("a", pending=2), Rank("b", pending=1)]
        )
        w.chat()
        self.assertEqual(w.agent.hosts(), ["10.0.0.3:11434"])
        w.agent.last.respond(200, length=0, finish=True)

    def test_failover_moves_the_reservation_and_backoff_releases_it(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        w.chat()
        self.assertEqual(dict(w.reservations.reservations), {"a": 1})
        w.agent.requests[0].respond(503, length=0, finish=True)
        self.assertEqual(dict(w.reservations.reservations), {"b": 1})
        w.agent.requests[1].respond(503, length=0, finish=True)
        self.assertEqual(dict(w.reservations.reservations), {})
        self.assertEqual(w.workload_events()[-1], ("workload:submitted", "queued", None))
        w.clock.advance(2)
        self.assertEqual(sum(w.reservations.reservations.values()), 1)
        w.agent.last.respond(200, length=0, finish=True)
        self.assertEqual(dict(w.reservations.reservations), {})

    def test_released_when_the_client_leaves(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        self.assertEqual(dict(w.reservations.reservations), {"a": 1})
        client.disconnect()
        self.assertEqual(dict(w.reservations.reservations), {})

    def test_held_while_streaming_and_released_at_the_end(self):
        w = self.world()
        w.add("a")
        w.chat()
        upstream = w.agent.last.respond(200)
        upstream.write(b'{"done":false}\n')
        self.assertEqual(dict(w.reservations.reservations), {"a": 1})
        upstream.finish()
        self.assertEqual(dict(w.reservations.reservations), {})

    def test_an_eligible_pin_takes_no_reservation(self):
        w = self.world()
        three_nodes(w)
        w.facade.router.set_pin("c")
        w.chat()
        self.assertEqual(w.agent.hosts(), ["10.0.0.3:11434"])
        self.assertEqual(dict(w.reservations.reservations), {})
        w.agent.last.respond(200, length=0, finish=True)

    def test_an_ineligible_pin_does_not_override_the_capability_filter(self):
        w = self.world()
        w.add("a", models=("mistral:latest",))
        w.add("b", addresses=("10.0.0.2",))
        w.facade.router.set_pin("a")
        w.chat()
        self.assertEqual(w.agent.hosts(), ["10.0.0.2:11434"])
        w.agent.last.respond(503, length=0, finish=True)
        w.clock.advance(2)
        self.assertEqual(w.agent.hosts(), ["10.0.0.2:11434"] * 2)
        w.agent.last.respond(200, length=0, finish=True)

    def test_requests_without_a_model_take_no_reservation(self):
        w = self.world()
        three_nodes(w)
        w.send("POST", "/api/chat", {"messages": []})
        w.send("GET", "/api/ps")
        self.assertEqual(dict(w.reservations.reservations), {})
        self.assertEqual(w.emitter.workload(), [])
        for record in w.agent.requests:
            record.respond(200, length=0, finish=True)
