"""What the admin listener remembers of finished requests and dispatches
(docs/references.md#admin-listener).

The facades' reporters tell a Recorder (their IRequestRecorder), when the admin listener is
on, of every ended request and dispatch; it keeps counters and histograms keyed by fixed
vocabularies and the last 100 requests, as plain Python, so the request path pays a few dict
updates and never a Prometheus call. Everything that is a state rather than an event (in
flight, reservations, held nodes) is read from a snapshot of the process tree at scrape time
instead (views.py, status.py).

Only operational metadata is kept (docs/references.md#no-content-logging): engine, node id, route
class, outcome, status, times, token counts, and the model name for the recent-requests table, never
a body.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from typing import Iterable

import attrs
from zope.interface import implementer

from ..core.interfaces import IRequestRecorder
from ..http.answers import LABELS, OTHER, STATUS_LABELS
from ..request.attempt import Committed
from ..request.events import Outcome, RequestEnded
from .cachetruth import CacheTruth

RECENT = 100
MODEL_SHOWN = 120  # characters of a requested model name kept for the recent table

# Dispatch results: how one attempt on one node ended (a failed one: its AttemptFailure).
COMMITTED = "committed"

# Why a request did not complete, from a fixed vocabulary (metric labels stay bounded): the
# label of its Reason, or, for an engine's own answer relayed with no reason of ours, its
# status's, and ``other`` last.
REASONS = LABELS

#: First-byte times kept between two history samples at most (a sample's percentiles are
#: then those of its first 4,096 requests).
TTFB_WINDOW = 4096

# Seconds, each family at most 16 buckets. First body byte: from a local engine's first
# token to a cold model load or a long context on a small GPU (minutes).
TTFB_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Waiting in the queue for a free slot (late binding): up to the job deadline (10 min).
QUEUE_WAIT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Whole requests: up to the response cap (30 min).
DURATION_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)


def reason(ended: RequestEnded) -> str | None:
    """The reason (one of REASONS) a request did not complete, None if it did."""
    if ended.outcome == Outcome.COMPLETED:  # a StrEnum: the wire string compares equal
        return None
    if ended.reason is not None:
        return ended.reason.label
    return STATUS_LABELS.get(ended.status, OTHER)


@attrs.define
class Histogram:
    """Cumulative-ready bucket counts: ``counts[i]`` observations at most ``bounds[i]``,
    the last one above every bound."""

    bounds: tuple[float, ...]
    counts: list[int] = attrs.field(init=False)
    total: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus wants them, ``+Inf`` last."""
        out, running = [], 0
        for label, count in zip([repr(b) for b in self.bounds] + ["+Inf"], self.counts):
            running += count
            out.append((label, running))
        return out


@implementer(IRequestRecorder)
class Recorder:
    """Counters, histograms and the last requests of every facade of the process: the one
    IRequestRecorder the facades' reporters are given when the admin listener is on."""

    def __init__(self, recent: int = RECENT) -> None:
        self.requests: Counter = Counter()  # (engine, route, outcome)
        self.reasons: Counter = Counter()  # (engine, reason)
        self.dispatches: Counter = Counter()  # (engine, node, result)
        self.failovers: Counter = Counter()  # engine
        self.prompt_tokens: Counter = Counter()  # (engine, node)
        self.completion_tokens: Counter = Counter()  # (engine, node)
        self.ttfb: dict[tuple[str, str], Histogram] = {}  # (engine, node)
        self.duration: dict[tuple[str, str], Histogram] = {}  # (engine, route)
        self.queue_wait: dict[tuple[str, str], Histogram] = {}  # (engine, priority)
        self.affinity: Counter = Counter()  # (engine, hit|spill|miss|none)
        self.placements: Counter = Counter()  # (engine, reason)
        self.last_request: dict[str, float] = {}  # node -> when a request on it last ended
        #: What the engines reused of the prompts (docs/operations.md#cache-truth).
        self.cache = CacheTruth()
        #: First-byte times since the history last sampled them (history.py), bounded.
        self.ttfb_window: list[float] = []
        self.recent: deque[RequestEnded] = deque(maxlen=recent)

    def request_ended(self, ended: RequestEnded) -> None:
        engine, node = ended.engine, ended.node
        self.requests[engine, ended.route, ended.outcome] += 1
        why = reason(ended)
        if why is not None:
            self.reasons[engine, why] += 1
        if ended.affinity is not None:
            self.affinity[engine, ended.affinity] += 1
        if ended.placement is not None:
            self.placements[engine, ended.placement] += 1
        if ended.dispatches > 1:
            self.failovers[engine] += ended.dispatches - 1
        self._histogram(self.duration, (engine, ended.route), DURATION_BUCKETS).observe(
            ended.duration
        )
        if node is not None:
            self.last_request[node] = ended.at
            if ended.ttfb is not None:
                self._histogram(self.ttfb, (engine, node), TTFB_BUCKETS).observe(ended.ttfb)
                if len(self.ttfb_window) < TTFB_WINDOW:
                    self.ttfb_window.append(ended.ttfb)
            stats = ended.stats or {}
            if isinstance(stats.get("promptTokens"), int):
                self.prompt_tokens[engine, node] += stats["promptTokens"]
            if isinstance(stats.get("completionTokens"), int):
                self.completion_tokens[engine, node] += stats["completionTokens"]
        if ended.model is not None and len(ended.model) > MODEL_SHOWN:
            ended = attrs.evolve(ended, model=ended.model[:MODEL_SHOWN] + "…")
        if ended.prompt is not None and node is not None:
            self.cache.observe(engine, node, ended.model, ended.prompt)
        self.recent.append(ended)

    def take_ttfbs(self) -> list[float]:
        """The first-byte times since the last call (history.py)."""
        taken, self.ttfb_window = self.ttfb_window, []
        return taken

    def queue_left(self, engine: str, waited: float, priority: str = "normal") -> None:
        self._histogram(self.queue_wait, (engine, priority), QUEUE_WAIT_BUCKETS).observe(waited)

    def dispatch_ended(self, engine: str, outcome) -> None:
        result = COMMITTED if isinstance(outcome, Committed) else outcome.kind.value
        self.dispatches[engine, outcome.node.id, result] += 1

    def forget_nodes_except(self, fleet: Iterable[str]) -> None:
        """Drop what is kept per node for nodes no longer in the fleet, so node labels stay
        bounded by the fleet (a node that comes back starts its counters again, which
        Prometheus's ``rate`` reads as a reset)."""
        keep = set(fleet)
        for table in (self.dispatches, self.prompt_tokens, self.completion_tokens, self.ttfb):
            for key in [k for k in table if k[1] not in keep]:
                del table[key]
        for node in [n for n in self.last_request if n not in keep]:
            del self.last_request[node]
        self.cache.forget_nodes_except(keep)

    @staticmethod
    def _histogram(table: dict, key: tuple, bounds: tuple[float, ...]) -> Histogram:
        histogram = table.get(key)
        if histogram is None:
            histogram = table[key] = Histogram(bounds)
        return histogram
