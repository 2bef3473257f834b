"""Model inventories: reading an engine's model list, probing nodes, and asking the fleet.

One parser serves both uses, so the ids a probe makes a node advertise are exactly the ids
the aggregated list shows to clients. Bodies are capped (16 MiB) and time-boxed (10 s) because
a model list comes from every node of the fleet and one bad node must not stall the rest.
The same fan-out carries CORS preflights (docs/references.md#browser-policy), eight at a time.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable, Sequence

import attrs
from twisted.application.internet import TimerService
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred, succeed
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent

from ..core import constants
from ..core.logs import logger
from ..http.loopguard import LoopGuard
from ..nodes.discovery import Node, host_port
from ..nodes.engines import Engine
from ..request.attempt import clean_end
from ..routing.router import Router

log = logger()


class InventoryError(Exception):
    """A model list that could not be read or is not the engine's envelope."""


@attrs.frozen
class Reply:
    """One upstream answer read whole (bodies are capped); ``node`` once the fleet was asked."""

    status: int
    phrase: bytes
    headers: Headers
    body: bytes
    node: Node | None = None


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
    # deliverBody connects a body receiver to the response's producer, not to a transport.
    transport: IPushProducer  # type: ignore[assignment]

    def __init__(self, done: Deferred, limit: int) -> None:
        self.done, self.limit, self.size = done, limit, 0
        self.parts: list[bytes] = []

    def dataReceived(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            self.transport.stopProducing()
            return
        self.parts.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.done.called:
            return
        if self.size > self.limit:
            self.done.errback(InventoryError("model list body over 16 MiB"))
        elif clean_end(reason):
            self.done.callback(b"".join(self.parts))
        else:
            self.done.errback(reason)


def fetch(
    agent: IAgent,
    clock: IReactorTime,
    url: bytes,
    headers: Headers | None = None,
    timeout: float = constants.MODEL_LIST_TIMEOUT,
    limit: int = constants.MODEL_LIST_MAX_BODY,
    method: bytes = b"GET",
) -> Deferred:
    """Ask ``url`` without a body; fires with a Reply or fails; never follows redirects."""
    request = maybeDeferred(agent.request, method, url, headers or Headers())

    def got(response):
        body: Deferred = Deferred(lambda d: protocol.transport.stopProducing())
        protocol = _Capped(body, limit)
        response.deliverBody(protocol)
        return body.addCallback(
            lambda data: Reply(response.code, response.phrase, response.headers, data)
        )

    request.addCallback(got)
    request.addTimeout(timeout, clock)
    return request


def node_url(node: Node, path: str, address: str | None = None) -> bytes:
    address = address if address is not None else node.dial_order()[0]
    return f"{node.scheme}://{host_port(address, node.port)}{path}".encode()


class _FanOut:
    """Every node asked, ``width`` at a time, none started or kept past the overall deadline.

    Each ask gets the time left as its own timeout, so the asks in flight at the deadline
    end there and the nodes still waiting are never asked. Cancelling stops the waiting ones
    and cancels those in flight; the fan-out then fires with what had answered.
    """

    def __init__(
        self,
        nodes: Sequence[Node],
        ask: Callable[[Node, float], Deferred],
        clock: IReactorTime,
        timeout: float,
        width: int | None,
    ) -> None:
        self.nodes, self.ask, self.clock = list(nodes), ask, clock
        self.deadline = clock.seconds() + timeout
        self.width = width or len(self.nodes)
        self.replies: list[Reply | None] = [None] * len(self.nodes)
        self.waiting = list(range(len(self.nodes)))
        self.running: dict[int, Deferred] = {}
        self.done: Deferred = Deferred(self._cancel)
        self._filling = False

    def start(self) -> Deferred:
        self._fill()
        return self.done

    def _fill(self) -> None:
        # An ask that fails synchronously lands inside this loop; the loop then goes on, so a
        # large fleet of such nodes never recurses.
        if self._filling:
            return
        self._filling = True
        while self.waiting and len(self.running) < self.width:
            remaining = self.deadline - self.clock.seconds()
            if remaining <= 0:
                self.waiting = []
                break
            index = self.waiting.pop(0)
            asked = maybeDeferred(self.ask, self.nodes[index], remaining)
            self.running[index] = asked
            asked.addBoth(self._landed, index)
        self._filling = False
        if not self.waiting and not self.running and not self.done.called:
            self.done.callback([reply for reply in self.replies if reply is not None])

    def _landed(self, result, index: int) -> None:
        self.running.pop(index, None)
        node = self.nodes[index]
        if isinstance(result, Failure):
            log.debug(
                "node {node} did not answer: {why}", node=node.id, why=result.getErrorMessage()
            )
        elif result.status >= 500:
            log.debug("node {node} answered HTTP {status}", node=node.id, status=result.status)
        else:
            self.replies[index] = attrs.evolve(result, node=node)
        self._fill()

    def _cancel(self, _: Deferred) -> None:
        self.waiting = []
        for asked in list(self.running.values()):
            asked.cancel()


def ask_fleet(
    nodes: Sequence[Node],
    ask: Callable[[Node, float], Deferred],
    clock: IReactorTime,
    *,
    timeout: float,
    width: int | None = None,
) -> Deferred:
    """Ask every node (``ask(node, time_left)`` fires with a Reply), ``width`` at a time.

    Fires with the replies of the nodes that answered, in node order. A node that is
    unavailable (transport error, timeout, body over its cap, any 5xx) is skipped: it is
    down or overloaded, and says nothing about the fleet's inventory or policy
    (docs/references.md#browser-policy).
    """
    return _FanOut(nodes, ask, clock, timeout, width).start()


class Prober(TimerService):
    """Keeps the inventory of nodes that came without ``models``
    (docs/references.md#probed-inventory, #probe-periods).

    A failed probe empties the node's models until the next success: a node we cannot ask
    is not one we should route to. A TimerService, so it runs exactly while its facade does.
    """

    def __init__(
        self,
        engine: Engine,
        router: Router,
        agent: IAgent,
        clock: IReactorTime,
        should_probe: Callable[[Node], bool],
        interval: float = constants.INVENTORY_PROBE_INTERVAL,
        agent_for: Callable[[Node], IAgent] | None = None,
        loop_guard: LoopGuard | None = None,
    ) -> None:
        super().__init__(interval, self.probe_all)
        # The router, not its node set: what a probe learns is a routing change
        # (docs/references.md#router-seam).
        self.engine, self.router, self.agent, self.clock = engine, router, agent, clock
        # The agent per node, as requests use it (TLS and key settings of the nodes file).
        self.agent_for = agent_for or (lambda node: agent)
        self.should_probe = should_probe
        # A probe of a node that is another proxy carries our Via too: its fan-out must not
        # ask us back without end.
        self.headers = (loop_guard or LoopGuard()).stamp(Headers())
        self._busy: dict[str, Deferred] = {}

    def stopService(self) -> Deferred:
        """Cancel the probes in flight: a silent node must not hold shutdown for the 10 s
        a model list may take."""
        for probe in list(self._busy.values()):
            probe.cancel()
        return super().stopService()

    def probe_all(self) -> Deferred:
        probes = [
            self.probe(node)
            for node in self.router.routable()
            if self.should_probe(node) and node.id not in self._busy
        ]
        return DeferredList(probes, consumeErrors=True) if probes else succeed(None)

    def probe(self, node: Node) -> Deferred:
        path = self.engine.model_list.upstream_path
        d = fetch(self.agent_for(node), self.clock, node_url(node, path), self.headers)
        self._busy[node.id] = d

        def ok(reply):
            pairs = listed_models(reply, self.engine.model_list.envelope)
            if pairs is None:
                raise InventoryError(f"no model list in an HTTP {reply.status} answer")
            return [model_id for model_id, _ in pairs]

        def done(models):
            if self._busy.get(node.id) is d:
                del self._busy[node.id]
            if isinstance(models, Failure):
                log.debug(
                    "inventory probe of {node} failed: {why}",
                    node=node.id,
                    why=models.getErrorMessage(),
                    engine=self.engine.id,
                )
                models = []
            self.router.set_models(node.id, models)

        return d.addCallback(ok).addBoth(done)


# Credentials never fan out; bodies are parsed here, so no content coding is negotiated.
MODEL_LIST_STRIPPED = (b"host", b"content-length", b"authorization", b"cookie", b"accept-encoding")


def listed_models(reply: Reply, envelope: str) -> list[tuple[str, dict]] | None:
    """The (id, entry) pairs of a valid inventory, or None.

    Only a 200 in the engine's envelope is an inventory: a redirect is not followed and is
    not one either (behaviours: model lists).
    """
    if reply.status != 200:
        return None
    try:
        return model_entries(reply.body, envelope)
    except InventoryError:
        return None


def merged_list(
    inventories: Iterable[list[tuple[str, dict]]],
    envelope: str,
    normalize: Callable[[str], str] = str,
) -> bytes:
    """One list in the engine's envelope: one record per model, the first occurrence winning,
    in node order, passed through unchanged (docs/references.md#model-list-merge).

    Ollama's native records are one model when their names normalise alike (``shared`` and
    ``shared:latest``), as routing treats them; OpenAI-envelope ids are compared exactly.
    """
    same = normalize if envelope != "openai" else str
    seen: set[str] = set()
    entries: list[dict] = []
    for pairs in inventories:
        for model_id, entry in pairs:
            key = same(model_id)
            if key not in seen:
                seen.add(key)
                entries.append(entry)
    return envelope_body(envelope, entries)
