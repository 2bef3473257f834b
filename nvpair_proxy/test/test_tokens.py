"""Tests for nvpair_proxy.body.tokens' BodyObserver: terminal frames and the stats block, read from
a
bounded tail."""

from __future__ import annotations

import ast
import inspect
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.body import frames, tokens
from nvpair_proxy.body.frames import LINE_LIMIT, TAIL_LIMIT
from nvpair_proxy.body.tokens import BodyObserver
from nvpair_proxy.test.recorded import (
    ANTHROPIC_SSE,
    JSON,
    LLAMACPP_ANTHROPIC_SSE,
    LLAMACPP_NATIVE_SSE,
    LLAMACPP_NATIVE_STATS,
    LLAMACPP_SSE,
    NDJSON,
    OLLAMA_JSON,
    OLLAMA_JSON_STATS,
    OLLAMA_STREAM,
    OLLAMA_STREAM_STATS,
    OPENAI_JSON,
    OPENAI_SSE,
    OPENAI_SSE_STATS,
    RECORDED,
    RESPONSES_SSE,
    RESPONSES_SSE_STATS,
    RESPONSES_USAGE,
    SSE,
    SSE_NO_USAGE,
    ndjson,
    ollama_token,
    openai_chunk,
    responses_sse,
    sse,
)
from nvpair_proxy.test.strategies import splits

# One clock for every measurement: admission, first body byte 250 ms later, end 2 s after that.
ADMITTED = 1000.0
FIRST_BYTE = 1000.25
ENDED = 1002.25


def observe(terminal, content_type, chunks) -> BodyObserver:
    observer = BodyObserver(terminal, content_type)
    for chunk in chunks:
        observer.feed(chunk)
    return observer


def measure(observer: BodyObserver, first_byte_at=FIRST_BYTE, ended_at=ENDED):
    return observer.measure(admitted_at=ADMITTED, first_byte_at=first_byte_at, ended_at=ended_at)


def chunked(body: bytes, size: int):
    return [body[i : i + size] for i in range(0, len(body), size)]


class RecordedBodyTests(SynchronousTestCase):
    """Each dialect's recorded body gives its exact stats and its terminal frame."""

    def test_exact_stats_and_terminal(self):
        for name, terminal, content_type, body, expected in RECORDED:
            observer = observe(terminal, content_type, [body])
            self.assertEqual(measure(observer), expected, name)
            self.assertTrue(observer.terminal_seen, name)
            self.assertEqual(observer.bytes_seen, len(body), name)

    def test_llamacpp_native_timings(self):
        observer = observe(None, SSE, [LLAMACPP_NATIVE_SSE])
        self.assertEqual(measure(observer), LLAMACPP_NATIVE_STATS)

    def test_byte_at_a_time(self):
        for name, terminal, content_type, body, expected in RECORDED:
            observer = observe(terminal, content_type, chunked(body, 1))
            self.assertEqual(measure(observer), expected, name)
            self.assertTrue(observer.terminal_seen, name)

    def test_every_two_way_split(self):
        """A chunk boundary anywhere (mid-line, mid-marker, mid-UTF-8) changes nothing."""
        for name, terminal, content_type, body, expected in RECORDED:
            whole = observe(terminal, content_type, [body])
            events = whole.events_seen
            for cut in range(1, len(body)):
                observer = observe(terminal, content_type, [body[:cut], body[cut:]])
                self.assertTrue(observer.terminal_seen, (name, cut))
                self.assertEqual(observer.events_seen, events, (name, cut))
                self.assertEqual(measure(observer), expected, (name, cut))

    def test_marker_split_across_feeds(self):
        for terminal, body, marker in [
            ("sse-done", OPENAI_SSE, b"data: [DONE]"),
            ("sse-message-stop", ANTHROPIC_SSE, b"event: message_stop"),
            ("sse-response-completed", RESPONSES_SSE, b"event: response.completed"),
            ("ndjson-done", OLLAMA_STREAM, b'"done":true'),
        ]:
            at = body.index(marker)
            for cut in range(at, at + len(marker)):
                observer = BodyObserver(terminal, None)
                observer.feed(body[:cut])
                self.assertFalse(observer.terminal_seen, (terminal, cut))
                observer.feed(body[cut:])
                self.assertTrue(observer.terminal_seen, (terminal, cut))

    def test_crlf_line_ends(self):
        body = OPENAI_SSE.replace(b"\n", b"\r\n")
        observer = observe("sse-done", SSE, chunked(body, 7))
        self.assertTrue(observer.terminal_seen)
        self.assertEqual(measure(observer), OPENAI_SSE_STATS)
        anthropic = observe("sse-message-stop", SSE, [ANTHROPIC_SSE.replace(b"\n", b"\r\n")])
        self.assertTrue(anthropic.terminal_seen)
        responses = observe(
            "sse-response-completed", SSE, chunked(RESPONSES_SSE.replace(b"\n", b"\r\n"), 5)
        )
        self.assertTrue(responses.terminal_seen)
        self.assertEqual(measure(responses), RESPONSES_SSE_STATS)

    def test_marker_without_space_or_trailing_newline(self):
        observer = observe("sse-done", SSE, [b'data:{"x":1}\n\ndata:[DONE]'])
        self.assertTrue(observer.terminal_seen)
        observer = observe("sse-message-stop", SSE, [b"event:message_stop\ndata: {}\n\n"])
        self.assertTrue(observer.terminal_seen)
        observer = observe("sse-response-completed", SSE, [b"event:response.completed \r\n"])
        self.assertTrue(observer.terminal_seen)
        observer = observe("sse-response-completed", SSE, [b"event: response.completed"])
        self.assertTrue(observer.terminal_seen)

    def test_events_counted(self):
        self.assertEqual(observe("sse-done", SSE, [OPENAI_SSE]).events_seen, 5)
        self.assertEqual(observe("sse-done", SSE, [SSE_NO_USAGE]).events_seen, 4)
        self.assertEqual(observe("ndjson-done", NDJSON, [OLLAMA_STREAM]).events_seen, 4)
        # every data line of a Responses stream: 4 opening events, 2 deltas, 4 closing ones
        self.assertEqual(observe("sse-response-completed", SSE, [RESPONSES_SSE]).events_seen, 10)
        self.assertEqual(observe("ndjson-done", JSON, [OLLAMA_JSON]).events_seen, 0)


class TerminalFrameTests(SynchronousTestCase):
    """Only a real terminal frame at a line start counts."""

    def test_quoted_sse_done_in_content(self):
        body = b'data: {"choices":[{"delta":{"content":"data: [DONE]"}}]}\n\n'
        for chunks in ([body], chunked(body, 1)):
            observer = observe("sse-done", SSE, chunks)
            self.assertFalse(observer.terminal_seen)
            self.assertEqual(observer.events_seen, 1)

    def test_a_marker_after_a_quoted_one_is_found(self):
        """Read in one pass at the end, a stream holds the marker's text in content first;
        every occurrence is looked at, not only the first."""
        for rule, quoted, marker in (
            ("sse-done", b'data: {"t":"[DONE]"}\n\n', b"data: [DONE]\n\n"),
            (
                "sse-message-stop",
                b'data: {"t":"message_stop"}\n\n',
                b"event: message_stop\ndata: {}\n\n",
            ),
        ):
            body = quoted + b'data: {"x":1}\n\n' + marker
            for chunks in ([body], chunked(body, 7)):
                observer = observe(rule, SSE, chunks)
                self.assertTrue(observer.terminal_seen, rule)
                self.assertEqual(observer.events_seen, 3 if rule == "sse-message-stop" else 2)

    def test_quoted_sse_done_after_escaped_newline(self):
        body = sse(openai_chunk({"content": "x\ndata: [DONE]\n\n"}))
        self.assertIn(b"\\ndata: [DONE]\\n", body)
        self.assertFalse(observe("sse-done", SSE, [body]).terminal_seen)

    def test_done_with_trailing_text_is_not_a_marker(self):
        self.assertFalse(observe("sse-done", SSE, [b"data: [DONE]x\n\n"]).terminal_seen)
        observer = observe("sse-done", SSE, [b"data: [DONE]"])
        self.assertTrue(observer.terminal_seen)  # judged as it stands...
        observer.feed(b"x\n\n")
        self.assertFalse(observer.terminal_seen)  # ...and it was not a marker after all

    def test_quoted_message_stop_in_content(self):
        body = sse(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "\nevent: message_stop\n"},
                },
            )
        )
        self.assertFalse(observe("sse-message-stop", SSE, [body]).terminal_seen)
        self.assertFalse(observe("sse-message-stop", SSE, chunked(body, 1)).terminal_seen)

    def test_quoted_response_completed_in_content(self):
        body = responses_sse(["\nevent: response.completed\n", "x"], RESPONSES_USAGE)
        body = body[: body.index(b"\nevent: response.completed\n") + 1]  # the real marker
        self.assertIn(b"\\nevent: response.completed\\n", body)
        self.assertFalse(observe("sse-response-completed", SSE, [body]).terminal_seen)
        self.assertFalse(observe("sse-response-completed", SSE, chunked(body, 1)).terminal_seen)

    def test_other_responses_events_are_not_terminal(self):
        for line in (
            b"event: response.completed.extra\n",
            b"event: response.completedx\n",
            b"event: response.output_text.done\n",
            b"data: response.completed\n",
            b" event: response.completed\n",
            b"event: response_completed\n",
        ):
            self.assertFalse(observe("sse-response-completed", SSE, [line]).terminal_seen, line)

    def test_route_rule_picks_the_marker(self):
        self.assertFalse(observe("sse-message-stop", SSE, [OPENAI_SSE]).terminal_seen)
        self.assertFalse(observe("sse-done", SSE, [ANTHROPIC_SSE]).terminal_seen)
        self.assertFalse(observe("sse-done", SSE, [RESPONSES_SSE]).terminal_seen)
        self.assertFalse(observe("sse-message-stop", SSE, [RESPONSES_SSE]).terminal_seen)
        self.assertFalse(observe("sse-response-completed", SSE, [OPENAI_SSE]).terminal_seen)
        self.assertFalse(observe("sse-response-completed", SSE, [ANTHROPIC_SSE]).terminal_seen)
        self.assertTrue(observe(None, SSE, [OPENAI_SSE]).terminal_seen)
        self.assertTrue(observe(None, SSE, [ANTHROPIC_SSE]).terminal_seen)
        self.assertTrue(observe(None, SSE, [RESPONSES_SSE]).terminal_seen)

    def test_quoted_done_in_ollama_token(self):
        for text in ('"done":true', '{"done": true}', '"done":true}\n'):
            body = ndjson(ollama_token(text))
            self.assertFalse(observe("ndjson-done", NDJSON, [body]).terminal_seen, text)
            self.assertFalse(observe("ndjson-done", NDJSON, chunked(body, 1)).terminal_seen, text)

    def test_nested_done_is_not_terminal(self):
        body = (
            b'{"model":"m","message":{"role":"assistant","content":"x","done":true},"done":false}\n'
        )
        self.assertFalse(observe("ndjson-done", NDJSON, [body]).terminal_seen)

    def test_spaced_ndjson_done(self):
        body = ndjson(ollama_token("a")) + b'{"model": "m", "done": true, "eval_count": 1}\n'
        self.assertTrue(observe("ndjson-done", NDJSON, [body]).terminal_seen)

    def test_truncated_streams(self):
        for terminal, content_type, body, marker in [
            ("sse-done", SSE, OPENAI_SSE, b"data: [DONE]"),
            ("sse-done", SSE, LLAMACPP_SSE, b"data: [DONE]"),
            ("sse-message-stop", SSE, ANTHROPIC_SSE, b"event: message_stop"),
            ("sse-message-stop", SSE, LLAMACPP_ANTHROPIC_SSE, b"event: message_stop"),
            ("sse-response-completed", SSE, RESPONSES_SSE, b"event: response.completed"),
            (
                "ndjson-done",
                NDJSON,
                OLLAMA_STREAM,
                b'{"model":"llama3:latest","created_at":"2024-05-29T16:00:03.5Z"',
            ),
        ]:
            truncated = body[: body.index(marker)]
            for chunks in ([truncated], chunked(truncated, 1)):
                self.assertFalse(observe(terminal, content_type, chunks).terminal_seen, terminal)
            # and cut inside the terminal frame itself
            self.assertFalse(
                observe(terminal, content_type, [body[: body.index(marker) + 5]]).terminal_seen
            )

    def test_truncated_stream_still_measured(self):
        truncated = OPENAI_SSE[
            : OPENAI_SSE.index(
                b'data: {"id":"chatcmpl-417","object":"chat.'
                b'completion.chunk","created":1716998400,"'
                b'model":"llama3:latest","system_fingerprint'
                b'":"fp_ollama","choices":[]'
            )
        ]
        observer = observe("sse-done", SSE, [truncated])
        self.assertEqual(
            measure(observer),
            {"completionTokens": 4, "tokensPerSecond": 2.0, "ttftMs": 250, "estimated": True},
        )
        ollama = observe("ndjson-done", NDJSON, [OLLAMA_STREAM[: OLLAMA_STREAM.rindex(b"{")]])
        self.assertEqual(
            measure(ollama),
            {"completionTokens": 4, "tokensPerSecond": 2.0, "ttftMs": 250, "estimated": True},
        )

    def test_truncated_anthropic_stream(self):
        """message_start's placeholder output_tokens is not a completion count."""
        truncated = ANTHROPIC_SSE[: ANTHROPIC_SSE.index(b"event: message_delta")]
        observer = observe("sse-message-stop", SSE, [truncated])
        self.assertFalse(observer.terminal_seen)
        self.assertEqual(
            measure(observer),
            {
                "promptTokens": 25,
                "completionTokens": 6,
                "tokensPerSecond": 3.0,
                "ttftMs": 250,
                "estimated": True,
            },
        )

    def test_truncated_responses_stream_is_estimated(self):
        """Without response.completed there is no usage: every data line so far is counted."""
        truncated = RESPONSES_SSE[: RESPONSES_SSE.index(b"event: response.completed")]
        observer = observe("sse-response-completed", SSE, [truncated])
        self.assertFalse(observer.terminal_seen)
        self.assertEqual(
            measure(observer),
            {"completionTokens": 9, "tokensPerSecond": 4.5, "ttftMs": 250, "estimated": True},
        )

    def test_terminal_is_sticky(self):
        observer = observe("sse-done", SSE, [OPENAI_SSE])
        observer.feed(sse(openai_chunk({"content": "late"})))
        self.assertTrue(observer.terminal_seen)
        ollama = observe("ndjson-done", NDJSON, [OLLAMA_STREAM + ndjson(ollama_token("x"))])
        self.assertTrue(ollama.terminal_seen)

    def test_json_document_completeness(self):
        for body, complete in [
            (b'{"a":1}', True),
            (b"  [1, 2]\n", True),
            (b'{"a":1', False),
            (b"", False),
            (b'{"a":"}"', False),
            (b'{"a":{"b":1}', False),
            (b"not json}", False),
            (b'{"a":"\\"}"}', True),
            (b'{"a":"\\\\"}', True),
            (b'{"a":"\\\\"', False),
            (b'{"a":"\\\\\\"}', False),
            (b'"a string"', False),
            (b"42", False),
            (b'{"a":[{"b":"]}"},{}]}', True),
            (b'{"a":[{"b":"]}"},{}]', False),
        ]:
            for chunks in ([body], chunked(body, 1)):
                self.assertEqual(observe(None, JSON, chunks).terminal_seen, complete, body)
        truncated = OPENAI_JSON.rstrip()[:-1]
        self.assertFalse(observe("sse-done", JSON, [truncated]).terminal_seen)
        self.assertFalse(observe("sse-done", None, [truncated]).terminal_seen)


class BoundedMemoryTests(SynchronousTestCase):
    """Multi-megabyte bodies keep the tail bounded and still find the figures at the end."""

    SIZE = 8 * 1024 * 1024

    def _assert_bounded(self, terminal, content_type, body, size):
        observer = BodyObserver(terminal, content_type)
        for chunk in chunked(body, size):
            observer.feed(chunk)
            self.assertLessEqual(len(observer._frames.tail), TAIL_LIMIT)
        self.assertEqual(observer.bytes_seen, len(body))
        return observer

    def test_openai_stream(self):
        token = sse(openai_chunk({"content": "tök"}))
        count = self.SIZE // len(token) + 1
        body = token * count + sse(
            {"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": count}},
            "[DONE]",
        )
        self.assertGreater(len(body), self.SIZE)
        for size in (65536 + 17, 4093, len(body)):
            observer = self._assert_bounded("sse-done", SSE, body, size)
            self.assertTrue(observer.terminal_seen)
            self.assertEqual(observer.events_seen, count + 1)
            self.assertEqual(
                measure(observer),
                {
                    "promptTokens": 7,
                    "completionTokens": count,
                    "tokensPerSecond": round(count / 2.0, 1),
                    "ttftMs": 250,
                },
            )

    def test_ollama_stream(self):
        token = ndjson(ollama_token("tök"))
        count = self.SIZE // len(token) + 1
        body = token * count + OLLAMA_STREAM.splitlines(keepends=True)[-1]
        observer = self._assert_bounded("ndjson-done", NDJSON, body, 65536 + 3)
        self.assertTrue(observer.terminal_seen)
        self.assertEqual(observer.events_seen, count)
        self.assertEqual(measure(observer), OLLAMA_STREAM_STATS)

    def test_anthropic_stream_prompt_scrolled_out(self):
        delta = sse(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "tök"},
                },
            )
        )
        body = (
            ANTHROPIC_SSE[: ANTHROPIC_SSE.index(b"event: content_block_delta")]
            + delta * (self.SIZE // len(delta) + 1)
            + ANTHROPIC_SSE[ANTHROPIC_SSE.index(b"event: content_block_stop") :]
        )
        observer = self._assert_bounded("sse-message-stop", SSE, body, 65536)
        self.assertTrue(observer.terminal_seen)
        self.assertEqual(
            measure(observer), {"completionTokens": 15, "tokensPerSecond": 7.5, "ttftMs": 250}
        )

    def test_responses_stream_whose_completed_event_outgrows_the_tail(self):
        """response.completed repeats the whole output; its usage comes after it, in the tail."""
        deltas = ["tök"] * (self.SIZE // 4 // 3)
        body = responses_sse(deltas, {**RESPONSES_USAGE, "output_tokens": len(deltas)})
        completed = body[body.index(b"event: response.completed") :]
        self.assertGreater(len(completed), TAIL_LIMIT)
        observer = self._assert_bounded("sse-response-completed", SSE, body, 65536 + 5)
        self.assertTrue(observer.terminal_seen)
        self.assertEqual(
            measure(observer),
            {
                "promptTokens": 11,
                "completionTokens": len(deltas),
                "tokensPerSecond": round(len(deltas) / 2.0, 1),
                "ttftMs": 250,
            },
        )

    def test_openai_json_larger_than_tail(self):
        # The content quotes a usage object of its own: escaped, so never read.
        content = 'words "usage": {"prompt_tokens": 999, "completion_tokens": 999} ' * 8 + "é" * (
            self.SIZE // 2
        )
        document = {
            "id": "chatcmpl-big",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "message": {"role": "assistant", "content": content},
                }
            ],
            "usage": {"prompt_tokens": 31, "completion_tokens": 4096, "total_tokens": 4127},
        }
        body = json.dumps(document, ensure_ascii=False).encode()
        self.assertGreater(len(body), self.SIZE)
        for content_type in (JSON, None):
            observer = self._assert_bounded("sse-done", content_type, body, 65536 + 1)
            self.assertTrue(observer.terminal_seen)
            self.assertEqual(
                measure(observer),
                {
                    "promptTokens": 31,
                    "completionTokens": 4096,
                    "tokensPerSecond": 2048.0,
                    "ttftMs": 250,
                },
            )
            cut = self._assert_bounded("sse-done", content_type, body[:-1], 65536 + 1)
            self.assertFalse(cut.terminal_seen)

    def test_ollama_json_longer_than_a_line(self):
        document = json.loads(OLLAMA_JSON)
        document["message"]["content"] = "x" * (LINE_LIMIT * 3)
        body = json.dumps(document, separators=(",", ":")).encode()
        for terminal, content_type in (
            ("ndjson-done", None),
            ("ndjson-done", JSON),
            ("ndjson-done", NDJSON),
        ):
            observer = self._assert_bounded(terminal, content_type, body, 1000)
            self.assertTrue(observer.terminal_seen, content_type)
            self.assertEqual(measure(observer), OLLAMA_JSON_STATS)
            # the same line completed by a newline in one big chunk
            observer = self._assert_bounded(terminal, content_type, body + b"\n", len(body) + 1)
            self.assertTrue(observer.terminal_seen, content_type)

    def test_long_sse_line_counts_as_an_event(self):
        line = b"data: " + json.dumps(openai_chunk({"content": "y" * (LINE_LIMIT * 2)})).encode()
        body = line + b"\n\n" + sse(openai_chunk({"content": "z"}), "[DONE]")
        for size in (1000, len(body)):
            observer = self._assert_bounded("sse-done", SSE, body, size)
            self.assertEqual(observer.events_seen, 2)
            self.assertTrue(observer.terminal_seen)


class MeasureTests(SynchronousTestCase):
    """What measure() reports when figures or times are missing."""

    def test_empty_body(self):
        for terminal, content_type in [
            ("sse-done", SSE),
            ("sse-message-stop", None),
            ("sse-response-completed", SSE),
            ("ndjson-done", NDJSON),
            (None, None),
        ]:
            observer = BodyObserver(terminal, content_type)
            observer.feed(b"")
            self.assertIsNone(measure(observer))
            self.assertFalse(observer.terminal_seen)
            self.assertEqual(observer.bytes_seen, 0)

    def test_error_bodies(self):
        for terminal, content_type, body in [
            (
                "sse-done",
                JSON,
                b'{"error":{"message":"model \\"nope\\" not found",'
                b'"type":"invalid_request_error","param":null,"code":null}}',
            ),
            ("sse-done", None, b'{"error":"Unexpected endpoint or method."}'),
            ("ndjson-done", JSON, b'{"error":"model \\"nope\\" not found, try pulling it first"}'),
            (
                "ndjson-done",
                NDJSON,
                b'{"error":"an error was encountered while running the model: unexpected EOF"}\n',
            ),
            ("sse-message-stop", SSE, b": keep-alive\n\nevent: ping\n\n"),
            (None, "text/plain", b"Internal Server Error\n"),
            (None, None, b"<html><body>502 Bad Gateway</body></html>"),
        ]:
            observer = observe(terminal, content_type, [body])
            self.assertIsNone(measure(observer), body)

    def test_no_first_byte(self):
        observer = observe("sse-done", SSE, [OPENAI_SSE])
        self.assertEqual(
            measure(observer, first_byte_at=None), {"promptTokens": 12, "completionTokens": 3}
        )
        ollama = observe("ndjson-done", NDJSON, [OLLAMA_STREAM])
        self.assertEqual(
            measure(ollama, first_byte_at=None),
            {"promptTokens": 26, "completionTokens": 298, "tokensPerSecond": 62.1},
        )

    def test_zero_interval_has_no_rate(self):
        observer = observe("sse-done", SSE, [SSE_NO_USAGE])
        self.assertEqual(
            measure(observer, ended_at=FIRST_BYTE),
            {"completionTokens": 4, "ttftMs": 250, "estimated": True},
        )

    def test_engine_rate_wins_over_wall_clock(self):
        ollama = observe("ndjson-done", NDJSON, [OLLAMA_STREAM])
        self.assertEqual(measure(ollama, ended_at=FIRST_BYTE + 100)["tokensPerSecond"], 62.1)
        llama = observe("sse-done", SSE, [LLAMACPP_SSE])
        self.assertEqual(measure(llama, ended_at=FIRST_BYTE + 100)["tokensPerSecond"], 83.0)

    def test_prompt_only(self):
        body = json.dumps(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "model": "nomic-embed-text",
                "usage": {"prompt_tokens": 8, "total_tokens": 8},
            }
        ).encode()
        self.assertEqual(measure(observe(None, JSON, [body])), {"promptTokens": 8, "ttftMs": 250})

    def test_usage_null_chunks_are_skipped(self):
        body = sse(openai_chunk({"content": "a"}, usage=None)) + b"data: [DONE]\n\n"
        self.assertEqual(
            measure(observe("sse-done", SSE, [body])),
            {"completionTokens": 1, "tokensPerSecond": 0.5, "ttftMs": 250, "estimated": True},
        )

    def test_measure_does_not_consume(self):
        observer = observe("sse-done", SSE, [OPENAI_SSE])
        self.assertEqual(measure(observer), measure(observer))


class PromptFiguresTests(SynchronousTestCase):
    """What placement reads besides the wire's stats: the prompt tokens an engine read for a
    request and the whole prompt's tokens, cached ones included."""

    def test_llamacpp_timings_count_the_cached_prefix_in_the_whole_prompt(self):
        figures = tokens.read_figures(
            json.dumps(
                {
                    "timings": {
                        "cache_n": 900,
                        "prompt_n": 100,
                        "prompt_per_second": 250.0,
                        "predicted_n": 5,
                    }
                }
            ).encode()
        )
        self.assertEqual(
            (figures.prompt, figures.prompt_read, figures.prompt_seen, figures.prompt_rate),
            (100, 100, 1000, 250.0),
            "promptTokens keeps the wire's reading; placement sees 1000",
        )

    def test_usage_is_the_whole_prompt_and_timings_what_was_read(self):
        figures = tokens.read_figures(
            json.dumps(
                {
                    "usage": {"prompt_tokens": 1000, "completion_tokens": 5},
                    "timings": {"cache_n": 990, "prompt_n": 10},
                }
            ).encode()
        )
        self.assertEqual(
            (figures.prompt, figures.prompt_read, figures.prompt_seen), (1000, 10, 1000)
        )

    def test_ollama_counts_what_it_evaluated(self):
        figures = tokens.read_figures(
            json.dumps(
                {
                    "done": True,
                    "prompt_eval_count": 300,
                    "prompt_eval_duration": 1_500_000_000,
                    "eval_count": 4,
                    "eval_duration": 100_000_000,
                }
            ).encode()
        )
        self.assertEqual(
            (figures.prompt_read, figures.prompt_seen, figures.prompt_rate), (300, 300, 200.0)
        )

    def test_an_ollama_that_says_what_its_cache_gave_counts_it_in_the_whole(self):
        """Ollama since it reports ``prompt_eval_cached_count``: ``prompt_eval_count`` is the
        logical prompt, cached tokens included, and its prefill rate is what it read."""
        figures = tokens.read_figures(
            json.dumps(
                {
                    "done": True,
                    "prompt_eval_count": 1000,
                    "prompt_eval_cached_count": 900,
                    "prompt_eval_duration": 500_000_000,
                    "eval_count": 4,
                }
            ).encode()
        )
        self.assertEqual(
            (
                figures.prompt,
                figures.prompt_read,
                figures.prompt_seen,
                figures.prompt_cached,
                figures.prompt_rate,
            ),
            (1000, 100, 1000, 900, 200.0),
        )

    def test_openai_usage_details_say_what_the_cache_gave(self):
        """Chat Completions' ``prompt_tokens_details.cached_tokens`` and Responses'
        ``input_tokens_details.cached_tokens`` (Ollama's /v1 routes) are counted in the whole
        prompt; a stream's last usage wins over an earlier one."""
        chat = (
            'data: {"usage":{"prompt_tokens":10,"completion_tokens":1,'
            '"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
            'data: {"usage":{"prompt_tokens":2000,"completion_tokens":7,'
            '"prompt_tokens_details":{"cached_tokens":1500}}}\n\n'
            "data: [DONE]\n\n"
        ).encode()
        responses = json.dumps(
            {
                "type": "response.completed",
                "response": {
                    "usage": {
                        "input_tokens": 800,
                        "output_tokens": 3,
                        "input_tokens_details": {"cached_tokens": 600},
                    }
                },
            }
        ).encode()
        for tail, expected in ((chat, (2000, 500, 2000, 1500)), (responses, (800, 200, 800, 600))):
            figures = tokens.read_figures(tail)
            self.assertEqual(
                (figures.prompt, figures.prompt_read, figures.prompt_seen, figures.prompt_cached),
                expected,
            )

    def test_usage_without_details_says_nothing_of_the_cache(self):
        figures = tokens.read_figures(b'{"usage":{"prompt_tokens":50,"completion_tokens":2}}')
        self.assertEqual((figures.prompt_seen, figures.prompt_cached), (50, None))

    def test_an_earlier_objects_details_never_describe_a_later_prompt(self):
        """The cached count is read beside the whole prompt it belongs to: a tail holding an
        earlier answer's usage with details, then the last one without, says nothing."""
        for earlier, last in (
            (
                {
                    "input_tokens": 100,
                    "output_tokens": 1,
                    "input_tokens_details": {"cached_tokens": 90},
                },
                {"input_tokens": 5000, "output_tokens": 20},
            ),
            (
                {
                    "prompt_tokens": 100,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": 90},
                },
                {"prompt_tokens": 5000},
            ),
        ):
            tail = (json.dumps({"usage": earlier}) + "\n" + json.dumps({"usage": last})).encode()
            figures = tokens.read_figures(tail)
            self.assertEqual((figures.prompt_seen, figures.prompt_cached), (5000, None), last)

    def test_more_cached_than_the_whole_prompt_is_unknown(self):
        """A body at odds with itself says nothing of the cache, rather than a full hit."""
        for said in (
            {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}},
            {"done": True, "prompt_eval_count": 10, "prompt_eval_cached_count": 11},
        ):
            figures = tokens.read_figures(json.dumps(said).encode())
            self.assertEqual((figures.prompt_seen, figures.prompt_cached), (10, None), said)

    def test_an_anthropic_stream_says_what_its_cache_gave_in_message_start(self):
        """llama.cpp's /v1/messages (what Claude Code speaks) has no timings: the cache's
        share is in message_start's usage, as llama.cpp 11434 sends it."""
        start = {
            "type": "message_start",
            "message": {
                "usage": {"cache_read_input_tokens": 21579, "input_tokens": 36, "output_tokens": 0}
            },
        }
        delta = {"type": "message_delta", "usage": {"output_tokens": 3}}
        tail = (
            f"event: message_start\ndata: {json.dumps(start)}\n\n"
            f"event: message_delta\ndata: {json.dumps(delta)}\n\n"
        ).encode()
        figures = tokens.read_figures(tail)
        self.assertEqual(
            (figures.prompt, figures.prompt_read, figures.prompt_seen, figures.prompt_cached),
            (36, 36, 21615, 21579),
            "promptTokens keeps the wire's input_tokens; placement sees the whole prompt",
        )
        self.assertEqual(figures.completion, 3)

    def test_a_cache_write_is_read_anew(self):
        usage = {
            "input_tokens": 10,
            "cache_creation_input_tokens": 90,
            "cache_read_input_tokens": 0,
        }
        figures = tokens.read_figures(json.dumps({"usage": usage}).encode())
        self.assertEqual(
            (figures.prompt_read, figures.prompt_seen, figures.prompt_cached), (100, 100, 0)
        )

    def test_nothing_reported_is_none(self):
        figures = tokens.read_figures(b'{"done":true}')
        self.assertEqual((figures.prompt_read, figures.prompt_seen), (None, None))


class HygieneTests(SynchronousTestCase):
    """The module stays pure and never shows body bytes."""

    def test_repr_shows_no_body(self):
        observer = observe(
            "ndjson-done", NDJSON, [ndjson(ollama_token("SECRET-PROMPT-TEXT")), b'{"partial SECRET']
        )
        self.assertNotIn("SECRET", repr(observer))
        self.assertNotIn("SECRET", str(observer))

    def test_no_twisted_and_no_logging(self):
        for module in (frames, tokens):
            tree = ast.parse(inspect.getsource(module))
            imported = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    imported.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    imported.add((node.module or "").split(".")[0])
            self.assertEqual(imported & {"twisted", "logging", "treq"}, set(), module.__name__)
            self.assertNotIn("print(", inspect.getsource(module), module.__name__)

    def test_unknown_rule_rejected(self):
        self.assertRaises(ValueError, BodyObserver, "sse-finished")

    def test_every_rule_an_engine_file_may_name_is_understood(self):
        from nvpair_proxy.nodes.engines import TERMINAL_FRAMES

        for terminal in TERMINAL_FRAMES:
            self.assertEqual(BodyObserver(terminal).terminal, terminal)

    def test_content_type_as_bytes(self):
        observer = observe("sse-done", b"text/event-stream; charset=utf-8", [OPENAI_SSE])
        self.assertTrue(observer.terminal_seen)
        self.assertEqual(measure(observer), OPENAI_SSE_STATS)

    def test_memoryview_and_bytearray_chunks(self):
        observer = observe(
            "sse-done", SSE, [bytearray(OPENAI_SSE[:50]), memoryview(OPENAI_SSE[50:])]
        )
        self.assertTrue(observer.terminal_seen)
        self.assertEqual(measure(observer), OPENAI_SSE_STATS)


class HostileNumbersTests(SynchronousTestCase):
    def test_an_absurd_count_is_not_a_count_and_does_not_raise(self):
        observer = BodyObserver("ndjson-done", "application/x-ndjson")
        observer.feed(b'{"done":true,"eval_count":' + b"9" * 400 + b',"eval_duration":1}\n')
        self.assertTrue(observer.terminal_seen)
        stats = observer.measure(admitted_at=0.0, first_byte_at=1.0, ended_at=2.0)
        self.assertNotIn("tokensPerSecond", stats or {})


# -- lazy reading: the answers never depend on when they are asked ---------------------------

FUZZ = settings.default.max_examples

_LINES = [
    b'data: {"x":1}\n',
    b"data: [DONE]\n",
    b"\n",
    b"\r\n",
    b"event: message_stop\n",
    b"event: response.completed\r\n",
    b"data: " + b"y" * 150 + b"\n",
    b"data:[DONE]",
    b'{"done":false}\n',
    b'{"done": true}\n',
    b'{"a":{"done":true}}\n',
    b"da",
    b"ta: ",
    b"z" * 300 + b"\n",
    b"[DONE]\n",
    b'{"done":true}',
    b'data: {"t":"[DONE]"}\n',
    b"event: x message_stop\n",
    b"data: [DONE] \t\r\n",
]


class LazyReadingProperties(SynchronousTestCase):
    @settings(max_examples=FUZZ, deadline=None)
    @given(
        lines=st.lists(st.sampled_from(_LINES), max_size=40),
        content_type=st.sampled_from(["text/event-stream", "application/x-ndjson"]),
        cuts=st.lists(st.integers(0, 20_000), max_size=25),
        asks=st.lists(st.booleans(), max_size=25),
        small=st.booleans(),
    )
    def test_asked_anywhere_a_reader_answers_as_one_fed_the_prefix_whole(
        self, lines, content_type, cuts, asks, small
    ):
        """Feeding in pieces and asking between them (the stream asks when a client leaves)
        answers what a reader given each prefix in one piece answers; a small tail runs the
        paths where unread bytes would leave it. (A line longer than the tail is long here
        and never holds an event or a marker: whether such a line's NDJSON event counts
        depends on where the reads split it, as the module says.)"""
        if small:
            self.patch(frames, "TAIL_LIMIT", 256)
            self.patch(frames, "LINE_LIMIT", 256)
        body = b"".join(lines)
        reader = frames.FrameReader(None, content_type)
        fed = 0
        for index, piece in enumerate(splits(body, cuts)):
            reader.feed(piece)
            fed += len(piece)
            if index < len(asks) and asks[index]:
                whole = frames.FrameReader(None, content_type)
                whole.feed(body[:fed])
                self.assertEqual(
                    (reader.terminal_seen, reader.events_seen),
                    (whole.terminal_seen, whole.events_seen),
                    fed,
                )
        whole = frames.FrameReader(None, content_type)
        if body:
            whole.feed(body)
        self.assertEqual(
            (reader.events_seen, bytes(reader.tail)), (whole.events_seen, bytes(whole.tail))
        )
        self.assertEqual(reader.terminal_seen, whole.terminal_seen)
