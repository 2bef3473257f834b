"""Affinity: a conversation's key, the facade's table, and placement that sends the next turn
back to the node holding its cache unless the spill rule says otherwise."""

from __future__ import annotations

import json
from collections import Counter

from twisted.logger import formatEvent
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from nvpair_proxy.admin.recorder import Recorder
from nvpair_proxy.routing.affinity import HASHED, MAX_KEYS, AffinityTable, affinity_key
from nvpair_proxy.routing.enginetruth import EngineTruth, Slots
from nvpair_proxy.routing.rates import NodeRates, PromptReading

from .support import LogCapture, by_labels, scraped
from .world import ENGINES, NDJSON, WorldTestCase, view_of

ADDRESS = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
NODE_OF = {address: node for node, address in ADDRESS.items()}
DONE = b'{"done":true}\n'
# A first message long enough that reading it again costs more than waiting a moment.
LONG = "one" + "z" * 4000


def node_of(request) -> str:
    return NODE_OF[request.uri.decode().split("//", 1)[1].split(":", 1)[0]]


def chat(first: str, *later: str, system: str = "be brief") -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    for turn in later:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": turn}]
    return {"model": "llama3", "messages": messages}


def key(body: dict, path: str = "/api/chat", **headers: str) -> bytes | None:
    raw = Headers({name.encode(): [value.encode()] for name, value in headers.items()})
    return affinity_key(raw, body, "llama3:latest", path)


class KeyTests(SynchronousTestCase):
    def test_each_session_header_names_the_conversation_in_order(self):
        body = chat("first")
        for header in (
            "x-session-affinity",
            "x-claude-code-session-id",
            "session_id",
            "session-id",
            "x-session-id",
        ):
            self.assertEqual(
                key(body, **{header: "s1"}), key(chat("other"), **{header: "s1"}), header
            )
            self.assertNotEqual(key(body, **{header: "s1"}), key(body, **{header: "s2"}), header)
        self.assertEqual(
            key(body, **{"x-session-affinity": "one", "x-session-id": "two"}),
            key(body, **{"x-session-affinity": "one"}),
            "the first match wins",
        )

    def test_the_body_prompt_cache_key_names_it_when_no_header_does(self):
        named = dict(chat("first"), prompt_cache_key="k")
        self.assertEqual(key(named), key(dict(chat("other"), prompt_cache_key="k")))
        self.assertNotEqual(key(named), key(chat("first")))
        self.assertEqual(
            key(named, **{"x-session-id": "h"}), key(chat("x"), **{"x-session-id": "h"})
        )

    def test_a_conversations_turns_share_its_digest_and_other_first_messages_do_not(self):
        self.assertEqual(
            key(chat("read this file")), key(chat("read this file", "and now?", "more"))
        )
        self.assertNotEqual(key(chat("read this file")), key(chat("read that file")))
        self.assertNotEqual(
            key(chat("read this file")), key(chat("read this file", system="be long"))
        )

    def test_messages_responses_and_prompts_have_their_own_heads(self):
        messages = {
            "model": "m",
            "system": [{"type": "text", "text": "sys"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        }
        self.assertEqual(
            key(messages, "/v1/messages"),
            key(
                dict(
                    messages,
                    messages=messages["messages"]
                    + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
                ),
                "/v1/messages",
            ),
        )
        responses = {"model": "m", "instructions": "i", "input": "question"}
        self.assertIsNotNone(key(responses, "/v1/responses"))
        self.assertNotEqual(
            key(responses, "/v1/responses"), key(dict(responses, instructions="j"), "/v1/responses")
        )
        prompt = {"model": "m", "prompt": "once upon a time"}
        self.assertEqual(
            key(prompt, "/api/generate"),
            key({"model": "m", "prompt": "once upon a time"}, "/api/generate"),
        )
        self.assertNotEqual(
            key(prompt, "/api/generate"), key({"model": "m", "prompt": "twice"}, "/api/generate")
        )

    def test_no_key_for_embeddings_or_a_body_without_a_conversation(self):
        self.assertIsNone(key({"model": "m", "input": "x"}, "/v1/embeddings"))
        self.assertIsNone(key({"model": "m", "prompt": "x"}, "/api/embeddings"))
        self.assertIsNone(key({"model": "m"}, "/api/chat"))
        self.assertIsNone(key({"model": "m", "messages": []}, "/api/chat"))
        self.assertIsNone(key({"model": "m", "messages": [{"role": "assistant"}]}, "/api/chat"))

    def test_at_most_16_KiB_of_a_head_is_hashed(self):
        head = "x" * HASHED
        self.assertEqual(
            key(chat(head + "a" * 200_000)),
            key(chat(head + "b")),
            "bytes past the bound never reach the digest",
        )
        self.assertNotEqual(key(chat("a" + head)), key(chat("b" + head)))

    def test_the_key_is_a_digest_never_the_text(self):
        digest = key(chat("secret words"))
        self.assertEqual(len(digest), 16)
        self.assertNotIn(b"secret", digest)


class TableTests(SynchronousTestCase):
    def test_bounded_by_count_the_least_recent_key_goes_first(self):
        table = AffinityTable(max_keys=2)
        table.committed(b"k1", "a", 0)
        table.committed(b"k2", "b", 1)
        table.committed(b"k1", "a", 2)
        table.committed(b"k3", "c", 3)
        self.assertEqual(
            (
                table.node_for(b"k1", 3),
                table.node_for(b"k2", 3),
                table.node_for(b"k3", 3),
                len(table),
            ),
            ("a", None, "c", 2),
        )

    def test_an_idle_key_expires(self):
        table = AffinityTable(idle_expiry=60)
        table.committed(b"k", "a", 0)
        self.assertEqual(table.node_for(b"k", 60), "a")
        self.assertIsNone(table.node_for(b"k", 60.5))
        self.assertEqual(len(table), 0)

    def test_a_node_that_left_leaves_the_table(self):
        table = AffinityTable()
        table.committed(b"k1", "a", 0)
        table.committed(b"k2", "b", 0)
        table.forget_nodes_except({"b"})
        self.assertEqual((table.node_for(b"k1", 0), table.node_for(b"k2", 0)), (None, "b"))
        self.assertEqual(table.keys_per_node(0), {"b": 1})


class FleetTestCase(WorldTestCase):
    def fleet(self, *nodes: str, recorder=None, **kwargs):
        w = self.world(scheduling=True, queue_depth=100, affinity=True, recorder=recorder, **kwargs)
        for node in nodes:
            w.add(node, addresses=(ADDRESS[node],))
        return w

    def tell(self, w, node: str, total: int, busy: int = 0) -> None:
        w.facade.router.set_truth(
            node, EngineTruth(read_at=w.clock.seconds(), slots=Slots(total, busy))
        )

    def turn(
        self, w, body: dict, *, answer: bool = True, timings: dict | None = None
    ) -> tuple[str, object]:
        """Send one turn; answer it at once unless told not to: (node, client)."""
        client = w.send("POST", "/api/chat", body)
        request = w.agent.last
        node = node_of(request)
        if answer:
            tail = dict(timings or {}, done=True)
            request.respond(200, NDJSON, json.dumps(tail).encode() + b"\n", finish=True)
        return node, client


class PlacementTests(FleetTestCase):
    def test_a_conversation_sticks_to_its_node_when_loads_are_equal(self):
        w = self.fleet("a", "b", "c")
        first, _ = self.turn(w, chat("file one"))
        other, _ = self.turn(w, chat("file two"), answer=False)
        self.assertEqual((first, other), ("a", "a"), "a new key is placed as before")
        w.agent.last.respond(200, NDJSON, DONE, finish=True)
        # b is now the least loaded by id order too; the conversation still goes to a.
        w.facade.router.set_truth("a", EngineTruth(read_at=w.clock.seconds(), slots=Slots(4, 2)))
        for turn in ("and?", "and then?"):
            node, client = self.turn(w, chat("file one", turn))
            self.assertEqual(node, "a")
            self.assertEqual(client.response().status, 200)

    def test_distinct_conversations_still_spread(self):
        w = self.fleet("a", "b")
        self.turn(w, chat("one"), answer=False)
        self.turn(w, chat("two"), answer=False)
        self.assertEqual([node_of(r) for r in w.agent.requests], ["a", "b"])
        for request in w.agent.requests:
            request.respond(200, NDJSON, DONE, finish=True)

    def sticky(self, *nodes: str, first: str = "one"):
        """A fleet where the conversation that begins with ``first`` lives on a."""
        w = self.fleet(*nodes)
        node, _ = self.turn(w, chat(first))
        self.assertEqual(node, "a")
        return w

    def test_it_spills_when_its_node_is_held_cooling_or_no_longer_an_owner(self):
        for why in ("held", "cooling", "gone"):
            w = self.sticky("a", "b")
            if why == "held":
                w.facade.router.answered("a", 503)
            elif why == "cooling":
                w.facade.router.stalled("a")
            else:
                w.remove("a")
            node, _ = self.turn(w, chat("one", "next"))
            self.assertEqual(node, "b", why)
            if why != "gone":
                w.clock.advance(31)

    def test_a_full_node_without_measured_rates_is_not_waited_for(self):
        w = self.sticky("a", "b")
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        self.turn(w, chat("two"), answer=False)  # takes a, the first by id
        self.assertEqual(node_of(w.agent.last), "a")
        node, client = self.turn(w, chat("one", "next"))
        self.assertEqual(node, "b", "no timings from a: spill at once")
        w.agent.requests[1].respond(200, NDJSON, DONE, finish=True)

    def measured(self, w, prompt_per_second: float = 100.0, bytes_per_token: float = 4.0) -> None:
        """a served a request of conversation "seed" in 2 s, at a measured prompt rate and
        a measured number of body bytes per prompt token: with the conversation's own first
        turn (0 s), a's time to serve one is 0.6 s (a moving average weighting each new
        request 0.3)."""
        body = chat("seed " * 100)
        size = len(json.dumps(body))
        client = w.send("POST", "/api/chat", body)
        self.assertEqual(node_of(w.agent.last), "a")
        w.clock.advance(2)
        w.agent.last.respond(
            200,
            NDJSON,
            json.dumps(
                {
                    "done": True,
                    "timings": {
                        "prompt_n": 64,
                        "cache_n": round(size / bytes_per_token) - 64,
                        "predicted_n": 5,
                        "predicted_per_second": 50.0,
                        "prompt_per_second": prompt_per_second,
                    },
                }
            ).encode()
            + b"\n",
            finish=True,
        )
        self.assertEqual(client.response().status, 200)
        view = next(v for v in w.facade.router.view().engines if v.node == "a")
        self.assertEqual(view.prompt_rate, prompt_per_second)
        self.assertLess(abs(view.bytes_per_token - bytes_per_token), 0.01)

    def test_a_full_node_is_waited_for_when_rereading_elsewhere_costs_more(self):
        w = self.sticky("a", "b", first=LONG)
        self.measured(w, prompt_per_second=10.0)  # re-reading a long context: slow
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        blocker, _ = self.turn(w, chat("other"), answer=False)
        self.assertEqual(blocker, "a")
        client = w.send("POST", "/api/chat", chat(LONG, "next"))
        self.assertEqual(len(w.agent.requests), 3, "waits for a, though b is free")
        w.clock.advance(0.5)
        w.agent.requests[2].respond(200, NDJSON, DONE, finish=True)
        w.clock.advance(0)
        self.assertEqual(node_of(w.agent.last), "a")
        w.agent.last.respond(200, NDJSON, DONE, finish=True)
        self.assertEqual(client.response().status, 200)

    def test_the_wait_for_a_full_node_never_outlasts_the_reread_it_saves(self):
        """At a measured byte a token and 3,000 tokens a second, reading the conversation
        again elsewhere costs its body's bytes / 3,000 s: that is how long it waits for a,
        and then it goes to b."""
        w = self.sticky("a", "b", first=LONG)
        self.measured(w, prompt_per_second=3000.0, bytes_per_token=1.0)
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        self.turn(w, chat("other"), answer=False)
        body = chat(LONG, "next")
        reread = len(json.dumps(body)) / 3000.0
        client = w.send("POST", "/api/chat", body)
        self.assertEqual(len(w.agent.requests), 3)
        w.clock.advance(reread - 0.05)
        self.assertEqual(len(w.agent.requests), 3, "still waiting for a")
        w.clock.advance(0.1)
        self.assertEqual(node_of(w.agent.last), "b")
        w.agent.last.respond(200, NDJSON, DONE, finish=True)
        self.assertEqual(client.response().status, 200)
        w.agent.requests[2].respond(200, NDJSON, DONE, finish=True)

    def test_the_request_in_its_slot_costs_only_what_is_left_of_it(self):
        """Calibrated at agent pace: a re-read elsewhere costs 0.34 s and a's time to serve
        one is 0.6 s. Just after the blocker went to a the turn spills (0.6 s ahead); 0.4 s
        later only 0.2 s of it is expected to be left, and the turn waits for a."""
        for ran, expected in ((0.0, "b"), (0.4, "a")):
            w = self.sticky("a", "b", first=LONG)
            self.measured(w, prompt_per_second=3000.0, bytes_per_token=4.0)
            self.tell(w, "a", total=1)
            self.tell(w, "b", total=1)
            self.turn(w, chat("other"), answer=False)
            w.clock.advance(ran)
            client = w.send("POST", "/api/chat", chat(LONG, "next"))
            went_at_once = len(w.agent.requests) == 4
            w.agent.requests[2].respond(200, NDJSON, DONE, finish=True)  # the blocker
            w.clock.advance(0)
            self.assertEqual(went_at_once, expected == "b", ran)
            self.assertEqual(node_of(w.agent.last), expected, ran)
            w.agent.last.respond(200, NDJSON, DONE, finish=True)
            self.assertEqual(client.response().status, 200)

    def test_a_short_turn_spills_when_rereading_is_cheaper_than_waiting(self):
        w = self.sticky("a", "b")
        self.measured(w, prompt_per_second=1000.0)
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        self.turn(w, chat("other"), answer=False)
        node, _ = self.turn(w, chat("one", "next"))
        self.assertEqual(node, "b")
        w.agent.requests[2].respond(200, NDJSON, DONE, finish=True)

    def test_a_measured_bytes_per_token_turns_a_spill_into_a_wait(self):
        """A 4 KB conversation on a node reading 3,000 prompt tokens a second: at 4 bytes a
        token re-reading it elsewhere takes 0.34 s, less than the 0.6 s a's next slot is
        expected in, so it spills; where the engine has shown a byte a token, re-reading
        takes 1.35 s and the turn waits for a."""
        for bytes_per_token, expected in ((4.0, "b"), (1.0, "a")):
            w = self.sticky("a", "b", first=LONG)
            self.measured(w, prompt_per_second=3000.0, bytes_per_token=bytes_per_token)
            self.tell(w, "a", total=1)
            self.tell(w, "b", total=1)
            self.turn(w, chat("other"), answer=False)
            client = w.send("POST", "/api/chat", chat(LONG, "next"))
            w.agent.requests[2].respond(200, NDJSON, DONE, finish=True)
            w.clock.advance(0)
            self.assertEqual(node_of(w.agent.last), expected, bytes_per_token)
            w.agent.last.respond(200, NDJSON, DONE, finish=True)
            self.assertEqual(client.response().status, 200)

    def test_a_reading_of_a_few_prompt_tokens_moves_no_figure(self):
        """A cache hit that read 10 new tokens says little of the engine's prompt rate (its
        fixed cost per request dominates) and of bytes per token (the JSON envelope does)."""
        w = self.fleet("a")

        def served(timings: dict) -> None:
            client = w.send("POST", "/api/chat", chat("seed " * 100))
            w.clock.advance(1)
            w.agent.last.respond(
                200,
                NDJSON,
                json.dumps({"done": True, "timings": timings}).encode() + b"\n",
                finish=True,
            )
            self.assertEqual(client.response().status, 200)

        def report():
            (view,) = w.facade.router.view().engines
            return view.prompt_rate, view.bytes_per_token

        size = len(json.dumps(chat("seed " * 100)))
        self.assertGreater(size, 500)
        served({"prompt_n": size // 2, "prompt_per_second": 400.0})
        first = size / (size // 2)
        self.assertEqual(report(), (400.0, first))
        served({"prompt_n": 10, "prompt_per_second": 20.0})
        self.assertEqual(report(), (400.0, first), "10 tokens read: unchanged")
        served({"prompt_n": 10, "cache_n": size - 10, "prompt_per_second": 20.0})
        self.assertEqual(
            report(),
            (400.0, first + 0.3 * (1.0 - first)),
            "a whole prompt of many tokens moves bytes per token, not the rate",
        )

    def test_a_nodes_prompt_rate_is_read_from_a_tail_at_most_once_a_second(self):
        w = self.fleet("a")

        def served(rate: float, after: float) -> None:
            client = w.send("POST", "/api/chat", chat("one"))
            w.clock.advance(after)
            w.agent.last.respond(
                200,
                NDJSON,
                json.dumps({"done": True, "timings": {"prompt_per_second": rate}}).encode() + b"\n",
                finish=True,
            )
            self.assertEqual(client.response().status, 200)

        def report():
            (view,) = w.facade.router.view().engines
            return view.prompt_rate, view.service

        served(100.0, after=2)
        self.assertEqual(report(), (100.0, 2.0))
        served(1.0, after=0.5)
        self.assertEqual(report(), (100.0, 1.55), "read 0.5 s after the last: not read")
        served(1.0, after=1)
        self.assertEqual(report(), (70.3, 1.385))

    def test_hits_spills_misses_and_none_are_counted_once_per_request(self):
        recorder = Recorder()
        w = self.fleet("a", "b", recorder=recorder)
        self.turn(w, chat("one"))  # miss
        self.turn(w, chat("one", "next"))  # hit
        w.facade.router.answered("a", 503)
        self.turn(w, chat("one", "again"))  # spill: a is held
        client = w.send("POST", "/api/embed", {"model": "llama3", "input": "x"})
        w.agent.last.respond(200, {"Content-Type": "application/json"}, b"{}", finish=True)
        self.assertEqual(client.response().status, 200)  # none
        self.assertEqual(
            dict(recorder.affinity),
            {
                ("ollama", "miss"): 1,
                ("ollama", "hit"): 1,
                ("ollama", "spill"): 1,
                ("ollama", "none"): 1,
            },
        )
        self.assertEqual(
            w.facade.router.view().affinity_keys,
            (("b", 1),),
            "the conversation now lives where it spilled",
        )

    def test_no_log_line_carries_a_key_or_a_digest(self):
        logs = LogCapture(self, level="debug")
        w = self.fleet("a", "b")
        body = dict(chat("one"), prompt_cache_key="cache-key-7")
        self.turn(w, body)
        self.turn(w, chat("two"))
        table = w.facade.router.affinity
        digests = [k for k in table._entries]  # the table's own keys, as the test reads them
        text = "\n".join(formatEvent(event) + repr(event) for event in logs.events)
        self.assertTrue(text)
        for digest in digests:
            self.assertNotIn(digest.hex(), text)
            self.assertNotIn(repr(digest), text)
        self.assertNotIn("cache-key-7", text)


class CalibrationTests(FleetTestCase):
    """The spill rule at agent pace (docs/decisions.md#affinity): the work ahead on the
    conversation's node is what is left of the request in its slot plus the uncached work of
    those already waiting for it, each from the node's measured rates."""

    def test_a_node_teaches_its_tail_beyond_reading_the_prompt(self):
        rates = NodeRates()
        rates.rate_read(PromptReading(rate=1000.0, read=500, seen=2000, size=8000), 0.0, 2.0)
        self.assertEqual(rates.tail, 1.5, "2 s served, 0.5 s of it reading 500 tokens")
        rates.rate_read(PromptReading(rate=1000.0, read=None, seen=2000, size=8000), 1.0, 9.0)
        self.assertEqual(rates.tail, 1.5, "a reading that does not say what it read: no tail")
        rates.served(2.0)
        self.assertEqual(rates.cost(1000), 1.0 + 1.5)
        rates.tail = None
        self.assertEqual(rates.cost(1000), 1.0 + 2.0, "no tail yet: its whole time to serve one")

    def test_what_is_left_of_the_request_in_a_slot(self):
        rates = NodeRates(service=3.0, dispatched_at=10.0)
        self.assertEqual(rates.residual(11.0, unseen=False), 2.0)
        self.assertEqual(rates.residual(20.0, unseen=False), 0.0)
        self.assertEqual(rates.residual(11.0, unseen=True), 3.0, "work we did not send")

    def test_turns_waiting_ahead_cost_their_uncached_work_not_a_whole_service_each(self):
        """Two conversations live on a; its slot runs a request just sent (1 s to serve
        one). X's next turn waits for a and is expected to hold it 0.1 s (its tail: it
        reads nothing anew). Y's turn then has 1.1 s ahead of it, less than the 1.5 s a
        re-read elsewhere costs, and waits too (counting X as a whole time to serve one, 2 s,
        it would have spilled)."""
        w = self.fleet("a", "b")
        x, y = "x" + "z" * 4000, "y" + "z" * 4000
        for first in (x, y):
            self.assertEqual(self.turn(w, chat(first))[0], "a")
        rates = w.facade.router.rates_of("a")
        tokens = len(json.dumps(chat(x, "next")))
        rates.service, rates.tail, rates.bytes_per_token = 1.0, 0.1, 1.0
        rates.prompt_rate = tokens / 1.5
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        self.assertEqual(self.turn(w, chat("other"), answer=False)[0], "a")
        clients = [w.send("POST", "/api/chat", chat(first, "next")) for first in (x, y)]
        self.assertEqual(len(w.agent.requests), 3, "both wait for a while b is free")
        for _ in clients:
            w.agent.last.respond(200, NDJSON, DONE, finish=True)
            w.clock.advance(0)
            self.assertEqual(node_of(w.agent.last), "a")
        w.agent.last.respond(200, NDJSON, DONE, finish=True)
        self.assertEqual([c.response().status for c in clients], [200, 200])
        self.assertEqual([node_of(r) for r in w.agent.requests], ["a"] * 5)


class BrokerAffinityTests(WorldTestCase):
    """Under the broker affinity is opt-in and only breaks the chooser's ties."""

    def fleet(self):
        w = self.world(affinity=True)
        for node in ("a", "b"):
            w.add(node, addresses=(ADDRESS[node],))
        return w

    def test_the_affine_node_wins_a_tie_only(self):
        w = self.fleet()
        w.facade.placement.conversations.committed(key(chat("one")), "b")
        client = w.send("POST", "/api/chat", chat("one", "next"))
        self.assertEqual(node_of(w.agent.last), "b", "equal loads: the affine node")
        held = w.send("POST", "/api/chat", chat("one", "again"))
        self.assertEqual(node_of(w.agent.last), "a", "b carries one more: the chooser wins")
        for request in w.agent.requests:
            request.respond(200, NDJSON, DONE, finish=True)
        self.assertEqual((client.response().status, held.response().status), (200, 200))

    def test_a_pin_and_the_capability_gate_stand(self):
        w = self.fleet()
        w.facade.placement.conversations.committed(key(chat("one")), "b")
        w.facade.router.set_pin("a")
        self.turn_to(w, chat("one", "next"), "a")
        w.facade.router.set_pin("")
        w.add("b", models=("other:latest",), addresses=(ADDRESS["b"],))
        self.turn_to(w, chat("one", "next"), "a")

    def turn_to(self, w, body, expected: str) -> None:
        client = w.send("POST", "/api/chat", body)
        self.assertEqual(node_of(w.agent.last), expected)
        w.agent.last.respond(200, NDJSON, DONE, finish=True)
        self.assertEqual(client.response().status, 200)


class TicketTests(WorldTestCase):
    """What a request's ticket carries and teaches, beyond placement itself."""

    def test_a_request_without_a_workload_still_teaches_its_nodes_service_time(self):
        w = self.world(scheduling=True, queue_depth=10, affinity=True)
        w.add("a")
        w.clock.advance(5)
        client = w.send("GET", "/api/version")
        w.clock.advance(0.25)
        w.agent.last.respond(200, {"Content-Type": "application/json"}, b"{}", finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(w.facade.router.rates["a"].service, 0.25)

    def test_without_affinity_or_late_binding_nothing_is_measured(self):
        # Late binding reads the service times too (docs/decisions.md#fair-share).
        w = self.world(scheduling=True)
        w.add("a")
        client = w.send("GET", "/api/version")
        w.agent.last.respond(200, {"Content-Type": "application/json"}, b"{}", finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(w.facade.router.rates, {})

    def test_a_bug_in_the_commits_ticket_costs_that_request_only(self):
        from nvpair_proxy.routing.tickets import ReservedTicket

        w = self.world()
        w.add("a")

        class Broken(ReservedTicket):
            def committed(self, node_id, status, head=b""):
                raise RuntimeError("a bug in the ticket")

        w.facade.placement.make = lambda model, key, size, request: Broken(
            w.facade.placement, model, key
        )
        self.addCleanup(self.flushLoggedErrors, RuntimeError)
        client = w.chat()
        upstream = w.agent.last.respond(200, NDJSON)
        upstream.write(b'{"done":true}\n')
        self.assertEqual(client.response().status, 500)
        self.assertTrue(upstream.transport.stopped, "the body nobody reads is aborted")
        self.assertEqual(w.reservations.reservations, {}, "its claim released")
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "failed"))

    def test_standalone_placement_without_the_reservation_map_is_refused_at_wiring(self):
        from twisted.internet.task import Clock

        from nvpair_proxy.facade.facade import make_facade
        from nvpair_proxy.routing.tickets import Direct, Policy
        from nvpair_proxy.testing import FakeAgent, RecordingEmitter

        def made(policy):
            return make_facade(
                ENGINES["ollama"],
                clock=Clock(),
                agent=FakeAgent(),
                emitter=RecordingEmitter(),
                run_id="0" * 16,
                random=lambda: 0.5,
                policy=policy,
            )

        self.assertIsInstance(made(Policy()).placement, Direct)
        for policy in (Policy(ranking=True), Policy(queue_depth=10)):
            self.assertRaises(ValueError, made, policy)


class EvictedTests(FleetTestCase):
    """A hit is checked against what the engine says it reused (issue 35, item 2)."""

    def timings(self, seen: int, cached: int) -> dict:
        return {"timings": {"prompt_n": seen - cached, "cache_n": cached, "predicted_n": 2}}

    def third_turn_then_a_full(self, third_cached: int):
        """A conversation on a (turns read 1000, then 1100 of which 1000 cached, then 1200 of
        which ``third_cached``), then a full and b free, with rates that make waiting for a
        worth it: the fourth turn's node (None while it waits) and the recorder."""
        recorder = Recorder()
        w = self.fleet("a", "b", recorder=recorder)
        self.turn(w, chat(LONG), timings=self.timings(1000, 0))  # a miss: read it all
        self.assertEqual(self.turn(w, chat(LONG, "next"), timings=self.timings(1100, 1000))[0], "a")
        third = self.timings(1200, third_cached)
        self.assertEqual(self.turn(w, chat(LONG, "next", "then"), timings=third)[0], "a")
        for node in ("a", "b"):
            rates = w.facade.router.rates_of(node)
            rates.service, rates.prompt_rate, rates.bytes_per_token = 0.6, 10.0, 4.0
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        self.turn(w, chat("other"), answer=False)
        self.assertEqual(node_of(w.agent.last), "a")
        before = len(w.agent.requests)
        client = w.send("POST", "/api/chat", chat(LONG, "next", "then", "more"))
        went = node_of(w.agent.last) if len(w.agent.requests) > before else None
        w.agent.requests[before - 1].respond(200, NDJSON, DONE, finish=True)
        w.clock.advance(0)
        w.agent.last.respond(200, NDJSON, DONE, finish=True)
        self.assertEqual(client.response().status, 200)
        return w, went, recorder

    def test_a_hit_whose_engine_read_it_all_again_is_evicted_and_not_waited_for(self):
        w, went, recorder = self.third_turn_then_a_full(third_cached=0)
        self.assertEqual(went, "b", "a wait for a would buy nothing: b at once")
        counts = {r: n for (e, r), n in recorder.affinity.items()}
        self.assertEqual((counts["miss"], counts["evicted"]), (2, 1))
        # the cache truth (docs/operations.md#cache-truth) counts the engine's own figures
        cache = recorder.cache.node_status("ollama", "a")
        self.assertEqual((cache["reused"], cache["read"], cache["source"]), (1000, 2300, "exact"))

    def test_a_hit_that_reused_its_context_is_still_waited_for(self):
        w, went, recorder = self.third_turn_then_a_full(third_cached=1100)
        self.assertIsNone(went, "it waited for a")
        self.assertNotIn("evicted", {r for (e, r) in recorder.affinity})

    def test_an_engine_that_does_not_say_leaves_a_hit_a_hit(self):
        recorder = Recorder()
        w = self.fleet("a", recorder=recorder)
        self.turn(w, chat(LONG), timings=self.timings(1000, 0))
        self.turn(w, chat(LONG, "next"))  # no timings: unknown, never a miss
        self.turn(w, chat(LONG, "next", "then"), timings={"prompt_eval_count": 900})
        self.assertEqual({r: n for (e, r), n in recorder.affinity.items()}, {"miss": 1, "hit": 2})
        cache = recorder.cache.node_status("ollama", "a")
        self.assertEqual((cache["reused"], cache["share"]), (0, 0.0))

    def test_an_ollama_that_says_what_its_cache_gave_is_checked_too(self):
        """Ollama's ``prompt_eval_cached_count`` beside ``prompt_eval_count`` (the whole
        prompt): a hit that took none of its 1,200 tokens from the cache was evicted."""
        recorder = Recorder()
        w = self.fleet("a", recorder=recorder)
        for turn, (count, cached) in enumerate(((1000, 0), (1100, 1000), (1200, 0))):
            said = {"prompt_eval_count": count, "prompt_eval_cached_count": cached}
            self.turn(w, chat(LONG, *["next", "then"][:turn]), timings=said)
        counts = {r: n for (e, r), n in recorder.affinity.items()}
        self.assertEqual(counts, {"miss": 1, "hit": 1, "evicted": 1})
        cache = recorder.cache.node_status("ollama", "a")
        self.assertEqual((cache["reused"], cache["read"], cache["source"]), (1000, 2300, "exact"))

    def test_a_spill_that_reads_it_all_is_no_eviction(self):
        recorder = Recorder()
        w = self.fleet("a", "b", recorder=recorder)
        self.turn(w, chat(LONG), timings=self.timings(1000, 0))
        w.facade.router.answered("a", 503)  # a is held: the next turn spills to b
        node, _ = self.turn(w, chat(LONG, "next"), timings=self.timings(1100, 0))
        self.assertEqual(node, "b")
        self.assertEqual({r: n for (e, r), n in recorder.affinity.items()}, {"miss": 1, "spill": 1})
        w.clock.advance(31)


SSE = {"Content-Type": "text/event-stream"}


def responses_head(response_id: str) -> bytes:
    created = {"type": "response.created", "response": {"id": response_id, "object": "response"}}
    return b"event: response.created\ndata: " + json.dumps(created).encode() + b"\n\n"


class PreviousResponseTests(FleetTestCase):
    """A Responses request that continues an answer goes to the node holding that answer's
    state (issue 35, item 4): another node would not know it (LM Studio keeps it server-side)."""

    def respond(self, w, response_id: str, finish: bool = True):
        upstream = w.agent.last.respond(200, SSE)
        upstream.write(responses_head(response_id))
        if finish:
            upstream.write(b'event: response.completed\ndata: {"type":"response.completed"}\n\n')
            upstream.finish()
        return upstream

    def ask(self, w, text: str = "hi", **fields):
        body = {"model": "llama3", "input": text, "stream": True, **fields}
        return w.send("POST", "/v1/responses", body)

    def test_a_follow_up_goes_to_the_node_that_made_the_answer_it_continues(self):
        w = self.fleet("a", "b")
        first = self.ask(w)
        self.assertEqual(node_of(w.agent.last), "a")
        self.respond(w, "resp_one")
        self.assertEqual(first.response().status, 200)
        busy, _ = self.turn(w, chat("other"), answer=False)  # a runs one now, b none
        self.assertEqual(busy, "a")
        follow = self.ask(w, "and then?", previous_response_id="resp_one")
        self.assertEqual(node_of(w.agent.last), "a", "not b, the less loaded")
        self.respond(w, "resp_two")
        self.assertEqual(follow.response().status, 200)
        fresh = self.ask(w, "something else")  # no previous: placed by load
        self.assertEqual(node_of(w.agent.last), "b")
        self.respond(w, "resp_three")
        self.assertEqual(fresh.response().status, 200)
        w.agent.requests[1].respond(200, NDJSON, DONE, finish=True)

    def test_a_response_id_is_kept_as_a_digest_in_the_bounded_table_and_never_logged(self):
        """Held to the table's one bound like every conversation key; never in the log."""
        logs = LogCapture(self, level="debug")
        w = self.fleet("a", "b")
        self.ask(w)
        self.respond(w, "resp_secret_one")
        follow = self.ask(w, "and then?", previous_response_id="resp_secret_one")
        self.assertEqual(node_of(w.agent.last), "a")
        self.respond(w, "resp_secret_two")
        self.assertEqual(follow.response().status, 200)
        table = w.facade.router.affinity
        keys = list(table._entries)  # the table's own keys, as the test reads them
        self.assertTrue(keys)
        self.assertFalse([k for k in keys if b"resp_secret" in k], "digests, not ids")
        self.assertEqual(table.max_keys, MAX_KEYS, "the one bound every key shares")
        table.max_keys = 1
        self.ask(w, "a third")
        self.respond(w, "resp_secret_three")
        self.assertEqual(len(table), 1, "a response id counts against the bound")
        text = "\n".join(formatEvent(event) + repr(event) for event in logs.events)
        self.assertTrue(text)
        self.assertNotIn("resp_secret", text)
        for key in keys:
            self.assertNotIn(key.hex(), text)

    def test_a_follow_up_waits_for_its_full_node_rather_than_go_elsewhere(self):
        w = self.fleet("a", "b")
        self.ask(w)
        self.respond(w, "resp_one")
        self.tell(w, "a", total=1)
        self.tell(w, "b", total=1)
        self.turn(w, chat("other"), answer=False)
        self.assertEqual(node_of(w.agent.last), "a")
        follow = self.ask(w, "and then?", previous_response_id="resp_one")
        self.assertEqual(len(w.agent.requests), 2, "it waits, though b is free")
        w.agent.requests[1].respond(200, NDJSON, DONE, finish=True)
        w.clock.advance(0)
        self.assertEqual(node_of(w.agent.last), "a")
        self.respond(w, "resp_two")
        self.assertEqual(follow.response().status, 200)

    def test_a_follow_up_whose_node_left_is_placed_as_any_other(self):
        w = self.fleet("a", "b")
        self.ask(w)
        self.respond(w, "resp_one")
        w.remove("a")
        follow = self.ask(w, "and then?", previous_response_id="resp_one")
        self.assertEqual(node_of(w.agent.last), "b")
        self.respond(w, "resp_two")
        self.assertEqual(follow.response().status, 200)


AGENT = "You are a coding agent. " + "Follow the repository's rules. " * 120  # ~3.6 KiB
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def session(first: str, *later: str, system: str = AGENT) -> dict:
    return dict(chat(first, *later, system=system), tools=TOOLS)


class SharedHeadTests(FleetTestCase):
    """A new conversation whose long head a node served lately goes there (issue 35, item 5):
    another session of the same agent harness, or a sub-agent of a conversation."""

    def busy_a(self, w) -> None:
        """a runs a request of another conversation now: b is the less loaded."""
        node, _ = self.turn(w, chat("unrelated"), answer=False)
        self.assertEqual(node, "a")

    def test_a_new_session_of_a_known_head_goes_to_the_node_that_served_it(self):
        recorder = Recorder()
        w = self.fleet("a", "b", recorder=recorder)
        self.assertEqual(self.turn(w, session("first task"))[0], "a")
        self.busy_a(w)
        node, client = self.turn(w, session("second task"))
        self.assertEqual(node, "a", "not b, the less loaded")
        self.assertEqual(client.response().status, 200)
        counts = {r: n for (e, r), n in recorder.affinity.items()}
        self.assertEqual((counts["head"], counts["miss"]), (1, 1))
        w.agent.requests[1].respond(200, NDJSON, DONE, finish=True)

    def test_a_sub_agent_goes_where_its_parent_is(self):
        w = self.fleet("a", "b", "c")
        self.assertEqual(self.turn(w, session("other work"))[0], "a")  # a knows the short head
        w.clock.advance(1)
        self.assertEqual(self.turn(w, session("parent task", system=AGENT + "!"))[0], "a")
        self.busy_a(w)
        # Children repeat their parent's system prompt, tools and first message, then their own.
        child = session("parent task", "child: look at x", system=AGENT + "!")
        node, _ = self.turn(
            w,
            dict(
                child,
                messages=child["messages"][:2] + [{"role": "user", "content": "child: look at x"}],
            ),
        )
        self.assertEqual(node, "a")
        w.agent.requests[2].respond(200, NDJSON, DONE, finish=True)

    def test_a_short_head_is_placed_by_load(self):
        w = self.fleet("a", "b")
        self.turn(w, session("first task", system="be brief"))
        self.busy_a(w)
        self.assertEqual(self.turn(w, dict(chat("second task"), tools=TOOLS))[0], "b")
        w.agent.requests[1].respond(200, NDJSON, DONE, finish=True)

    def test_a_full_head_node_is_waited_for_only_when_rereading_the_head_costs_more(self):
        for prompt_rate, expected in ((10.0, None), (100_000.0, "b")):
            w = self.fleet("a", "b")
            self.turn(w, session("first task"))
            for node in ("a", "b"):
                rates = w.facade.router.rates_of(node)
                rates.service, rates.prompt_rate, rates.bytes_per_token = 0.6, prompt_rate, 4.0
            self.tell(w, "a", total=1)
            self.tell(w, "b", total=1)
            self.busy_a(w)
            before = len(w.agent.requests)
            client = w.send("POST", "/api/chat", session("second task"))
            went = node_of(w.agent.last) if len(w.agent.requests) > before else None
            self.assertEqual(went, expected, prompt_rate)
            w.agent.requests[before - 1].respond(200, NDJSON, DONE, finish=True)
            w.clock.advance(0)
            w.agent.last.respond(200, NDJSON, DONE, finish=True)
            self.assertEqual(client.response().status, 200)


class SubAgentTests(FleetTestCase):
    """Sub-agents go where their parent is (issue 35, item 4), by the names the real clients
    send (captured from Claude Code 2.1.337 and Codex CLI 0.169.0 on loopback): each names
    its root session in every request, its sub-agents' included, beside a per-agent or
    per-thread id that a child gets new."""

    def test_children_of_a_session_go_to_its_node_whatever_their_own_ids(self):
        cases = {
            "claude code": (
                {"x-claude-code-session-id": "7c1f0f2e-root"},
                {"x-claude-code-agent-id": "a6887620fc923b34e"},
            ),
            "codex": (
                {"session-id": "0199-root", "thread-id": "0199-root"},
                {
                    "thread-id": "0199-child",
                    "x-codex-parent-thread-id": "0199-root",
                    "x-openai-subagent": "collab_spawn",
                },
            ),
        }
        for harness, (parent, child) in cases.items():
            w = self.fleet("a", "b")
            first = w.send("POST", "/api/chat", chat("parent task"), headers=parent)
            self.assertEqual(node_of(w.agent.last), "a", harness)
            w.agent.last.respond(200, NDJSON, DONE, finish=True)
            self.assertEqual(first.response().status, 200)
            self.turn(w, chat("unrelated"), answer=False)  # a is the more loaded now
            spawned = w.send(
                "POST", "/api/chat", chat("child: look at x"), headers={**parent, **child}
            )
            self.assertEqual(node_of(w.agent.last), "a", harness)
            w.agent.last.respond(200, NDJSON, DONE, finish=True)
            self.assertEqual(spawned.response().status, 200)
            w.agent.requests[1].respond(200, NDJSON, DONE, finish=True)


class ForkTests(FleetTestCase):
    """A child that shares its parent's whole context under a session id of its own: Claude
    Code's ``--fork-session`` and ``fork`` sub-agents, Codex's ``exec fork`` (captured:
    nothing links the new id to the old one). It goes where its parent is, by the head they
    share, though its id is new."""

    def test_a_fork_under_a_new_session_id_goes_where_its_parent_is(self):
        for harness, header in (
            ("claude code", "x-claude-code-session-id"),
            ("codex", "session-id"),
        ):
            w = self.fleet("a", "b")
            parent = session("parent task")
            sent = w.send("POST", "/api/chat", parent, headers={header: "root-0001"})
            self.assertEqual(node_of(w.agent.last), "a", harness)
            w.agent.last.respond(200, NDJSON, DONE, finish=True)
            self.assertEqual(sent.response().status, 200)
            self.assertEqual(self.turn(w, chat("unrelated"), answer=False)[0], "a")
            fork = session("parent task", "and now the fork's own question")
            forked = w.send("POST", "/api/chat", fork, headers={header: "fork-0002"})
            self.assertEqual(node_of(w.agent.last), "a", f"{harness}: not b, the less loaded")
            w.agent.last.respond(200, NDJSON, DONE, finish=True)
            self.assertEqual(forked.response().status, 200)
            w.agent.requests[1].respond(200, NDJSON, DONE, finish=True)


class SpillBindingTests(FleetTestCase):
    """``--affinity-spill``: after a spill the conversation is bound to the node it spilled to
    (move, the default) or stays bound to its node before (keep)."""

    def test_a_spilled_conversation_moves_or_keeps_its_binding(self):
        for keeps, expected in ((False, "b"), (True, "a")):
            w = self.fleet("a", "b", spill_keeps=keeps)
            self.assertEqual(self.turn(w, chat("one"))[0], "a")
            w.facade.router.answered("a", 503)  # held: the next turn spills
            self.assertEqual(self.turn(w, chat("one", "next"))[0], "b")
            w.clock.advance(31)  # the hold is over: both are free again
            self.assertEqual(self.turn(w, chat("one", "next", "then"))[0], expected, keeps)


class ScrapedReasonTests(FleetTestCase):
    """The reasons affinity gives, as an operator reads them: counted by reason on /metrics."""

    def placements(self, w, recorder) -> Counter:
        return by_labels(scraped(view_of(w, recorder)), "nvpair_proxy_placements_total", "reason")

    def test_a_spill_says_spill_on_the_scrape(self):
        recorder = Recorder()
        w = self.fleet("a", "b", recorder=recorder)
        self.assertEqual(self.turn(w, chat("one"))[0], "a")
        w.facade.router.answered("a", 503)  # its node is held: the next turn spills
        node, client = self.turn(w, chat("one", "next"))
        self.assertEqual((node, client.response().status), ("b", 200))
        self.assertEqual([ended.placement for ended in recorder.recent], ["least-busy", "spill"])
        self.assertEqual(self.placements(w, recorder), {"least-busy": 1, "spill": 1})

    def test_a_new_session_sent_to_its_heads_node_says_head_on_the_scrape(self):
        recorder = Recorder()
        w = self.fleet("a", "b", recorder=recorder)
        self.assertEqual(self.turn(w, session("first task"))[0], "a")
        busy, _ = self.turn(w, chat("unrelated"), answer=False)
        self.assertEqual(busy, "a")
        node, client = self.turn(w, session("second task"))
        self.assertEqual((node, client.response().status), ("a", 200))
        w.agent.requests[1].respond(200, NDJSON, DONE, finish=True)
        self.assertEqual(
            [ended.placement for ended in recorder.recent], ["least-busy", "head", "least-busy"]
        )
        self.assertEqual(self.placements(w, recorder), {"least-busy": 2, "head": 1})
