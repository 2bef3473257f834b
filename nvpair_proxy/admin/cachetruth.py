"""Cache truth (docs/operations.md#cache-truth): how many prompt tokens each node's engine
took from its prompt cache and how many it read anew, by engine, node and source, from what
its completed answers said. It answers the operator's first question about a shared fleet,
whether the cache is helping, with the engines' own figures rather than our affinity's
guesses.

* ``exact``: the engine says what it reused (llama.cpp ``timings.cache_n`` beside
  ``prompt_n``, Anthropic Messages ``cache_read_input_tokens``, Ollama
  ``prompt_eval_cached_count``, OpenAI-style ``usage.*_tokens_details.cached_tokens``).
* ``estimated``: it does not (LM Studio, an Ollama that does not report its cache). Its
  answer gives the whole prompt's tokens,
  and its own prefill time (Ollama ``prompt_eval_duration``, llama.cpp ``prompt_ms``) or, for
  a stream, dispatch to the first body byte. The tokens read anew are taken as that time at
  the model's cold reading rate on that node (:class:`ColdRate`), capped by the prompt; the
  rest as reused. An answer with neither
  a prefill time nor a reuse figure is not counted at all: nothing is guessed from nothing.

Plain bookkeeping fed by the recorder at a request's end: no Twisted, no parse of its own
(the body's tail is read once, for the stats, and handed here).
"""

from __future__ import annotations

import math
from collections import Counter, deque

import attrs

from ..request.events import PromptUse

__all__ = ["CacheTruth", "ColdRate", "Split", "EXACT", "ESTIMATED", "MIXED", "SOURCES"]

EXACT, ESTIMATED = "exact", "estimated"
SOURCES = (EXACT, ESTIMATED)
#: A node whose engine's answers were counted both ways (``/status`` only: the counters
#: keep each source apart).
MIXED = "mixed"

#: Prompts shorter than this are counted as read in full when estimated, and teach the cold
#: rate nothing: their prefill is mostly the engine's fixed cost per request.
MIN_PROMPT_TOKENS = 64
#: The readings a cold rate is taken from: the last ones of that model on that node, so a
#: slow outlier is forgotten after this many more.
COLD_WINDOW = 16
#: Models kept apart per node and engine (on ``/status``, and each with its own cold rate);
#: the rest are summed as OTHER_MODELS, so what is kept stays bounded whatever names clients
#: send.
MODELS_PER_NODE = 16
OTHER_MODELS = "(other)"


@attrs.frozen
class Split:
    """One answer's prompt: tokens reused, tokens read anew, and how we know."""

    reused: int
    read: int
    source: str


@attrs.define
class ColdRate:
    """One model's prompt tokens per second on one node when nothing of the prompt is
    cached: the slowest of its last COLD_WINDOW readings (whole prompt over prefill time),
    since a cache hit reads as a fast prompt. Agents read a conversation from scratch once
    and hit it for many turns after, so one cold reading among many hits must set the rate;
    the price is that a reading slowed by something else (a model load inside a stream's
    first byte, an engine busy with other work) sets it too, until it leaves the window."""

    readings: deque = attrs.Factory(lambda: deque(maxlen=COLD_WINDOW))

    @property
    def rate(self) -> float | None:
        """None until a prompt long enough was read."""
        return min(self.readings) if self.readings else None

    def read(self, seen: int, prefill: float) -> int:
        """The tokens of a ``seen``-token prompt read anew in ``prefill`` seconds."""
        if seen < MIN_PROMPT_TOKENS or not prefill > 0:
            return seen
        apparent = seen / prefill
        if math.isfinite(apparent):
            self.readings.append(apparent)
        rate = self.rate
        return seen if rate is None else min(seen, round(prefill * rate))


@attrs.define
class CacheTruth:
    """The counts, per (engine, node, source), and per (engine, node) by model."""

    reused: Counter = attrs.Factory(Counter)
    read: Counter = attrs.Factory(Counter)
    #: (engine, node) -> model -> [reused, read]
    models: dict[tuple[str, str], dict[str, list[int]]] = attrs.Factory(dict)
    #: (engine, node, model) -> its cold rate; the models are those of ``models``.
    _cold: dict[tuple[str, str, str], ColdRate] = attrs.Factory(dict)
    #: Everything counted since start, nodes since forgotten included: what the history's
    #: intervals are measured from, so a node leaving never makes one shrink.
    _totals: list[int] = attrs.Factory(lambda: [0, 0])

    def observe(self, engine: str, node: str, model: str | None, use: PromptUse) -> Split | None:
        """A completed request's answer on ``node`` said ``use``; None when it cannot say
        what was reused (neither a reuse figure nor a prefill time)."""
        if use.cached is None and use.prefill is None:
            return None
        models = self.models.setdefault((engine, node), {})
        name = model or OTHER_MODELS
        if name not in models and len(models) >= MODELS_PER_NODE:
            name = OTHER_MODELS
        if use.cached is not None:
            cached = min(use.cached, use.seen)
            found = Split(cached, use.seen - cached, EXACT)
        else:
            assert use.prefill is not None
            cold = self._cold.get((engine, node, name))
            if cold is None:
                cold = self._cold[engine, node, name] = ColdRate()
            read = cold.read(use.seen, use.prefill)
            found = Split(use.seen - read, read, ESTIMATED)
        self.reused[engine, node, found.source] += found.reused
        self.read[engine, node, found.source] += found.read
        counts = models.setdefault(name, [0, 0])
        counts[0] += found.reused
        counts[1] += found.read
        self._totals[0] += found.reused
        self._totals[1] += found.read
        return found

    def totals(self) -> tuple[int, int]:
        """Every token reused and read since start (the history's share is their rise)."""
        return self._totals[0], self._totals[1]

    def engine_share(self, engine: str) -> float | None:
        """The share of prompt tokens ``engine``'s nodes reused, None before any said."""
        reused = sum(n for key, n in self.reused.items() if key[0] == engine)
        read = sum(n for key, n in self.read.items() if key[0] == engine)
        return share(reused, read)

    def node_status(self, engine: str, node: str) -> dict | None:
        """``/status``'s ``cache`` of one node's engine, None before its answers said."""
        models = self.models.get((engine, node))
        if models is None:
            return None
        sources = [s for s in SOURCES if (engine, node, s) in self.read]
        reused = sum(counts[0] for counts in models.values())
        read = sum(counts[1] for counts in models.values())
        return {
            "reused": reused,
            "read": read,
            "share": share(reused, read),
            "source": sources[0] if len(sources) == 1 else MIXED,
            "models": {
                name: {"reused": counts[0], "read": counts[1], "share": share(*counts)}
                for name, counts in sorted(models.items())
            },
        }

    def forget_nodes_except(self, keep: set[str]) -> None:
        """Drop the nodes no longer in the fleet (their labels stay bounded by it)."""
        tables: tuple[dict, ...] = (self.reused, self.read, self.models, self._cold)
        for table in tables:
            for key in [k for k in table if k[1] not in keep]:
                del table[key]


def share(reused: int, read: int) -> float | None:
    """Reused over all, to three places; None when no token was counted."""
    total = reused + read
    return round(reused / total, 3) if total else None
