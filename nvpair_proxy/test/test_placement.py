"""Every placement explained (docs/operations.md#placement): why a committed request went
where it did, counted by reason, shown among the recent requests with its wait, and, only
with ``--placement-header``, said to the client."""

from __future__ import annotations

from nvpair_proxy.admin.recorder import Recorder
from nvpair_proxy.routing.enginetruth import EngineTruth, Slots

from .world import NDJSON, WorldTestCase

ADDRESS = {"a": "10.0.0.1", "b": "10.0.0.2"}
NODE_OF = {address: node for node, address in ADDRESS.items()}
DONE = b'{"done":true}\n'


def node_of(request) -> str:
    return NODE_OF[request.uri.decode().split("//", 1)[1].split(":", 1)[0]]


def chat(text: str) -> dict:
    return {"model": "llama3", "messages": [{"role": "user", "content": text}]}


class ReasonTests(WorldTestCase):
    def fleet(self, *nodes: str, **kwargs):
        self.recorder = Recorder()
        kwargs.setdefault("scheduling", True)
        w = self.world(recorder=self.recorder, **kwargs)
        for node in nodes:
            w.add(node, addresses=(ADDRESS[node],))
        return w

    def reasons(self) -> list[str]:
        return [ended.placement for ended in self.recorder.recent]

    def answer(self, w, request=None) -> None:
        (request or w.agent.last).respond(200, NDJSON, DONE, finish=True)

    def test_standalone_ranking_says_free_warm_or_least_busy(self):
        w = self.fleet("a", "b", queue_depth=10)
        router = w.facade.router
        router.set_truth("a", EngineTruth(read_at=0, slots=Slots(2, 0)))
        w.send("POST", "/api/chat", chat("one"))
        self.answer(w)
        router.set_truth("a", None)
        router.set_truth("b", EngineTruth(read_at=0, warm=frozenset({"llama3:latest"})))
        w.send("POST", "/api/chat", chat("two"))
        self.assertEqual(node_of(w.agent.last), "b")
        self.answer(w)
        router.set_truth("b", None)
        w.send("POST", "/api/chat", chat("three"))
        self.answer(w)
        self.assertEqual(self.reasons(), ["free", "warm", "least-busy"])

    def test_a_request_that_waited_says_queued_and_how_long(self):
        w = self.fleet("a", queue_depth=10)
        w.facade.router.set_truth("a", EngineTruth(read_at=0, slots=Slots(1, 0)))
        w.send("POST", "/api/chat", chat("first"))
        blocker = w.agent.last
        waiting = w.send("POST", "/api/chat", chat("second"))
        self.assertEqual(len(w.agent.requests), 1, "the second waits for the slot")
        w.clock.advance(1.5)
        self.answer(w, blocker)
        w.clock.advance(0)
        self.answer(w)
        self.assertEqual(waiting.response().status, 200)
        last = self.recorder.recent[-1]
        self.assertEqual((last.placement, last.waited), ("queued", 1.5))

    def test_a_failover_says_so(self):
        w = self.fleet("a", "b")
        client = w.send("POST", "/api/chat", chat("x"))
        w.agent.last.respond(503, {"Content-Type": "application/json"}, b"{}", finish=True)
        w.clock.advance(0)
        self.assertEqual(node_of(w.agent.last), "b")
        self.answer(w)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(self.reasons(), ["failover"])

    def test_a_conversations_next_turn_says_affine(self):
        w = self.fleet("a", "b", affinity=True)
        w.send("POST", "/api/chat", chat("conversation"))
        self.answer(w)
        w.send("POST", "/api/chat", chat("other"), headers={})
        busy = w.agent.last
        body = chat("conversation")
        body["messages"] += [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"},
        ]
        w.send("POST", "/api/chat", body)
        self.assertEqual(node_of(w.agent.last), "a")
        self.answer(w)
        self.answer(w, busy)
        self.assertEqual(self.reasons(), ["least-busy", "affine", "least-busy"])
        counts = {reason: n for (_, reason), n in self.recorder.placements.items()}
        self.assertEqual(counts, {"least-busy": 2, "affine": 1})

    def test_under_the_broker_the_scheduler_order_or_the_pin(self):
        w = self.fleet("a", "b", scheduling=False)
        w.send("POST", "/api/chat", chat("x"))
        self.answer(w)
        w.facade.router.set_pin("b")
        w.send("POST", "/api/chat", chat("y"))
        self.assertEqual(node_of(w.agent.last), "b")
        self.answer(w)
        self.assertEqual(self.reasons(), ["priority", "pinned"])


class HeaderTests(WorldTestCase):
    def send_one(self, **kwargs):
        w = self.world(scheduling=True, **kwargs)
        w.add("a", addresses=(ADDRESS["a"],))
        w.facade.router.set_truth("a", EngineTruth(read_at=0, slots=Slots(2, 0)))
        client = w.send("POST", "/api/chat", chat("x"))
        w.agent.last.respond(200, NDJSON, DONE, finish=True)
        return client.response()

    def test_the_header_only_with_the_flag(self):
        said = self.send_one(placement_header=True)
        self.assertEqual(said.status, 200)
        self.assertEqual(said.header("x-nvpair-placement"), "free; node=a; waited=0")
        quiet = self.send_one()
        self.assertEqual(quiet.status, 200)
        self.assertIsNone(quiet.header("x-nvpair-placement"))
