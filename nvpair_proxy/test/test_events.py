"""Workload and request events as the broker receives them (spec 5.5, protocol 4, design 6)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.logger import formatEvent
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core import logs
from nvpair_proxy.test.recorded import (
    LLAMACPP_ANTHROPIC_SSE,
    LLAMACPP_ANTHROPIC_SSE_STATS,
    LLAMACPP_RESPONSES_SSE,
    LLAMACPP_RESPONSES_SSE_STATS,
    RESPONSES_SSE,
    RESPONSES_SSE_STATS,
)
from nvpair_proxy.test.support import LogCapture
from nvpair_proxy.test.world import World, WorldTestCase

NDJSON = {"Content-Type": "application/x-ndjson"}

# Admitted, on a, cleared for a backoff, on a again, served by a.
BACKED_OFF_ONCE_THEN_SERVED_BY_A = [
    ("workload:submitted", "queued", None),
    ("workload:submitted", "queued", "a"),
    ("workload:submitted", "queued", None),
    ("workload:submitted", "queued", "a"),
    ("workload:started", "running", "a"),
    ("workload:completed", "completed", "a"),
]


class WorkloadSequenceTests(WorldTestCase):
    def test_a_simple_job_is_seq_one_to_four_with_every_field(self):
        w = self.world()
        w.clock.advance(1716998400)
        w.add("node-a")
        w.chat(model="llama3")
        w.clock.advance(0.25)
        upstream = w.agent.last.respond(200, NDJSON)
        upstream.write(b'{"message":{"content":"x"},"done":false}\n')
        w.clock.advance(2)
        upstream.write(
            b'{"done":true,"prompt_eval_count":7,"eval_count":20,"eval_duration":1000000000}\n'
        )
        upstream.finish()
        sent = w.emitter.workload()
        self.assertEqual(
            [m for m, _ in sent],
            ["workload:submitted", "workload:submitted", "workload:started", "workload:completed"],
        )
        base = {
            "id": "1",
            "model": "llama3",
            "engine": "ollama",
            "runId": "0123456789abcdef",
            "originatedFrom": "",
            "createdAt": 1716998400000,
            "requesterId": None,
            "error": None,
        }
        self.assertEqual(
            sent[0][1],
            {**base, "state": "queued", "startedAt": None, "completedAt": None, "seq": 1},
        )
        self.assertEqual(
            sent[1][1],
            {
                **base,
                "state": "queued",
                "scheduledOn": "node-a",
                "startedAt": None,
                "completedAt": None,
                "seq": 2,
            },
        )
        self.assertEqual(
            sent[2][1],
            {
                **base,
                "state": "running",
                "scheduledOn": "node-a",
                "startedAt": 1716998400250,
                "completedAt": None,
                "seq": 3,
            },
        )
        self.assertEqual(
            sent[3][1],
            {
                **base,
                "state": "completed",
                "scheduledOn": "node-a",
                "startedAt": 1716998400250,
                "completedAt": 1716998402250,
                "seq": 4,
                "stats": {
                    "promptTokens": 7,
                    "completionTokens": 20,
                    "tokensPerSecond": 20.0,
                    "ttftMs": 250,
                },
            },
        )

    def test_backing_off_between_rounds_clears_the_placement_then_returns_to_it(self):
        w = self.world()
        w.add("a")
        w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        w.clock.advance(1)
        w.agent.last.respond(200, length=0, finish=True)
        self.assertEqual(w.workload_events(), BACKED_OFF_ONCE_THEN_SERVED_BY_A)
        self.assertEqual([i["seq"] for _, i in w.emitter.workload()], [1, 2, 3, 4, 5, 6])

    def test_nothing_is_sent_after_the_terminal_event(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        upstream = w.agent.last.respond(200, NDJSON)
        upstream.write(b'{"done":true}\n')
        upstream.finish()
        count = len(w.emitter.sent)
        client.disconnect()
        w.facade.shutdown()
        self.assertEqual(len(w.emitter.sent), count)

    def test_failed_job_rides_errored_with_the_proxy_answer_text(self):
        w = self.world()
        w.add("a")
        w.chat()
        for index in range(5):
            w.agent.requests[index].refuse()
            w.clock.advance(8)
        method, info = w.emitter.workload()[-1]
        self.assertEqual(
            (method, info["state"], info["error"]),
            ("workload:errored", "failed", "upstream error: connection refused"),
        )

    def test_a_request_without_a_model_is_not_a_workload(self):
        w = self.world()
        w.add("a")
        w.send("POST", "/api/chat", {"messages": []})
        w.agent.last.respond(200, length=0, finish=True)
        self.assertEqual(w.emitter.workload(), [])
        self.assertEqual(
            w.emitter.methods(), ["ollama:proxy/request-started", "ollama:proxy/request"]
        )


class RequestEventTests(WorldTestCase):
    def test_request_started_at_commit_and_request_at_the_end(self):
        w = self.world()
        w.add("a", port=11434)
        w.chat()
        w.clock.advance(0.5)
        upstream = w.agent.last.respond(200, NDJSON)
        upstream.write(b"{}\n")
        w.clock.advance(1)
        upstream.finish()
        events = [(m, p) for m, p in w.emitter.sent if m.startswith("ollama:proxy/")]
        self.assertEqual(
            events,
            [
                (
                    "ollama:proxy/request-started",
                    {
                        "id": "1",
                        "node_id": "a",
                        "method": "POST",
                        "path": "/api/chat",
                        "target": "10.0.0.1:11434",
                    },
                ),
                (
                    "ollama:proxy/request",
                    {
                        "id": "1",
                        "node_id": "a",
                        "method": "POST",
                        "path": "/api/chat",
                        "target": "10.0.0.1:11434",
                        "status": 200,
                        "duration_ms": 1500,
                        "ttfb_ms": 500,
                    },
                ),
            ],
        )

    def test_a_rejection_is_reported_with_its_status_and_error(self):
        w = self.world()
        w.chat()
        self.assertEqual(
            w.emitter.sent,
            [
                (
                    "ollama:proxy/request",
                    {
                        "id": "1",
                        "method": "POST",
                        "path": "/api/chat",
                        "target": "",
                        "status": 502,
                        "duration_ms": 0,
                        "error": "no available node advertises the requested model",
                    },
                )
            ],
        )


class ActivityTests(WorldTestCase):
    def test_streamed_bytes_report_node_activity_at_most_every_two_seconds(self):
        w = self.world()
        w.add("a")
        w.chat()
        upstream = w.agent.last.respond(200, NDJSON)
        for step in (0, 1, 1.5, 0.5):
            w.clock.advance(step)
            upstream.write(b"{}\n")
        upstream.finish()
        activity = [(w_, p) for w_, p in w.emitter.sent if w_ == "node/activity"]
        self.assertEqual(activity, [("node/activity", {"hostUuid": "a", "msSince": 0})] * 2)

    def test_a_node_that_wrote_nothing_is_not_reported(self):
        w = self.world()
        w.add("a")
        w.chat()
        w.agent.last.respond(200, length=0, finish=True)
        self.assertNotIn("node/activity", w.emitter.methods())


class PrivacyTests(WorldTestCase):
    def test_a_prompt_marker_never_reaches_the_log_at_debug(self):
        marker = "MARKER-7f3a9c-secret-prompt"
        seen = LogCapture(self).events
        logs.set_level("debug")
        self.addCleanup(logs.set_level, "info")
        from nvpair_proxy.request.events import LogEmitter

        w = self.world()
        w.facade.reporter.emitter = LogEmitter()
        w.facade.reporter.activity.emitter = w.facade.reporter.emitter
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        w.send(
            "POST",
            "/api/chat",
            {"model": "llama3", "messages": [{"role": "user", "content": marker}]},
            headers={"Authorization": f"Bearer {marker}"},
        )
        w.agent.requests[0].respond(503, body=marker.encode(), length=len(marker), finish=True)
        upstream = w.agent.requests[1].respond(200, NDJSON)
        upstream.write(json.dumps({"message": {"content": marker}, "done": True}).encode() + b"\n")
        upstream.finish()
        text = "\n".join(formatEvent(event) + repr(event) for event in seen)
        self.assertIn("workload:completed", text)
        self.assertNotIn(marker, text)
        ours = [e for e in seen if e.get("log_namespace") == "nvpair-proxy"]
        self.assertGreater(len(ours), 5)
        process_scoped = ("workload:", "node/activity")
        facade_scoped = [e for e in ours if not any(p in formatEvent(e) for p in process_scoped)]
        self.assertEqual({e.get("engine") for e in facade_scoped}, {"ollama"})


class PlacementTests(WorldTestCase):
    def test_waiting_for_an_owner_over_several_rounds_clears_the_placement_once(self):
        w = self.world()
        node = w.add("a")
        w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        w.remove("a")
        w.clock.pump([1] * 5)
        w.facade.router.put_manual(node)
        w.clock.advance(1)
        w.agent.last.respond(200, length=0, finish=True)
        self.assertEqual(w.workload_events(), BACKED_OFF_ONCE_THEN_SERVED_BY_A)

    def test_a_truncated_upstream_gives_exactly_one_terminal_for_every_engine(self):
        cases = {
            "ollama": ("/api/chat", "llama3:latest"),
            "lmstudio": ("/v1/chat/completions", "qwen"),
            "llamacpp": ("/v1/chat/completions", "phi"),
        }
        for engine, (path, model) in cases.items():
            w = self.world(engine)
            w.add("a", models=(model,))
            client = w.send("POST", path, {"model": model, "stream": True})
            upstream = w.agent.last.respond(200)
            upstream.write(b"data: {}\n\n")
            upstream.break_off()
            client.disconnect()
            terminals = [
                m
                for m, _ in w.emitter.workload()
                if m in ("workload:completed", "workload:errored")
            ]
            self.assertEqual(terminals, ["workload:completed"], engine)


class ClientClosingAfterTheTerminalFrameTests(WorldTestCase):
    """Design 6: a client that closes once its route's terminal frame has arrived is
    `completed` (with the stats read from the tail), one that closes before it `cancelled`."""

    SSE = {"Content-Type": "text/event-stream"}
    # (engine, path, model, body, its terminal frame, the stats of the whole body)
    CASES = [
        (
            "llamacpp",
            "/v1/messages",
            "phi",
            LLAMACPP_ANTHROPIC_SSE,
            b"event: message_stop",
            LLAMACPP_ANTHROPIC_SSE_STATS,
        ),
        (
            "ollama",
            "/v1/responses",
            "llama3:latest",
            RESPONSES_SSE,
            b"event: response.completed",
            RESPONSES_SSE_STATS,
        ),
        (
            "lmstudio",
            "/v1/responses",
            "qwen",
            RESPONSES_SSE,
            b"event: response.completed",
            RESPONSES_SSE_STATS,
        ),
        (
            "llamacpp",
            "/v1/responses",
            "phi",
            LLAMACPP_RESPONSES_SSE,
            b"event: response.completed",
            LLAMACPP_RESPONSES_SSE_STATS,
        ),
    ]

    def _stream_then_close(
        self, engine: str, path: str, model: str, body: bytes, headers: dict
    ) -> tuple[World, object]:
        """Admitted at 1000 s, first byte at 1000.25 s, the client gone at 1002.25 s."""
        w = self.world(engine)
        w.clock.advance(1000)
        w.add("a", models=(model,))
        client = w.send("POST", path, {"model": model, "stream": True})
        w.clock.advance(0.25)
        upstream = w.agent.last.respond(200, headers)
        upstream.write(body)
        w.clock.advance(2)
        client.disconnect()
        return w, upstream

    def _terminal(self, w: World) -> tuple[str, str, dict | None]:
        method, info = w.emitter.workload()[-1]
        return method, info["state"], info.get("stats")

    def test_closing_after_the_terminal_frame_is_completed_with_the_streams_stats(self):
        for engine, path, model, body, _, stats in self.CASES:
            w, upstream = self._stream_then_close(engine, path, model, body, self.SSE)
            self.assertEqual(
                self._terminal(w), ("workload:completed", "completed", stats), (engine, path)
            )
            self.assertTrue(upstream.transport.stopped)

    def test_closing_before_the_terminal_frame_is_cancelled(self):
        for engine, path, model, body, marker, _ in self.CASES:
            w, upstream = self._stream_then_close(
                engine, path, model, body[: body.index(marker)], self.SSE
            )
            method, state, _ = self._terminal(w)
            self.assertEqual((method, state), ("workload:errored", "cancelled"), (engine, path))
            self.assertEqual(
                w.emitter.workload()[-1][1]["error"], "client disconnected before completion"
            )

    def test_ollamas_end_frame_counts_with_a_space_after_the_colon(self):
        body = (
            json.dumps(
                {"model": "llama3:latest", "message": {"content": "x"}, "done": False}
            ).encode()
            + b"\n"
            + json.dumps(
                {
                    "model": "llama3:latest",
                    "done": True,
                    "prompt_eval_count": 5,
                    "eval_count": 3,
                    "eval_duration": 1500000000,
                }
            ).encode()
            + b"\n"
        )
        self.assertIn(b'"done": true', body)
        w, _ = self._stream_then_close("ollama", "/api/chat", "llama3:latest", body, NDJSON)
        self.assertEqual(
            self._terminal(w),
            (
                "workload:completed",
                "completed",
                {"promptTokens": 5, "completionTokens": 3, "tokensPerSecond": 2.0, "ttftMs": 250},
            ),
        )


# What the link wrote before events were encoded from parts: the object, in the contract's
# field order, through the link's own encoder. Each line must stay byte for byte the same.
def object_line(name: str, params: dict) -> bytes:
    from nvpair_proxy.broker.rpc import _encode

    return _encode({"jsonrpc": "2.0", "method": name, "params": params}, strict=False) + b"\n"


def workload_object(
    w, state: str, scheduled_on, started_at, completed_at, error, seq, stats
) -> dict:
    def ms(seconds):
        return None if seconds is None else int(round(seconds * 1000))

    info = {
        "id": w.id,
        "model": w.model,
        "engine": w.engine,
        "runId": w.run_id,
        "state": state,
        "originatedFrom": "",
    }
    if scheduled_on:
        info["scheduledOn"] = scheduled_on
    info.update(
        {
            "createdAt": ms(w.created_at),
            "startedAt": ms(started_at),
            "completedAt": ms(completed_at),
            "error": error,
            "requesterId": None,
            "seq": seq,
        }
    )
    if stats:
        info["stats"] = stats
    return {"workloadInfo": info}


def request_object(
    id, method, path, target, node_id=None, status=None, duration=None, ttfb=None, error=None
) -> dict:
    params = {"id": id}
    if node_id:
        params["node_id"] = node_id
    params.update({"method": method, "path": path, "target": target})
    if status is not None:
        params.update({"status": status, "duration_ms": int(round(duration * 1000))})
        if ttfb is not None:
            params["ttfb_ms"] = int(round(ttfb * 1000))
        if error:
            params["error"] = error
    return params


TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=30)
SECONDS = st.floats(min_value=0, max_value=4e9, allow_nan=False)
STATS = st.one_of(
    st.none(),
    st.just({}),
    st.fixed_dictionaries(
        {"promptTokens": st.integers(0, 10**9), "completionTokens": st.integers(0, 10**9)},
        optional={
            "tokensPerSecond": st.floats(allow_nan=False, allow_infinity=False),
            "ttftMs": st.integers(0, 10**9),
            "estimated": st.just(True),
        },
    ),
)


class EncodedEventTests(SynchronousTestCase):
    """Every workload and request event is encoded from parts straight into the link's line
    (no object built); each line is byte for byte what encoding the object would write."""

    def link(self):
        from twisted.internet.testing import StringTransport

        from nvpair_proxy.broker.rpc import RpcLink

        link = RpcLink(lambda method, params: None)
        transport = StringTransport()
        link.framer.makeConnection(transport)
        return link, transport

    @settings(max_examples=200, deadline=None)
    @given(
        id=TEXT,
        model=TEXT,
        engine=TEXT,
        run_id=TEXT,
        node=st.one_of(st.none(), TEXT),
        created=SECONDS,
        started=SECONDS,
        ended=SECONDS,
        error=st.one_of(st.none(), TEXT),
        stats=STATS,
    )
    def test_a_workloads_lines_are_its_objects_encoded(
        self, id, model, engine, run_id, node, created, started, ended, error, stats
    ):
        from nvpair_proxy.request.events import FAILED, Workload

        link, transport = self.link()
        now = [started]
        w = Workload(
            emitter=link,
            clock=lambda: now[0],
            run_id=run_id,
            engine=engine,
            id=id,
            model=model,
            created_at=created,
        )
        w.admitted()
        expected = object_line(
            "workload:submitted", workload_object(w, "queued", None, None, None, None, 1, None)
        )
        if node is not None:
            w.dispatched(node)
            expected += object_line(
                "workload:submitted", workload_object(w, "queued", node, None, None, None, 2, None)
            )
            w.started(node)
            expected += object_line(
                "workload:started",
                workload_object(w, "running", node, started, None, None, 3, None),
            )
        now[0] = ended
        w.terminal(FAILED, error, stats)
        expected += object_line(
            "workload:errored",
            workload_object(w, "failed", node, w.started_at, ended, error, w.seq, stats),
        )
        self.assertEqual(transport.value(), expected)

    @settings(max_examples=200, deadline=None)
    @given(
        id=TEXT,
        method=TEXT,
        path=TEXT,
        target=TEXT,
        node=st.one_of(st.none(), TEXT),
        status=st.integers(100, 599),
        duration=SECONDS,
        ttfb=st.one_of(st.none(), SECONDS),
        error=st.one_of(st.none(), TEXT),
    )
    def test_request_lines_are_their_objects_encoded(
        self, id, method, path, target, node, status, duration, ttfb, error
    ):
        from nvpair_proxy.request.events import ActivityThrottle, Reporter

        link, transport = self.link()
        reporter = Reporter(
            engine="ollama",
            emitter=link,
            clock=lambda: 0.0,
            run_id="r",
            activity=ActivityThrottle(link, lambda: 0.0),
        )
        reporter.request_started(id, method, path, target, node)
        reporter.request_finished(id, method, path, target, status, duration, node, ttfb, error)
        self.assertEqual(
            transport.value(),
            object_line(
                "ollama:proxy/request-started", request_object(id, method, path, target, node)
            )
            + object_line(
                "ollama:proxy/request",
                request_object(id, method, path, target, node, status, duration, ttfb, error),
            ),
        )

    def test_a_known_line_byte_for_byte(self):
        """One line written out, so a change of the encoder's output shows here as text."""
        from nvpair_proxy.request.events import COMPLETED, Workload

        link, transport = self.link()
        w = Workload(
            emitter=link,
            clock=lambda: 12.5,
            run_id="0123456789abcdef",
            engine="ollama",
            id="7",
            model="llama3:latest",
            created_at=10.0,
        )
        w.started("gpu-ä")
        w.terminal(COMPLETED, None, {"promptTokens": 3, "tokensPerSecond": 1.5})
        self.assertEqual(
            transport.value().splitlines()[-1],
            (
                b'{"jsonrpc":"2.0","method":"workload:completed","params":{"workloadInfo":'
                b'{"id":"7","model":"llama3:latest","engine":"ollama","runId":"0123456789abcdef",'
                b'"state":"completed","originatedFrom":"","scheduledOn":"gpu-\\u00e4",'
                b'"createdAt":10000,"startedAt":12500,"completedAt":12500,"error":null,'
                b'"requesterId":null,"seq":2,"stats":{"promptTokens":3,"tokensPerSecond":1.5}}}}'
            ),
        )
