"""Tail-only reading of a response body as it streams to the client (design 6 and 7).

The proxy hands every relayed chunk to a :class:`BodyObserver`. The observer never keeps the
body: it holds the last :data:`TAIL_LIMIT` bytes, the first few bytes of the line in progress,
and a handful of counters. From that it answers two questions:

* :attr:`BodyObserver.terminal_seen`: has the stream's terminal frame arrived (design 6)? A
  client that closes after it is ``completed``, not ``cancelled``.
* :meth:`BodyObserver.measure`: the ``stats`` block of the terminal workload event (spec 5.5,
  design 7, decision 12), read from the tail when the response ends.

Reading the tail of a body is allowed; logging it is not (spec 9). This module logs nothing,
and an observer's ``repr`` never shows body bytes.

Framing
-------
The framing comes from the ``Content-Type`` when it names one, else from the route's terminal
rule (the ``terminal`` field of the engine file):

* ``text/event-stream`` (or an ``sse-*`` rule): Server-Sent Events. The terminal frame is a line
  that is exactly ``data: [DONE]`` (``sse-done``: OpenAI chat and completions),
  ``event: message_stop`` (``sse-message-stop``: Anthropic Messages) or
  ``event: response.completed`` (``sse-response-completed``: OpenAI Responses); the space after
  the colon is optional and trailing blanks or a ``\\r`` are allowed. When the route names no SSE
  rule, any of these markers counts. A marker quoted inside a JSON payload is escaped and never
  at a line start, so it does not count. Lines end with
  ``\\n`` or ``\\r\\n`` (a bare ``\\r`` line end, legal but unused by any engine, is not
  recognised). When the framing comes only from an ``sse-*`` rule and the body's first
  non-blank byte is ``{`` or ``[``, the answer is a non-streaming JSON document (the request
  said ``stream: false``) and is read as such.
* ``application/x-ndjson`` and friends (or the ``ndjson-done`` rule): one JSON object per line.
  The terminal frame is a line whose top-level object has ``"done": true``; a ``"done":true``
  inside a string is escaped and does not count, nor does one in a nested object. The last
  line may lack its newline (Ollama's non-streaming answer is a single such line).
* anything else (``application/json``, or no rule and no type): one JSON document. Its
  "terminal frame" is the document itself: ``terminal_seen`` is true once the top-level object
  or array has closed. The observer follows the nesting depth as bytes go by (string- and
  escape-aware, a C-level search per string or bracket, no buffering), so this holds for a
  document of any size; a top-level scalar or a body that does not start as JSON never counts.

``terminal_seen`` is sticky: once a terminal frame has arrived it stays true even if more
frames follow, because what design 6 asks is whether it *arrived* before the client left. (The
one exception is the incomplete last line, which is judged as it stands each time: a line that
reads ``data: [DONE]`` but then continues was never a terminal frame.)

Stats
-----
Read once, from the tail, when :meth:`BodyObserver.measure` is called:

* ``completionTokens``: OpenAI ``usage.completion_tokens``, else Anthropic and OpenAI Responses
  ``usage.output_tokens``, else Ollama ``eval_count``, else llama.cpp ``timings.predicted_n``,
  else llama.cpp ``tokens_predicted``; failing all of them, the number of stream events counted
  while the body went by, with ``"estimated": True``. A stream event is an SSE ``data:`` line
  other than ``[DONE]``, or an NDJSON line reporting ``"done":false`` (Ollama's per-token
  frame; blank lines and ``{"error": ...}`` lines are not events). A JSON document has none.
* ``promptTokens``: ``usage.prompt_tokens``, else ``usage.input_tokens``, else
  ``prompt_eval_count``, else ``timings.prompt_n``, else ``tokens_evaluated``. Omitted when the
  tail holds none of them: it is never guessed, and an estimated completion count is reported
  without one unless the engine reported it. For an Anthropic stream longer than the tail,
  ``message_start`` (the only frame that carries ``input_tokens`` for some servers) has
  scrolled out, so the prompt count is best effort. The ``output_tokens`` of
  ``message_start`` is a placeholder and is never read; the final ``message_delta``'s is. An
  OpenAI Responses stream reports both counts once, in ``response.usage`` of its last event
  (``response.completed``), and a non-streaming Responses object in its top-level ``usage``:
  the same keys, so the same reading; the ``"usage": null`` of ``response.created`` is skipped.
* ``tokensPerSecond``: the engine's own decode rate when it reports one (decision 12): Ollama
  ``eval_count / (eval_duration / 1e9)``, llama.cpp ``timings.predicted_per_second``; else
  completion tokens over first body byte to end. Rounded to one decimal; omitted when neither
  is available (no first byte, or a zero interval).
* ``ttftMs``: ``round((first_byte_at - admitted_at) * 1000)``, omitted without a first byte.
* ``estimated``: present, and ``True``, only for a counted completion figure.

When several objects carry the same figure (an OpenAI stream sends ``"usage": null`` in every
chunk and the real object last; Anthropic's ``message_start`` and ``message_delta`` both carry
``usage``), the last one in the body wins, field by field. Keys are matched only where their
quotes are unescaped, so a figure quoted in generated text is never read. ``measure`` returns
``None`` when no token figure was found at all (an error body, an empty body, a stream with no
events).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterator

import attrs

__all__ = [
    "BodyObserver",
    "LINE_LIMIT",
    "TAIL_LIMIT",
    "TERMINAL_NDJSON_DONE",
    "TERMINAL_SSE_DONE",
    "TERMINAL_SSE_MESSAGE_STOP",
    "TERMINAL_SSE_RESPONSE_COMPLETED",
]

TERMINAL_SSE_DONE = "sse-done"
TERMINAL_SSE_MESSAGE_STOP = "sse-message-stop"
TERMINAL_SSE_RESPONSE_COMPLETED = "sse-response-completed"
TERMINAL_NDJSON_DONE = "ndjson-done"
_SSE_TERMINALS = (TERMINAL_SSE_DONE, TERMINAL_SSE_MESSAGE_STOP, TERMINAL_SSE_RESPONSE_COMPLETED)
_TERMINALS = (*_SSE_TERMINALS, TERMINAL_NDJSON_DONE)

#: The most body bytes an observer keeps (the tail every stats figure is read from).
TAIL_LIMIT = 64 * 1024
#: A line longer than this is "long": it cannot be an SSE marker, and an NDJSON ``done`` key is
#: only looked for in its last ``LINE_LIMIT`` bytes. It must not exceed ``TAIL_LIMIT``, because
#: the line in progress is read back from the tail.
LINE_LIMIT = TAIL_LIMIT
#: How much of the line in progress is kept aside, so a long SSE line's field name is known.
_LINE_HEAD = 16
#: A line this short or shorter may be an SSE marker (``data: [DONE]`` with blanks and ``\r``).
_MARKER_LINE_MAX = 64

_SSE, _NDJSON, _JSON = "sse", "ndjson", "json"

_SSE_TYPES = frozenset({"text/event-stream"})
_NDJSON_TYPES = frozenset({
    "application/x-ndjson",
    "application/ndjson",
    "application/jsonl",
    "application/x-jsonl",
    "application/jsonlines",
    "application/x-jsonlines",
})

# Bytes patterns, run over chunks as they pass (with pos/endpos, so nothing is copied).
# MULTILINE: "^" matches at a line start, "$" before a "\n" (or at endpos).
_SSE_DONE = re.compile(rb"^data: ?\[DONE\][ \t]*\r?$", re.MULTILINE)
_SSE_STOP = re.compile(rb"^event: ?message_stop[ \t]*\r?$", re.MULTILINE)
_SSE_COMPLETED = re.compile(rb"^event: ?response\.completed[ \t]*\r?$", re.MULTILINE)
_DONE_LITERAL = b"[DONE]"
_STOP_LITERAL = b"message_stop"
_COMPLETED_LITERAL = b"response.completed"
_NDJSON_DONE_TRUE = re.compile(rb'"done"[ \t]*:[ \t]*true')
_NDJSON_EVENT_COMPACT = b'"done":false'  # what Go's encoding/json (Ollama) writes
_NDJSON_EVENT_SPACED = b'"done": false'  # what Python's json.dumps writes
_NON_BLANK = re.compile(rb"[^ \t\r\n]")
# A JSON document's structure: the next quote or bracket outside a string, and the rest of a
# string (up to, not including, its closing quote or a backslash that ends the chunk).
_JSON_STRUCTURE = re.compile(rb'["{}\[\]]')
_JSON_STRING_BODY = re.compile(rb'(?:[^"\\]+|\\.)*', re.DOTALL)
_QUOTE, _OPENERS = 0x22, (0x7B, 0x5B)
# JSON document tracking states.
_TRACKING, _CLOSED, _NOT_JSON = "tracking", "closed", "not-json"

# Text patterns, run once over the decoded tail by measure(). A key matches only with its own,
# unescaped quotes: quoted inside a JSON string it reads \"key\" and never matches.
_USAGE = re.compile(r'"usage"\s*:\s*(?=\{)')
_TIMINGS = re.compile(r'"timings"\s*:\s*(?=\{)')


def _int_key(name: str) -> re.Pattern[str]:
    return re.compile(r'"%s"\s*:\s*(\d+)(?![\d.eE])' % re.escape(name))


_PROMPT_EVAL_COUNT = _int_key("prompt_eval_count")
_EVAL_COUNT = _int_key("eval_count")
_EVAL_DURATION = _int_key("eval_duration")
_TOKENS_PREDICTED = _int_key("tokens_predicted")
_TOKENS_EVALUATED = _int_key("tokens_evaluated")

_DECODER = json.JSONDecoder()


def _media_type(content_type: str | bytes | None) -> str | None:
    if content_type is None:
        return None
    if isinstance(content_type, (bytes, bytearray)):
        content_type = bytes(content_type).decode("latin-1")
    media = content_type.split(";", 1)[0].strip().lower()
    return media or None


def _framing(terminal: str | None, content_type: str | bytes | None) -> tuple[str, bool]:
    """The framing to read the body with, and whether to sniff for a JSON document."""
    media = _media_type(content_type)
    if media in _SSE_TYPES:
        return _SSE, False
    if media in _NDJSON_TYPES:
        return _NDJSON, False
    if media is not None and (media == "application/json" or media.endswith("+json")):
        return _JSON, False
    if terminal in _SSE_TERMINALS:
        return _SSE, True
    if terminal == TERMINAL_NDJSON_DONE:
        return _NDJSON, False
    return _JSON, False


def _object_from(text: str, start: int, end: int | None = None) -> dict[str, Any] | None:
    """Parse ``text[start:end]`` as the inside of an object that closes exactly at ``end``.

    ``start`` is a key's opening quote; ``"{"`` is put in front, so this succeeds only when the
    key sits at the top level of the object that the text closes last.
    """
    fragment = "{" + text[start:end]
    try:
        value, stop = _DECODER.raw_decode(fragment)
    except (ValueError, RecursionError):
        return None
    if fragment[stop:].strip():
        return None
    return value if isinstance(value, dict) else None


def _ndjson_done_in(buf: bytes | bytearray, start: int, end: int) -> bool:
    """Whether a line of ``buf[start:end]`` (whole lines) is an object with top-level done=true."""
    for match in _NDJSON_DONE_TRUE.finditer(buf, start, end):
        eol = buf.find(b"\n", match.end(), end)
        if eol == -1:
            eol = end
        text = bytes(buf[match.start():eol]).decode("utf-8", "replace")
        obj = _object_from(text, 0)
        if obj is not None and obj.get("done") is True:
            return True
    return False


def _sse_marker_in(buf: bytes | bytearray, start: int, end: int, markers: tuple[str, ...]) -> int:
    """How many lines of ``buf[start:end]`` (whole lines) are terminal markers."""
    found = 0
    if TERMINAL_SSE_DONE in markers and buf.find(_DONE_LITERAL, start, end) != -1:
        found += len(_SSE_DONE.findall(buf, start, end))
    if TERMINAL_SSE_MESSAGE_STOP in markers and buf.find(_STOP_LITERAL, start, end) != -1:
        found += len(_SSE_STOP.findall(buf, start, end))
    if (TERMINAL_SSE_RESPONSE_COMPLETED in markers
            and buf.find(_COMPLETED_LITERAL, start, end) != -1):
        found += len(_SSE_COMPLETED.findall(buf, start, end))
    return found


def _sse_done_lines(buf: bytes | bytearray, start: int, end: int) -> int:
    if buf.find(_DONE_LITERAL, start, end) == -1:
        return 0
    return len(_SSE_DONE.findall(buf, start, end))


def _sse_data_lines(buf: bytes | bytearray, start: int, end: int) -> int:
    """Lines starting with ``data:`` in ``buf[start:end]``, where ``start`` is a line start."""
    count = buf.count(b"\ndata:", start, end)
    if buf.startswith(b"data:", start, end):
        count += 1
    return count


def _last_int(pattern: re.Pattern[str], text: str) -> int | None:
    value = None
    for match in pattern.finditer(text):
        value = match.group(1)
    if value is None or len(value) > 18:
        return None  # absent, or no real count: never a number that overflows the arithmetic
    return int(value)


def _objects(pattern: re.Pattern[str], text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects after each match of ``pattern`` with the match's offset, last first.

    Unparsable ones (cut by the tail's start or a truncated end) are skipped.
    """
    for match in reversed(list(pattern.finditer(text))):
        try:
            value, _ = _DECODER.raw_decode(text, match.end())
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            yield match.start(), value


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _rate(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


@attrs.frozen
class _Figures:
    """What the engine itself reported, as read from the tail."""

    prompt: int | None = None
    completion: int | None = None
    rate: float | None = None


def _read_figures(tail: bytes | bytearray) -> _Figures:
    text = bytes(tail).decode("utf-8", "replace")

    usage: dict[str, int] = {}
    wanted = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")
    if '"usage"' in text:
        for at, obj in _objects(_USAGE, text):
            line = text[text.rfind("\n", 0, at) + 1 : at]
            # Anthropic's message_start reports output_tokens 1 before anything is generated.
            opening = '"message_start"' in line
            for key in wanted:
                if opening and key == "output_tokens":
                    continue
                if key not in usage and (value := _count(obj.get(key))) is not None:
                    usage[key] = value
            if len(usage) == len(wanted):
                break

    timings: dict[str, Any] = {}
    if '"timings"' in text:
        for _, obj in _objects(_TIMINGS, text):
            for key in ("prompt_n", "predicted_n", "predicted_per_second"):
                if key not in timings and key in obj:
                    timings[key] = obj[key]

    eval_count = _last_int(_EVAL_COUNT, text)
    eval_duration = _last_int(_EVAL_DURATION, text)

    def first(*candidates: int | None) -> int | None:
        return next((c for c in candidates if c is not None), None)

    completion = first(
        usage.get("completion_tokens"),
        usage.get("output_tokens"),
        eval_count,
        _count(timings.get("predicted_n")),
        _last_int(_TOKENS_PREDICTED, text),
    )
    prompt = first(
        usage.get("prompt_tokens"),
        usage.get("input_tokens"),
        _last_int(_PROMPT_EVAL_COUNT, text),
        _count(timings.get("prompt_n")),
        _last_int(_TOKENS_EVALUATED, text),
    )
    rate = None
    if eval_count is not None and eval_duration:
        rate = eval_count / (eval_duration / 1e9)
    elif (per_second := _rate(timings.get("predicted_per_second"))) is not None:
        rate = per_second
    return _Figures(prompt=prompt, completion=completion, rate=rate)


@attrs.define(init=False, eq=False)
class BodyObserver:
    """Watch a response body go by: its terminal frame and its stats, from a bounded tail.

    ``terminal`` is the route's terminal frame rule from the engine file (``sse-done``,
    ``sse-message-stop``, ``sse-response-completed``, ``ndjson-done``) or ``None``;
    ``content_type`` is the response's ``Content-Type`` (``str`` or ``bytes``), which wins over
    the rule when it names a framing.

    Cost per :meth:`feed`: one bounded append to the tail plus a few C-level searches over the
    lines the chunk completes; nothing is re-scanned. Memory: ``TAIL_LIMIT`` body bytes at most
    (plus a 16-byte line head).
    """

    terminal: str | None
    content_type: str | bytes | None = attrs.field(repr=False)
    #: Body bytes fed so far.
    bytes_seen: int
    _mode: str
    _sniff: bool = attrs.field(repr=False)
    _markers: tuple[str, ...] = attrs.field(repr=False)
    _events: int
    _terminal_found: bool
    # Body bytes: never in the repr (spec 9).
    _tail: bytearray = attrs.field(repr=False)
    _line_head: bytes = attrs.field(repr=False)
    _line_len: int = attrs.field(repr=False)
    _cache: tuple[int, bool] | None = attrs.field(repr=False)
    _json_state: str = attrs.field(repr=False)
    _json_depth: int = attrs.field(repr=False)
    _json_in_string: bool = attrs.field(repr=False)
    _json_escape: bool = attrs.field(repr=False)

    def __init__(self, terminal: str | None, content_type: str | bytes | None = None) -> None:
        if terminal is not None and terminal not in _TERMINALS:
            raise ValueError(f"unknown terminal frame rule {terminal!r}")
        framing, sniff = _framing(terminal, content_type)
        if terminal in _SSE_TERMINALS:
            markers: tuple[str, ...] = (terminal,)
        else:
            markers = _SSE_TERMINALS
        self.terminal = terminal
        self.content_type = content_type
        self.bytes_seen = 0
        self._mode = framing
        self._sniff = sniff
        self._markers = markers
        self._events = 0
        self._terminal_found = False
        self._tail = bytearray()
        self._line_head = b""
        self._line_len = 0
        self._cache = None
        self._json_state = _TRACKING
        self._json_depth = 0
        self._json_in_string = False
        self._json_escape = False

    # -- feeding --------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Observe the next relayed chunk (split anywhere)."""
        if not data:
            return
        if not isinstance(data, bytes):
            data = bytes(data)
        if self._sniff:
            first = _NON_BLANK.search(data)
            if first is not None:
                self._sniff = False
                if data[first.start()] in b"{[":
                    self._mode = _JSON
        if self._mode != _JSON:
            self._scan_lines(data)
        elif self._json_state == _TRACKING:
            self._track_json(data)
        self._keep_tail(data)
        self.bytes_seen += len(data)

    def _keep_tail(self, data: bytes) -> None:
        tail = self._tail
        if len(data) >= TAIL_LIMIT:
            tail[:] = data[-TAIL_LIMIT:]
            return
        tail += data
        excess = len(tail) - TAIL_LIMIT
        if excess > 0:
            del tail[:excess]  # CPython moves the start of a bytearray: no copy

    def _track_json(self, data: bytes) -> None:
        """Follow a JSON document's nesting until its top-level object or array closes."""
        depth, in_string = self._json_depth, self._json_in_string
        pos, size = 0, len(data)
        if self._json_escape:  # the last chunk ended on a backslash inside a string
            self._json_escape = False
            pos = 1
        while pos < size:
            if in_string:
                end = _JSON_STRING_BODY.match(data, pos).end()
                if end >= size:
                    break
                if data[end] == _QUOTE:
                    in_string = False
                    pos = end + 1
                else:  # a backslash as the chunk's last byte
                    self._json_escape = True
                    break
                continue
            if depth == 0:  # before the document: blanks, then "{" or "["
                first = _NON_BLANK.search(data, pos)
                if first is None:
                    break
                if data[first.start()] not in _OPENERS:
                    self._json_state = _NOT_JSON  # a scalar, or text that is not JSON
                    return
                depth, pos = 1, first.end()
                continue
            match = _JSON_STRUCTURE.search(data, pos)
            if match is None:
                break
            char, pos = data[match.start()], match.end()
            if char == _QUOTE:
                in_string = True
            elif char in _OPENERS:
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    self._json_state = _CLOSED
                    self._terminal_found = True
                    return
        self._json_depth, self._json_in_string = depth, in_string

    def _scan_lines(self, data: bytes) -> None:
        """Account for the lines this chunk completes. Runs before the chunk joins the tail."""
        first_nl = data.find(b"\n")
        if first_nl == -1:
            if len(self._line_head) < _LINE_HEAD:
                self._line_head += data[: _LINE_HEAD - len(self._line_head)]
            self._line_len += len(data)
            return
        self._finish_first_line(data, first_nl)
        last_nl = data.rfind(b"\n")
        if last_nl > first_nl:
            self._scan_region(data, first_nl + 1, last_nl + 1)
        rest = len(data) - last_nl - 1
        self._line_head = data[last_nl + 1 : last_nl + 1 + _LINE_HEAD]
        self._line_len = rest

    def _finish_first_line(self, data: bytes, first_nl: int) -> None:
        """The line in progress ends in this chunk: its start is in the tail, its end in data."""
        carried = self._line_len
        length = carried + first_nl + 1
        if length <= LINE_LIMIT:
            line = data[: first_nl + 1]
            if carried:
                line = bytes(self._tail[len(self._tail) - carried :]) + line
            self._scan_region(line, 0, len(line))
            return
        # A long line: an SSE field name from its head, an NDJSON done key from its end.
        if self._mode == _SSE:
            head = (self._line_head + data[:_LINE_HEAD])[:_LINE_HEAD]
            if head.startswith(b"data:"):
                self._events += 1
        elif not self._terminal_found:
            keep = LINE_LIMIT - (first_nl + 1)
            if keep > 0:
                suffix = bytes(self._tail[len(self._tail) - keep :]) + data[: first_nl + 1]
            else:
                suffix = data[first_nl + 1 - LINE_LIMIT : first_nl + 1]
            if _ndjson_done_in(suffix, 0, len(suffix)):
                self._terminal_found = True

    def _scan_region(self, buf: bytes, start: int, end: int) -> None:
        """``buf[start:end]`` is whole lines, ``start`` at a line start, ``end`` after a newline."""
        if self._mode == _SSE:
            events = _sse_data_lines(buf, start, end)
            if events:
                events -= _sse_done_lines(buf, start, end)
                self._events += events
            if not self._terminal_found and _sse_marker_in(buf, start, end, self._markers):
                self._terminal_found = True
        else:
            self._events += buf.count(_NDJSON_EVENT_COMPACT, start, end)
            self._events += buf.count(_NDJSON_EVENT_SPACED, start, end)
            if not self._terminal_found and _ndjson_done_in(buf, start, end):
                self._terminal_found = True

    # -- reading --------------------------------------------------------------------------

    @property
    def events_seen(self) -> int:
        """Stream events counted so far (see the module docstring); 0 for a JSON document."""
        return self._events

    @property
    def terminal_seen(self) -> bool:
        """Whether the body's terminal frame has arrived (design 6). Sticky once true."""
        if self._terminal_found:
            return True
        if self._cache is not None and self._cache[0] == self.bytes_seen:
            return self._cache[1]
        if self._mode == _JSON:
            return False  # set by _track_json the moment the document closes
        seen = self._last_line_is_terminal()
        self._cache = (self.bytes_seen, seen)
        return seen

    def _last_line_is_terminal(self) -> bool:
        """Judge the line in progress (no newline yet) as if it were complete."""
        length = self._line_len
        if not length:
            return False
        tail = self._tail
        if self._mode == _SSE:
            if length > _MARKER_LINE_MAX:
                return False
            line = bytes(tail[len(tail) - length :])
            return bool(_sse_marker_in(line, 0, len(line), self._markers))
        keep = min(length, LINE_LIMIT)
        line = bytes(tail[len(tail) - keep :])
        return _ndjson_done_in(line, 0, len(line))

    def measure(
        self, *, admitted_at: float, first_byte_at: float | None, ended_at: float
    ) -> dict[str, Any] | None:
        """The ``stats`` block of the terminal workload event, or ``None`` if nothing was measured.

        Times are seconds on one clock: ``admitted_at`` the workload's admission,
        ``first_byte_at`` the first body byte (``None`` if there was none), ``ended_at`` the end.
        """
        figures = _read_figures(self._tail) if self.bytes_seen else _Figures()
        completion = figures.completion
        estimated = False
        if completion is None and self._events:
            completion = self._events
            estimated = True
        if completion is None and figures.prompt is None:
            return None
        stats: dict[str, Any] = {}
        if figures.prompt is not None:
            stats["promptTokens"] = figures.prompt
        if completion is not None:
            stats["completionTokens"] = completion
        rate = None if estimated else figures.rate
        if rate is None and completion is not None and first_byte_at is not None:
            elapsed = ended_at - first_byte_at
            if elapsed > 0:
                rate = completion / elapsed
        if rate is not None:
            stats["tokensPerSecond"] = round(rate, 1)
        if first_byte_at is not None:
            stats["ttftMs"] = max(0, round((first_byte_at - admitted_at) * 1000))
        if estimated:
            stats["estimated"] = True
        return stats
