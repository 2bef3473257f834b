"""Terminal frames: has a response body's terminal frame arrived
(docs/references.md#terminal-frames)?

A :class:`FrameReader` sees every relayed chunk of one body and keeps its last
:data:`TAIL_LIMIT` bytes (the tail that :mod:`nvpair_proxy.body.tokens` reads figures from), the
first few bytes of the line in progress, and a handful of counters. It answers
:attr:`FrameReader.terminal_seen`: a client that closes after the terminal frame is
``completed``, not ``cancelled``; and :attr:`FrameReader.events_seen`, the stream events that
an estimated completion count falls back on.

This module imports nothing of Twisted (engines.py takes the rule names from here) and logs
nothing; a reader's ``repr`` never shows body bytes (docs/references.md#no-content-logging).

Framing
-------
The framing comes from the ``Content-Type`` when it names one, else from the route's terminal
rule (the ``terminal`` field of the engine file, one of :data:`TERMINAL_FRAMES`):

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
  or array has closed. The reader follows the nesting depth (string- and escape-aware, a
  C-level search per string or bracket), so this holds for a document of any size; a top-level
  scalar or a body that does not start as JSON never counts. The depth is followed lazily: over
  the bytes still in the tail when ``terminal_seen`` is asked, and over bytes about to leave
  the tail before they leave it; a document that fits in the tail and is never asked about
  costs nothing per chunk.

``terminal_seen`` is sticky: once a terminal frame has arrived it stays true even if more
frames follow, because what docs/references.md#terminal-frames asks is whether it *arrived* before
the client left. (The one exception is the incomplete last line, which is judged as it stands each
time: a line that reads ``data: [DONE]`` but then continues was never a terminal frame.)

Stream events: an SSE ``data:`` line other than ``[DONE]``, or an NDJSON line reporting
``"done":false`` (Ollama's per-token frame; blank lines and ``{"error": ...}`` lines are not
events). A JSON document has none.

Cost per chunk: the chunk joins the tail (one bounded append, no other copy), and nothing
else. Lines are read lazily, like a JSON document's depth: when ``events_seen`` or
``terminal_seen`` is asked, and before unread bytes would leave the tail. Then the lines the
unread bytes complete are searched where they lie in the tail, once, with a few C-level
searches for all of them; nothing is re-scanned. A stream that fits in the tail is read once,
at its end, instead of once per token. A chunk that with its line in progress outgrows the
tail is scanned where it lies instead.
"""

from __future__ import annotations

import json
import re

from ..core.memo import Memo

__all__ = [
    "FrameReader",
    "LINE_LIMIT",
    "TAIL_LIMIT",
    "TERMINAL_FRAMES",
    "TERMINAL_NDJSON_DONE",
    "TERMINAL_SSE_DONE",
    "TERMINAL_SSE_MESSAGE_STOP",
    "TERMINAL_SSE_RESPONSE_COMPLETED",
]

TERMINAL_SSE_DONE = "sse-done"
TERMINAL_SSE_MESSAGE_STOP = "sse-message-stop"
TERMINAL_SSE_RESPONSE_COMPLETED = "sse-response-completed"
TERMINAL_NDJSON_DONE = "ndjson-done"
SSE_TERMINALS = (TERMINAL_SSE_DONE, TERMINAL_SSE_MESSAGE_STOP, TERMINAL_SSE_RESPONSE_COMPLETED)
#: Every terminal frame rule an engine file may name (the one list: engines.py validates by it).
TERMINAL_FRAMES = (*SSE_TERMINALS, TERMINAL_NDJSON_DONE)

#: The most body bytes a reader keeps (the tail every stats figure is read from).
TAIL_LIMIT = 64 * 1024
#: A line longer than this is "long": it cannot be an SSE marker, and an NDJSON ``done`` key is
#: only looked for in its last ``LINE_LIMIT`` bytes. Whether a long NDJSON line counts as a
#: stream event depends on where the reads split it (its start may have left the tail);
#: no engine sends an event line that long. It must not exceed ``TAIL_LIMIT``, because
#: the line in progress is read back from the tail.
LINE_LIMIT = TAIL_LIMIT
#: How much of the line in progress is kept aside, so a long SSE line's field name is known.
_LINE_HEAD = 16
#: A line this short or shorter may be an SSE marker (``data: [DONE]`` with blanks and ``\r``).
_MARKER_LINE_MAX = 64

_SSE, _NDJSON, _JSON = "sse", "ndjson", "json"

_SSE_TYPES = frozenset({"text/event-stream"})
_NDJSON_TYPES = frozenset(
    {
        "application/x-ndjson",
        "application/ndjson",
        "application/jsonl",
        "application/x-jsonl",
        "application/jsonlines",
        "application/x-jsonlines",
    }
)

# Bytes patterns, run over the tail or a chunk with pos/endpos, so nothing is copied.
# MULTILINE: "^" matches at a line start, "$" before a "\n" (or at endpos).
_SSE_DONE = re.compile(rb"^data: ?\[DONE\][ \t]*\r?$", re.MULTILINE)
_SSE_STOP = re.compile(rb"^event: ?message_stop[ \t]*\r?$", re.MULTILINE)
_SSE_COMPLETED = re.compile(rb"^event: ?response\.completed[ \t]*\r?$", re.MULTILINE)
_DONE_LITERAL = b"[DONE]"
# Each rule's marker: a literal to find first (a C search), then the line pattern.
_MARKERS = {
    TERMINAL_SSE_DONE: (_DONE_LITERAL, _SSE_DONE),
    TERMINAL_SSE_MESSAGE_STOP: (b"message_stop", _SSE_STOP),
    TERMINAL_SSE_RESPONSE_COMPLETED: (b"response.completed", _SSE_COMPLETED),
}
_NDJSON_DONE_TRUE = re.compile(rb'"done"[ \t]*:[ \t]*true')
_NDJSON_EVENT_COMPACT = b'"done":false'  # what Go's encoding/json (Ollama) writes
_NDJSON_EVENT_SPACED = b'"done": false'  # what Python's json.dumps writes
_NON_BLANK = re.compile(rb"[^ \t\r\n]")
# A JSON document's structure: the next quote or bracket outside a string, and the rest of a
# string (up to, not including, its closing quote or a backslash that ends the region).
_JSON_STRUCTURE = re.compile(rb'["{}\[\]]')
_JSON_STRING_BODY = re.compile(rb'(?:[^"\\]+|\\.)*', re.DOTALL)
_QUOTE, _OPENERS = 0x22, (0x7B, 0x5B)
# JSON document tracking states.
_TRACKING, _CLOSED, _NOT_JSON = "tracking", "closed", "not-json"

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
    if terminal in SSE_TERMINALS:
        return _SSE, True
    if terminal == TERMINAL_NDJSON_DONE:
        return _NDJSON, False
    return _JSON, False


# How each (rule, Content-Type) pair is read: a response's reading is made once per pair, not
# per response. Engines send a handful of types; the bound keeps a hostile one from growing it.
_READINGS: Memo[tuple, tuple[str, bool, tuple]] = Memo(64)


def _reading(
    terminal: str | None, content_type: str | bytes | None
) -> tuple[str, bool, tuple[tuple[bytes, re.Pattern[bytes]], ...]]:
    """The framing, whether to sniff for a JSON document, and the SSE markers to look for."""
    if isinstance(content_type, bytearray):
        content_type = bytes(content_type)
    key = (terminal, content_type)
    reading = _READINGS.get(key)
    if reading is None:
        if terminal is not None and terminal not in TERMINAL_FRAMES:
            raise ValueError(f"unknown terminal frame rule {terminal!r}")
        framing, sniff = _framing(terminal, content_type)
        rules = (terminal,) if terminal in SSE_TERMINALS else SSE_TERMINALS
        reading = _READINGS.remember(key, (framing, sniff, tuple(_MARKERS[rule] for rule in rules)))
    return reading


def _top_level_done(text: str) -> bool:
    """Whether ``text``, a ``"done"`` key's opening quote to the line end, is the rest of an
    object with top-level ``done`` true.

    ``"{"`` is put in front, so this succeeds only when the key sits at the top level of the
    object that the line closes last.
    """
    fragment = "{" + text
    try:
        value, stop = _DECODER.raw_decode(fragment)
    except (ValueError, RecursionError):
        return False
    if fragment[stop:].strip():
        return False
    return isinstance(value, dict) and value.get("done") is True


def _marker_lines(
    buf: bytes | bytearray,
    literal: bytes,
    pattern: re.Pattern[bytes],
    start: int,
    end: int,
    first_only: bool,
) -> int:
    """How many lines of ``buf[start:end]`` (whole lines, ``start`` at a line start) are
    ``pattern``'s marker line; with ``first_only``, 1 at the first.

    The pattern is tried only at the start of a line that holds ``literal``: a line-anchored
    pattern searched over a whole region is tried at every byte of it, which over a stream
    read at its end cost more than the rest of its reading.
    """
    found = 0
    at = buf.find(literal, start, end)
    while at != -1:
        line_start = buf.rfind(b"\n", start, at) + 1 or start
        if pattern.match(buf, line_start, end) is not None:
            found += 1
            if first_only:
                return found
        line_end = buf.find(b"\n", at, end)
        if line_end == -1:
            break
        at = buf.find(literal, line_end + 1, end)
    return found


def _ndjson_done_in(buf: bytes | bytearray, start: int, end: int) -> bool:
    """Whether a line of ``buf[start:end]`` (whole lines) is an object with top-level done=true."""
    for match in _NDJSON_DONE_TRUE.finditer(buf, start, end):
        eol = buf.find(b"\n", match.end(), end)
        if eol == -1:
            eol = end
        if _top_level_done(buf[match.start() : eol].decode("utf-8", "replace")):
            return True
    return False


class FrameReader:
    """Follow one body's framing as it goes by: its terminal frame and its stream events.

    ``terminal`` is the route's terminal frame rule from the engine file (one of
    :data:`TERMINAL_FRAMES`) or ``None``; ``content_type`` is the response's ``Content-Type``
    (``str`` or ``bytes``), which wins over the rule when it names a framing.

    Memory: ``TAIL_LIMIT`` body bytes at most (plus a 16-byte line head), in :attr:`tail`.
    """

    __slots__ = (
        "terminal",
        "tail",
        "bytes_seen",
        "_events",
        "_mode",
        "_sniff",
        "_markers",
        "_terminal_found",
        "_line_head",
        "_line_len",
        "_pending",
        "_cache",
        "_json_state",
        "_json_depth",
        "_json_in_string",
        "_json_escape",
        "_json_seen",
    )

    def __init__(self, terminal: str | None, content_type: str | bytes | None = None) -> None:
        framing, sniff, markers = _reading(terminal, content_type)
        self.terminal = terminal
        #: The last ``TAIL_LIMIT`` body bytes (never logged: docs/references.md#no-content-logging).
        self.tail = bytearray()
        #: Body bytes fed so far.
        self.bytes_seen = 0
        self._events = 0
        # Bytes at the end of the tail that joined it without being read yet: lines are read
        # when asked about, or before they would leave the tail.
        self._pending = 0
        self._mode = framing
        self._sniff = sniff
        self._markers = markers
        self._terminal_found = False
        self._line_head = b""
        self._line_len = 0
        self._cache: tuple[int, bool] | None = None
        self._json_state = _TRACKING
        self._json_depth = 0
        self._json_in_string = False
        self._json_escape = False
        #: Body bytes the JSON document tracker has read (it reads lazily).
        self._json_seen = 0

    def __repr__(self) -> str:
        return (
            f"<FrameReader terminal={self.terminal!r} mode={self._mode!r} "
            f"bytes_seen={self.bytes_seen} events_seen={self.events_seen} "
            f"terminal_found={self._terminal_found}>"
        )

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
                    self._pending = 0  # blanks: no line of them is an event or a marker
                    self._json_seen = self.bytes_seen  # what came before was blank
        size = len(data)
        if self._mode == _JSON:
            self._feed_json(data)
        elif self._line_len + self._pending + size <= TAIL_LIMIT:
            # The common case: the chunk joins the tail, read later with those before it.
            tail = self.tail
            tail += data
            excess = len(tail) - TAIL_LIMIT
            if excess > 0:
                del tail[:excess]  # never an unread byte, nor the line in progress
            self._pending += size
        else:
            self._read_pending()
            if self._line_len + size <= TAIL_LIMIT:
                self._feed_lines(data)
            else:  # the chunk and its line in progress outgrow the tail: read it where it lies
                self._scan_lines(data)
                self._keep_tail(data)
        self.bytes_seen += size

    def _keep_tail(self, data: bytes) -> None:
        tail = self.tail
        if len(data) >= TAIL_LIMIT:
            tail[:] = data[-TAIL_LIMIT:]
            return
        tail += data
        excess = len(tail) - TAIL_LIMIT
        if excess > 0:
            del tail[:excess]  # CPython moves the start of a bytearray: no copy

    def _read_pending(self) -> None:
        """Read the lines that the bytes fed since the last read complete, where they lie in
        the tail, as :meth:`_feed_lines` reads a chunk: the same answer however the bytes
        were split, with one pass for many chunks."""
        pending = self._pending
        if not pending:
            return
        self._pending = 0
        tail = self.tail
        start = len(tail) - pending
        last_nl = tail.rfind(b"\n", start)
        if last_nl == -1:
            if len(self._line_head) < _LINE_HEAD:
                self._line_head += bytes(tail[start : start + _LINE_HEAD - len(self._line_head)])
            self._line_len += pending
            return
        self._scan_region(tail, start - self._line_len, last_nl + 1)
        rest = len(tail) - last_nl - 1
        self._line_head = bytes(tail[last_nl + 1 : last_nl + 1 + _LINE_HEAD]) if rest else b""
        self._line_len = rest

    def _feed_lines(self, data: bytes) -> None:
        """The common case: the line in progress and the chunk both fit in the tail.

        The chunk joins the tail first; then the lines it completes, from the start of the
        line in progress to its last newline, are scanned where they lie in the tail.
        """
        tail = self.tail
        tail += data
        excess = len(tail) - TAIL_LIMIT
        if excess > 0:
            del tail[:excess]
        last_nl = data.rfind(b"\n")
        if last_nl == -1:
            if len(self._line_head) < _LINE_HEAD:
                self._line_head += data[: _LINE_HEAD - len(self._line_head)]
            self._line_len += len(data)
            return
        rest = len(data) - last_nl - 1
        end = len(tail) - rest
        self._scan_region(tail, end - last_nl - 1 - self._line_len, end)
        self._line_head = data[last_nl + 1 : last_nl + 1 + _LINE_HEAD] if rest else b""
        self._line_len = rest

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
                line = bytes(self.tail[len(self.tail) - carried :]) + line
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
                suffix = bytes(self.tail[len(self.tail) - keep :]) + data[: first_nl + 1]
            else:
                suffix = data[first_nl + 1 - LINE_LIMIT : first_nl + 1]
            if _ndjson_done_in(suffix, 0, len(suffix)):
                self._terminal_found = True

    def _scan_region(self, buf: bytes | bytearray, start: int, end: int) -> None:
        """``buf[start:end]`` is whole lines, ``start`` at a line start, ``end`` after a newline."""
        if self._mode == _SSE:
            events = buf.count(b"\ndata:", start, end)
            if buf.startswith(b"data:", start, end):
                events += 1
            if events:
                events -= _marker_lines(buf, _DONE_LITERAL, _SSE_DONE, start, end, False)
            self._events += events
            if not self._terminal_found:
                for literal, pattern in self._markers:  # _marker_in, inlined
                    if _marker_lines(buf, literal, pattern, start, end, True):
                        self._terminal_found = True
                        break
        else:
            self._events += buf.count(_NDJSON_EVENT_COMPACT, start, end) + buf.count(
                _NDJSON_EVENT_SPACED, start, end
            )
            if not self._terminal_found and _ndjson_done_in(buf, start, end):
                self._terminal_found = True

    def _marker_in(self, buf: bytes | bytearray, start: int, end: int) -> bool:
        """Whether a line of ``buf[start:end]`` (whole lines) is one of the route's markers."""
        return any(
            _marker_lines(buf, literal, pattern, start, end, True)
            for literal, pattern in self._markers
        )

    # -- a JSON document ------------------------------------------------------------------

    def _feed_json(self, data: bytes) -> None:
        if self._json_state == _TRACKING and len(self.tail) + len(data) > TAIL_LIMIT:
            # Bytes are about to leave the tail: the tracker reads them first.
            self._catch_up()
            if self._json_state == _TRACKING:
                self._track_json(data, 0, len(data))
            self._json_seen = self.bytes_seen + len(data)
        self._keep_tail(data)

    def _catch_up(self) -> None:
        """Let the JSON tracker read the bytes fed so far that it has not read yet."""
        tail = self.tail
        start = self._json_seen - (self.bytes_seen - len(tail))
        if start < len(tail):
            self._track_json(tail, start, len(tail))
        self._json_seen = self.bytes_seen

    def _track_json(self, buf: bytes | bytearray, pos: int, size: int) -> None:
        """Follow a JSON document's nesting over ``buf[pos:size]`` until its top-level object or
        array closes."""
        depth, in_string = self._json_depth, self._json_in_string
        if self._json_escape:  # the last region ended on a backslash inside a string
            self._json_escape = False
            pos += 1
        while pos < size:
            if in_string:
                body = _JSON_STRING_BODY.match(buf, pos, size)
                assert body is not None  # the pattern matches the empty string too
                end = body.end()
                if end >= size:
                    break
                if buf[end] == _QUOTE:
                    in_string = False
                    pos = end + 1
                else:  # a backslash as the region's last byte
                    self._json_escape = True
                    break
                continue
            if depth == 0:  # before the document: blanks, then "{" or "["
                first = _NON_BLANK.search(buf, pos, size)
                if first is None:
                    break
                if buf[first.start()] not in _OPENERS:
                    self._json_state = _NOT_JSON  # a scalar, or text that is not JSON
                    return
                depth, pos = 1, first.end()
                continue
            match = _JSON_STRUCTURE.search(buf, pos, size)
            if match is None:
                break
            char, pos = buf[match.start()], match.end()
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

    # -- reading --------------------------------------------------------------------------

    @property
    def events_seen(self) -> int:
        """Stream events counted so far (see the module docstring); 0 for a JSON document."""
        self._read_pending()
        return self._events

    @property
    def terminal_seen(self) -> bool:
        """Whether the body's terminal frame has arrived (docs/references.md#terminal-frames).
        Sticky once true."""
        if self._pending:
            self._read_pending()
        if self._terminal_found:
            return True
        if self._mode == _JSON:
            if self._json_state == _TRACKING:
                self._catch_up()
            return self._terminal_found
        if self._cache is not None and self._cache[0] == self.bytes_seen:
            return self._cache[1]
        seen = self._last_line_is_terminal()
        self._cache = (self.bytes_seen, seen)
        return seen

    def _last_line_is_terminal(self) -> bool:
        """Judge the line in progress (no newline yet) as if it were complete."""
        length = self._line_len
        if not length:
            return False
        tail = self.tail
        if self._mode == _SSE:
            if length > _MARKER_LINE_MAX:
                return False
            line = bytes(tail[len(tail) - length :])
            return self._marker_in(line, 0, len(line))
        keep = min(length, LINE_LIMIT)
        line = bytes(tail[len(tail) - keep :])
        return _ndjson_done_in(line, 0, len(line))
