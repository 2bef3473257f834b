"""``/metrics``: the Recorder's counts and the tree's state in Prometheus's text format.

prometheus-client writes the format; what it is given is a custom collector that yields
metric families at scrape time from our own counters (recorder.py) and from one snapshot of
the tree (status.ProcessView, views.py), so nothing is kept twice and nothing runs on the
request path.

Labels are bounded (docs/references.md#bounded-labels): ``engine`` (the engine files), ``node`` only
for ids of the current fleet (counts of nodes that left are dropped, not shown), ``route``,
``outcome``, ``result`` and ``reason`` from fixed vocabularies; never a model name, a path or a
client.
"""

from __future__ import annotations

import platform
from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

import twisted

from .. import __version__
from ..core.views import ProcessSnapshot
from .status import ProcessView, fleet_ids, in_flight_per_node, waiting_for_owner

PREFIX = "nvpair_proxy_"
__all__ = ["CONTENT_TYPE_LATEST", "ProxyCollector", "registry", "scrape"]


def _family(kind, name: str, documentation: str, labels: list[str], values):
    family = kind(PREFIX + name, documentation, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family


def _counter(name: str, documentation: str, labels: list[str], counts) -> CounterMetricFamily:
    return _family(CounterMetricFamily, name, documentation, labels, counts)


def _gauge(name: str, documentation: str, labels: list[str], values) -> GaugeMetricFamily:
    return _family(GaugeMetricFamily, name, documentation, labels, values)


def _histogram(name: str, documentation: str, labels: list[str], table) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + name, documentation, labels=labels)
    for key, histogram in sorted(table.items()):
        family.add_metric(list(key), histogram.cumulative(), histogram.total)
    return family


class ProxyCollector(Collector):
    """Every ``nvpair_proxy_*`` family, built when scraped."""

    def __init__(self, view: ProcessView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        view, recorder = self.view, self.view.recorder
        snapshot = view.snapshot()
        yield InfoMetricFamily(
            PREFIX + "build",
            "Version of the proxy and what it runs on.",
            value={
                "version": __version__,
                "mode": view.mode,
                "python": platform.python_version(),
                "twisted": twisted.__version__,
            },
        )
        yield _counter(
            "requests",
            "Finished requests by engine, route class and outcome.",
            ["engine", "route", "outcome"],
            recorder.requests,
        )
        yield _counter(
            "request_errors",
            "Requests that did not complete, by reason.",
            ["engine", "reason"],
            recorder.reasons,
        )
        yield _counter(
            "dispatches",
            "Dispatches to a node, by how they ended.",
            ["engine", "node", "result"],
            recorder.dispatches,
        )
        yield _counter(
            "failovers",
            "Dispatches that followed a failed one (same request).",
            ["engine"],
            recorder.failovers,
        )
        yield _histogram(
            "ttfb_seconds",
            "Time from admission to the first body byte.",
            ["engine", "node"],
            recorder.ttfb,
        )
        yield _histogram(
            "request_duration_seconds",
            "Time from admission to the end.",
            ["engine", "route"],
            recorder.duration,
        )
        yield _histogram(
            "queue_wait_seconds",
            "Time a request waited in the queue for a free slot (standalone late binding), "
            "by its priority (normal, or batch: X-NVPAIR-Priority).",
            ["engine", "priority"],
            recorder.queue_wait,
        )
        yield _counter(
            "placements",
            "Committed requests of a workload by why they went where they did: pinned (a "
            "previous answer's node, or node/select), affine, head or spill (affinity), "
            "failover, queued (waited for a slot), free, warm or least-busy (standalone "
            "ranking), priority (the scheduler's order).",
            ["engine", "reason"],
            recorder.placements,
        )
        yield _counter(
            "affinity",
            "Inference requests by how affinity placed them: hit (served "
            "by the conversation's node), evicted (served there, but its engine had "
            "lost the conversation: it reused less than half of the last prompt), spill "
            "(passed over), head (a new conversation sent where its long head was served), "
            "miss (a new or expired conversation), none (no conversation).",
            ["engine", "result"],
            recorder.affinity,
        )
        yield _counter(
            "prompt_tokens",
            "Prompt tokens the engines reported.",
            ["engine", "node"],
            recorder.prompt_tokens,
        )
        cache = recorder.cache
        yield _counter(
            "prompt_tokens_reused",
            "Prompt tokens a node's engine took from its prompt cache instead of reading "
            "them: exact where the engine says (llama.cpp cache_n, Messages "
            "cache_read_input_tokens, Ollama prompt_eval_cached_count, OpenAI-style "
            "cached_tokens), estimated from its prefill time at the node's measured reading "
            "rate where it does not (LM Studio, an Ollama that does not report its cache).",
            ["engine", "node", "source"],
            cache.reused,
        )
        yield _counter(
            "prompt_tokens_read",
            "Prompt tokens a node's engine read anew (the rest of the prompt: see "
            "prompt_tokens_reused).",
            ["engine", "node", "source"],
            cache.read,
        )
        yield _counter(
            "generated_tokens",
            "Generated tokens the engines reported.",
            ["engine", "node"],
            recorder.completion_tokens,
        )
        yield from self._state(snapshot)

    def _state(self, snapshot: ProcessSnapshot) -> Iterator[Metric]:
        """Gauges read from the snapshot of the tree taken for this scrape."""
        fleet = fleet_ids(snapshot)
        facades, routing = snapshot.facades, {f.engine: f.routing for f in snapshot.facades}
        yield _gauge(
            "requests_in_flight",
            "Requests admitted and not yet ended.",
            ["engine"],
            {f.engine: len(f.in_flight) for f in facades},
        )
        yield _gauge(
            "requests_waiting_for_owner",
            "Requests backing off until a node advertises their model.",
            ["engine"],
            {f.engine: waiting_for_owner(f) for f in facades},
        )
        yield _gauge(
            "nodes",
            "Routable nodes.",
            ["engine"],
            {engine: len(r.routable) for engine, r in routing.items()},
        )
        yield _gauge(
            "nodes_busy_held",
            "Nodes held after a 429 or 503 (issue 8).",
            ["engine"],
            {engine: len(r.held) for engine, r in routing.items()},
        )
        yield _gauge(
            "nodes_cooling",
            "Nodes cooling after a first-content stall (issue 8).",
            ["engine"],
            {engine: len(r.cooling) for engine, r in routing.items()},
        )
        yield _gauge(
            "affinity_keys",
            "Conversations whose node a facade remembers.",
            ["engine"],
            {
                engine: sum(n for _, n in r.affinity_keys)
                for engine, r in routing.items()
                if r.affinity_keys is not None
            },
        )
        yield _gauge(
            "queue_depth",
            "Requests waiting in the queue for a free slot (standalone late binding).",
            ["engine"],
            {engine: r.queued for engine, r in routing.items()},
        )
        yield _gauge(
            "queue_clients",
            "Clients with a request waiting in the queue (fair share takes turns across them).",
            ["engine"],
            {engine: r.clients_waiting for engine, r in routing.items()},
        )
        slots = {}
        for engine, r in routing.items():
            for report in r.engines:
                if report.node in fleet:
                    slots[engine, report.node, "busy"] = report.busy
                    if report.slots_total is not None:
                        slots[engine, report.node, "total"] = report.slots_total
        yield _gauge(
            "node_slots",
            "A node's slots as standalone placement counts them: busy "
            "(ours or its engine's report, the larger) and total (when known).",
            ["engine", "node", "state"],
            slots,
        )
        per_node = {
            key: count for key, count in in_flight_per_node(snapshot).items() if key[1] in fleet
        }
        yield _gauge(
            "node_requests_in_flight", "Requests in flight on a node.", ["engine", "node"], per_node
        )
        yield _gauge(
            "reservations",
            "Reservations counted against a node (spec 6).",
            ["node"],
            {n: count for n, count in snapshot.reservations.items() if n in fleet},
        )
        link = self.view.link_up(snapshot)
        if link is not None:
            yield _gauge(
                "broker_link_up", "1 while the link to the broker is open.", [], {(): int(link)}
            )
        if snapshot.cluster_pins is not None:
            yield _gauge(
                "cluster_pins", "Cluster peers with a live pin.", [], {(): snapshot.cluster_pins}
            )


def registry(view: ProcessView) -> CollectorRegistry:
    """Our families plus the process's CPU, memory and descriptors (``process_*``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProxyCollector(view))
    ProcessCollector(registry=registry)
    return registry


def scrape(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
