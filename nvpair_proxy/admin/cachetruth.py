"""Cache truth (docs/operations.md#cache-truth): how many prompt tokens each node's engine
took from its prompt cache and how many it read anew, by engine, node and source, from what
its completed answers said. It answers the operator's first question about a shared fleet,
whether the cache is helping, with the engines' own figures rather than our affinity's
guesses.

* ``exact``: the engine says what it reused (llama.cpp ``timings.cache_n`` beside
  ``prompt_n``, Anthropic Messages ``cache_read_input_tokens``).
* ``estimated``: it does not (Ollama, LM Studio). Its answer gives the whole prompt's tokens,
  and its own prefill time (Ollama ``prompt_eval_duration``) or, for a stream, dispatch to the
  first body byte. The tokens read anew are taken as that time at the node's cold reading
  rate (:class:`ColdRate`), capped by the prompt; the rest as reused. An answer with neither
  a prefill time nor a reuse figure is not counted at all: nothing is guessed from nothing.

Plain bookkeeping fed by the recorder at a request's end: no Twisted, no parse of its own
(the body's tail is read once, for the stats, and handed here).
"""

from __future__ import annotations

from collections import Counter

import attrs

from ..request.events import PromptUse

__all__ = ["CacheTruth", "ColdRate", "Split", "EXACT", "ESTIMATED", "SOURCES"]

EXACT, ESTIMATED = "exact", "estimated"
SOURCES = (EXACT, ESTIMATED)

#: Prompts shorter than this are counted as read in full when estimated, and teach the cold
#: rate nothing: their prefill is mostly the engine's fixed cost per request.
MIN_PROMPT_TOKENS = 64
#: How far a reading slower than the cold rate moves it down.
RATE_DOWN = 0.3
#: How far, at most, one faster reading moves it up: a cache hit reads as a very fast prompt,
#: so faster readings may only creep (which lets a rate dragged down by a slow outlier, a busy
#: engine, recover over a few dozen requests).
RATE_CREEP = 1.02
#: Models kept apart per node and engine on ``/status``; the rest are summed as OTHER_MODELS,
#: so what is kept stays bounded whatever names clients send.
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
    """A node's prompt tokens per second when nothing of the prompt is cached: the lower
    envelope of its whole prompts over their prefill times (a cache hit reads as fast, so
    only slower readings pull it freely). None until a prompt long enough was read."""

    rate: float | None = None

    def read(self, seen: int, prefill: float) -> int:
        """The tokens of a ``seen``-token prompt read anew in ``prefill`` seconds."""
        if seen < MIN_PROMPT_TOKENS or prefill <= 0:
            return seen
        apparent = seen / prefill
        if self.rate is None:
            self.rate = apparent
        elif apparent <= self.rate:
            self.rate += RATE_DOWN * (apparent - self.rate)
        else:
            self.rate = min(apparent, self.rate * RATE_CREEP)
        return min(seen, round(prefill * self.rate))


def split(use: PromptUse, cold: ColdRate) -> Split | None:
    """What ``use`` says was reused and read, None when it cannot say."""
    if use.cached is not None:
        cached = min(use.cached, use.seen)
        return Split(cached, use.seen - cached, EXACT)
    if use.prefill is None:
        return None
    read = cold.read(use.seen, use.prefill)
    return Split(use.seen - read, read, ESTIMATED)


@attrs.define
class CacheTruth:
    """The counts, per (engine, node, source), and per (engine, node) by model."""

    reused: Counter = attrs.Factory(Counter)
    read: Counter = attrs.Factory(Counter)
    #: (engine, node) -> model -> [reused, read]
    models: dict[tuple[str, str], dict[str, list[int]]] = attrs.Factory(dict)
    _cold: dict[tuple[str, str], ColdRate] = attrs.Factory(dict)

    def observe(self, engine: str, node: str, model: str | None, use: PromptUse) -> Split | None:
        """A completed request's answer on ``node`` said ``use``."""
        key = (engine, node)
        cold = self._cold.get(key)
        if cold is None:
            cold = self._cold[key] = ColdRate()
        found = split(use, cold)
        if found is None:
            return None
        self.reused[engine, node, found.source] += found.reused
        self.read[engine, node, found.source] += found.read
        models = self.models.setdefault(key, {})
        name = model or OTHER_MODELS
        if name not in models and len(models) >= MODELS_PER_NODE:
            name = OTHER_MODELS
        counts = models.setdefault(name, [0, 0])
        counts[0] += found.reused
        counts[1] += found.read
        return found

    def totals(self) -> tuple[int, int]:
        """Every token reused and read so far (the history's share is their rise)."""
        return sum(self.reused.values()), sum(self.read.values())

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
        reused = {
            s: self.reused[engine, node, s] for s in SOURCES if (engine, node, s) in self.read
        }
        read = {s: self.read[engine, node, s] for s in reused}
        total_reused, total_read = sum(reused.values()), sum(read.values())
        return {
            "reused": total_reused,
            "read": total_read,
            "share": share(total_reused, total_read),
            "source": next(iter(reused)) if len(reused) == 1 else "mixed",
            "models": {
                name: {"reused": counts[0], "read": counts[1], "share": share(*counts)}
                for name, counts in sorted(models.items())
            },
        }

    def forget_nodes_except(self, keep: set[str]) -> None:
        """Drop the nodes no longer in the fleet (their labels stay bounded by it)."""
        for table in (self.reused, self.read):
            for key in [k for k in table if k[1] not in keep]:
                del table[key]
        for per_node in (self.models, self._cold):
            for key in [k for k in per_node if k[1] not in keep]:
                del per_node[key]


def share(reused: int, read: int) -> float | None:
    """Reused over all, to three places; None when no token was counted."""
    total = reused + read
    return round(reused / total, 3) if total else None
