"""Token figures: the ``stats`` block of a workload, read from the tail of its body
(docs/references.md#stats-sources).

:func:`measure` reads once, when the response ends, from the bounded tail that
:class:`nvpair_proxy.body.frames.FrameReader` kept, plus its count of stream events. Reading the
tail of a body is allowed; logging it is not (docs/references.md#no-content-logging): this module
logs nothing.

:class:`BodyObserver` is what the proxy hands every relayed chunk to: a frame reader (the
terminal frame and the bounded tail, :mod:`nvpair_proxy.body.frames`) whose tail is measured here
when the response ends. It never keeps the body, only the last
:data:`~nvpair_proxy.body.frames.TAIL_LIMIT` bytes at most, and its ``repr`` never shows body bytes.

* ``completionTokens``: OpenAI ``usage.completion_tokens``, else Anthropic and OpenAI Responses
  ``usage.output_tokens``, else Ollama ``eval_count``, else llama.cpp ``timings.predicted_n``,
  else llama.cpp ``tokens_predicted``; failing all of them, the number of stream events counted
  while the body went by, with ``"estimated": True``.
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
* ``tokensPerSecond``: the engine's own decode rate when it reports one
  (docs/references.md#engine-decode-rate): Ollama ``eval_count / (eval_duration / 1e9)``, llama.cpp
  ``timings.predicted_per_second``; else completion tokens over first body byte to end. Rounded to
  one decimal; omitted when neither is available (no first byte, or a zero interval).
* ``ttftMs``: ``round((first_byte_at - admitted_at) * 1000)``, omitted without a first byte.
* ``estimated``: present, and ``True``, only for a counted completion figure.

When several objects carry the same figure (an OpenAI stream sends ``"usage": null`` in every
chunk and the real object last; Anthropic's ``message_start`` and ``message_delta`` both carry
``usage``), the last one in the body wins, field by field. Keys are matched only where their
quotes are unescaped, so a figure quoted in generated text is never read. :func:`measure`
returns ``None`` when no token figure was found at all (an error body, an empty body, a stream
with no events).

Cost: the tail is decoded once; each key is found from the end backwards with a C-level
substring search and its pattern is tried only where the key is, so a key that is absent costs
one search and a present one is read at its last occurrence; the search stops as soon as the
remaining occurrences can no longer change the answer.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterator

import attrs

from .frames import FrameReader

__all__ = ["BodyObserver", "Figures", "measure", "read_figures"]

# Text patterns, tried where their key's literal occurs in the decoded tail. A key matches only
# with its own, unescaped quotes: quoted inside a JSON string it reads \"key\" and never matches.
_USAGE = re.compile(r'"usage"\s*:\s*(?=\{)')
_TIMINGS = re.compile(r'"timings"\s*:\s*(?=\{)')


def _int_key(name: str) -> tuple[str, re.Pattern[str]]:
    return '"%s"' % name, re.compile(r'"%s"\s*:\s*(\d+)(?![\d.eE])' % re.escape(name))


_PROMPT_EVAL_COUNT = _int_key("prompt_eval_count")
_PROMPT_EVAL_CACHED_COUNT = _int_key("prompt_eval_cached_count")
_EVAL_COUNT = _int_key("eval_count")
_EVAL_DURATION = _int_key("eval_duration")
_PROMPT_EVAL_DURATION = _int_key("prompt_eval_duration")
_TOKENS_PREDICTED = _int_key("tokens_predicted")
_TOKENS_EVALUATED = _int_key("tokens_evaluated")

_DECODER = json.JSONDecoder()


def _matches_backwards(
    literal: str, pattern: re.Pattern[str], text: str
) -> Iterator[re.Match[str]]:
    """The matches of ``pattern`` in ``text``, last first; each starts with ``literal``.

    The same matches as ``finditer`` would give: a match holds a quote only in its literal,
    so no two overlap, and each one is found by trying the pattern where the literal occurs.
    """
    end = len(text)
    overlap = len(literal) - 1  # an earlier occurrence may share the closing quote
    while (at := text.rfind(literal, 0, end)) != -1:
        match = pattern.match(text, at)
        if match is not None:
            yield match
        end = at + overlap


def _last_int(key: tuple[str, re.Pattern[str]], text: str) -> int | None:
    match = next(_matches_backwards(*key, text), None)
    if match is None:
        return None
    value = match.group(1)
    if len(value) > 18:
        return None  # no real count: never a number that overflows the arithmetic
    return int(value)


def _objects(
    literal: str, pattern: re.Pattern[str], text: str
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects after each match of ``pattern`` with the match's offset, last first.

    Unparsable ones (cut by the tail's start or a truncated end) are skipped.
    """
    for match in _matches_backwards(literal, pattern, text):
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
class Figures:
    """What the engine itself reported, as read from the tail."""

    prompt: int | None = None
    completion: int | None = None
    rate: float | None = None
    #: Prompt tokens the engine processed per second (llama.cpp ``prompt_per_second``, Ollama
    #: the tokens it read over ``prompt_eval_duration``): what placement weighs a re-read by.
    prompt_rate: float | None = None
    #: Prompt tokens the engine read for this request (llama.cpp ``timings.prompt_n``, Ollama
    #: ``prompt_eval_count`` less ``prompt_eval_cached_count`` where it says it): fewer than
    #: the prompt's when it reused a cache.
    prompt_read: int | None = None
    #: The whole prompt's tokens, cached ones included: ``usage``, else llama.cpp
    #: ``prompt_n + cache_n``, else the count ``prompt`` reads. Placement weighs a body's bytes
    #: by it; ``promptTokens`` keeps the wire's reading (``prompt``).
    prompt_seen: int | None = None
    #: Prompt tokens the engine took from its cache instead of reading (llama.cpp
    #: ``timings.cache_n``, Anthropic Messages ``usage.cache_read_input_tokens``, which
    #: llama.cpp's ``/v1/messages`` reports in ``message_start``, Ollama
    #: ``prompt_eval_cached_count``, OpenAI-style ``usage.prompt_tokens_details.cached_tokens``
    #: or ``usage.input_tokens_details.cached_tokens``); None when it does not say, which is
    #: never "none cached".
    prompt_cached: int | None = None
    #: Seconds the engine itself says it spent reading the prompt (llama.cpp
    #: ``timings.prompt_ms``, Ollama ``prompt_eval_duration``): what the operator's cache
    #: truth estimates an engine's reuse from when it does not say (docs/operations.md#cache-truth).
    prompt_seconds: float | None = None


_USAGE_KEYS = (
    "prompt_tokens",
    "completion_tokens",
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)
#: Where OpenAI-style usage says how much of the prompt came from the cache
#: (``cached_tokens``, counted in ``prompt_tokens`` or ``input_tokens``): Chat Completions,
#: then Responses. Ollama's ``/v1`` routes say it; LM Studio's do not (yet).
_DETAILS = ("prompt_tokens_details", "input_tokens_details")
#: The usage keys that give the whole prompt: Chat Completions', then Responses'.
_WHOLE_KEYS = ("prompt_tokens", "input_tokens")
_TIMINGS_KEYS = (
    "prompt_n",
    "predicted_n",
    "predicted_per_second",
    "prompt_per_second",
    "cache_n",
    "prompt_ms",
)


def _details_cached(usage: dict) -> int | None:
    """The ``cached_tokens`` an OpenAI-style usage object says of its prompt, or None."""
    for details in _DETAILS:
        if isinstance(part := usage.get(details), dict):
            if (value := _count(part.get("cached_tokens"))) is not None:
                return value
    return None


def read_figures(tail: bytes | bytearray) -> Figures:
    """The figures the engine reported in ``tail``, the last one of each winning."""
    text = tail.decode("utf-8", "replace")

    usage: dict[str, int] = {}
    # The cached count said beside each whole-prompt key, from the same object only: an
    # earlier answer's details never describe a later object's prompt.
    cached_beside: dict[str, int | None] = {}
    for at, obj in _objects('"usage"', _USAGE, text):
        line = text[text.rfind("\n", 0, at) + 1 : at]
        # Anthropic's message_start reports output_tokens 1 before anything is generated.
        opening = '"message_start"' in line
        for key in _USAGE_KEYS:
            if opening and key == "output_tokens":
                continue
            if key not in usage and (value := _count(obj.get(key))) is not None:
                usage[key] = value
                if key in _WHOLE_KEYS:
                    cached_beside[key] = _details_cached(obj)
        # prompt_tokens and completion_tokens come first wherever they are read: once both
        # are known, earlier objects can change nothing.
        if len(usage) == len(_USAGE_KEYS) or (
            "prompt_tokens" in usage and "completion_tokens" in usage
        ):
            break

    timings: dict[str, Any] = {}
    for _, obj in _objects('"timings"', _TIMINGS, text):
        for key in _TIMINGS_KEYS:
            if key not in timings and key in obj:
                timings[key] = obj[key]
        if len(timings) == len(_TIMINGS_KEYS):
            break

    eval_count = _last_int(_EVAL_COUNT, text)

    completion = usage.get("completion_tokens")
    if completion is None:
        completion = usage.get("output_tokens")
    if completion is None:
        completion = eval_count
    if completion is None:
        completion = _count(timings.get("predicted_n"))
    if completion is None:
        completion = _last_int(_TOKENS_PREDICTED, text)

    # Each is read once: Ollama's count serves the prompt, its rate and what was read.
    evaluated = _last_int(_PROMPT_EVAL_COUNT, text)
    # An Ollama that says what its cache gave (prompt_eval_cached_count) counts it in
    # prompt_eval_count, the logical prompt: what it read is the difference.
    # More cached than the whole is a body at odds with itself: then the cache is unknown.
    ollama_cached = None
    ollama_read = evaluated
    if evaluated is not None and (said := _last_int(_PROMPT_EVAL_CACHED_COUNT, text)) is not None:
        if said <= evaluated:
            ollama_cached, ollama_read = said, evaluated - said
    prompt_n = _count(timings.get("prompt_n"))
    whole_key = "prompt_tokens" if "prompt_tokens" in usage else "input_tokens"
    whole = usage.get(whole_key)

    prompt = whole
    if prompt is None:
        prompt = evaluated
    if prompt is None:
        prompt = prompt_n
    if prompt is None:
        prompt = _last_int(_TOKENS_EVALUATED, text)

    rate = None
    if eval_count is not None and (eval_duration := _last_int(_EVAL_DURATION, text)):
        rate = eval_count / (eval_duration / 1e9)
    elif (per_second := _rate(timings.get("predicted_per_second"))) is not None:
        rate = per_second
    prompt_rate = _rate(timings.get("prompt_per_second"))
    prompt_seconds = None
    if (prompt_ms := _rate(timings.get("prompt_ms"))) is not None:
        prompt_seconds = prompt_ms / 1000
    elif evaluated is not None and (duration := _last_int(_PROMPT_EVAL_DURATION, text)) is not None:
        prompt_seconds = duration / 1e9
        if prompt_rate is None and ollama_read and duration:
            prompt_rate = ollama_read / prompt_seconds
    prompt_read = prompt_n if prompt_n is not None else ollama_read
    prompt_cached = _count(timings.get("cache_n"))
    prompt_seen: int | None
    cache_read = usage.get("cache_read_input_tokens")
    details_cached = cached_beside.get(whole_key)
    if prompt_n is None and cache_read is not None and "input_tokens" in usage:
        # Anthropic Messages (llama.cpp's /v1/messages says nothing in timings):
        # input_tokens are those read anew, beside what the cache gave and what it stored.
        prompt_read = usage["input_tokens"] + usage.get("cache_creation_input_tokens", 0)
        prompt_seen, prompt_cached = prompt_read + cache_read, cache_read
    elif prompt_n is None and whole is not None and details_cached is not None:
        # OpenAI-style usage: the whole prompt, of which cached_tokens came from the cache
        # (more than the whole is a body at odds with itself: then the cache is unknown).
        prompt_seen = whole
        if details_cached <= whole:
            prompt_cached, prompt_read = details_cached, whole - details_cached
    elif prompt_n is None and ollama_cached is not None:
        prompt_seen, prompt_cached = evaluated, ollama_cached
    elif whole is not None:
        prompt_seen = whole
    elif prompt_n is not None:
        prompt_seen = prompt_n + (prompt_cached or 0)
    else:
        prompt_seen = prompt
    return Figures(
        prompt=prompt,
        completion=completion,
        rate=rate,
        prompt_rate=prompt_rate,
        prompt_read=prompt_read,
        prompt_seen=prompt_seen,
        prompt_cached=prompt_cached,
        prompt_seconds=prompt_seconds,
    )


def measure(
    tail: bytes | bytearray,
    events: int,
    *,
    admitted_at: float,
    first_byte_at: float | None,
    ended_at: float,
    figures: Figures | None = None,
) -> dict[str, Any] | None:
    """The ``stats`` block of the terminal workload event, or ``None`` if nothing was measured.

    ``tail`` is the end of the body, ``events`` the stream events counted over all of it.
    Times are seconds on one clock: ``admitted_at`` the workload's admission,
    ``first_byte_at`` the first body byte (``None`` if there was none), ``ended_at`` the end.
    ``figures``: the tail already read, so a body's tail is parsed once whoever asks.
    """
    if figures is None:
        figures = read_figures(tail) if tail else Figures()
    completion = figures.completion
    estimated = False
    if completion is None and events:
        completion = events
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


class BodyObserver:
    """Watch a response body go by: its terminal frame and its stats, from a bounded tail.

    ``terminal`` is the route's terminal frame rule from the engine file (``sse-done``,
    ``sse-message-stop``, ``sse-response-completed``, ``ndjson-done``) or ``None``;
    ``content_type`` is the response's ``Content-Type`` (``str`` or ``bytes``), which wins over
    the rule when it names a framing. Unknown rules raise ``ValueError``.

    :meth:`feed` is the frame reader's own, bound once here, so a chunk costs no extra call.
    """

    def __init__(self, terminal: str | None, content_type: str | bytes | None = None) -> None:
        self._frames = FrameReader(terminal, content_type)
        self.terminal = terminal
        #: The tail's figures and how many body bytes had been seen when they were read: the
        #: stats, placement's rates and the cache truth all read one parse of an ended body.
        self._figures: tuple[int, Figures] | None = None
        self.feed = self._frames.feed  # type: ignore[method-assign]  # bound once: no extra call

    def __repr__(self) -> str:
        frames = self._frames
        return (
            f"<BodyObserver terminal={self.terminal!r} bytes_seen={frames.bytes_seen} "
            f"events_seen={frames.events_seen} terminal_seen={frames.terminal_seen}>"
        )

    def feed(self, data: bytes) -> None:  # replaced per instance by the reader's feed
        """Observe the next relayed chunk (split anywhere)."""
        self._frames.feed(data)

    @property
    def bytes_seen(self) -> int:
        """Body bytes fed so far."""
        return self._frames.bytes_seen

    @property
    def events_seen(self) -> int:
        """Stream events counted so far (see :mod:`nvpair_proxy.body.frames`); 0 for a JSON
        document."""
        return self._frames.events_seen

    @property
    def terminal_seen(self) -> bool:
        """Whether the body's terminal frame has arrived (docs/references.md#terminal-frames).
        Sticky once true."""
        return self._frames.terminal_seen

    def figures(self) -> Figures:
        """What the engine reported in the body's tail (placement reads its prompt rate),
        read once for as long as no byte arrives."""
        frames = self._frames
        read = self._figures
        if read is None or read[0] != frames.bytes_seen:
            tail = frames.tail
            read = self._figures = (frames.bytes_seen, read_figures(tail) if tail else Figures())
        return read[1]

    def measure(
        self, *, admitted_at: float, first_byte_at: float | None, ended_at: float
    ) -> dict[str, Any] | None:
        """The ``stats`` block of the terminal workload event, or ``None`` if nothing was measured.

        Times are seconds on one clock: ``admitted_at`` the workload's admission,
        ``first_byte_at`` the first body byte (``None`` if there was none), ``ended_at`` the end.
        """
        frames = self._frames
        return measure(
            frames.tail,
            frames.events_seen,
            admitted_at=admitted_at,
            first_byte_at=first_byte_at,
            ended_at=ended_at,
            figures=self.figures(),
        )
