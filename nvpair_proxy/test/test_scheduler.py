"""Standalone placement and late binding: owners ranked by what their engines report, and a
request waiting in the proxy, not inside a full engine, until the first owner frees."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.http.answers import Reason
from nvpair_proxy.nodes.discovery import make_node
from nvpair_proxy.routing.enginetruth import EngineTruth, Slots
from nvpair_proxy.routing.placement import standing
from nvpair_proxy.routing.reservations import ReservationMap
from nvpair_proxy.routing.router import Router

from .world import ENGINES, NDJSON, WorldTestCase

ADDRESS = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
NODE_OF = {address: node for node, address in ADDRESS.items()}


def node_of(request) -> str:
    """The node an upstream request was sent to, by its address."""
    return NODE_OF[request.uri.decode().split("//", 1)[1].split(":", 1)[0]]


class StandingTests(SynchronousTestCase):
    """One owner's figures, as placement weighs them."""

    node = make_node(ENGINES["ollama"], id="a", port=1, addresses=["10.0.0.1"], models=["m"])

    def test_busy_is_the_larger_of_ours_and_what_the_engine_reported(self):
        truth = EngineTruth(read_at=0, slots=Slots(total=4, busy=3))
        self.assertEqual(standing(self.node, "m:latest", truth, ours=1).busy, 3)
        self.assertEqual(standing(self.node, "m:latest", truth, ours=4).busy, 4)

    def test_ours_that_ended_since_the_read_no_longer_count_in_the_report(self):
        truth = EngineTruth(read_at=0, slots=Slots(total=1, busy=1))
        self.assertTrue(standing(self.node, "m:latest", truth, ours=0).full)
        self.assertFalse(standing(self.node, "m:latest", truth, ours=0, ended_since_read=1).full)

    def test_an_unknown_slot_count_is_never_full(self):
        item = standing(self.node, "m:latest", None, ours=50)
        self.assertEqual((item.total, item.full, item.free_slots), (None, False, None))

    def test_the_nodes_file_slots_supply_or_cap_the_count(self):
        capped = make_node(
            ENGINES["ollama"], id="a", port=1, addresses=["x"], models=["m"], slots=2
        )
        self.assertEqual(standing(capped, "m:latest", None, ours=2).total, 2)
        self.assertTrue(standing(capped, "m:latest", None, ours=2).full)
        reported = EngineTruth(read_at=0, slots=Slots(total=8, busy=1))
        self.assertEqual(standing(capped, "m:latest", reported, ours=0).total, 2)
        fewer = EngineTruth(read_at=0, slots=Slots(total=1, busy=0))
        self.assertEqual(standing(capped, "m:latest", fewer, ours=0).total, 1)

    def test_warmth_is_what_the_engine_says_of_this_model(self):
        truth = EngineTruth(read_at=0, warm=frozenset({"m:latest"}))
        self.assertIs(standing(self.node, "m:latest", truth, 0).warm, True)
        self.assertIs(standing(self.node, "n:latest", truth, 0).warm, False)
        self.assertIsNone(standing(self.node, "m:latest", EngineTruth(read_at=0), 0).warm)

    def test_our_ended_dispatch_frees_its_slot_in_the_ranking_without_late_binding(self):
        # The engine's report still counts a dispatch of ours that ended since it was read:
        # the router takes it off at the release, whether or not requests wait (late binding).
        reservations = ReservationMap()
        router = Router(
            engine=ENGINES["ollama"], clock=Clock(), reservations=reservations, scheduling=True
        )
        router.put_manual(self.node)
        router.set_truth("a", EngineTruth(read_at=0, slots=Slots(total=1, busy=1)))
        claim = reservations.reserve("a")
        self.assertTrue(router.standings([self.node], "m:latest")[0].full)
        claim.release()
        self.assertFalse(router.standings([self.node], "m:latest")[0].full)

    def test_a_router_mode_model_competes_for_its_own_slots(self):
        truth = EngineTruth(read_at=0, slots=None, model_slots={"m:latest": Slots(total=2, busy=2)})
        self.assertTrue(standing(self.node, "m:latest", truth, 0).full)
        self.assertIsNone(standing(self.node, "n:latest", truth, 0).total)


class RankingTests(WorldTestCase):
    """Eligible owners; free before full; warm before cold; fewest busy; node id."""

    def scheduled(self, *nodes: str, **kwargs):
        w = self.world(scheduling=True, **kwargs)
        for node in nodes:
            w.add(node, addresses=(ADDRESS[node],))
        return w

    def tell(self, w, node: str, total: int | None = None, busy: int = 0, warm=None) -> None:
        slots = None if total is None else Slots(total=total, busy=busy)
        w.facade.router.set_truth(
            node,
            EngineTruth(
                read_at=w.clock.seconds(),
                slots=slots,
                warm=None if warm is None else frozenset(warm),
            ),
        )

    def served_by(self, w) -> str:
        """One chat, answered at once: the node it was sent to."""
        client = w.chat()
        node = node_of(w.agent.last)
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.assertEqual(client.response().status, 200)
        return node

    def order(self, w) -> list[str]:
        return [n.id for n in w.facade.router.candidates("llama3:latest")]

    def test_ties_go_to_the_node_id_as_before(self):
        w = self.scheduled("c", "a", "b")
        self.assertEqual(self.order(w), ["a", "b", "c"])

    def test_a_warm_owner_goes_before_a_cold_one(self):
        w = self.scheduled("a", "b")
        self.tell(w, "a", warm=["other:latest"])
        self.tell(w, "b", warm=["llama3:latest"])
        self.assertEqual(self.order(w), ["b", "a"])
        self.assertEqual(self.served_by(w), "b")

    def test_a_node_that_does_not_say_goes_between_warm_and_cold(self):
        w = self.scheduled("a", "b", "c")
        self.tell(w, "a", warm=[])
        self.tell(w, "c", warm=["llama3:latest"])
        self.assertEqual(self.order(w), ["c", "b", "a"])

    def test_a_free_slot_goes_before_a_warm_full_engine(self):
        w = self.scheduled("a", "b")
        self.tell(w, "a", total=1, busy=1, warm=["llama3:latest"])
        self.tell(w, "b", total=2, busy=0, warm=[])
        self.assertEqual(self.order(w), ["b", "a"])

    def test_fewest_busy_slots_first_counting_the_engines_other_clients(self):
        w = self.scheduled("a", "b")
        self.tell(w, "a", total=8, busy=3)
        self.tell(w, "b", total=8, busy=1)
        self.assertEqual(self.order(w), ["b", "a"])

    def test_our_own_dispatches_count_when_they_exceed_the_report(self):
        w = self.scheduled("a", "b")
        w.chat()
        self.assertEqual(node_of(w.agent.last), "a")
        self.assertEqual(self.order(w), ["b", "a"])
        w.chat()
        self.assertEqual([node_of(r) for r in w.agent.requests], ["a", "b"])
        for request in w.agent.requests:
            request.respond(200, NDJSON, b'{"done":true}\n', finish=True)

    def test_held_and_cooling_nodes_still_go_last(self):
        w = self.scheduled("a", "b", "c")
        self.tell(w, "a", total=4, warm=["llama3:latest"])
        self.tell(w, "b", total=4, warm=["llama3:latest"])
        w.facade.router.answered("a", 503)
        w.facade.router.stalled("b")
        self.assertEqual(self.order(w), ["c", "b", "a"])

    def test_broker_mode_ranks_as_before_whatever_the_engines_say(self):
        w = self.world()
        for node in ("a", "b"):
            w.add(node, addresses=(ADDRESS[node],))
        self.tell(w, "b", total=4, warm=["llama3:latest"])
        self.tell(w, "a", total=1, busy=1, warm=[])
        self.assertEqual(self.order(w), ["a", "b"])


class LateBindingTests(RankingTests):
    """When every owner with a known slot count is full, a request waits in the facade's
    queue and goes to the first owner that frees."""

    def full_fleet(self, depth: int = 1000):
        """Two one-slot owners, each running one of our streams."""
        w = self.scheduled("a", "b", queue_depth=depth)
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        first, second = w.chat(), w.chat()
        streams = {node_of(r): r.respond(200, NDJSON) for r in w.agent.requests}
        self.assertEqual(sorted(streams), ["a", "b"])
        return w, streams, (first, second)

    def end(self, w, stream) -> None:
        stream.write(b'{"done":true}\n')
        stream.finish()

    def test_a_request_waits_in_the_proxy_and_goes_to_the_first_owner_that_frees(self):
        w, streams, _ = self.full_fleet()
        waiting = w.chat()
        self.assertEqual(len(w.agent.requests), 2, "nothing dispatched into a full engine")
        self.assertEqual(w.facade.router.view().queued, 1)
        self.assertEqual(w.workload_events()[-1], ("workload:submitted", "queued", None))
        self.end(w, streams["b"])
        w.clock.advance(0)
        self.assertEqual(node_of(w.agent.last), "b")
        self.assertEqual(w.facade.router.view().queued, 0)
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.end(w, streams["a"])
        self.assertEqual(waiting.response().status, 200)

    def test_waiting_requests_go_in_arrival_order(self):
        w, streams, _ = self.full_fleet()
        later = [w.chat(model="llama3") for _ in range(3)]
        bodies = []
        self.end(w, streams["a"])
        w.clock.advance(0)
        bodies.append(w.agent.last)
        self.assertEqual(len(w.agent.requests), 3)
        # The first waiter went, the other two still wait, in order.
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        w.clock.advance(0)
        self.assertEqual(len(w.agent.requests), 4)
        self.assertEqual(later[0].response().status, 200)
        self.assertFalse(later[1].answered() or later[2].answered())
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        w.clock.advance(0)
        self.assertEqual(later[1].response().status, 200)
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.end(w, streams["b"])
        self.assertEqual(later[2].response().status, 200)

    def test_an_engine_reporting_a_free_slot_lets_a_waiting_request_go(self):
        w = self.scheduled("a", queue_depth=10)
        self.tell(w, "a", total=1, busy=1)  # the engine's other client holds its slot
        waiting = w.chat()
        self.assertEqual(w.agent.requests, [])
        self.tell(w, "a", total=1, busy=0)
        w.clock.advance(0)
        self.assertEqual(node_of(w.agent.last), "a")
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.assertEqual(waiting.response().status, 200)

    def test_at_the_deadline_a_waiting_request_gets_503_and_nothing_was_dispatched(self):
        # The slot is held by our own stream: with another's work on it, the request would
        # join the engine's queue after the hold instead (docs/decisions.md#fair-share).
        w = self.scheduled("a", queue_depth=10)
        self.tell(w, "a", total=1, busy=0)
        running = w.chat()
        stream = w.agent.last.respond(200, NDJSON)
        waiting = w.chat()
        w.clock.advance(0)
        self.assertEqual(
            [d.func.__name__ for d in w.clock.getDelayedCalls()].count("_expire_due"),
            1,
            "one timer for the whole queue",
        )
        w.clock.advance(599)
        self.assertFalse(waiting.answered())
        w.clock.advance(1)
        response = waiting.response()
        self.assertEqual((response.status, response.header("retry-after")), (503, "1"))
        self.assertEqual(response.json(), {"error": Reason.NO_FREE_SLOT.text})
        self.assertEqual(len(w.agent.requests), 1, "nothing dispatched for it")
        self.assertEqual(
            [e[0] for e in w.workload_events()][-2:], ["workload:submitted", "workload:errored"]
        )
        stream.write(b'{"done":true}\n')
        stream.finish()
        self.assertEqual(running.response().status, 200)

    def test_a_client_that_leaves_while_waiting_is_cancelled_and_nothing_is_dispatched(self):
        w = self.scheduled("a", queue_depth=10)
        self.tell(w, "a", total=1, busy=1)
        waiting = w.chat()
        waiting.disconnect()
        self.assertEqual(w.facade.router.view().queued, 0)
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "cancelled"))
        self.tell(w, "a", total=1, busy=0)
        w.clock.advance(0)
        self.assertEqual(w.agent.requests, [])
        self.assertEqual(w.clock.getDelayedCalls(), [])

    def test_a_full_queue_answers_the_busy_503_at_once_without_a_workload(self):
        w, streams, _ = self.full_fleet(depth=1)
        w.chat()
        refused = w.chat()
        response = refused.response()
        self.assertEqual((response.status, response.header("retry-after")), (503, "1"))
        self.assertEqual(response.json(), {"error": Reason.ALL_OWNERS_BUSY.text})
        self.assertEqual(
            len({info["id"] for _, info in w.emitter.workload()}),
            3,
            "the refused request made no workload",
        )
        self.end(w, streams["a"])
        w.clock.advance(0)
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.end(w, streams["b"])

    def test_an_owner_with_an_unknown_slot_count_takes_work_as_before(self):
        w = self.scheduled("a", "b", queue_depth=10)
        self.tell(w, "a", total=1, busy=1)
        self.assertEqual(self.served_by(w), "b")

    def test_a_free_cold_owner_is_used_before_waiting(self):
        w = self.scheduled("a", "b", queue_depth=10)
        self.tell(w, "a", total=1, busy=1, warm=["llama3:latest"])
        self.tell(w, "b", total=1, busy=0, warm=[])
        self.assertEqual(self.served_by(w), "b")

    def test_without_late_binding_a_request_goes_into_a_full_engine(self):
        w = self.scheduled("a")
        self.tell(w, "a", total=1, busy=1)
        self.assertEqual(self.served_by(w), "a")

    def test_a_failover_that_finds_every_owner_full_waits_ahead_of_new_arrivals(self):
        w = self.scheduled("a", "b", queue_depth=10)
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        first = w.chat()
        self.assertEqual(node_of(w.agent.last), "a")
        second = w.chat()
        stream_b = w.agent.last.respond(200, NDJSON)
        newcomer = w.chat()
        self.assertEqual(len(w.agent.requests), 2)
        # a says it is full: the first request fails over, finds b full, and waits ahead.
        w.agent.requests[0].respond(503, body=b"busy", finish=True)
        self.assertEqual(len(w.agent.requests), 2)
        self.assertEqual(w.facade.router.view().queued, 2)
        self.end(w, stream_b)
        self.assertEqual(second.response().status, 200)
        w.clock.advance(0)
        self.assertEqual(len(w.agent.requests), 3)
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.assertEqual(first.response().status, 200, "the failover went first")
        self.assertFalse(newcomer.answered())
        w.clock.advance(0)
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.assertEqual(newcomer.response().status, 200)
        self.assertEqual(len(w.agent.requests), 4)

    def test_a_failover_alone_in_the_queue_takes_the_slot_its_own_claim_freed(self):
        # One owner, one slot: the request's own dispatch holds it. The engine answers 503
        # and the engine's report still says full: the failover joins an empty queue after
        # releasing its claim, and must be offered the slot that release freed.
        w = self.scheduled("a", "b", queue_depth=10)
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1, busy=1)
        client = w.chat()
        self.assertEqual(node_of(w.agent.last), "a")
        w.agent.last.respond(502, body=b"bad gateway", finish=True)
        self.assertEqual(len(w.agent.requests), 1)
        self.assertEqual(w.facade.router.view().queued, 1)
        w.clock.advance(0)
        self.assertEqual([node_of(r) for r in w.agent.requests], ["a", "a"])
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.assertEqual(client.response().status, 200)

    def test_the_status_view_shows_the_queue_and_each_engines_figures(self):
        w, streams, _ = self.full_fleet()
        w.chat()
        w.clock.advance(3)
        view = w.facade.router.view()
        self.assertEqual((view.queued, view.oldest_wait), (1, 3.0))
        engines = {e.node: e for e in view.engines}
        self.assertEqual(
            (
                engines["a"].slots_total,
                engines["a"].busy,
                engines["a"].ours,
                engines["a"].reported_busy,
                engines["a"].read_age,
            ),
            (1, 1, 1, 0, 3.0),
        )
        self.end(w, streams["a"])
        w.clock.advance(0)
        w.agent.last.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        self.end(w, streams["b"])
