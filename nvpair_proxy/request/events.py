"""Workload lifecycle and request events (docs/references.md#workload-lifecycle, #notifications,
#terminal-frames and #events-between-rounds).

Every admitted request ends in exactly one terminal event: ``terminal`` is idempotent and
anything after it is dropped, so the many paths that can end a request (commit and stream end,
client gone, shutdown, an unexpected exception, the backstop) can all call it safely.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
from typing import Callable

import attrs
from twisted.logger import LogLevel
from zope.interface import implementer

from ..core import constants
from ..core.interfaces import IEmitter, IRequestRecorder
from ..core.logs import enabled, logger
from ..http.answers import Reason


class Outcome(enum.StrEnum):
    """How a request ended, as its ``outcome`` label in the metrics; for an admitted one
    (all but ``REJECTED``) also its terminal workload state on the wire."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: Answered before routing (a refused key, a bad target, CORS): never admitted.
    REJECTED = "rejected"


# A workload's states before its end (protocol strings), then its outcomes.
QUEUED, RUNNING = "queued", "running"
COMPLETED, FAILED, CANCELLED, REJECTED = Outcome

log = logger()


def new_run_id() -> str:
    """16 hex digits, random per process start (docs/references.md#run-id)."""
    return os.urandom(8).hex()


@implementer(IEmitter)
class LogEmitter:
    """Standalone mode: events to the log at debug, one line each
    (docs/references.md#standalone-events-log)."""

    @property
    def listening(self) -> bool:
        return enabled(LogLevel.debug)

    def notify(self, method: str, params: dict, engine: str | None = None) -> None:
        if not enabled(LogLevel.debug):
            return  # nobody reads it: do not encode it (docs/references.md#bare-proxy-cpu)
        name = f"{engine}:{method}" if engine else method
        log.debug(
            "event {method} {params}",
            method=name,
            params=json.dumps(params, sort_keys=True),
            engine=engine,
        )

    def notify_json(self, method: str, params: str, engine: str | None = None) -> None:
        if enabled(LogLevel.debug):
            self.notify(method, json.loads(params), engine)


#: A string as compact JSON (the C encoder's own function): what the link's encoder writes
#: for a string, so a line built from parts is byte for byte the line the encoder would write.
quoted = json.encoder.encode_basestring_ascii
#: Compact JSON of anything else (a workload's stats), as the link writes it.
_COMPACT = json.JSONEncoder(separators=(",", ":"), allow_nan=True)


def ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(round(seconds * 1000))


def _ms_text(seconds: float | None) -> str:
    """:func:`ms` as JSON."""
    return "null" if seconds is None else str(ms(seconds))


#: The keys of a ``stats`` block (``tokens.measure``), each as JSON.
_STATS_KEYS = {
    key: quoted(key) + ":"
    for key in ("promptTokens", "completionTokens", "tokensPerSecond", "ttftMs", "estimated")
}


def _stats_text(stats: dict) -> str:
    """``stats`` as compact JSON, the text ``_COMPACT`` writes for it, without making an
    encoder per call: its keys are ``measure``'s and its values ints, finite floats or true.
    Anything else is left to the encoder."""
    parts = []
    for key, value in stats.items():
        name = _STATS_KEYS.get(key)
        if name is None:
            return _COMPACT.encode(stats)
        kind = type(value)
        if kind is int:
            parts.append(name + int.__repr__(value))
        elif kind is float and math.isfinite(value):
            parts.append(name + float.__repr__(value))
        elif value is True:
            parts.append(name + "true")
        else:
            return _COMPACT.encode(stats)
    return "{" + ",".join(parts) + "}"


_STATES = {
    state: quoted(state) for state in ("queued", "running", "completed", "failed", "cancelled")
}


@attrs.define
class Workload:
    """One admitted inference request's lifecycle as the broker sees it."""

    emitter: IEmitter
    clock: Callable[[], float]
    run_id: str
    engine: str
    id: str
    model: str
    created_at: float
    state: str = QUEUED
    scheduled_on: str | None = None
    started_at: float | None = None
    seq: int = 0
    ended: bool = False
    _sent_any: bool = False
    #: The fixed head of its workloadInfo, encoded at its first event.
    _head: str | None = None
    #: ``createdAt`` as JSON, encoded with the head.
    _created: str = ""

    def admitted(self) -> None:
        self._submit(None)

    def dispatched(self, node_id: str) -> None:
        self._submit(node_id)

    def cleared(self) -> None:
        self._submit(None)

    def started(self, node_id: str) -> None:
        if self.ended:
            return
        self.state, self.scheduled_on, self.started_at = RUNNING, node_id, self.clock()
        self._emit("workload:started", None, None, None)

    def terminal(self, state: Outcome, error: str | None = None, stats: dict | None = None) -> bool:
        """Emit the one terminal event; False (and nothing sent) if one was sent already."""
        if self.ended:
            return False
        self.state = state
        method = "workload:completed" if state is COMPLETED else "workload:errored"
        self._emit(method, error, self.clock(), stats)
        self.ended = True
        return True

    def _submit(self, node_id: str | None) -> None:
        """Re-pointing a job at its current placement says nothing new, so sends nothing."""
        if self.ended or (self._sent_any and node_id == self.scheduled_on):
            return
        self.scheduled_on = node_id
        self._emit("workload:submitted", None, None, None)

    def _emit(
        self, method: str, error: str | None, completed_at: float | None, stats: dict | None
    ) -> None:
        self._sent_any = True
        self.seq += 1
        if not self.emitter.listening:
            return
        # Encoded from parts, fields in the contract's order (docs/references.md#notifications):
        # the line is byte for byte what encoding the object would give (test_events pins it),
        # without building the object (docs/references.md#bare-proxy-cpu).
        head = self._head
        if head is None:
            head = self._head = (
                '{"workloadInfo":{"id":'
                + quoted(self.id)
                + ',"model":'
                + quoted(self.model)
                + ',"engine":'
                + quoted(self.engine)
                + ',"runId":'
                + quoted(self.run_id)
                + ',"state":'
            )
            self._created = _ms_text(self.created_at)
        state = _STATES.get(self.state) or quoted(self.state)
        placed = ',"scheduledOn":' + quoted(self.scheduled_on) if self.scheduled_on else ""
        params = (
            head
            + state
            + ',"originatedFrom":""'
            + placed
            + ',"createdAt":'
            + self._created
            + ',"startedAt":'
            + _ms_text(self.started_at)
            + ',"completedAt":'
            + _ms_text(completed_at)
            + ',"error":'
            + ("null" if error is None else quoted(error))
            + ',"requesterId":null,"seq":'
            + str(self.seq)
            + (',"stats":' + _stats_text(stats) if stats else "")
            + "}}"
        )
        self.emitter.notify_json(method, params)


def _request_head(id: str, method: str, path: str, target: str, node_id: str | None) -> str:
    """The fields both request events start with (docs/references.md#request-events), in the
    contract's order, as compact JSON without the closing brace; ``node_id`` only when set."""
    return (
        '{"id":'
        + quoted(id)
        + (',"node_id":' + quoted(node_id) if node_id else "")
        + ',"method":'
        + quoted(method)
        + ',"path":'
        + quoted(path)
        + ',"target":'
        + quoted(target)
    )


class ActivityThrottle:
    """``node/activity`` on streamed bytes, at most once per node per 2 s
    (docs/references.md#node-activity)."""

    def __init__(
        self,
        emitter: IEmitter,
        clock: Callable[[], float],
        interval: float = constants.ACTIVITY_INTERVAL,
    ) -> None:
        self.emitter, self.clock, self.interval = emitter, clock, interval
        self._last: dict[str, float] = {}

    def touch(self, node_id: str) -> float:
        """Report the node unless it was within the interval; returns when it may be next."""
        now = self.clock()
        last = self._last.get(node_id)
        if last is not None and now - last < self.interval:
            return last + self.interval
        self._last[node_id] = now
        self.emitter.notify("node/activity", {"hostUuid": node_id, "msSince": 0})
        return now + self.interval

    def last_seen(self) -> dict[str, float]:
        """When each node last streamed bytes, to within the interval (for the status page)."""
        return dict(self._last)


# Route classes and request outcomes: the fixed vocabularies of the admin listener
# (docs/references.md#bounded-labels).
INFERENCE, MODELS, PREFLIGHT, OTHER = "inference", "models", "preflight", "other"


def route_class(route) -> str:
    """An engine route's class: inference, models, or other (forwarded verbatim)."""
    if route is None:
        return OTHER
    return INFERENCE if route.is_inference else MODELS if route.is_models else OTHER


@attrs.frozen
class PromptUse:
    """How much of a completed request's prompt its engine took from its cache, as its
    answer said (docs/operations.md#cache-truth): ``seen`` the whole prompt's tokens,
    ``cached`` those the engine says it reused (None: it does not say), ``prefill`` the
    seconds it spent reading the prompt, by its own account or, for a stream, from dispatch
    to the first body byte (None: unknown)."""

    seen: int
    cached: int | None = None
    prefill: float | None = None


@attrs.frozen
class RequestEnded:
    """What the admin listener learns of one finished request: operational metadata only
    (docs/references.md#no-content-logging: never a prompt, a body or a credential). Times in
    seconds on the facade clock."""

    engine: str
    at: float
    route: str
    outcome: Outcome
    status: int
    duration: float
    node: str | None = None
    model: str | None = None
    reason: Reason | None = None
    ttfb: float | None = None
    dispatches: int = 0
    stats: dict | None = None
    #: How affinity placed it (``hit``, ``spill``, ``miss``, ``none``); None when it is off.
    affinity: str | None = None
    #: Why it went where it did (docs/operations.md#placement); None when nothing was placed.
    placement: str | None = None
    #: Seconds it waited in the facade's queue.
    waited: float = 0.0
    #: What its engine reused of its prompt (a completed request whose answer said).
    prompt: PromptUse | None = None


@attrs.define(eq=False)
class Reporter:
    """One facade's voice on the link: request and workload ids, and the events of
    docs/references.md#notifications.

    The request path holds this rather than the facade, so what a request can say is exactly
    what it reports, addressed to its engine.
    """

    engine: str
    emitter: IEmitter
    clock: Callable[[], float]
    run_id: str
    activity: ActivityThrottle
    recorder: IRequestRecorder | None = None
    _request_ids: itertools.count = attrs.Factory(lambda: itertools.count(1))
    _workload_ids: itertools.count = attrs.Factory(lambda: itertools.count(1))

    def next_request_id(self) -> str:
        return str(next(self._request_ids))

    def new_workload(self, model: str, created_at: float) -> Workload:
        return Workload(
            emitter=self.emitter,
            clock=self.clock,
            run_id=self.run_id,
            engine=self.engine,
            id=str(next(self._workload_ids)),
            model=model,
            created_at=created_at,
        )

    @property
    def listening(self) -> bool:
        """Whether the events (and the figures that only feed them: token stats) are wanted
        at all: by the link or log, or by the admin listener's recorder."""
        return self.emitter.listening or self.recorder is not None

    def notify(self, method: str, params: dict) -> None:
        self.emitter.notify(method, params, engine=self.engine)

    def request_started(
        self, id: str, method: str, path: str, target: str, node_id: str | None = None
    ) -> None:
        """``proxy/request-started``."""
        if self.emitter.listening:
            self.emitter.notify_json(
                "proxy/request-started",
                _request_head(id, method, path, target, node_id) + "}",
                engine=self.engine,
            )

    def request_finished(
        self,
        id: str,
        method: str,
        path: str,
        target: str,
        status: int,
        duration: float,
        node_id: str | None = None,
        ttfb: float | None = None,
        error: str | None = None,
    ) -> None:
        """``proxy/request``; ``duration`` and ``ttfb`` in seconds, sent as whole ms,
        ``ttfb_ms`` and ``error`` only when there are ones."""
        if self.emitter.listening:
            self.emitter.notify_json(
                "proxy/request",
                (
                    _request_head(id, method, path, target, node_id)
                    + ',"status":'
                    + str(int(status))
                    + ',"duration_ms":'
                    + _ms_text(duration)
                    + ("" if ttfb is None else ',"ttfb_ms":' + _ms_text(ttfb))
                    + (',"error":' + quoted(error) if error else "")
                    + "}"
                ),
                engine=self.engine,
            )

    def activity_on(self, node_id: str) -> float:
        """Bytes streamed from the node; returns the time before which asking again is moot."""
        return self.activity.touch(node_id)

    def request_ended(self, **fields) -> None:
        """A finished request, with :class:`RequestEnded`'s fields, for the recorder if any.
        What the admin listener keeps is additive: a fault in it is logged and costs the
        request nothing (its answer still ends)."""
        if self.recorder is not None:
            try:
                self.recorder.request_ended(
                    RequestEnded(engine=self.engine, at=self.clock(), **fields)
                )
            except Exception:
                log.failure("could not record the end of a request", engine=self.engine)

    def dispatch_ended(self, outcome) -> None:
        """One dispatch's outcome (Committed or Failed), for the recorder if any."""
        if self.recorder is not None:
            self.recorder.dispatch_ended(self.engine, outcome)
