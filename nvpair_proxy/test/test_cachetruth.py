"""Cache truth (docs/operations.md#cache-truth): what each node's engine reused of the prompts,
from its own figures, exact where it says and estimated, and labelled so, where it does not;
counted by engine, node and source, shown on ``/status``, and read from one parse of the
answer's tail without touching the broker's ``stats``."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.admin import cachetruth
from nvpair_proxy.admin.cachetruth import MODELS_PER_NODE, OTHER_MODELS, CacheTruth, ColdRate
from nvpair_proxy.admin.history import History
from nvpair_proxy.admin.metrics import registry, scrape
from nvpair_proxy.admin.recorder import Recorder
from nvpair_proxy.admin.status import ProcessView, status
from nvpair_proxy.body import tokens
from nvpair_proxy.core.views import ProcessSnapshot
from nvpair_proxy.request.events import PromptUse

from .world import NDJSON, WorldTestCase, view_of

SSE = {"Content-Type": "text/event-stream"}
JSON = {"Content-Type": "application/json"}


def reuse_samples(view: ProcessView) -> dict[tuple[str, str, str, str], float]:
    """The cache truth's counters by (name, engine, node, source)."""
    out = {}
    for family in text_string_to_metric_families(scrape(registry(view)).decode()):
        for sample in family.samples:
            if sample.name.startswith("nvpair_proxy_prompt_tokens_re"):
                labels = sample.labels
                key = (sample.name, labels["engine"], labels["node"], labels["source"])
                out[key] = sample.value
    return out


def llamacpp_stream(prompt_n: int, cache_n: int) -> bytes:
    """A llama-server chat stream: a token, then its last chunk with usage and timings."""
    last = {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_n + cache_n, "completion_tokens": 2},
        "timings": {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 12.5, "predicted_n": 2},
    }
    token = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    return (
        b"data: " + json.dumps(token).encode() + b"\n\n"
        b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"
    )


def llamacpp_whole(prompt_n: int, cache_n: int) -> bytes:
    return json.dumps(
        {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": prompt_n + cache_n, "completion_tokens": 2},
            "timings": {"cache_n": cache_n, "prompt_n": prompt_n, "predicted_n": 2},
        }
    ).encode()


def chat(model: str, stream: bool) -> dict:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "x"}]}


def ollama_answers(test: WorldTestCase, recorder: Recorder, ends: list[dict]):
    """One Ollama node ``a`` answering a chat per entry of ``ends`` with that final line."""
    w = test.world(recorder=recorder)
    w.add("a")
    for end in ends:
        client = w.chat()
        line = json.dumps({"done": True, "prompt_eval_duration": 100_000_000, **end})
        w.agent.last.respond(200, NDJSON, line.encode() + b"\n", finish=True)
        test.assertEqual(client.response().status, 200)
    return w


class ExactTests(WorldTestCase):
    def llamacpp(self):
        recorder = Recorder()
        w = self.world("llamacpp", recorder=recorder)
        w.add("a", models=("m",), addresses=("10.0.0.1",))
        w.add("b", models=("m",), addresses=("10.0.0.2",))
        w.facade.router.set_pin("a")
        return w, recorder

    def test_reuse_counters_equal_llamacpps_own_figures(self):
        """A fake llama-server that reports ``cache_n`` and ``prompt_n`` in streams and whole
        answers: the counters are those figures summed, to the token."""
        w, recorder = self.llamacpp()
        figures = [(1000, 0, True), (120, 1000, True), (64, 1100, False), (3000, 2, False)]
        for prompt_n, cache_n, stream in figures:
            client = w.send("POST", "/v1/chat/completions", chat("m", stream))
            body = (
                llamacpp_stream(prompt_n, cache_n) if stream else llamacpp_whole(prompt_n, cache_n)
            )
            w.agent.last.respond(200, SSE if stream else JSON, body, finish=True)
            self.assertEqual(client.response().status, 200)
        view = view_of(w, recorder)
        reused, read = sum(f[1] for f in figures), sum(f[0] for f in figures)
        self.assertEqual(
            reuse_samples(view),
            {
                ("nvpair_proxy_prompt_tokens_reused_total", "llamacpp", "a", "exact"): reused,
                ("nvpair_proxy_prompt_tokens_read_total", "llamacpp", "a", "exact"): read,
            },
        )
        document = status(view)
        node_a = next(node for node in document["nodes"] if node["id"] == "a")
        self.assertEqual(
            node_a["engines"][0]["cache"],
            {
                "reused": 2102,
                "read": 4184,
                "share": round(2102 / 6286, 3),
                "source": "exact",
                "models": {"m": {"reused": 2102, "read": 4184, "share": round(2102 / 6286, 3)}},
            },
        )
        self.assertEqual(document["engines"][0]["prompt_reused_share"], round(2102 / 6286, 3))

    def test_messages_usage_is_exact_too(self):
        """llama.cpp's ``/v1/messages`` says what its cache gave in ``message_start``."""
        w, recorder = self.llamacpp()
        start = {
            "type": "message_start",
            "message": {
                "usage": {"input_tokens": 40, "cache_read_input_tokens": 900, "output_tokens": 1}
            },
        }
        body = (
            b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n"
            b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":3}}\n\n'
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
        )
        client = w.send("POST", "/v1/messages", chat("m", True))
        w.agent.last.respond(200, SSE, body, finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(
            reuse_samples(view_of(w, recorder)),
            {
                ("nvpair_proxy_prompt_tokens_reused_total", "llamacpp", "a", "exact"): 900,
                ("nvpair_proxy_prompt_tokens_read_total", "llamacpp", "a", "exact"): 40,
            },
        )

    def test_the_tail_is_read_once_and_the_broker_stats_keep_their_fields(self):
        """Stats, placement's rates and the cache truth share one parse of the tail; the
        terminal event's ``stats`` carry no new field."""
        w, recorder = self.llamacpp()
        reads = []
        real = tokens.read_figures

        def counting(tail):
            reads.append(len(tail))
            return real(tail)

        self.patch(tokens, "read_figures", counting)
        client = w.send("POST", "/v1/chat/completions", chat("m", True))
        w.agent.last.respond(200, SSE, llamacpp_stream(100, 900), finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(len(reads), 1)
        (terminal,) = [
            info for method, info in w.emitter.workload() if info["state"] == "completed"
        ]
        self.assertEqual(set(terminal["stats"]), {"promptTokens", "completionTokens", "ttftMs"})
        self.assertEqual(recorder.cache.totals(), (900, 100))

    def test_without_the_admin_listener_nothing_is_counted_or_read_for_it(self):
        w = self.world("llamacpp")
        w.add("a", models=("m",))
        reads = []
        self.patch(tokens, "read_figures", lambda tail: reads.append(tail) or tokens.Figures())
        w.emitter.listening = False
        client = w.send("POST", "/v1/chat/completions", chat("m", True))
        w.agent.last.respond(200, SSE, llamacpp_stream(100, 900), finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(reads, [], "no stats, no recorder: the tail is never parsed")

    def test_an_ollama_that_says_what_its_cache_gave_is_exact(self):
        """Ollama with ``prompt_eval_cached_count`` (its own count of cached prompt tokens,
        counted in ``prompt_eval_count``) needs no estimate."""
        recorder = Recorder()
        w = ollama_answers(
            self,
            recorder,
            [
                {"prompt_eval_count": count, "prompt_eval_cached_count": cached}
                for count, cached in ((1000, 0), (1100, 1000))
            ],
        )
        self.assertEqual(
            reuse_samples(view_of(w, recorder)),
            {
                ("nvpair_proxy_prompt_tokens_reused_total", "ollama", "a", "exact"): 1000,
                ("nvpair_proxy_prompt_tokens_read_total", "ollama", "a", "exact"): 1100,
            },
        )


class EstimatedTests(WorldTestCase):
    def test_ollama_reuse_is_estimated_from_its_prefill_time_and_labelled(self):
        """Ollama says the whole prompt and the seconds it spent reading: the first, cold,
        answer sets the model's rate there (1,000 tokens a second); a later one that read
        1,100 tokens in 0.1 s read 100 of them anew."""
        recorder = Recorder()
        w = ollama_answers(
            self,
            recorder,
            [
                {"prompt_eval_count": count, "prompt_eval_duration": nanoseconds}
                for count, nanoseconds in ((1000, 1_000_000_000), (1100, 100_000_000))
            ],
        )
        self.assertEqual(
            reuse_samples(view_of(w, recorder)),
            {
                ("nvpair_proxy_prompt_tokens_reused_total", "ollama", "a", "estimated"): 1000,
                ("nvpair_proxy_prompt_tokens_read_total", "ollama", "a", "estimated"): 1100,
            },
        )
        cache = status(view_of(w, recorder))["nodes"][0]["engines"][0]["cache"]
        self.assertEqual((cache["source"], cache["share"]), ("estimated", round(1000 / 2100, 3)))

    def test_lm_studio_streams_are_timed_from_dispatch_to_first_byte(self):
        """LM Studio says nothing of its cache or its prefill: a stream's first byte after
        2 s for 2,000 tokens is the cold rate; the next, 2,100 tokens after 0.2 s, read
        200 anew. A whole answer's first byte says nothing: it is not counted."""
        recorder = Recorder()
        w = self.world("lmstudio", recorder=recorder)
        w.add("a", models=("m",))
        for prompt, seconds in ((2000, 2.0), (2100, 0.2)):
            client = w.send("POST", "/v1/chat/completions", chat("m", True))
            w.clock.advance(seconds)
            upstream = w.agent.last.respond(200, SSE)
            upstream.write(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
            usage = {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 1}}
            upstream.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
            upstream.finish()
            self.assertEqual(client.response().status, 200)
        client = w.send("POST", "/v1/chat/completions", chat("m", False))
        w.clock.advance(0.1)
        whole = {"choices": [], "usage": {"prompt_tokens": 5000, "completion_tokens": 1}}
        w.agent.last.respond(200, JSON, json.dumps(whole).encode(), finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(recorder.cache.totals(), (1900, 2200))
        self.assertEqual({key[2] for key in recorder.cache.read}, {"estimated"})


class ColdRateTests(SynchronousTestCase):
    def test_the_slowest_recent_reading_is_the_cold_rate(self):
        cold = ColdRate()
        self.assertEqual(cold.read(1000, 1.0), 1000, "the first reading is taken as cold")
        for _ in range(10):  # an agent's turns: hits, read as fast
            self.assertEqual(cold.read(1000, 0.1), 100, "900 reused")
        self.assertEqual(cold.rate, 1000.0, "one cold reading among many hits sets it")
        self.assertEqual(cold.read(1000, 10.0), 1000, "a model load: slower, read in full")
        self.assertEqual(cold.rate, 100.0)
        self.assertEqual(cold.read(1000, 1.0), 100, "until it leaves the window, it errs")

    def test_its_window_forgets_old_readings(self):
        cold = ColdRate()
        cold.read(1000, 10.0)
        for _ in range(cachetruth.COLD_WINDOW - 1):
            cold.read(1000, 1.0)
        self.assertEqual(cold.rate, 100.0, "still in the window")
        cold.read(1000, 1.0)
        self.assertEqual(cold.rate, 1000.0, "the slow one left it")

    def test_a_short_prompt_or_no_time_counts_as_read_and_teaches_nothing(self):
        cold = ColdRate()
        self.assertEqual(cold.read(cachetruth.MIN_PROMPT_TOKENS - 1, 0.001), 63)
        self.assertEqual(cold.read(5000, 0.0), 5000)
        self.assertIsNone(cold.rate)

    def test_a_prefill_too_small_to_divide_by_teaches_nothing_and_raises_nothing(self):
        cold = ColdRate()
        self.assertEqual(cold.read(1000, 1e-323), 1000, "no rate yet: read in full")
        self.assertIsNone(cold.rate)
        cold.read(1000, 1.0)
        self.assertEqual(cold.read(1000, 1e-323), 0, "all reused, as the engine said")


class PerModelTests(SynchronousTestCase):
    def test_each_model_on_a_node_has_its_own_cold_rate(self):
        """A small model reads 2,000 tokens in 0.4 s, a large one in 10 s, five times: the
        small model's next cold prompt is still read in full."""
        truth = CacheTruth()
        truth.observe("ollama", "a", "small", PromptUse(seen=2000, prefill=0.4))
        for _ in range(5):
            truth.observe("ollama", "a", "large", PromptUse(seen=2000, prefill=10.0))
        found = truth.observe("ollama", "a", "small", PromptUse(seen=2000, prefill=0.4))
        self.assertEqual((found.reused, found.read), (0, 2000))


class BoundsTests(SynchronousTestCase):
    def test_models_per_node_are_bounded_and_the_rest_summed(self):
        truth = CacheTruth()
        for n in range(MODELS_PER_NODE + 3):
            truth.observe("llamacpp", "a", f"model-{n}", PromptUse(seen=100, cached=40))
        models = truth.node_status("llamacpp", "a")["models"]
        self.assertEqual(len(models), MODELS_PER_NODE + 1)
        self.assertEqual(models[OTHER_MODELS], {"reused": 120, "read": 180, "share": 0.4})

    def test_nodes_that_left_the_fleet_are_forgotten(self):
        truth = CacheTruth()
        truth.observe("llamacpp", "a", "m", PromptUse(seen=100, cached=40))
        truth.observe("ollama", "a", "m", PromptUse(seen=1000, prefill=1.0))
        truth.observe("ollama", "b", "m", PromptUse(seen=100, prefill=0.1))
        truth.forget_nodes_except({"b"})
        self.assertEqual(list(truth.reused), [("ollama", "b", "estimated")])
        self.assertEqual(list(truth.read), [("ollama", "b", "estimated")])
        self.assertIsNone(truth.node_status("llamacpp", "a"))
        # node a's cold rate went with it: its first answer back is taken as cold again
        found = truth.observe("ollama", "a", "m", PromptUse(seen=1000, prefill=0.1))
        self.assertEqual((found.reused, found.read), (0, 1000))
        # since start: llama.cpp's 40 reused and 60 read, Ollama's 1,000 + 100 + 1,000 read
        self.assertEqual(truth.totals(), (40, 2160))

    def test_the_history_never_sees_a_node_leaving_as_a_shrinking_count(self):
        """A node's counts go with it, but the history's interval is measured from the
        totals since start: a node that leaves never makes a share negative or above 1."""
        recorder, history = Recorder(), History()
        recorder.cache.observe("llamacpp", "a", "m", PromptUse(seen=1000, cached=900))
        history.take(10.0, recorder, ProcessSnapshot(True, (), {}, {}))
        recorder.forget_nodes_except({"b"})
        recorder.cache.observe("llamacpp", "b", "m", PromptUse(seen=1100, cached=0))
        sample = history.take(20.0, recorder, ProcessSnapshot(True, (), {}, {}))
        self.assertEqual(sample.prompt_reused_share, 0.0)

    def test_an_answer_that_says_neither_is_not_counted(self):
        truth = CacheTruth()
        self.assertIsNone(truth.observe("lmstudio", "a", "m", PromptUse(seen=100)))
        self.assertEqual(truth.totals(), (0, 0))
        self.assertIsNone(truth.node_status("lmstudio", "a"))


class ContainmentTests(WorldTestCase):
    def test_a_fault_in_the_bookkeeping_costs_the_request_nothing(self):
        """The recorder raises at a request's end: logged, and the client's answer still
        ends, whole."""

        class Broken(Recorder):
            def request_ended(self, ended):
                raise ValueError("bookkeeping bug")

        w = self.world("llamacpp", recorder=Broken())
        w.add("a", models=("m",))
        client = w.send("POST", "/v1/chat/completions", chat("m", True))
        w.agent.last.respond(200, SSE, llamacpp_stream(100, 900), finish=True)
        response = client.response()
        self.assertEqual(response.status, 200)
        self.assertTrue(response.body.endswith(b"data: [DONE]\n\n"), response.body[-40:])
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)
