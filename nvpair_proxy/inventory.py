"""Model inventories: reading an engine's model list, probing nodes, and fleet-wide lists.

One parser serves both uses, so the ids a probe makes a node advertise are exactly the ids
the aggregated list shows to clients. Bodies are capped (16 MiB) and time-boxed (10 s) because
a model list comes from every node of the fleet and one bad node must not stall the rest.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

from twisted.internet.defer import Deferred, DeferredList, maybeDeferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.internet.task import LoopingCall
from .logs import logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent

from . import constants
from .attempt import clean_end
from .discovery import Node, NodeSet, host_port
from .engines import Engine

log = logger()


class InventoryError(Exception):
    """A model list that could not be read or is not the engine's envelope."""


def model_entries(body: bytes, envelope: str) -> list[tuple[str, dict]]:
    """(id, entry) pairs of a model-list body in the given envelope."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InventoryError("model list is not JSON") from None
    key = "data" if envelope == "openai" else "models"
    items = data.get(key) if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise InventoryError(f"model list has no {key!r} array")
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        if envelope == "openai":
            model_id = item.get("id")
        else:
            model_id = item.get("model") or item.get("name")
        if isinstance(model_id, str) and model_id.strip():
            out.append((model_id, item))
    return out


def envelope_body(envelope: str, entries: Iterable[dict]) -> bytes:
    if envelope == "openai":
        return json.dumps({"object": "list", "data": list(entries)}).encode()
    return json.dumps({"models": list(entries)}).encode()


class _Capped(Protocol):
    def __init__(self, done: Deferred, limit: int) -> None:
        self.done, self.limit, self.parts, self.size = done, limit, [], 0

    def dataReceived(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            self.transport.stopProducing()
            return
        self.parts.append(data)

    def connectionLost(self, reason: Failure) -> None:
        if self.done.called:
            return
        if self.size > self.limit:
            self.done.errback(InventoryError("model list body over 16 MiB"))
        elif clean_end(reason):
            self.done.callback(b"".join(self.parts))
        else:
            self.done.errback(reason)


def fetch(agent: IAgent, clock: IReactorTime, url: bytes, headers: Headers | None = None,
          timeout: float = constants.MODEL_LIST_TIMEOUT,
          limit: int = constants.MODEL_LIST_MAX_BODY) -> Deferred:
    """GET ``url``; fires (status, headers, body) or fails; never follows redirects."""
    request = maybeDeferred(agent.request, b"GET", url, headers or Headers())

    def got(response):
        body: Deferred = Deferred(lambda d: protocol.transport.stopProducing())
        protocol = _Capped(body, limit)
        response.deliverBody(protocol)
        return body.addCallback(lambda data: (response.code, response.headers, data))

    request.addCallback(got)
    request.addTimeout(timeout, clock)
    return request


def node_url(node: Node, path: str) -> bytes:
    address = node.dial_order()[0]
    return f"{node.scheme}://{host_port(address, node.port)}{path}".encode()


class Prober:
    """Keeps the inventory of nodes that came without ``models`` (design 4, decision 15).

    A failed probe empties the node's models until the next success: a node we cannot ask
    is not one we should route to.
    """

    def __init__(self, engine: Engine, nodes: NodeSet, agent: IAgent, clock: IReactorTime,
                 should_probe: Callable[[Node], bool],
                 interval: float = constants.INVENTORY_PROBE_INTERVAL) -> None:
        self.engine, self.nodes, self.agent, self.clock = engine, nodes, agent, clock
        self.should_probe, self.interval = should_probe, interval
        self._loop: LoopingCall | None = None
        self._busy: set[str] = set()

    def start(self) -> None:
        self._loop = LoopingCall(self.probe_all)
        self._loop.clock = self.clock
        self._loop.start(self.interval, now=True)

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()

    def probe_all(self) -> Deferred:
        probes = [self.probe(node) for node in self.nodes.routable()
                  if self.should_probe(node) and node.id not in self._busy]
        return DeferredList(probes, consumeErrors=True) if probes else succeed(None)

    def probe(self, node: Node) -> Deferred:
        self._busy.add(node.id)
        path = self.engine.model_list.upstream_path
        d = fetch(self.agent, self.clock, node_url(node, path))

        def ok(result):
            status, _headers, body = result
            if status != 200:
                raise InventoryError(f"model list answered HTTP {status}")
            return [model_id for model_id, _ in model_entries(body, self.engine.model_list.envelope)]

        def done(models):
            self._busy.discard(node.id)
            if isinstance(models, Failure):
                log.debug("inventory probe of {node} failed: {why}", node=node.id,
                          why=models.getErrorMessage(), engine=self.engine.id)
                models = []
            self.nodes.set_models(node.id, self.engine, models)

        return d.addCallback(ok).addBoth(done)


# Credentials never fan out; bodies are parsed here, so no content coding is negotiated.
MODEL_LIST_STRIPPED = (b"host", b"content-length", b"authorization", b"cookie",
                       b"accept-encoding")


def fleet_model_list(agent: IAgent, clock: IReactorTime, nodes: list[Node], path: str,
                     envelope: str, headers: Headers) -> Deferred:
    """Ask every node concurrently and merge: first occurrence of an id wins, in node order.

    Fires with the merged body, or None when no node gave a valid list (all down or
    malformed). Credentials never fan out to the fleet (behaviours: model lists).
    """
    asks = [fetch(agent, clock, node_url(node, path), headers) for node in nodes]

    def merge(results):
        seen: set[str] = set()
        entries: list[dict] = []
        valid = 0
        for ok, result in results:
            if not ok:
                continue
            status, _headers, body = result
            if status != 200:
                continue
            try:
                pairs = model_entries(body, envelope)
            except InventoryError:
                continue
            valid += 1
            for model_id, entry in pairs:
                if model_id not in seen:
                    seen.add(model_id)
                    entries.append(entry)
        return envelope_body(envelope, entries) if valid else None

    return DeferredList(asks, consumeErrors=True).addCallback(merge)
