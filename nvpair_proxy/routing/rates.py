"""What a node's recent requests say about it, for the spill rule of affinity
(docs/decisions.md#affinity): how long one request takes there, how much of that is not
reading its prompt, how fast its engine reads a prompt, how many bytes of a request body make
one prompt token, and when we last sent it one.

Each figure is a moving average, fed at most once a second per node (``RATE_READ_INTERVAL``)
from a completed response's tail, so its cost is O(nodes) a second, never a parse per request.
"""

from __future__ import annotations

import attrs

__all__ = [
    "BYTES_PER_TOKEN",
    "MIN_PROMPT_TOKENS",
    "NodeRates",
    "PromptReading",
    "RATE_READ_INTERVAL",
    "RATE_WEIGHT",
]

#: A request body's bytes per prompt token until a node has measured its own: about four
#: characters a token for English text and code, JSON quoting included. Other text (a
#: byte-level tokenizer, CJK, tool output) differs, which is why it is measured.
BYTES_PER_TOKEN = 4.0
#: How much each new observation moves a node's measured rates.
RATE_WEIGHT = 0.3
#: Seconds between two reads of a node's figures from a response's tail.
RATE_READ_INTERVAL = 1.0
#: The fewest prompt tokens a reading must cover to count: an engine's rate over a few tokens
#: (a cache hit that read only the new turn) is mostly its fixed cost per request, and a ratio
#: of bytes to a few tokens is mostly the body's JSON envelope.
MIN_PROMPT_TOKENS = 64


@attrs.frozen
class PromptReading:
    """One completed response's prompt figures, as its engine reported them."""

    #: Prompt tokens per second the engine reported (None: none).
    rate: float | None = None
    #: Tokens it read for this request (llama.cpp ``prompt_n``, Ollama ``prompt_eval_count``);
    #: None when it did not say, and then its rate is taken as it is.
    read: int | None = None
    #: Tokens of the whole prompt, cached ones included; None when unknown.
    seen: int | None = None
    #: The request body's bytes.
    size: int = 0


@attrs.define
class NodeRates:
    """A node's moving averages: seconds to serve one request (dispatch to end), the prompt
    tokens per second its engine reported, and request-body bytes per prompt token."""

    service: float | None = None
    prompt_rate: float | None = None
    bytes_per_token: float | None = None
    #: Seconds a request spends there beyond reading its prompt anew (generating, the
    #: engine's fixed cost): what a waiting turn that hits its cache costs besides its new
    #: tokens. None until a reading said how many tokens it read.
    tail: float | None = None
    #: When we last dispatched a request there (None: never): how far the request in its
    #: slot has come.
    dispatched_at: float | None = None
    #: When a response's tail was last read for these (None: never).
    rate_read_at: float | None = None

    def served(self, seconds: float) -> None:
        self.service = _moved(self.service, seconds)

    def rate_read(self, reading: PromptReading, now: float, seconds: float | None = None) -> None:
        """``seconds``: the request's time from dispatch to end, whose part beyond reading
        its prompt is the node's tail."""
        self.rate_read_at = now
        if reading.rate and (reading.read is None or reading.read >= MIN_PROMPT_TOKENS):
            self.prompt_rate = _moved(self.prompt_rate, reading.rate)
        if reading.rate and reading.read is not None and seconds is not None:
            self.tail = _moved(self.tail, max(0.0, seconds - reading.read / reading.rate))
        if reading.seen is not None and reading.seen >= MIN_PROMPT_TOKENS and reading.size > 0:
            self.bytes_per_token = _moved(self.bytes_per_token, reading.size / reading.seen)

    def tokens(self, size: int) -> float:
        """The prompt tokens a body of ``size`` bytes is expected to hold."""
        return size / (self.bytes_per_token or BYTES_PER_TOKEN)

    def residual(self, now: float, unseen: bool) -> float:
        """Seconds until its slot is expected to free: its time to serve one less how long
        our last dispatch there has run; the whole time to serve one when work we did not
        send holds it (``unseen``: its age is unknown). With several slots the last dispatch
        is the youngest, so this errs long. Only asked once ``service`` is measured."""
        service = self.service or 0.0
        if unseen or self.dispatched_at is None:
            return service
        return max(0.0, service - (now - self.dispatched_at))

    def cost(self, tokens: float) -> float:
        """Seconds a request that reads ``tokens`` anew is expected to hold a slot there: the
        tokens at its prompt rate, plus its tail (its whole time to serve one until a tail
        is measured). Only asked once ``prompt_rate`` and ``service`` are measured."""
        tail = self.tail if self.tail is not None else self.service or 0.0
        return tokens / (self.prompt_rate or 1.0) + tail


def _moved(average: float | None, value: float) -> float:
    return value if average is None else average + RATE_WEIGHT * (value - average)
