"""Engine truth: the routes an engine file declares, the shapes read from them, and the poller
that asks each node without side effects, paced by the facade's traffic."""

from __future__ import annotations

import json

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.fleet.truthpoller import TruthPoller
from nvpair_proxy.nodes.discovery import make_node
from nvpair_proxy.nodes.engines import EngineFileError, TruthRoutes, parse_engine
from nvpair_proxy.routing.enginetruth import (
    EngineTruth,
    Slots,
    TruthError,
    read_loaded,
    read_models,
    read_slots,
)
from nvpair_proxy.routing.router import Router
from nvpair_proxy.standalone.nodesfile import NodesFileError, parse_nodes
from nvpair_proxy.testing import FakeAgent

from .support import LogCapture
from .world import ENGINES

SLOTS = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]


class EngineFileTests(SynchronousTestCase):
    def test_each_builtin_engine_declares_its_truth_routes(self):
        self.assertEqual(ENGINES["llamacpp"].truth, TruthRoutes(slots="/slots", models="/models"))
        self.assertEqual(ENGINES["ollama"].truth, TruthRoutes(loaded="/api/ps"))
        self.assertEqual(ENGINES["lmstudio"].truth, TruthRoutes(models="/api/v0/models"))

    def test_an_unknown_truth_route_or_a_relative_path_names_the_file_and_field(self):
        base = {
            "id": "x",
            "service_key": "x",
            "persisted_port_file": "x.json",
            "model_rule": "exact",
            "inventory_source": "models",
            "ports": {"own": 1, "relocated": 2, "standalone": 3},
            "model_list": {"upstream_path": "/m", "envelope": "openai"},
            "routes": [],
        }
        self.assertEqual(parse_engine(base, "x.toml").truth, TruthRoutes())
        with self.assertRaisesRegex(EngineFileError, r"x.toml: truth: unknown field 'load'"):
            parse_engine({**base, "truth": {"load": "/x"}}, "x.toml")
        with self.assertRaisesRegex(EngineFileError, r"x.toml: truth: field 'slots' must start"):
            parse_engine({**base, "truth": {"slots": "slots"}}, "x.toml")


class ReaderTests(SynchronousTestCase):
    normalize = staticmethod(ENGINES["ollama"].normalize_model)

    def test_llamacpp_slots_count_those_processing(self):
        self.assertEqual(read_slots(json.dumps(SLOTS).encode()), Slots(total=2, busy=1))

    def test_slots_that_are_not_an_array_of_objects_are_an_error(self):
        for body in (b"{}", b"[]", b"[1]", b"not json"):
            with self.assertRaises(TruthError):
                read_slots(body)

    def test_ollama_ps_lists_the_warm_models_normalized(self):
        body = json.dumps(
            {"models": [{"name": "llama3", "model": "llama3"}, {"name": "qwen:7b"}]}
        ).encode()
        self.assertEqual(read_loaded(body, self.normalize), frozenset({"llama3:latest", "qwen:7b"}))

    def test_lmstudio_and_llamacpp_router_states_only_loaded_is_warm(self):
        lmstudio = {"data": [{"id": "a", "state": "loaded"}, {"id": "b", "state": "not-loaded"}]}
        router = {
            "data": [
                {"id": "a", "status": {"value": "loaded"}},
                {"id": "b", "status": {"value": "loading"}},
                {"id": "c", "status": {"value": "unloaded"}},
            ]
        }
        for data in (lmstudio, router):
            states = read_models(json.dumps(data).encode(), str, listed_are_loaded=False)
            self.assertEqual((states.warm, states.per_model), (frozenset({"a"}), True))

    def test_a_list_without_states_is_warm_only_where_the_engine_lists_what_it_loaded(self):
        body = json.dumps({"data": [{"id": "a"}]}).encode()
        self.assertEqual(read_models(body, str, listed_are_loaded=True).warm, frozenset({"a"}))
        self.assertIsNone(read_models(body, str, listed_are_loaded=False).warm)


class NodesFileSlotsTests(SynchronousTestCase):
    def nodes(self, slots: str):
        return parse_nodes(
            f'[[node]]\nid = "a"\naddress = "127.0.0.1"\n'
            f"[node.engines.ollama]\nport = 1\n{slots}\n",
            ENGINES,
            "n.toml",
        )

    def test_slots_reach_the_node(self):
        self.assertEqual(self.nodes("slots = 4").nodes["ollama"][0].slots, 4)
        self.assertIsNone(self.nodes("").nodes["ollama"][0].slots)

    def test_slots_below_one_or_not_a_number_stop_the_load_with_the_field_named(self):
        for bad in ("slots = 0", "slots = true", 'slots = "4"'):
            with self.assertRaisesRegex(NodesFileError, "field 'slots' must be a whole number"):
                self.nodes(bad)


class PollerTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.agent = FakeAgent()
        self.logs = LogCapture(self)

    def poller(self, engine_id: str, *nodes):
        engine = ENGINES[engine_id]
        router = Router(engine=engine, clock=self.clock)
        for node_id, port in nodes:
            router.put_manual(
                make_node(engine, id=node_id, port=port, addresses=["127.0.0.1"], models=["m"])
            )
        poller = TruthPoller(
            engine, router, lambda node: self.agent, self.clock, random=lambda: 0.5
        )
        poller.startService()
        self.addCleanup(poller.stopService)
        return poller, router

    def warnings(self) -> list[str]:
        from twisted.logger import formatEvent

        return [formatEvent(e) for e in self.logs.at("warn")]

    def answer(self, status: int, body) -> None:
        request = self.agent.requests[-1]
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        request.respond(status, {"Content-Type": "application/json"}, raw, finish=True)

    def test_the_first_read_comes_a_second_after_start_then_each_node_once_per_round(self):
        poller, router = self.poller("ollama", ("a", 1), ("b", 2))
        self.clock.advance(0.99)
        self.assertEqual(self.agent.requests, [])
        self.clock.advance(0.01)
        self.assertEqual(
            [(r.method, r.uri) for r in self.agent.requests],
            [(b"GET", b"http://127.0.0.1:1/api/ps"), (b"GET", b"http://127.0.0.1:2/api/ps")],
        )
        self.assertIn(b"nvpair-", self.agent.requests[0].headers.getRawHeaders(b"via")[0])

    def test_idle_facades_are_read_every_8_seconds_and_busy_ones_every_second(self):
        poller, router = self.poller("ollama", ("a", 1))
        self.clock.advance(1)
        self.answer(200, {"models": []})
        self.clock.advance(7.99)
        self.assertEqual(len(self.agent.requests), 1)
        self.clock.advance(0.01)
        self.assertEqual(len(self.agent.requests), 2)
        self.answer(200, {"models": []})
        router.admitted()
        self.clock.advance(8)
        self.assertEqual(len(self.agent.requests), 3, "the next round after traffic is 1 s")
        self.answer(200, {"models": []})
        self.clock.advance(1)
        self.assertEqual(len(self.agent.requests), 4)
        self.answer(200, {"models": []})
        self.clock.advance(60)
        before = len(self.agent.requests)
        self.clock.advance(1)
        self.assertEqual(len(self.agent.requests), before, "a minute without traffic: idle pace")

    def test_the_reads_are_per_node_and_round_however_many_requests_come(self):
        """The poll costs O(nodes) per interval, never per request."""
        poller, router = self.poller("ollama", ("a", 1), ("b", 2))

        def answer_all():
            for request in [r for r in self.agent.requests if r.pending]:
                request.respond(
                    200, {"Content-Type": "application/json"}, b'{"models":[]}', finish=True
                )

        self.clock.advance(1)
        answer_all()
        for _ in range(500):
            router.admitted()
        self.clock.advance(8)  # the idle round; with traffic the next ones come each second
        answer_all()
        for second in range(5):
            for _ in range(500):
                router.admitted()
            self.clock.advance(1)
            answer_all()
        self.assertEqual(len(self.agent.requests), 2 + 2 + 2 * 5)
        self.assertEqual(
            sorted({r.uri for r in self.agent.requests}),
            [b"http://127.0.0.1:1/api/ps", b"http://127.0.0.1:2/api/ps"],
        )

    def test_a_node_still_answering_is_not_asked_again_and_a_read_gives_up_after_2s(self):
        poller, router = self.poller("ollama", ("a", 1))
        router.admitted()
        self.clock.advance(1)
        self.clock.advance(1)
        self.assertEqual(len(self.agent.requests), 1)
        self.clock.advance(0.5)
        self.assertFalse(self.agent.requests[0].cancelled)
        self.clock.advance(0.5)
        self.assertTrue(self.agent.requests[0].cancelled)
        self.clock.advance(1)
        self.assertEqual(len(self.agent.requests), 2)
        self.answer(200, {"models": []})

    def test_ollama_ps_marks_warm_models(self):
        poller, router = self.poller("ollama", ("a", 1))
        self.clock.advance(1)
        self.answer(200, {"models": [{"name": "m:latest"}]})
        truth = router.truth_of("a")
        self.assertEqual(
            (truth.warm, truth.slots, truth.read_at), (frozenset({"m:latest"}), None, 1.0)
        )

    def test_llamacpp_reads_its_models_then_its_slots(self):
        poller, router = self.poller("llamacpp", ("a", 1))
        self.clock.advance(1)
        self.assertEqual(self.agent.requests[-1].uri, b"http://127.0.0.1:1/models")
        self.answer(200, {"object": "list", "data": [{"id": "m"}]})
        self.assertEqual(self.agent.requests[-1].uri, b"http://127.0.0.1:1/slots")
        self.answer(200, SLOTS)
        truth = router.truth_of("a")
        self.assertEqual((truth.slots, truth.warm), (Slots(2, 1), frozenset({"m"})))

    def test_a_llamacpp_router_is_asked_the_slots_of_its_loaded_models_only(self):
        poller, router = self.poller("llamacpp", ("a", 1))
        self.clock.advance(1)
        self.answer(
            200,
            {
                "data": [
                    {"id": "b/x", "status": {"value": "loaded"}},
                    {"id": "m", "status": {"value": "unloaded"}},
                    {"id": "n", "status": {"value": "loading"}},
                ]
            },
        )
        self.assertEqual(self.agent.requests[-1].uri, b"http://127.0.0.1:1/slots?model=b%2Fx")
        self.answer(200, SLOTS)
        self.assertEqual(
            [r.uri for r in self.agent.requests],
            [b"http://127.0.0.1:1/models", b"http://127.0.0.1:1/slots?model=b%2Fx"],
            "nothing asked of an unloaded model (asking could load it)",
        )
        truth = router.truth_of("a")
        self.assertEqual(
            (truth.slots, dict(truth.model_slots), truth.warm),
            (None, {"b/x": Slots(2, 1)}, frozenset({"b/x"})),
        )

    def test_no_slots_501_leaves_the_count_unknown(self):
        poller, router = self.poller("llamacpp", ("a", 1))
        self.clock.advance(1)
        self.answer(200, {"data": [{"id": "m"}]})
        self.answer(501, {"error": "This server does not support slots endpoint."})
        truth = router.truth_of("a")
        self.assertEqual((truth.slots, truth.warm), (None, frozenset({"m"})))

    def test_a_node_that_reports_nothing_is_unknown(self):
        poller, router = self.poller("lmstudio", ("a", 1))
        router.set_truth("a", EngineTruth(read_at=0, slots=Slots(1, 1)))
        self.clock.advance(1)
        self.agent.requests[-1].refuse()
        self.assertIsNone(router.truth_of("a"))
        self.clock.advance(8)
        self.answer(404, b"not found")
        self.assertIsNone(router.truth_of("a"))
        self.assertEqual(self.warnings(), [])

    def test_an_answer_that_does_not_parse_is_warned_once_per_change_and_never_free(self):
        poller, router = self.poller("llamacpp", ("a", 1))
        for _ in range(2):
            self.clock.advance(8)
            self.answer(200, {"data": [{"id": "m"}]})
            self.answer(200, b"[1, 2]")
            self.assertIsNone(router.truth_of("a"))
        self.clock.advance(8)
        self.answer(200, {"data": [{"id": "m"}]})
        self.answer(500, b"oops")
        warnings = self.warnings()
        self.assertEqual(len(warnings), 2, warnings)
        self.assertIn("node a", warnings[0])
        self.assertNotIn("[1, 2]", " ".join(warnings), "never the body")

    def test_stopping_cancels_reads_in_flight_and_leaves_no_timer(self):
        poller, router = self.poller("ollama", ("a", 1))
        self.clock.advance(1)
        poller.stopService()
        self.assertTrue(self.agent.requests[0].cancelled)
        self.assertEqual(self.clock.getDelayedCalls(), [])


JSON = {"Content-Type": "application/json"}


def never() -> None:
    raise AssertionError("a waiter that is never woken nor expired here")


class FleetSink:
    """An ``ITruthSink`` over a fleet of ``count`` Ollama nodes: busy or not, and the nodes
    placement wants read (what a router's queue and contention would say)."""

    def __init__(self, clock: Clock, count: int) -> None:
        engine = ENGINES["ollama"]
        self.clock = clock
        self.nodes = [
            make_node(engine, id=f"n{i:03d}", port=1000 + i, addresses=["127.0.0.1"], models=["m"])
            for i in range(count)
        ]
        self.traffic: float | None = None
        self.wanting: frozenset[str] = frozenset()
        self.told: list[str] = []

    def routable(self):
        return list(self.nodes)

    def set_truth(self, node_id, truth) -> None:
        self.told.append(node_id)

    def last_traffic(self):
        return self.traffic

    def is_routable(self, node_id: str) -> bool:
        return True

    def wanted(self) -> frozenset[str]:
        return self.wanting


class LargeFleetPollerTests(SynchronousTestCase):
    """At scale (docs/decisions.md#engine-truth): a round's reads are spread over its
    interval, and a busy facade of more than 32 nodes reads at the active pace only the nodes
    placement needs, every node at the idle pace."""

    def setUp(self):
        self.clock = Clock()
        self.agent = FakeAgent()

    def poller(self, count: int) -> tuple[TruthPoller, FleetSink]:
        sink = FleetSink(self.clock, count)
        poller = TruthPoller(
            ENGINES["ollama"], sink, lambda node: self.agent, self.clock, random=lambda: 0.5
        )
        poller.startService()
        self.addCleanup(poller.stopService)
        return poller, sink

    def answer_all(self) -> None:
        for request in [r for r in self.agent.requests if r.pending]:
            request.respond(
                200, {"Content-Type": "application/json"}, b'{"models":[]}', finish=True
            )

    def test_a_round_of_100_nodes_is_spread_over_its_interval(self):
        poller, sink = self.poller(100)
        sink.traffic = 0.0
        self.clock.advance(1)
        self.assertEqual(len(self.agent.requests), 10, "a tenth of the fleet at once, not all")
        for step in range(1, 10):
            self.answer_all()
            self.clock.advance(0.1)
            self.assertEqual(len(self.agent.requests), 10 * (step + 1))
        self.answer_all()
        self.assertEqual(len({r.uri for r in self.agent.requests}), 100, "each node once")

    def test_a_busy_large_fleet_reads_what_placement_needs_and_the_rest_at_the_idle_pace(self):
        poller, sink = self.poller(100)
        sink.traffic = 0.0
        self.clock.advance(1)
        for _ in range(10):
            self.answer_all()
            self.clock.advance(0.1)
        self.answer_all()
        self.assertEqual(len(self.agent.requests), 100, "the first round asks every node")
        sink.wanting = frozenset({"n005", "n042"})
        for second in range(5):
            sink.traffic = self.clock.seconds()
            self.clock.advance(1)
            self.answer_all()
        self.assertEqual(len(self.agent.requests), 100 + 2 * 5, "only the two it needs")
        self.assertEqual(
            {r.uri for r in self.agent.requests[100:]},
            {b"http://127.0.0.1:1005/api/ps", b"http://127.0.0.1:1042/api/ps"},
        )
        for _ in range(40):  # past the idle pace since the first round: every node again
            sink.traffic = self.clock.seconds()
            self.clock.advance(0.1)
            self.answer_all()
        self.assertGreaterEqual(len(self.agent.requests), 100 + 2 * 5 + 100)

    def test_a_small_fleet_is_read_whole_every_second_while_busy(self):
        poller, sink = self.poller(3)
        for second in range(4):
            sink.traffic = self.clock.seconds()
            self.clock.advance(1)
            self.answer_all()
        self.assertEqual(len(self.agent.requests), 3 * 4)


class WantedTests(SynchronousTestCase):
    def test_the_owners_of_what_waits_and_the_nodes_running_others_work(self):
        from nvpair_proxy.routing.reservations import ReservationMap
        from nvpair_proxy.routing.slotqueue import SlotQueue, Waiter

        clock = Clock()
        engine = ENGINES["ollama"]
        queue = SlotQueue(clock, depth=10)
        router = Router(
            engine=engine,
            clock=clock,
            reservations=ReservationMap(),
            scheduling=True,
            queue=queue,
        )
        for node_id, models in (("a", ["m"]), ("b", ["m"]), ("c", ["other"]), ("d", ["x"])):
            router.put_manual(
                make_node(engine, id=node_id, port=1, addresses=["127.0.0.1"], models=models)
            )
        self.assertEqual(router.wanted(), frozenset())
        queue.add(
            Waiter(model="m:latest", deadline=600, since=0, wake=lambda: None, expire=lambda: None)
        )
        self.assertEqual(router.wanted(), frozenset({"a", "b"}))
        router.set_truth("d", EngineTruth(read_at=0, slots=Slots(1, 1)))  # none of it ours
        self.assertEqual(router.wanted(), frozenset({"a", "b", "d"}))
        queue.close()
