"""One facade's routing: who may serve a request, in which order, and who is left alone.

Everything a routing decision reads lives here: the node set, the ``node/select`` pin, the
scheduler's priority and the process-wide reservations (docs/references.md#owner-filter,
#owner-order, #reserve-least-loaded, #reservations), and the two overload protections the existing
proxy gained after production incidents (docs/decisions.md#busy-hold, #stall-cooldown):

- **Busy hold.** A node that answered 429 or 503 is held for a second: a new request whose
  owners are all held is answered 503 at once instead of being queued into engines that just
  said they are full (about 100 requests a second into a full Ollama queue built thousands of
  queued jobs and five times the engine load). An admitted request keeps its whole budget;
  held nodes only go last in its order.
- **Stall cooldown.** A node that used up a whole first-content budget without a byte goes to
  the back of the order for 30 s, so the next request does not pay that budget again. It is
  never excluded: a sole owner still serves.

Both are timestamps compared with the clock, not timers: nothing is left running when a
facade is idle. The broker and standalone mode change routing only through this class.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import attrs
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from zope.interface import implementer

from ..core import constants
from ..core.interfaces import IHealth, IOwners, ITruthSink, IWatchedAttempt
from ..core.logs import logger
from ..core.timers import cancel_pending
from ..core.views import EngineView, RoutingView
from ..nodes.discovery import Diff, Node, NodeSet
from ..nodes.engines import Engine
from ..nodes.selection import order, owners
from .affinity import AffinityTable
from .enginetruth import EngineTruth
from .fairshare import Contention
from .placement import Standing, rank_key, standing
from .rankindex import RankIndex
from .rates import NodeRates
from .reservations import ReservationMap
from .slotqueue import SlotQueue

log = logger()

# The statuses that mean "this engine's queue is full" (docs/decisions.md#busy-hold).
BUSY_STATUSES = frozenset({429, 503})


@implementer(IOwners, IHealth, ITruthSink)
@attrs.define(eq=False)
class Router:
    """One facade's routing state: the node set, the pin, holds and cooldowns, what the
    engines report and the rates measured, the target watch, and the view for ``/status``.
    The placement policy (tickets.py) decides over it; the queue and the affinity table are
    kept here as state the view shows."""

    engine: Engine
    clock: IReactorTime
    #: The process-wide claims and the scheduler's priority (a facade without a shared map,
    #: in tests, gets one of its own: nothing else claims on it).
    reservations: ReservationMap = attrs.Factory(ReservationMap)
    nodes: NodeSet = attrs.Factory(NodeSet)
    busy_hold: float = constants.BUSY_HOLD
    stall_cooldown: float = constants.STALL_COOLDOWN
    watch_interval: float = constants.TARGET_WATCH_INTERVAL
    _pin: str = ""
    _held: dict[str, float] = attrs.Factory(dict)
    _cooling: dict[str, float] = attrs.Factory(dict)
    _watched: set = attrs.Factory(set)
    _sweep: IDelayedCall | None = None
    #: Standalone placement (placement.py): owners ranked by what their engines report.
    #: Read once, when the router is made: it chooses how candidates are ordered.
    scheduling: bool = False
    #: Late binding (slotqueue.py): where requests wait when every owner is full; None keeps
    #: them going to the engines (broker mode, ``--no-late-binding``).
    queue: SlotQueue | None = None
    #: Affinity (affinity.py): the node that last committed each conversation; None: off.
    affinity: AffinityTable | None = None
    #: Each node's measured rates (standalone placement with affinity measures them).
    rates: dict[str, NodeRates] = attrs.Factory(dict)
    #: Called whenever a slot may have freed: an engine's report changed, or (standalone) one
    #: of our dispatches on a node of this fleet ended or moved away.
    on_freed: list[Callable[[], None]] = attrs.Factory(list)
    #: Which nodes lately ran work we did not send (fair share reads it).
    contention: Contention = attrs.Factory(Contention)
    _truth: dict[str, EngineTruth] = attrs.Factory(dict)
    _ended_since_read: dict[str, int] = attrs.Factory(dict)
    _last_traffic: float | None = None
    _order: Callable[[list[Node], str | None], list[Node]] = attrs.field(init=False)
    #: Standalone: each model's owners kept in rank order (rankindex.py); None under the
    #: broker, whose scheduler orders.
    index: RankIndex | None = attrs.field(default=None, init=False)
    _index_generation: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        # Chosen once: standalone ranks by what the engines report; the broker's order stands
        # with held and cooling nodes last.
        self._order = self.ranked if self.scheduling else self._held_last
        if self.scheduling:
            # Any of our dispatches ending frees a slot at once, whichever facade made it.
            self.reservations.on_release.append(self._released)
            self.index = RankIndex(self._rank_key)
            # One of ours starting on a node moves it in the ranking; one ending does in
            # ``_released``, after its end is counted.
            self.reservations.on_count.append(self.index.touch)

    # The node set.

    def routable(self) -> list[Node]:
        return self.nodes.routable()

    def is_routable(self, node_id: str) -> bool:
        """In the routable set now, whatever made a node leave (docs/references.md#routable-set)."""
        return node_id in self.nodes

    def replace_discovered(self, nodes: Iterable[Node]) -> Diff:
        """A discovery snapshot; a pin on a discovered node that vanished is cleared
        (docs/references.md#discovery-diff)."""
        previous = set(self.nodes.discovered)
        change = self.nodes.replace_discovered(nodes)
        if self._pin in previous and not self.nodes.known(self._pin):
            self._pin = ""
        if change.removed:
            self._forget_departed()
        return change

    def put_manual(self, node: Node) -> bool:
        return self.nodes.put_manual(node)

    def remove_manual(self, node_id: str) -> Node | None:
        """Remove a manual node; a pin on it goes with it (docs/references.md#manual-nodes)."""
        node = self.nodes.remove_manual(node_id)
        if node is not None and self._pin == node_id:
            self._pin = ""
        if node is not None:
            self._forget_departed()
        return node

    def _forget_departed(self) -> None:
        """A node that left the fleet leaves the affinity table and its measured rates."""
        known = {node.id for node in self.nodes.all()}
        if self.affinity is not None:
            self.affinity.forget_nodes_except(known)
        for node_id in [n for n in self.rates if n not in known]:
            del self.rates[node_id]

    def set_admission(
        self, admit: Callable[[Node], Node | None], state: Callable[[], object] | None = None
    ) -> None:
        """How a discovered node is reached (broker mode: self through the local backend,
        peers over pinned mutual TLS only), asked again whenever ``state()``, what its answers
        depend on, changes (without ``state``: at every read)."""
        self.nodes.admit, self.nodes.admit_state = admit, state
        self.nodes.changed()

    def check_self(self, is_self: Callable[[Node], bool]) -> None:
        """How this facade recognises itself among the nodes (selfcheck.py); asked now, and
        again on every ``recheck_self``."""
        self.nodes.is_self = is_self
        self.nodes.recheck_self()

    def recheck_self(self) -> None:
        """The facade's ports moved: a node that was self may no longer be, and another may
        now be (docs/references.md#self-by-address: re-checked on every change)."""
        self.nodes.recheck_self()

    def admission_changed(self) -> None:
        """Something admission reads changed (the local backend): the routable set is asked
        again, since it is otherwise kept between node-set changes."""
        self.nodes.changed()

    def set_models(self, node_id: str, models: Iterable[str]) -> None:
        """A probe's answer replaces the node's inventory (docs/references.md#probed-inventory): an
        empty list takes it out of every model's owners until the next success."""
        self.nodes.set_models(node_id, self.engine, models)

    # What the engines report (standalone mode's poller).

    def set_truth(self, node_id: str, truth: EngineTruth | None) -> None:
        """A node's latest read; None forgets it (the engine reports nothing). A read that
        shows a free slot lets a waiting request go (within one poll of the slot freeing)."""
        ended = self._ended_since_read.pop(node_id, 0)
        if truth is None:
            self._truth.pop(node_id, None)
            self.contention.forget(node_id)
        else:
            self._truth[node_id] = truth
            self.contention.read(node_id, truth, self.ours(node_id), ended, self.clock.seconds())
        if self.index is not None:
            self.index.touch(node_id)
        for freed in self.on_freed:
            freed()

    def wanted(self) -> frozenset[str]:
        """ITruthSink: the owners of every model requests wait for, and the nodes lately
        running work we did not send (fair share watches them); asked once a round, so
        O(nodes) a second at most, never per request."""
        ids = set(self.contention.recent(self.clock.seconds()))
        if self.queue is not None and len(self.queue):
            for model in self.queue.models():
                ids.update(node.id for node in self.candidates(model))
        return frozenset(ids)

    def truth_of(self, node_id: str) -> EngineTruth | None:
        return self._truth.get(node_id)

    def last_traffic(self) -> float | None:
        return self._last_traffic

    def admitted(self) -> None:
        """A request was admitted now: the poller reads engines more often while traffic
        flows."""
        self._last_traffic = self.clock.seconds()

    # The pin.

    @property
    def pin(self) -> str:
        return self._pin

    def set_pin(self, node_id: str) -> None:
        """``node/select``: "" clears; an unknown id is refused by the caller."""
        if node_id and not self.nodes.known(node_id):
            raise KeyError(node_id)
        self._pin = node_id

    # Ordering (docs/references.md#owner-filter, #owner-order).

    def priority(self) -> tuple[str, ...]:
        return self.reservations.priority

    def candidates(self, model: str | None) -> list[Node]:
        """The owners of ``model`` (normalized; None: every routable node) in the order a
        round tries them: pin, priority, id (standalone: ranked by what the engines report),
        then cooling nodes, then held ones last."""
        index = self.index
        if index is not None and model is not None:
            generation = self.reservations.generation
            if generation != self._index_generation:
                # A scheduler snapshot replaced every claim (never in standalone mode).
                self._index_generation = generation
                index.reset()
            return self._held_last(index.ranked(self.nodes.routable_map(), model), model)
        nodes = self.routable()
        if model is not None:
            nodes = owners(nodes, model)
        return self._order(order(nodes, self._pin, self.priority()), model)

    def _rank_key(self, node: Node, model: str | None) -> tuple:
        """``node``'s standing for ``model`` as ``ranked`` weighs it (held and cooling aside),
        its id last: the rank index's key."""
        node_id = node.id
        return (
            *rank_key(
                node,
                model,
                self._truth.get(node_id),
                self.ours(node_id),
                self._ended_since_read.get(node_id, 0),
            ),
            node_id,
        )

    def _held_last(self, ordered: list[Node], model: str | None) -> list[Node]:
        if not self._held and not self._cooling:
            return ordered
        now = self.clock.seconds()
        return sorted(
            ordered, key=lambda n: (self._is_held(n.id, now), self._is_cooling(n.id, now))
        )

    def standings(self, nodes: Sequence[Node], model: str | None) -> list[Standing]:
        """Each node's slots, busy count and warmth for ``model``, as placement weighs them."""
        truth, ended = self._truth, self._ended_since_read
        return [
            standing(node, model, truth.get(node.id), self.ours(node.id), ended.get(node.id, 0))
            for node in nodes
        ]

    def ranked(self, nodes: Sequence[Node], model: str | None) -> list[Node]:
        """Free before full, warm before cold, fewer busy, node id; held and cooling last."""
        if len(nodes) < 2:
            return list(nodes)  # nothing to weigh: one owner is the usual standalone case
        held, cooling = self._held, self._cooling
        now = self.clock.seconds()

        def key(node: Node) -> tuple:
            node_id = node.id
            return (
                bool(held) and self._is_held(node_id, now),
                bool(cooling) and self._is_cooling(node_id, now),
                self._rank_key(node, model),
            )

        return sorted(nodes, key=key)

    def ours(self, node_id: str) -> int:
        """Our dispatches in flight to ``node_id`` now."""
        return int(self.reservations.load(node_id))

    def rates_of(self, node_id: str) -> NodeRates | None:
        """The node's measured rates, made at first use; None for a node not in the fleet."""
        if node_id not in self.nodes:
            return None
        rates = self.rates.get(node_id)
        if rates is None:
            rates = self.rates[node_id] = NodeRates()
        return rates

    def _released(self, node_id: str) -> None:
        """One of our dispatches on ``node_id`` ended or moved away: the engine's last report
        still counts it, and a slot may be free."""
        if node_id not in self.nodes:
            return
        self._ended_since_read[node_id] = self._ended_since_read.get(node_id, 0) + 1
        if self.index is not None:
            self.index.touch(node_id)
        for freed in self.on_freed:
            freed()

    def busy_for(self, model: str) -> float | None:
        """Seconds until the longest hold ends when every owner of ``model`` is held, else
        None: one free owner turns the gate off (docs/decisions.md#busy-hold)."""
        if not self._held:
            return None  # the usual case: no owner worked out a second time per request
        now = self.clock.seconds()
        remaining = []
        for node in owners(self.routable(), model):
            until = self._held.get(node.id, now)
            if until <= now:
                return None
            remaining.append(until - now)
        return max(remaining) if remaining else None

    def model_owners(self, model: str) -> list[str]:
        """``node/model-owners``: exactly the candidates a request would try, in order."""
        nodes = self.candidates(model)
        if nodes and not self.pinned_first(nodes):
            chosen = self.reservations.pick(self.preferred_ids(nodes))
            nodes.sort(key=lambda n: n.id != chosen)
        return [n.id for n in nodes]

    # What attempts tell the router.

    def answered(self, node_id: str, status: int) -> None:
        """A busy answer holds the node (each renews the hold); any other status is a
        refusal, which says nothing about its queue. A commit clears a hold (``first_byte``)."""
        if status in BUSY_STATUSES:
            self._held[node_id] = self.clock.seconds() + self.busy_hold

    def first_byte(self, node_id: str) -> None:
        """The node produced content: it is neither stalled nor busy."""
        self._cooling.pop(node_id, None)
        self._held.pop(node_id, None)

    def stalled(self, node_id: str) -> None:
        """The node used up a whole first-content budget without a byte."""
        self._cooling[node_id] = self.clock.seconds() + self.stall_cooldown

    def held(self) -> dict[str, float]:
        """Held nodes and the seconds left on each hold (for status and metrics)."""
        return self._remaining(self._held)

    def cooling(self) -> dict[str, float]:
        """Cooling nodes and the seconds left on each cooldown."""
        return self._remaining(self._cooling)

    def view(self) -> RoutingView:
        """This facade's routing as the admin listener shows it, read now (views.py)."""
        routable = self.routable()
        queue = self.queue
        oldest = queue.oldest_since() if queue is not None else None
        now = self.clock.seconds()
        return RoutingView(
            pin=self._pin,
            nodes=tuple(node.view() for node in self.nodes.all()),
            routable=tuple(node.id for node in routable),
            held=tuple(self.held()),
            cooling=tuple(self.cooling()),
            engines=self._engine_views(routable) if self.scheduling else (),  # not a request's
            queued=len(queue) if queue is not None else 0,
            oldest_wait=None if oldest is None else now - oldest,
            clients_waiting=queue.clients() if queue is not None else 0,
            batch_waiting=queue.batch_waiting() if queue is not None else 0,
            affinity_keys=None
            if self.affinity is None
            else tuple(sorted(self.affinity.keys_per_node(now).items())),
        )

    def _engine_views(self, nodes: Sequence[Node]) -> tuple[EngineView, ...]:
        now = self.clock.seconds()
        views = []
        for node, item in zip(nodes, self.standings(nodes, None)):
            truth = self._truth.get(node.id)
            slots = truth.slots_for(None) if truth is not None else None
            warm = None if truth is None or truth.warm is None else tuple(sorted(truth.warm))
            rates = self.rates.get(node.id)
            views.append(
                EngineView(
                    node=node.id,
                    slots_total=item.total,
                    busy=item.busy,
                    ours=self.ours(node.id),
                    reported_busy=None if slots is None else slots.busy,
                    warm=warm,
                    read_age=None if truth is None else now - truth.read_at,
                    service=rates.service if rates else None,
                    prompt_rate=rates.prompt_rate if rates else None,
                    bytes_per_token=rates.bytes_per_token if rates else None,
                )
            )
        return tuple(views)

    # An attempt whose target left the routable set is abandoned
    # (docs/references.md#target-left-discovery).

    def watch(self, attempt: IWatchedAttempt) -> None:
        """Check ``attempt``'s target every ``watch_interval`` until ``unwatch``.

        One timer per facade sweeps every attempt in flight, rather than one per attempt: a
        timer per dispatch was a measurable share of a request's CPU
        (docs/references.md#bare-proxy-cpu).
        """
        self._watched.add(attempt)
        if self._sweep is None:
            self._sweep = self.clock.callLater(self.watch_interval, self._check_targets)

    def unwatch(self, attempt: IWatchedAttempt) -> None:
        self._watched.discard(attempt)
        if not self._watched:
            cancel_pending(self._sweep)
            self._sweep = None

    def _check_targets(self) -> None:
        self._sweep = None
        for attempt in list(self._watched):
            if attempt not in self._watched:
                continue  # a cancel earlier in this sweep ended it
            if not self.is_routable(attempt.node.id):
                self._watched.discard(attempt)
                try:
                    attempt.cancel("target left discovery")
                except Exception:
                    log.failure("cancelling an attempt whose target left", engine=self.engine.id)
        if self._watched and self._sweep is None:
            self._sweep = self.clock.callLater(self.watch_interval, self._check_targets)

    # What placement asks (tickets.py).

    def pinned_first(self, nodes: Sequence[Node]) -> bool:
        """Whether an eligible pin heads ``nodes`` (it takes no reservation)."""
        return bool(self._pin) and nodes[0].id == self._pin

    def is_held(self, node_id: str, now: float) -> bool:
        """Held at ``now`` (a decision reads the clock once)."""
        return self._is_held(node_id, now)

    def is_cooling(self, node_id: str, now: float) -> bool:
        """Cooling at ``now`` (a decision reads the clock once)."""
        return self._is_cooling(node_id, now)

    def preferred_ids(self, nodes: Sequence[Node]) -> list[str]:
        """Free nodes; else those only cooling (a busy hold is the stronger signal); else all."""
        now = self.clock.seconds()
        not_held = [n.id for n in nodes if not self._is_held(n.id, now)]
        free = [node_id for node_id in not_held if not self._is_cooling(node_id, now)]
        return free or not_held or [n.id for n in nodes]

    def _is_held(self, node_id: str, now: float) -> bool:
        return self._expires(self._held, node_id, now)

    def _is_cooling(self, node_id: str, now: float) -> bool:
        return self._expires(self._cooling, node_id, now)

    @staticmethod
    def _expires(table: dict[str, float], node_id: str, now: float) -> bool:
        until = table.get(node_id)
        if until is None:
            return False
        if until <= now:
            del table[node_id]
            return False
        return True

    def _remaining(self, table: dict[str, float]) -> dict[str, float]:
        now = self.clock.seconds()
        return {node_id: until - now for node_id, until in sorted(table.items()) if until > now}


def retry_after(seconds: float) -> int:
    """Whole seconds, rounded up, at least 1 (docs/decisions.md#busy-hold)."""
    return max(1, math.ceil(seconds))
