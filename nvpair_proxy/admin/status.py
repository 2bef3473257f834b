"""The process as the admin listener shows it: ``/status`` (JSON) and what metrics read.

A ProcessView asks its source (the service tree, IStatusSource) for one frozen snapshot per
read (views.py) and joins it with the Recorder's counts, so nothing here runs on the request
path or reaches into a live object. ``/status`` carries operational metadata only
(docs/references.md#no-content-logging): node ids, addresses and advertised models, counts and
times, and for recent requests the engine, model, node, outcome and timings, never a body.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterator

import attrs

from .. import __version__
from ..core.interfaces import IStatusSource
from ..core.views import EngineView, FacadeView, InFlightView, ProcessSnapshot, RoutingView
from ..nodes.selfcheck import self_reason
from ..request.events import ms
from .cachetruth import CacheTruth
from .history import History
from .recorder import Recorder

STATUS_SCHEMA = 1


@attrs.define(eq=False)
class ProcessView:
    """The process read at request time: its source's snapshot, the recorder's counts, the
    mode and the clock."""

    source: IStatusSource
    recorder: Recorder
    mode: str
    clock: Callable[[], float]
    started: float
    #: The last fifteen minutes (history.py), sampled by the admin listener's timer.
    history: History = attrs.Factory(History)

    def snapshot(self) -> ProcessSnapshot:
        """The process now; the recorder forgets the nodes that left the fleet since, so a
        scrape and ``/status`` only ever name the current fleet's nodes."""
        snapshot: ProcessSnapshot = self.source.snapshot()
        self.recorder.forget_nodes_except(fleet_ids(snapshot))
        return snapshot

    def sample(self) -> None:
        """Take the history's next sample (the admin listener's timer, every 10 s)."""
        self.history.take(self.clock(), self.recorder, self.snapshot())

    def history_status(self) -> dict:
        return self.history.status()

    def link_up(self, snapshot: ProcessSnapshot) -> bool | None:
        """Broker mode: whether the link to the broker is open; None in standalone mode."""
        return bool(snapshot.link_up) if self.mode == "broker" else None

    def last_activity(self, snapshot: ProcessSnapshot) -> dict[str, float]:
        """When each node last ended a request or streamed bytes, whichever was later."""
        seen: dict[str, float] = dict(self.recorder.last_request)
        for node, at in snapshot.streamed.items():
            seen[node] = max(at, seen.get(node, at))
        return seen


def fleet_ids(snapshot: ProcessSnapshot) -> set[str]:
    """Every node id a facade knows now: the only node label values metrics show."""
    return {node.id for routing in routings(snapshot) for node in routing.nodes}


def routings(snapshot: ProcessSnapshot) -> Iterator[RoutingView]:
    for facade in snapshot.facades:
        yield facade.routing


def waiting_for_owner(facade: FacadeView) -> int:
    return sum(1 for request in facade.in_flight if request.waiting_for_owner)


def in_flight(snapshot: ProcessSnapshot) -> Iterator[tuple[str, InFlightView]]:
    """``(engine, request)`` for every request in flight."""
    for facade in snapshot.facades:
        for request in facade.in_flight:
            yield facade.engine, request


def in_flight_per_node(snapshot: ProcessSnapshot) -> Counter:
    """Requests in flight per (engine, node serving them)."""
    return Counter(
        (engine, request.node)
        for engine, request in in_flight(snapshot)
        if request.node is not None
    )


def _by(counter, engine: str, position: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in counter.items():
        if key[0] == engine:
            out[key[position]] = out.get(key[position], 0) + value
    return dict(sorted(out.items()))


def engine_status(facade: FacadeView, recorder: Recorder, cache: CacheTruth) -> dict:
    engine, routing = facade.engine, facade.routing
    return {
        "engine": engine,
        "port": facade.port,
        "pin": routing.pin or None,
        "nodes": len(routing.routable),
        "in_flight": len(facade.in_flight),
        "waiting_for_owner": waiting_for_owner(facade),
        "held": list(routing.held),
        "cooling": list(routing.cooling),
        # Standalone late binding: the requests waiting for a free slot, the longest wait.
        "queued": routing.queued,
        "oldest_wait_s": None if routing.oldest_wait is None else round(routing.oldest_wait, 3),
        # Fair share: how many clients wait (never who), and batch work still yielding.
        "clients_waiting": routing.clients_waiting,
        "batch_waiting": routing.batch_waiting,
        # Affinity: conversations remembered (null when it is off).
        "affinity_keys": None
        if routing.affinity_keys is None
        else sum(n for _, n in routing.affinity_keys),
        "requests": _by(recorder.requests, engine, 2),
        "reasons": _by(recorder.reasons, engine, 1),
        "dispatches": _by(recorder.dispatches, engine, 2),
        "failovers": recorder.failovers.get(engine, 0),
        "prompt_tokens": sum(_by(recorder.prompt_tokens, engine, 1).values()),
        "completion_tokens": sum(_by(recorder.completion_tokens, engine, 1).values()),
        # Cache truth: the share of prompt tokens its nodes' engines reused.
        "prompt_reused_share": cache.engine_share(engine),
        # Broker mode: the local engine's parallel slots from node/set-local-backend.
        "slots": dict(facade.slots) if facade.slots is not None else None,
    }


def nodes_status(view: ProcessView, snapshot: ProcessSnapshot, cache: CacheTruth) -> list[dict]:
    reservations, seen = snapshot.reservations, view.last_activity(snapshot)
    busy: dict[str, int] = {}
    for (_, node), count in in_flight_per_node(snapshot).items():
        busy[node] = busy.get(node, 0) + count
    nodes: dict[str, dict] = {}
    for facade in snapshot.facades:
        engine, routing = facade.engine, facade.routing
        held, cooling, routable = set(routing.held), set(routing.cooling), set(routing.routable)
        reports = {report.node: report for report in routing.engines}
        keys = dict(routing.affinity_keys) if routing.affinity_keys is not None else None
        for node in routing.nodes:
            entry = nodes.setdefault(
                node.id,
                {
                    "id": node.id,
                    "name": node.name,
                    "addresses": [],
                    "engines": [],
                    "last_activity": seen.get(node.id),
                    "reservations": reservations.get(node.id, 0),
                    "in_flight": busy.get(node.id, 0),
                    "held": False,
                    "cooling": False,
                },
            )
            for address in node.addresses:
                if address not in entry["addresses"]:
                    entry["addresses"].append(address)
            state = (
                "held"
                if node.id in held
                else "cooling"
                if node.id in cooling
                else "ready"
                if node.id in routable
                else "excluded"
                if node.local
                else "unroutable"
            )
            entry["held"] = entry["held"] or node.id in held
            entry["cooling"] = entry["cooling"] or node.id in cooling
            models = list(node.models) if node.models is not None else None
            shown = {"engine": engine, "port": node.port, "models": models, "state": state}
            if state == "excluded":
                shown["excluded"] = self_reason(engine, node.port)
            report = reports.get(node.id)
            if report is not None:
                shown["engine_report"] = engine_report(report)
            if keys is not None:
                shown["affinity_keys"] = keys.get(node.id, 0)
            shown["cache"] = cache.node_status(engine, node.id)
            entry["engines"].append(shown)
    return [nodes[node_id] for node_id in sorted(nodes)]


def engine_report(report: EngineView) -> dict:
    """What a node's engine said (standalone placement): slots as placement counts them
    (``busy`` the larger of ``ours`` and ``reported_busy``), the warm models, and how long
    ago the engine was last read; None where it did not say."""
    return {
        "slots_total": report.slots_total,
        "slots_busy": report.busy,
        "ours": report.ours,
        "reported_busy": report.reported_busy,
        "warm": None if report.warm is None else list(report.warm),
        "read_age_s": None if report.read_age is None else round(report.read_age, 3),
        "service_s": None if report.service is None else round(report.service, 3),
        "prompt_tokens_per_second": None
        if report.prompt_rate is None
        else round(report.prompt_rate, 1),
        "prompt_bytes_per_token": None
        if report.bytes_per_token is None
        else round(report.bytes_per_token, 2),
    }


def recent_status(recorder: Recorder) -> list[dict]:
    """The last requests, newest first."""
    out = []
    for ended in reversed(recorder.recent):
        stats = ended.stats or {}
        out.append(
            {
                "time": ended.at,
                "engine": ended.engine,
                "route": ended.route,
                "model": ended.model,
                "node": ended.node,
                "outcome": ended.outcome,
                "status": ended.status,
                "ttfb_ms": ms(ended.ttfb),
                "duration_ms": ms(ended.duration),
                "dispatches": ended.dispatches,
                "prompt_tokens": stats.get("promptTokens"),
                "completion_tokens": stats.get("completionTokens"),
                "placement": ended.placement,
                "waited_ms": ms(ended.waited) if ended.placement is not None else None,
            }
        )
    return out


def status(view: ProcessView) -> dict:
    """The ``/status`` document (schema 1, documented in docs/operations.md)."""
    snapshot = view.snapshot()
    recorder, now = view.recorder, view.clock()
    cache = recorder.cache
    return {
        "schema": STATUS_SCHEMA,
        "version": __version__,
        "mode": view.mode,
        "now": now,
        "uptime_s": round(now - view.started, 3),
        "broker_link_up": view.link_up(snapshot),
        "cluster_pins": snapshot.cluster_pins,
        "reservations": sum(snapshot.reservations.values()),
        "engines": [engine_status(facade, recorder, cache) for facade in snapshot.facades],
        "nodes": nodes_status(view, snapshot, cache),
        "recent": recent_status(recorder),
        "history": view.history_status(),
    }
