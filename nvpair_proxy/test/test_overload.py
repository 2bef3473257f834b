"""Overload protection (issue 8): the busy hold and the stall cooldown, through a real facade."""

from __future__ import annotations

from nvpair_proxy.routing.reservations import Rank
from nvpair_proxy.test.world import NDJSON, WorldTestCase, serve, serve_all

BUSY_TEXT = "every node advertising the requested model is busy; retry shortly"


class BusyHoldTests(WorldTestCase):
    def held_world(self, *node_ids: str, status: int = 429):
        """Every node answered ``status`` once to a first request, which is now backing off."""
        w = self.world()
        for index, node_id in enumerate(node_ids):
            w.add(node_id, addresses=(f"10.0.0.{index + 1}",))
        first = w.chat()
        for index in range(len(node_ids)):  # each refusal fails over to the next node
            w.agent.requests[index].respond(status, body=b"busy", length=4, finish=True)
        self.assertEqual(len(w.agent.requests), len(node_ids))
        return w, first

    def test_all_owners_held_answers_503_at_once_with_nothing_dispatched(self):
        w, first = self.held_world("a", "b")
        sent = len(w.emitter.sent)
        client = w.chat()
        response = client.response()
        self.assertEqual(response.status, 503)
        self.assertEqual(response.json(), {"error": BUSY_TEXT})
        self.assertEqual(response.header("retry-after"), "1")
        self.assertEqual(response.header("content-type"), "application/json")
        self.assertEqual(response.header("x-content-type-options"), "nosniff")
        self.assertEqual(len(w.agent.requests), 2)
        self.assertEqual(
            w.emitter.sent[sent:],
            [
                (
                    "ollama:proxy/request",
                    {
                        "id": "2",
                        "method": "POST",
                        "path": "/api/chat",
                        "target": "",
                        "status": 503,
                        "duration_ms": 0,
                        "error": BUSY_TEXT,
                    },
                )
            ],
        )
        serve_all(self, w, first)  # nothing left open

    def test_503_holds_like_429(self):
        w, first = self.held_world("a", status=503)
        self.assertEqual(w.chat().response().status, 503)
        serve_all(self, w, first)  # nothing left open

    def test_retry_after_is_the_longest_remaining_hold_rounded_up(self):
        w = self.world()
        w.facade.router.busy_hold = 2.5
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        first = w.chat()
        w.agent.requests[0].respond(429, body=b"busy", length=4, finish=True)  # a until 2.5
        w.clock.advance(1.0)
        second = w.chat()  # b is free: admitted, and sent to b first
        self.assertEqual(w.agent.hosts()[-1], "10.0.0.2:11434")
        w.agent.requests[-1].respond(429, body=b"busy", length=4, finish=True)  # b until 3.5
        w.clock.advance(0.2)
        response = w.chat().response()
        self.assertEqual((response.status, response.header("retry-after")), (503, "3"))
        serve_all(self, w, first, second)

    def test_one_free_owner_turns_the_gate_off_and_held_nodes_go_last(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        first = w.chat()
        w.agent.requests[0].respond(429, body=b"busy", length=4, finish=True)
        serve(w.agent.requests[1])  # the first request fails over to b
        self.assertEqual(first.response().status, 200)
        second = w.chat()
        # a sorts first by id, but it is held: b goes first, a is still a candidate.
        self.assertEqual(w.agent.hosts()[2:], ["10.0.0.2:11434"])
        w.agent.requests[2].respond(500, body=b"oops", length=4, finish=True)
        self.assertEqual(w.agent.hosts()[3:], ["10.0.0.1:11434"])
        serve(w.agent.requests[3])
        self.assertEqual(second.response().status, 200)

    def test_the_hold_lasts_one_second(self):
        w, first = self.held_world("a")
        w.clock.advance(0.999)
        self.assertEqual(w.chat().response().status, 503)
        w.clock.advance(0.001)
        # The first request's backoff (1 s at jitter 0.5) and a new one are both dispatched.
        second = w.chat()
        self.assertEqual(len(w.agent.requests), 3)
        serve(w.agent.requests[1]), serve(w.agent.requests[2])
        self.assertEqual((first.response().status, second.response().status), (200, 200))

    def test_each_busy_answer_renews_the_hold(self):
        w, first = self.held_world("a")
        w.clock.advance(1.0)  # the first request's second dispatch, to a again
        w.agent.requests[1].respond(503, body=b"busy", length=4, finish=True)
        w.clock.advance(0.9)
        self.assertEqual(w.chat().response().status, 503)
        w.clock.advance(0.1)
        second = w.chat()
        serve(w.agent.requests[-1])
        self.assertEqual(second.response().status, 200)
        serve_all(self, w, first)  # nothing left open

    def assertCommitClearsTheHold(self, commit) -> None:
        """A held node's commit (``commit`` answers its request) lets the next request in."""
        w = self.world()
        w.facade.router.busy_hold = 60.0
        w.add("a")
        first = w.chat()
        w.agent.requests[0].respond(429, body=b"busy", length=4, finish=True)
        self.assertEqual(w.chat().response().status, 503)
        w.clock.advance(1.0)  # the admitted request keeps its budget: dispatched to a again
        commit(w.agent.requests[1])
        second = w.chat()
        self.assertEqual(len(w.agent.requests), 3)
        serve(w.agent.requests[2])
        self.assertEqual(second.response().status, 200)
        return first.response().status

    def test_a_commit_from_the_node_clears_its_hold(self):
        self.assertEqual(self.assertCommitClearsTheHold(serve), 200)

    def test_any_commit_clears_the_hold_not_only_a_2xx(self):
        # A committed 400 is the engine answering, not the engine being full.
        status = self.assertCommitClearsTheHold(
            lambda request: request.respond(
                400, {"Content-Type": "application/json"}, b'{"error":"x"}', length=13, finish=True
            )
        )
        self.assertEqual(status, 400)

    def test_a_held_pin_goes_after_a_free_node(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        router = w.facade.router
        router.set_pin("a")
        self.assertEqual(router.model_owners("llama3:latest"), ["a", "b"])
        router.answered("a", 429)
        self.assertEqual(router.model_owners("llama3:latest"), ["b", "a"])
        client = w.chat()
        self.assertEqual(w.agent.hosts(), ["10.0.0.2:11434"])
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)

    def test_a_busy_final_answer_also_holds(self):
        w = self.world()
        w.add("a")
        first = w.chat()
        for index, backoff in enumerate((1, 2, 4, 8)):
            w.agent.requests[index].respond(503, body=b"busy", length=4, finish=True)
            w.clock.advance(backoff)
        w.agent.requests[4].respond(503, body=b"full", length=4, finish=True)
        self.assertEqual((first.response().status, first.response().body), (503, b"full"))
        self.assertEqual(w.chat().response().json(), {"error": BUSY_TEXT})

    def test_the_no_owner_502_comes_before_the_busy_503(self):
        w, first = self.held_world("a")
        response = w.chat(model="mistral").response()
        self.assertEqual(
            (response.status, response.json()),
            (502, {"error": "no available node advertises the requested model"}),
        )
        serve_all(self, w, first)  # nothing left open

    def test_non_inference_and_model_less_requests_are_never_gated(self):
        w, first = self.held_world("a")
        ps = w.send("GET", "/api/ps")
        self.assertEqual(w.agent.last.uri, b"http://10.0.0.1:11434/api/ps")
        w.agent.last.respond(
            200, {"Content-Type": "application/json"}, b"{}", length=2, finish=True
        )
        self.assertEqual(ps.response().status, 200)
        unnamed = w.send("POST", "/api/chat", {"messages": []})
        self.assertEqual(w.agent.last.uri, b"http://10.0.0.1:11434/api/chat")
        serve(w.agent.last)
        self.assertEqual(unnamed.response().status, 200)
        serve_all(self, w, first)  # nothing left open

    def test_the_hold_is_per_facade(self):
        ollama, first = self.held_world("a")
        lmstudio = self.world("lmstudio", reservations=ollama.reservations, clock=ollama.clock)
        lmstudio.add("a", models=("qwen",), port=1234)
        client = lmstudio.send("POST", "/v1/chat/completions", {"model": "qwen"})
        self.assertEqual(lmstudio.agent.hosts(), ["10.0.0.1:1234"])
        serve(lmstudio.agent.last)
        self.assertEqual(client.response().status, 200)
        serve_all(self, ollama, first)  # nothing left open


class StallCooldownTests(WorldTestCase):
    def stalled_world(self, *node_ids: str, **world):
        """Node ``node_ids[0]`` spends a whole 60 s first-content budget silent; the request
        fails over to the next node, which serves it."""
        w = self.world(response_timeout=60, **world)
        for index, node_id in enumerate(node_ids):
            w.add(node_id, addresses=(f"10.0.0.{index + 1}",))
        return w

    def served_by(self, w, index: int, host: str) -> None:
        """A new chat's first dispatch (the ``index``-th of the world) goes to ``host``,
        which serves it."""
        client = w.chat()
        self.assertEqual(w.agent.hosts()[index], host)
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)

    def stall_then_serve(self, w) -> None:
        client = w.chat()
        w.agent.last.respond(200, NDJSON)
        w.clock.advance(60)
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)

    def test_a_stalled_node_goes_last_for_30_seconds(self):
        w = self.stalled_world("a", "b")
        self.stall_then_serve(w)
        self.assertEqual(w.agent.hosts(), ["10.0.0.1:11434", "10.0.0.2:11434"])
        self.served_by(w, 2, "10.0.0.2:11434")
        w.clock.advance(30)
        self.served_by(w, 3, "10.0.0.1:11434")

    def test_the_cooldown_ends_after_30_seconds_not_before(self):
        w = self.stalled_world("a", "b")
        self.stall_then_serve(w)  # a cooling from t=60
        w.clock.advance(29.9)
        self.assertEqual(w.facade.router.model_owners("llama3:latest"), ["b", "a"])
        w.clock.advance(0.1)
        self.assertEqual(w.facade.router.model_owners("llama3:latest"), ["a", "b"])

    def test_headers_withheld_for_the_whole_cap_also_cool_the_node(self):
        w = self.stalled_world("a", "b")
        client = w.chat()
        w.clock.advance(60)  # a never sends headers: the header cap ends the attempt
        self.assertEqual(w.agent.hosts(), ["10.0.0.1:11434", "10.0.0.2:11434"])
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(list(w.facade.router.cooling()), ["a"])
        self.served_by(w, 2, "10.0.0.2:11434")

    def test_a_refused_dial_does_not_cool_the_node(self):
        w = self.stalled_world("a", "b")
        client = w.chat()
        w.agent.last.refuse()
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(w.facade.router.cooling(), {})

    def test_any_first_byte_ends_the_cooldown(self):
        w = self.stalled_world("a", "b")
        self.stall_then_serve(w)  # a cooling
        client = w.chat()  # b first, refuses; a answers 400, committed
        w.agent.last.respond(500, body=b"oops", length=4, finish=True)
        w.agent.last.respond(
            400, {"Content-Type": "application/json"}, b'{"error":"x"}', length=13, finish=True
        )
        self.assertEqual(client.response().status, 400)
        self.assertEqual(w.facade.router.cooling(), {})

    def test_the_cooldown_demotes_a_pin(self):
        w = self.stalled_world("a", "b")
        w.facade.router.set_pin("a")
        self.stall_then_serve(w)
        self.served_by(w, 2, "10.0.0.2:11434")

    def test_a_cooling_sole_owner_still_serves(self):
        w = self.stalled_world("a")
        client = w.chat()
        w.agent.last.respond(200, NDJSON)
        w.clock.advance(60)
        w.clock.advance(1)  # backoff, then a again
        self.assertEqual(w.agent.hosts(), ["10.0.0.1:11434"] * 2)
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)
        second = w.chat()
        self.assertEqual(w.agent.hosts(), ["10.0.0.1:11434"] * 3)
        serve(w.agent.last)
        self.assertEqual(second.response().status, 200)

    def test_the_chooser_skips_cooling_nodes(self):
        w = self.stalled_world("a", "b")
        # a is the least loaded and would be reserved first, were it not cooling.
        w.reservations.set_priority(1, ["a", "b"], [Rank("b", pending=5)])
        self.stall_then_serve(w)
        client = w.chat()
        self.assertEqual(w.agent.hosts()[2], "10.0.0.2:11434")
        self.assertEqual(w.reservations.reservations, {"b": 1})
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)

    def test_the_chooser_takes_a_cooling_node_when_all_are(self):
        w = self.stalled_world("a", "b")
        w.reservations.set_priority(1, ["a", "b"], [Rank("b", pending=5)])
        router = w.facade.router
        router.stalled("a"), router.stalled("b")
        client = w.chat()
        self.assertEqual(w.reservations.reservations, {"a": 1})
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)

    def test_a_first_byte_ends_the_cooldown_early(self):
        w = self.stalled_world("a", "b")
        self.stall_then_serve(w)  # a cooling
        client = w.chat()  # b first, refuses; a serves
        w.agent.last.respond(500, body=b"oops", length=4, finish=True)
        self.assertEqual(w.agent.hosts()[3], "10.0.0.1:11434")
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)
        self.served_by(w, 4, "10.0.0.1:11434")  # a is first again, by id, well within 30 s


class HeldAndCoolingTests(WorldTestCase):
    def test_the_chooser_prefers_a_cooling_node_to_a_held_one(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        w.reservations.set_priority(1, ["a", "b"], [Rank("b", pending=5)])
        router = w.facade.router
        router.answered("a", 429)  # held: the engine said it is full
        router.stalled("b")  # cooling: slow once, not full
        client = w.chat()
        self.assertEqual(w.agent.hosts(), ["10.0.0.2:11434"])
        self.assertEqual(w.reservations.reservations, {"b": 1})
        serve(w.agent.last)
        self.assertEqual(client.response().status, 200)


class StoppingTests(WorldTestCase):
    def test_a_request_after_shutdown_began_is_refused_not_admitted(self):
        w = self.world()
        w.add("a")
        w.facade.shutdown()
        sent = len(w.emitter.sent)
        response = w.chat().response()
        self.assertEqual(
            (response.status, response.json()), (503, {"error": "the proxy is shutting down"})
        )
        self.assertEqual(response.header("connection"), "close")
        self.assertEqual(response.header("retry-after"), "1")
        self.assertEqual(w.agent.requests, [])
        self.assertEqual([m for m, _ in w.emitter.sent[sent:]], ["ollama:proxy/request"])
        self.assertEqual(w.emitter.sent[-1][1]["status"], 503)
