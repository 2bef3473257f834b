"""Asking each node's engine what it is doing, in standalone mode (docs/decisions.md#engine-truth).

One read per node at a time, paced by the facade's traffic: about every second while it
admitted requests in the last minute, and never more than ten seconds apart when idle, so the
first read comes soon after start-up. Every interval is jittered, so a fleet of proxies does
not ask in step. The routes come from the engine file, and none of them loads a model: a read
that made an engine load one would be the very cold start placement tries to avoid.

What a read cannot say stays unknown: a refused connection, a 404 or a 501 (a llama-server
run with ``--no-slots``) leave the node ranked as if it had not been asked. An answer that
does not parse is warned about once per node per change of reason, and also leaves it unknown,
never free.
"""

from __future__ import annotations

from collections import deque
from typing import Callable
from urllib.parse import quote

from twisted.application.service import Service
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent

from ..core import constants
from ..core.interfaces import ITruthSink
from ..core.logs import logger
from ..core.timers import cancel_pending
from ..http.loopguard import LoopGuard
from ..nodes.discovery import Node
from ..nodes.engines import Engine
from ..routing.enginetruth import (
    EngineTruth,
    ModelStates,
    Slots,
    TruthError,
    read_loaded,
    read_models,
    read_slots,
)
from .inventory import Reply, fetch, node_url

log = logger()

#: Answers that mean "this engine does not report that": not an error, the node is unknown.
NOT_REPORTED = frozenset({404, 405, 501})


class TruthPoller(Service):
    """Keeps a facade's router told what each node's engine reports (``ITruthSink``)."""

    def __init__(
        self,
        engine: Engine,
        sink: ITruthSink,
        agent_for: Callable[[Node], IAgent],
        clock: IReactorTime,
        random: Callable[[], float],
        loop_guard: LoopGuard | None = None,
        active: float = constants.TRUTH_ACTIVE_INTERVAL,
        idle: float = constants.TRUTH_IDLE_INTERVAL,
        window: float = constants.TRUTH_TRAFFIC_WINDOW,
        jitter: float = constants.TRUTH_JITTER,
        timeout: float = constants.TRUTH_TIMEOUT,
    ) -> None:
        self.engine, self.sink, self.agent_for, self.clock = engine, sink, agent_for, clock
        self.random = random
        self.active, self.idle, self.window, self.jitter = active, idle, window, jitter
        self.timeout = timeout
        # A read of a node that is another proxy carries our Via, like every request we send.
        self.headers = (loop_guard or LoopGuard()).stamp(Headers())
        self._reading: dict[str, Deferred] = {}
        self._warned: dict[str, str] = {}
        self._timer: IDelayedCall | None = None
        #: The round's nodes still to read, in slices (``_read_slice``), and its timer.
        self._round: deque[Node] = deque()
        self._slice_size = 1
        self._slice_timer: IDelayedCall | None = None
        #: When every node was last asked (None: never): a large fleet is asked whole at the
        #: idle pace, and between such rounds only what placement needs (``ITruthSink.wanted``).
        self._whole_at: float | None = None

    @property
    def asks(self) -> bool:
        """Whether this engine declares any truth route at all."""
        truth = self.engine.truth
        return any((truth.slots, truth.loaded, truth.models))

    def startService(self) -> None:
        super().startService()
        if self.asks:
            # The first read soon after start-up, jittered like the rest.
            self._schedule(self.active)

    def stopService(self) -> Deferred | None:
        cancel_pending(self._timer)
        cancel_pending(self._slice_timer)
        self._timer = self._slice_timer = None
        self._round.clear()
        for reading in list(self._reading.values()):
            reading.cancel()
        return super().stopService()

    def busy(self) -> bool:
        """Whether the facade admitted a request within the traffic window."""
        last = self.sink.last_traffic()
        return last is not None and self.clock.seconds() - last < self.window

    def interval(self) -> float:
        """Seconds to the next round: short while the facade has traffic, else the idle pace."""
        return self.active if self.busy() else self.idle

    def _schedule(self, base: float) -> None:
        delay = base * (1 + self.jitter * (2 * self.random() - 1))
        self._timer = self.clock.callLater(delay, self.poll)

    def poll(self) -> None:
        """One round: the nodes it asks (``chosen``) not still answering the last one, spread
        over the round's interval in slices."""
        self._timer = None
        interval = self.interval()
        nodes = self.chosen(self.sink.routable(), interval)
        cancel_pending(self._slice_timer)
        self._round = deque(node for node in nodes if node.id not in self._reading)
        count = len(self._round)
        slices = constants.TRUTH_SLICES
        self._slice_size = count if count <= slices else -(-count // slices)
        self._read_slice(interval / constants.TRUTH_SLICES)
        if self.running:
            self._schedule(interval)

    def chosen(self, nodes: list[Node], interval: float) -> list[Node]:
        """A round's nodes: all of them, unless a large fleet's facade is busy, which asks
        every node at the idle pace and, between, only those placement needs now."""
        now = self.clock.seconds()
        whole = self._whole_at is None or now - self._whole_at >= self.idle * (1 - self.jitter)
        if len(nodes) <= constants.TRUTH_ALL_ACTIVE or interval >= self.idle or whole:
            self._whole_at = now
            return nodes
        wanted = self.sink.wanted()
        return [node for node in nodes if node.id in wanted] if wanted else []

    def _read_slice(self, gap: float) -> None:
        self._slice_timer = None
        for _ in range(min(self._slice_size, len(self._round))):
            node = self._round.popleft()
            if node.id not in self._reading:
                self.read(node)
        if self._round and self.running:
            self._slice_timer = self.clock.callLater(gap, self._read_slice, gap)

    def read(self, node: Node) -> Deferred:
        reading = self._read(node)
        self._reading[node.id] = reading

        def done(result: object) -> None:
            if self._reading.get(node.id) is reading:
                del self._reading[node.id]

        reading.addBoth(done)
        return reading

    @inlineCallbacks
    def _read(self, node: Node):
        read_at = self.clock.seconds()
        try:
            truth = yield self._ask(node, read_at)
        except TruthError as error:
            self._warn(node, str(error))
            truth = None
        except Exception as error:  # refused, reset, timed out: the engine said nothing
            log.debug(
                "engine truth of {node} unavailable: {why}",
                node=node.id,
                why=error.__class__.__name__,
                engine=self.engine.id,
            )
            truth = None
        else:
            self._warned.pop(node.id, None)
            log.debug(
                "engine truth of {node} read: {said}",
                node=node.id,
                said="nothing" if truth is None else "slots and models",
                engine=self.engine.id,
            )
        if self.sink.is_routable(node.id):
            self.sink.set_truth(node.id, truth)

    @inlineCallbacks
    def _ask(self, node: Node, read_at: float):
        routes = self.engine.truth
        normalize = self.engine.normalize_model
        states = ModelStates(None, False)
        if routes.loaded is not None:
            body = yield self._get(node, routes.loaded)
            if body is not None:
                states = ModelStates(read_loaded(body, normalize), False)
        elif routes.models is not None:
            body = yield self._get(node, routes.models)
            if body is not None:
                states = read_models(
                    body, normalize, listed_are_loaded=self.engine.inventory_source == "loaded"
                )
        slots: Slots | None = None
        model_slots: dict[str, Slots] = {}
        if routes.slots is not None:
            if states.per_model:
                # A llama.cpp router answers /slots only for a named model, and asking about
                # an unloaded one could load it: only loaded models are asked.
                for model in sorted(states.warm or ())[: constants.TRUTH_MAX_MODEL_SLOTS]:
                    body = yield self._get(node, f"{routes.slots}?model={quote(model, safe='')}")
                    if body is not None:
                        model_slots[model] = read_slots(body)
            else:
                body = yield self._get(node, routes.slots)
                if body is not None:
                    slots = read_slots(body)
        if slots is None and not model_slots and states.warm is None:
            return None
        return EngineTruth(read_at=read_at, slots=slots, warm=states.warm, model_slots=model_slots)

    @inlineCallbacks
    def _get(self, node: Node, path: str):
        """The body of a 200, None when the engine does not report this; else TruthError."""
        reply: Reply = yield fetch(
            self.agent_for(node),
            self.clock,
            node_url(node, path),
            self.headers,
            timeout=self.timeout,
            limit=constants.TRUTH_MAX_BODY,
        )
        if reply.status == 200:
            return reply.body
        if reply.status in NOT_REPORTED or reply.status == 400:
            # 400: a llama.cpp router asked /slots without a model.
            return None
        raise TruthError(f"HTTP {reply.status} from {path.split('?', 1)[0]}")

    def _warn(self, node: Node, why: str) -> None:
        if self._warned.get(node.id) == why:
            return
        self._warned[node.id] = why
        log.warn(
            "engine truth of node {node} not understood ({why}); placing it as unknown",
            node=node.id,
            why=why,
            engine=self.engine.id,
        )
