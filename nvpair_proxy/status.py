"""The process as the admin listener shows it: ``/status`` (JSON) and what metrics read.

A ProcessView reads the service tree when asked (facades, routers, reservations, the link)
and the Recorder's counts, so nothing here runs on the request path. ``/status`` carries
operational metadata only (spec 9): node ids, addresses and advertised models, counts and
times, and for recent requests the engine, model, node, outcome and timings, never a body.
"""

from __future__ import annotations

from collections import Counter

from typing import Callable, Iterator

import attrs

from . import __version__
from .selfcheck import self_reason
from .events import ms
from .recorder import Recorder

STATUS_SCHEMA = 1


@attrs.define(eq=False)
class ProcessView:
    """The process tree, read at request time: the root's runtime and facades, the broker
    link and the cluster directory when there are."""

    root: object
    recorder: Recorder
    mode: str
    clock: Callable[[], float]
    started: float

    def facade_services(self) -> list:
        return list(self.root.facades) if self.root.facades is not None else []

    def facades(self) -> list:
        return [service.facade for service in self.facade_services()]

    def fleet_ids(self) -> set[str]:
        """Every node id a facade knows now: the only node label values metrics show."""
        return {node.id for facade in self.facades() for node in facade.router.nodes.all()}

    def reservations(self) -> dict[str, int]:
        runtime = self.root.runtime
        return dict(runtime.reservations.reservations) if runtime is not None else {}

    def last_activity(self) -> dict[str, float]:
        seen: dict[str, float] = dict(self.recorder.last_request)
        runtime = self.root.runtime
        if runtime is not None and runtime.activity is not None:
            for node, at in runtime.activity.last_seen().items():
                seen[node] = max(at, seen.get(node, at))
        return seen

    def link_up(self) -> bool | None:
        """Broker mode: whether the link to the broker is open; None in standalone mode."""
        if self.mode != "broker":
            return None
        try:
            link = self.root.getServiceNamed("link")
        except KeyError:
            return False
        transport = link.link.framer.transport
        return bool(link.running and transport is not None
                    and not getattr(transport, "disconnected", False))

    def live_pins(self) -> int | None:
        """Broker mode with --cluster-dir: pinned peers trusted now; None otherwise."""
        directory = getattr(self.root.facades, "directory", None)
        if directory is None:
            return None
        return len(directory.pins) if directory.member else 0


def serving_node(exchange) -> str | None:
    """The node a request in flight is on: its committed node, else its attempt's."""
    if exchange.node_id is not None:
        return exchange.node_id
    attempt = exchange.dispatch.attempt if exchange.dispatch is not None else None
    return attempt.node.id if attempt is not None else None


def in_flight(view: ProcessView) -> Iterator[tuple[str, object]]:
    """``(engine, exchange)`` for every request in flight."""
    for facade in view.facades():
        for exchange in list(facade.in_flight):
            yield facade.engine.id, exchange


def waiting_for_owner(facade) -> int:
    return sum(1 for exchange in list(facade.in_flight)
               if exchange.dispatch is not None and exchange.dispatch.waiting_for_owner)


def _by(counter, engine: str, position: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in counter.items():
        if key[0] == engine:
            out[key[position]] = out.get(key[position], 0) + value
    return dict(sorted(out.items()))


def engine_status(view: ProcessView, service) -> dict:
    facade, recorder = service.facade, view.recorder
    engine = facade.engine.id
    router = facade.router
    return {
        "engine": engine, "port": service.listening.getHost().port, "pin": router.pin or None,
        "nodes": len(router.routable()), "in_flight": len(facade.in_flight),
        "waiting_for_owner": waiting_for_owner(facade),
        "held": sorted(router.held()), "cooling": sorted(router.cooling()),
        "requests": _by(recorder.requests, engine, 2),
        "reasons": _by(recorder.reasons, engine, 1),
        "dispatches": _by(recorder.dispatches, engine, 2),
        "failovers": recorder.failovers.get(engine, 0),
        "prompt_tokens": sum(_by(recorder.prompt_tokens, engine, 1).values()),
        "completion_tokens": sum(_by(recorder.completion_tokens, engine, 1).values()),
        # Broker mode: the local engine's parallel slots from node/set-local-backend.
        "slots": service.slots.describe() if service.slots is not None else None,
    }


def in_flight_per_node(view: ProcessView) -> Counter:
    """Requests in flight per (engine, node serving them)."""
    return Counter((engine, node) for engine, exchange in in_flight(view)
                   if (node := serving_node(exchange)) is not None)


def nodes_status(view: ProcessView) -> list[dict]:
    reservations, seen = view.reservations(), view.last_activity()
    busy: dict[str, int] = {}
    for (_, node), count in in_flight_per_node(view).items():
        busy[node] = busy.get(node, 0) + count
    nodes: dict[str, dict] = {}
    for facade in view.facades():
        router = facade.router
        held, cooling = router.held(), router.cooling()
        routable = {node.id for node in router.routable()}
        for node in router.nodes.all():
            entry = nodes.setdefault(node.id, {
                "id": node.id, "name": node.name, "addresses": [], "engines": [],
                "last_activity": seen.get(node.id), "reservations": reservations.get(node.id, 0),
                "in_flight": busy.get(node.id, 0), "held": False, "cooling": False})
            for address in node.addresses:
                if address not in entry["addresses"]:
                    entry["addresses"].append(address)
            state = ("held" if node.id in held else "cooling" if node.id in cooling
                     else "ready" if node.id in routable
                     else "excluded" if node.local else "unroutable")
            entry["held"] = entry["held"] or node.id in held
            entry["cooling"] = entry["cooling"] or node.id in cooling
            models = (list(node.advertised) if node.advertised is not None
                      else sorted(node.models) if node.models is not None else None)
            shown = {"engine": facade.engine.id, "port": node.port, "models": models,
                     "state": state}
            if state == "excluded":
                shown["excluded"] = self_reason(facade.engine.id, node.port)
            entry["engines"].append(shown)
    return [nodes[node_id] for node_id in sorted(nodes)]


def recent_status(view: ProcessView) -> list[dict]:
    """The last requests, newest first."""
    out = []
    for ended in reversed(view.recorder.recent):
        stats = ended.stats or {}
        out.append({"time": ended.at, "engine": ended.engine, "route": ended.route,
                    "model": ended.model, "node": ended.node, "outcome": ended.outcome,
                    "status": ended.status, "ttfb_ms": ms(ended.ttfb),
                    "duration_ms": ms(ended.duration), "dispatches": ended.dispatches,
                    "prompt_tokens": stats.get("promptTokens"),
                    "completion_tokens": stats.get("completionTokens")})
    return out


def status(view: ProcessView) -> dict:
    """The ``/status`` document (schema 1, documented in docs/operations.md)."""
    view.recorder.forget_nodes_except(view.fleet_ids())
    now = view.clock()
    return {
        "schema": STATUS_SCHEMA, "version": __version__, "mode": view.mode, "now": now,
        "uptime_s": round(now - view.started, 3), "broker_link_up": view.link_up(),
        "cluster_pins": view.live_pins(),
        "reservations": sum(view.reservations().values()),
        "engines": [engine_status(view, service) for service in view.facade_services()],
        "nodes": nodes_status(view),
        "recent": recent_status(view),
    }
