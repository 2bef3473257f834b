"""Placement policies and the routing ticket each gives a request (docs/architecture.md).

A facade's placement policy is chosen once, when the facade is wired: ``Standalone`` ranks
owners by what their engines report and lets requests wait in the facade's queue (late
binding) or for their conversation's node (affinity); ``Brokered`` spreads by the
reservation chooser among the broker's candidates; ``Direct`` places nothing (the mutual-TLS
ingress, and a facade without a reservation map). Nothing on the request path asks which one
it has.

At admission the policy makes one ``ITicket`` for the request. The ticket carries what is
the request's own in routing: its conversation's key and how affinity placed it, its claim on
a node (the reservation), its place in the queue, and what its end teaches the policy (the
node's rates). The dispatch loop asks the ticket where to go next, the exchange tells it how
the request ended; neither holds routing state of its own.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, Sequence

import attrs
from zope.interface import implementer

from ..core.interfaces import IPlacement, ITicket, IWaitSink
from ..http.server import BoundedRequest
from ..nodes.discovery import Node
from .affinity import (
    AffinityTable,
    affinity_key,
    previous_response,
    response_id_in,
    response_key,
    shared_head,
)
from .clients import client_of, is_batch
from .fairshare import RETRY_MIN, hold_for
from .fairshare import retry_after as fair_retry_after
from .placement import Standing
from .rates import MIN_PROMPT_TOKENS, RATE_READ_INTERVAL, PromptReading
from .reservations import Reservation, ReservationMap
from .router import Router
from .slotqueue import SlotQueue, Waiter


@attrs.frozen
class Policy:
    """How a process's facades place requests, fixed at start-up from the command line and
    handed on as one value: which placement policy each facade is given (``placement_for``
    in facade.py), and what it is made with."""

    #: Rank owners by what their engines report (standalone mode); else the broker's order.
    ranking: bool = False
    #: Late binding with this bound on new arrivals (``--queue-depth``); None: off.
    queue_depth: int | None = None
    #: Send a conversation back to the node that holds its cache.
    affinity: bool = False
    #: A conversation that spilled stays bound to its node before (``--affinity-spill keep``).
    spill_keeps: bool = False
    #: Answers say why they went where they did (``--placement-header``).
    placement_header: bool = False


@attrs.frozen
class Wait:
    """A round's answer when the request should wait in the facade's queue instead of
    going: every owner is full, or its conversation's node is worth waiting for."""

    #: Ahead of new arrivals: it already spent a dispatch (a failover).
    ahead: bool
    #: The node it waits for while another is free, and for how long at most (affinity).
    prefer: str | None = None
    patience: float | None = None
    #: Seconds it is expected to hold a slot of ``prefer``: what it adds to the work ahead of
    #: the next request that weighs waiting for that node (the spill rule).
    work: float = 0.0


#: What a round (``place``) or the next dispatch (``next``) answers: the nodes in the order
#: to try them, or wait.
Plan = list[Node] | Wait


@attrs.frozen
class Placed:
    """How a request was placed, for the admin listener and the placement header."""

    #: How affinity placed it (none, miss, hit, head, spill, evicted), None when it is off.
    affinity: str | None = None
    #: Why it went where it did (``ReservedTicket.placement_reason``), None when nothing
    #: was placed (no workload) or it never committed.
    reason: str | None = None
    #: Seconds it waited in the facade's queue.
    waited: float = 0.0


NOT_PLACED = Placed()


@implementer(ITicket)
class PassTicket:
    """The ticket of a request that reserves nothing: the candidates are tried as they
    come, each dispatch claims nothing, and it never waits (a request without a workload,
    or any request of a ``Direct`` placement)."""

    placed = NOT_PLACED

    def place(self, candidates: list[Node], ahead: bool) -> Plan:
        return candidates

    def next(self, queue: list[Node], failed: bool) -> Node | Wait:
        return queue.pop(0)

    def wait(self, plan: Wait, deadline: float, sink: IWaitSink) -> None:
        raise AssertionError("a request that reserves nothing never waits")

    def retry_after(self) -> int:
        return RETRY_MIN

    def release(self) -> None:
        """Nothing is held."""

    def committed(self, node_id: str, status: int, head: bytes = b"") -> Reservation | None:
        return None

    def measured(self, node_id: str, seconds: float, figures: Callable[[], Any]) -> None:
        """Nothing is learned from it."""


PASS = PassTicket()


@implementer(ITicket)
class MeteredPass(PassTicket):
    """A request that reserves nothing under standalone placement: its end still teaches
    the placement's rate meter (a null one without affinity)."""

    def __init__(self, meter: "RateMeter | NoMeter", size: int) -> None:
        self.meter, self.size = meter, size

    def measured(self, node_id: str, seconds: float, figures: Callable[[], Any]) -> None:
        self.meter.measured(node_id, seconds, figures, self.size)


@implementer(IPlacement)
class Direct:
    """No placement: one pass over the candidates as they come, nothing reserved, nothing
    queued (the ingress forwards to its one backend; its engine's queue is the one to wait
    in)."""

    def refuses(self, nodes: Sequence[Node], model: str | None) -> bool:
        return False

    def ticket(
        self, model: str | None, size: int, request: BoundedRequest, body: Any, reserve: bool
    ) -> ITicket:
        return PASS

    def retry_after(self, nodes: Sequence[Node], model: str | None) -> int:
        return RETRY_MIN

    def hold_offers(self) -> None:
        """Nothing waits, so nothing is offered."""

    def offer_held(self) -> None:
        """Nothing waits, so nothing is offered."""


@implementer(ITicket)
class ReservedTicket:
    """A workload's ticket: its claim on the node it goes to (docs/references.md#reservations),
    moved with each dispatch, handed over at the commit, released when it backs off, waits or
    ends."""

    #: The key names a previous Responses answer (``previous_response_id``): its node is the
    #: one that holds that answer's state, so the request goes there while it is an owner.
    pinned = False
    #: An OpenAI Responses request: its answer's id is learned at the commit.
    responses = False
    #: A new conversation's shared head (affinity.shared_head), longest first, and its bytes:
    #: it goes to a node that served that head lately, whose engine may still hold it.
    heads: tuple[bytes, ...] = ()
    head_size = 0
    #: The node that served the head when the request was placed there, None when not.
    head_node: str | None = None
    #: Why it went where it did, once it committed (docs/operations.md#placement): pinned,
    #: affine, head, spill, failover, queued, free, warm, least-busy or priority.
    placement_reason: str | None = None
    #: Seconds it waited in the facade's queue, all its waits together.
    waited = 0.0
    #: The node its last round placed first, and why that one (``IPlacement.why``).
    _first: str | None = None
    _ranked = "priority"

    def __init__(self, placement: "Brokered", model: str, key: bytes | None) -> None:
        self.placement, self.model, self.key = placement, model, key
        self.reservation: Reservation | None = None
        #: The node that last committed the conversation (affinity), None when none.
        self.affine = placement.conversations.node_for(key)
        #: How affinity placed it (a metrics label): none, miss, hit or spill; None when off.
        self.affinity: str | None = placement.conversations.label(key, self.affine)

    @property
    def placed(self) -> Placed:
        return Placed(self.affinity, self.placement_reason, self.waited)

    def place(self, candidates: list[Node], ahead: bool) -> Plan:
        # Asked at every round: another request of the conversation may have moved it.
        affine = self.placement.conversations.node_for(self.key)
        nodes, self.reservation = self.placement.place(candidates, affine)
        return self._placed(nodes)

    def _placed(self, nodes: list[Node]) -> list[Node]:
        """A round placed ``nodes`` first to last: remember which went first, and why."""
        if nodes:
            self._first = nodes[0].id
            self._ranked = self.placement.why(nodes, self.model)
        return nodes

    def next(self, queue: list[Node], failed: bool) -> Node | Wait:
        """The next node to try, popped from ``queue``: after a failure in this round the
        least loaded remaining owner, not the list's head."""
        reservation = self.reservation
        if reservation is not None and failed:
            plan = self.placement.fail_over(queue, self.model)
            if isinstance(plan, Wait):
                return plan
            queue[:] = plan
        node = queue.pop(0)
        if reservation is not None:
            reservation.move(node.id)
        return node

    def wait(self, plan: Wait, deadline: float, sink: IWaitSink) -> None:
        raise AssertionError("the broker's candidates never make a request wait")

    def retry_after(self) -> int:
        """Nothing waits under the broker: come back in a second."""
        return RETRY_MIN

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None

    def committed(self, node_id: str, status: int, head: bytes = b"") -> Reservation | None:
        """The node committed: its cache holds the conversation now (and a Responses answer's
        state, named by the id in its ``head``), and the claim goes with the commit (the
        stream holds the node until it ends)."""
        key = self.key
        if key is not None and status < 400:
            conversations = self.placement.conversations
            conversations.committed(key, node_id, spilled=self.affine not in (None, node_id))
            if self.responses:
                conversations.responded(self.model, head, node_id)
            if self.heads:
                conversations.served_head(self.heads, node_id)
                if node_id == self.head_node:
                    self.affinity = "head"
        if self.affine is not None:
            self.affinity = "hit" if node_id == self.affine else "spill"
        self.placement_reason = self._reason(node_id)
        reservation, self.reservation = self.reservation, None
        return reservation

    def _reason(self, node_id: str) -> str:
        """Why the request committed on ``node_id``: the first that applies of its
        Responses pin, its conversation (affinity), a failover, a wait, and its rank."""
        if self.pinned and node_id == self.affine:
            return "pinned"
        if self.affinity in _BY_AFFINITY:
            return _BY_AFFINITY[self.affinity]
        if node_id != self._first:
            return "failover"
        if self.waited:
            return "queued"
        return self._ranked

    def measured(self, node_id: str, seconds: float, figures: Callable[[], Any]) -> None:
        """The broker's placement learns nothing from a request's end."""


class Conversations:
    """Affinity on: each request's conversation key (routing/affinity.py; never logged, nor
    anything derived from it) and the node that last committed it."""

    def __init__(self, table: AffinityTable, clock) -> None:
        self.table, self.clock = table, clock

    def key(self, request: BoundedRequest, body: Any, model: str) -> bytes | None:
        return affinity_key(request.requestHeaders, body, model, request.path.decode("latin-1"))

    def heads(self, body: Any, model: str) -> tuple[tuple[bytes, ...], int]:
        """A new conversation's head digests and the head's bytes."""
        return shared_head(body, model)

    def head_node(self, heads: tuple[bytes, ...]) -> str | None:
        """The node that lately served the longest of ``heads``, None when none did."""
        now = self.clock.seconds()
        for digest in heads:
            node = self.table.node_for(digest, now)
            if node is not None:
                return node
        return None

    def served_head(self, heads: tuple[bytes, ...], node_id: str) -> None:
        now = self.clock.seconds()
        for digest in heads:
            self.table.committed(digest, node_id, now)

    def previous(self, body: Any, model: str) -> bytes | None:
        """The key of the Responses answer the request continues, None when it names none."""
        named = previous_response(body)
        return None if named is None else response_key(model, named)

    def responded(self, model: str, head: bytes, node_id: str) -> None:
        """A Responses answer committed on ``node_id``: its id, read from its head, points
        there (a digest, never the id)."""
        named = response_id_in(head)
        if named is not None:
            self.table.committed(response_key(model, named), node_id, self.clock.seconds())

    def node_for(self, key: bytes | None) -> str | None:
        """The node that last committed ``key``'s conversation, None when none."""
        return None if key is None else self.table.node_for(key, self.clock.seconds())

    def label(self, key: bytes | None, affine: str | None) -> str | None:
        """How affinity placed a request at admission: none (no key), miss (a new key) or,
        until its commit says hit, spill."""
        return "none" if key is None else "miss" if affine is None else "spill"

    def committed(self, key: bytes, node_id: str, spilled: bool = False) -> None:
        self.table.committed(key, node_id, self.clock.seconds(), spilled)

    def evicted(self, key: bytes | None) -> bool:
        return key is not None and self.table.is_evicted(key)

    def prompt_of(self, key: bytes | None) -> int | None:
        """The prompt tokens ``key``'s last answer saw (what its node's engine keeps of
        it), None when its engine did not say."""
        return None if key is None else self.table.prompt_of(key)

    def answered(self, key: bytes, seen: int, cached: int, hit: bool) -> bool:
        """A committed answer of ``key``'s conversation said its engine saw ``seen`` prompt
        tokens and took ``cached`` from its cache. True for a ``hit`` whose node's cache had
        lost the conversation (it reused less than half of what the previous answer saw),
        which the table then remembers (docs/decisions.md#affinity)."""
        before = self.table.prompt_seen(key, seen)
        if not hit or before is None or cached * 2 >= before:
            return False
        self.table.evicted(key)
        return True


class NoConversations:
    """Affinity off: no request has a key, and nothing is looked up or remembered."""

    def key(self, request: BoundedRequest, body: Any, model: str) -> None:
        return None

    def heads(self, body: Any, model: str) -> tuple[tuple[bytes, ...], int]:
        return (), 0

    def head_node(self, heads: tuple[bytes, ...]) -> None:
        return None

    def served_head(self, heads: tuple[bytes, ...], node_id: str) -> None:
        pass

    def previous(self, body: Any, model: str) -> None:
        return None

    def responded(self, model: str, head: bytes, node_id: str) -> None:
        pass

    def node_for(self, key: bytes | None) -> None:
        return None

    def label(self, key: bytes | None, affine: str | None) -> None:
        return None

    def committed(self, key: bytes, node_id: str, spilled: bool = False) -> None:
        pass

    def evicted(self, key: bytes | None) -> bool:
        return False

    def prompt_of(self, key: bytes | None) -> None:
        return None

    def answered(self, key: bytes, seen: int, cached: int, hit: bool) -> bool:
        return False


NO_CONVERSATIONS = NoConversations()


@implementer(IPlacement)
class Brokered:
    """Broker mode: the cluster's scheduler ranks (the router's candidates come in its
    order), and the reservation chooser spreads a burst over the least loaded
    (docs/references.md#reserve-least-loaded). Opt-in affinity (``--affinity``) only breaks the
    chooser's tie among equally loaded listed candidates."""

    def __init__(
        self, router: Router, reservations: ReservationMap, affinity: AffinityTable | None = None
    ) -> None:
        self.router, self.reservations = router, reservations
        self.clock = router.clock
        # Chosen once: with affinity off a request has no key, and no lookup runs.
        self.conversations: Conversations | NoConversations = (
            NO_CONVERSATIONS if affinity is None else Conversations(affinity, self.clock)
        )

    def refuses(self, nodes: Sequence[Node], model: str | None) -> bool:
        return False

    def ticket(
        self, model: str | None, size: int, request: BoundedRequest, body: Any, reserve: bool
    ) -> ITicket:
        self.router.admitted()
        if not reserve or model is None:
            return self.unreserved(size)
        # Never logged, nor anything derived from it (routing/affinity.py).
        conversations = self.conversations
        previous = conversations.previous(body, model)
        key = conversations.key(request, body, model) if previous is None else previous
        ticket = self.make(model, key, size, request)
        ticket.pinned = previous is not None
        ticket.responses = request.path.endswith(b"/responses")
        if key is not None and ticket.affine is None and previous is None:
            # A new conversation (the usual first turn): its head may be known elsewhere.
            ticket.heads, ticket.head_size = conversations.heads(body, model)
        return ticket

    def make(
        self, model: str, key: bytes | None, size: int, request: BoundedRequest | None = None
    ) -> ReservedTicket:
        return ReservedTicket(self, model, key)

    def unreserved(self, size: int) -> ITicket:
        """The ticket of a request that reserves nothing (no workload)."""
        return PASS

    def retry_after(self, nodes: Sequence[Node], model: str | None) -> int:
        """The cluster's scheduler decides when there is room: come back in a second."""
        return RETRY_MIN

    def hold_offers(self) -> None:
        """Nothing waits, so nothing is offered."""

    def offer_held(self) -> None:
        """Nothing waits, so nothing is offered."""

    # What its tickets ask, over a round's candidates or what is left of them (never none).

    def why(self, nodes: Sequence[Node], model: str | None) -> str:
        """Why ``nodes[0]`` went first: the ``node/select`` pin, or the scheduler's order."""
        return "pinned" if self.router.pinned_first(nodes) else "priority"

    def place(
        self, nodes: Sequence[Node], affine: str | None
    ) -> tuple[list[Node], Reservation | None]:
        """Reserve the least loaded candidate and move it to the front; an eligible pin
        first takes no reservation. The chooser skips held and cooling nodes unless all
        candidates are (docs/decisions.md#busy-hold, #stall-cooldown)."""
        nodes = list(nodes)
        if self.router.pinned_first(nodes):
            return nodes, None
        reservation = self.reservations.choose(self.router.preferred_ids(nodes), prefer=affine)
        if reservation is None:
            return nodes, None
        return sorted(nodes, key=lambda n: n.id != reservation.node_id), reservation

    def fail_over(self, remaining: Sequence[Node], model: str) -> Plan:
        """Failover goes to the least loaded remaining owner, not the list's head."""
        chosen = self.reservations.pick(self.router.preferred_ids(remaining))
        return sorted(remaining, key=lambda n: n.id != chosen)


@implementer(ITicket)
class StandaloneTicket(ReservedTicket):
    """A workload's ticket under standalone placement: it may wait in the facade's queue
    (late binding), once for its conversation's node (affinity), and its end teaches the
    placement the node's rates."""

    placement: "Standalone"

    def __init__(
        self,
        placement: "Standalone",
        model: str,
        key: bytes | None,
        size: int,
        request: BoundedRequest | None = None,
    ) -> None:
        super().__init__(placement, model, key)
        self.size = size
        #: Who the request is and whether it is batch work: read only if it waits.
        self.request = request
        self.waiter: Waiter | None = None
        #: A request waits for its conversation's node at most once (the spill rule's bound).
        self.waited_for_affine = False
        #: Its hold ran out (fair share): it goes to an owner even when every one is full,
        #: to wait in that engine's own queue.
        self.forced = False

    def place(self, candidates: list[Node], ahead: bool) -> Plan:
        placement = self.placement
        if self.forced:
            self.forced = False
            nodes, self.reservation = placement.place(candidates, None)
            return self._placed(nodes)
        # Asked at every round: another request of the conversation may have moved it.
        conversations = placement.conversations
        affine = conversations.node_for(self.key)
        if self.pinned and affine is not None and any(n.id == affine for n in candidates):
            # A previous answer's state lives on its node: there, waiting while it is full.
            if placement.all_full([n for n in candidates if n.id == affine], self.model):
                return Wait(ahead=ahead, prefer=affine)
            nodes, self.reservation = placement.place(candidates, affine)
            return self._placed(nodes)
        if placement.all_full(candidates, self.model):
            return Wait(ahead=ahead)
        kept = kept_size = None
        if affine is None and self.heads:
            # A new conversation whose head a node served lately: there, as its own node
            # would be, where it reads anew all but the head (docs/decisions.md#affinity).
            affine = self.head_node = conversations.head_node(self.heads)
            kept_size = self.head_size
        elif affine is not None:
            kept = conversations.prompt_of(self.key)
        if (
            affine is not None
            and not self.waited_for_affine
            and not conversations.evicted(self.key)
        ):
            waiting = placement.affinity_wait(
                candidates, self.model, affine, self.size, kept, kept_size
            )
            if waiting is not None:
                self.waited_for_affine = True
                return attrs.evolve(waiting, ahead=ahead)
        nodes, self.reservation = placement.place(candidates, affine)
        return self._placed(nodes)

    def wait(self, plan: Wait, deadline: float, sink: IWaitSink) -> None:
        """Wait in the facade's queue, costing no attempt and holding no reservation, until
        a slot frees (``sink.slot_freed``) or the deadline (``sink.queue_deadline``)."""
        self.release()
        clock = self.placement.clock
        began = clock.seconds()

        def woken() -> None:
            waiter, self.waiter = self.waiter, None
            self.forced = waiter is not None and waiter.forced
            self.waited += clock.seconds() - began
            sink.slot_freed()

        def expired() -> None:
            self.waiter = None
            self.waited += clock.seconds() - began
            sink.queue_deadline()

        self.waiter = self.placement.wait(self.model, deadline, woken, expired, plan, self.request)

    def retry_after(self) -> int:
        """When a request that waited out its deadline should come back."""
        placement = self.placement
        return placement.retry_after(placement.router.candidates(self.model), self.model)

    def release(self) -> None:
        super().release()
        if self.waiter is not None:
            waiter, self.waiter = self.waiter, None
            self.placement.unwait(waiter)

    def measured(self, node_id: str, seconds: float, figures: Callable[[], Any]) -> None:
        """A committed request below 400 ended on ``node_id``, ``seconds`` after its
        dispatch: the node's time to serve one, and (at most once a second per node) the
        prompt figures its response's tail said. A conversation's answer is read each time:
        what its engine reused checks a hit (``figures`` reads the tail once however often
        it is asked: body/tokens.BodyObserver)."""
        placement = self.placement
        if self.key is not None:
            read = figures()
            seen, cached = read.prompt_seen, read.prompt_cached
            if seen and cached is not None and seen >= MIN_PROMPT_TOKENS:
                hit = self.affinity == "hit"
                if placement.conversations.answered(self.key, seen, cached, hit):
                    self.affinity = "evicted"
        placement.measured(node_id, seconds, figures, self.size)


class RateMeter:
    """What a request's end teaches standalone placement with affinity: the node's time to
    serve one request (dispatch to end), and its prompt figures, read from a response's tail
    at most once a second per node (so placement's rates cost O(nodes) a second, not a parse
    per request)."""

    def __init__(self, router: Router) -> None:
        self.router, self.clock = router, router.clock

    def measured(self, node_id: str, seconds: float, figures: Callable[[], Any], size: int) -> None:
        rates = self.router.rates_of(node_id)
        if rates is None:
            return
        now = self.clock.seconds()
        if rates.rate_read_at is None or now - rates.rate_read_at >= RATE_READ_INTERVAL:
            read = figures()
            rates.rate_read(
                PromptReading(size=size)
                if read is None
                else PromptReading(
                    rate=read.prompt_rate, read=read.prompt_read, seen=read.prompt_seen, size=size
                ),
                now,
                seconds,
            )
        rates.served(seconds)

    def dispatched(self, node_id: str) -> None:
        """A request was placed on ``node_id`` now: how far the one in its slot has come."""
        rates = self.router.rates_of(node_id)
        if rates is not None:
            rates.dispatched_at = self.clock.seconds()


class NoMeter:
    """Without affinity nothing reads the rates, so nothing is measured."""

    def measured(self, node_id: str, seconds: float, figures: Callable[[], Any], size: int) -> None:
        pass

    def dispatched(self, node_id: str) -> None:
        pass


NO_METER = NoMeter()


@implementer(IPlacement)
class Standalone(Brokered):
    """Standalone mode without late binding (``--no-late-binding``): owners ranked by what
    their engines report (the router ranks its candidates so), the first reserved; a
    conversation's node goes first when it is free to (affinity, when ``affinity`` is
    given). Nothing waits: every request goes to the engines
    (docs/decisions.md#standalone-placement, #affinity)."""

    def __init__(
        self, router: Router, reservations: ReservationMap, affinity: AffinityTable | None = None
    ) -> None:
        super().__init__(router, reservations, affinity)
        # Chosen once: only the spill rule (affinity) reads the rates, so only then are they
        # measured.
        self.meter: RateMeter | NoMeter = NO_METER if affinity is None else RateMeter(router)

    def make(
        self, model: str, key: bytes | None, size: int, request: BoundedRequest | None = None
    ) -> ReservedTicket:
        return StandaloneTicket(self, model, key, size, request)

    def unreserved(self, size: int) -> ITicket:
        """A request without a workload reserves nothing, yet its end on a node is measured
        as every request's is (the node's time to serve one, its prompt figures)."""
        return MeteredPass(self.meter, size)

    def all_full(self, nodes: Sequence[Node], model: str | None) -> bool:
        """Whether a request should wait instead of going to ``nodes``: never, here."""
        return False

    def affinity_wait(
        self,
        nodes: Sequence[Node],
        model: str,
        affine: str,
        size: int,
        kept: float | None = None,
        kept_size: int | None = None,
    ) -> Wait | None:
        """Whether to wait for the conversation's node: never, here (nothing waits)."""
        return None

    def wait(
        self,
        model: str,
        deadline: float,
        wake: Callable[[], None],
        expire,
        plan: Wait,
        request: BoundedRequest | None,
    ) -> Waiter:
        raise AssertionError("without late binding nothing waits")

    def unwait(self, waiter: Waiter) -> None:
        raise AssertionError("without late binding nothing waits")

    def place(
        self, nodes: Sequence[Node], affine: str | None
    ) -> tuple[list[Node], Reservation | None]:
        """The first ranked node is the placement, unless the conversation's node is free to
        take it; an eligible pin first takes no reservation."""
        nodes = list(nodes)
        if self.router.pinned_first(nodes):
            return nodes, None
        if affine is not None and nodes[0].id != affine:
            self._lead_with(affine, nodes)
        self.meter.dispatched(nodes[0].id)
        return nodes, self.reservations.reserve(nodes[0].id)

    def fail_over(self, remaining: Sequence[Node], model: str) -> Plan:
        """The remaining owners, ranked again."""
        return self.router.ranked(remaining, model)

    def why(self, nodes: Sequence[Node], model: str | None) -> str:
        """Why ``nodes[0]`` ranked first: a known free slot, else its model loaded, else the
        fewest busy slots (an engine that reports neither ranks by our own count)."""
        standing = self.router.standings(nodes[:1], model)[0]
        if standing.total is not None and not standing.full:
            return "free"
        return "warm" if standing.warm else "least-busy"

    def _lead_with(self, node_id: str, nodes: list[Node]) -> None:
        """Move ``node_id`` first in ``nodes`` when it is among them, neither held nor
        cooling, nor full. The conversation's usual case at scale, so the owners are searched
        by C-level means (a map of their ids, an index), never a Python step per node."""
        router = self.router
        now = self.clock.seconds()
        if router.is_held(node_id, now) or router.is_cooling(node_id, now):
            return
        ids = list(map(_NODE_ID, nodes))
        if node_id not in ids:
            return
        at = ids.index(node_id)
        if router.standings(nodes[at : at + 1], None)[0].full:
            return
        nodes.insert(0, nodes.pop(at))

    def measured(self, node_id: str, seconds: float, figures: Callable[[], Any], size: int) -> None:
        self.meter.measured(node_id, seconds, figures, size)


@implementer(IPlacement)
class LateBinding(Standalone):
    """Standalone mode with late binding (the default): a request waits in the facade's
    ``queue`` when every owner is full, and for its conversation's node when that costs less
    than reading the context again elsewhere (docs/decisions.md#late-binding, #affinity)."""

    def __init__(
        self,
        router: Router,
        reservations: ReservationMap,
        queue: SlotQueue,
        affinity: AffinityTable | None = None,
    ) -> None:
        super().__init__(router, reservations, affinity)
        self.queue = queue
        # The hold and a busy answer's Retry-After read the owners' service times too, so
        # they are measured with or without affinity (docs/decisions.md#fair-share).
        self.meter = RateMeter(router)
        self._offer: Any = None
        #: While a request's end runs (``hold_offers``): a slot it frees is offered when it is done.
        self._holding = 0
        self._offer_due = False
        #: The contention changes this placement last looked at (``_offer_slots``).
        self._shared_seen = router.contention.changes
        # A slot frees when any of our dispatches ends, whichever facade made it, and when a
        # read of an engine shows one free (the router says which); for a waiter whose patience
        # ran out, any slot will do.
        router.on_freed.append(self._offer_soon)
        queue.on_patience = self._offer_soon

    def refuses(self, nodes: Sequence[Node], model: str | None) -> bool:
        """A new request would wait, and the queue has no room for it (the busy 503)."""
        return self.queue.is_full() and self.all_full(nodes, model)

    def all_full(self, nodes: Sequence[Node], model: str | None) -> bool:
        """Whether a request for ``model`` should wait rather than go to ``nodes``: every
        owner is full by its known slots (a held one counts as full: it just said so). An
        owner whose slots are unknown is never full."""
        if model is None or not nodes:
            return False
        router = self.router
        now = self.clock.seconds()
        first = nodes[0].id
        if not router.is_held(first, now) and not router.standings(nodes[:1], model)[0].full:
            return False  # the usual case, one owner asked: ranked first and free
        known_full = False
        for item in router.standings(nodes, model):
            if item.full:
                known_full = True
            elif not router.is_held(item.node_id, now):
                return False
        return known_full

    def fail_over(self, remaining: Sequence[Node], model: str) -> Plan:
        """A failover that finds every owner full waits, ahead of new arrivals."""
        if self.all_full(remaining, model):
            return Wait(ahead=True)
        return super().fail_over(remaining, model)

    def wait(
        self,
        model: str,
        deadline: float,
        wake: Callable[[], None],
        expire,
        plan: Wait,
        request: BoundedRequest | None,
    ) -> Waiter:
        now = self.clock.seconds()
        router = self.router
        owners = router.candidates(model)
        hold_until = None
        if plan.prefer is None and router.contention.shared([n.id for n in owners], now):
            # Others work on these owners: wait for a slot we see free only so long, then
            # join the engine's own queue (docs/decisions.md#fair-share).
            hold_until = now + hold_for(self._services(owners))
        waiter = self.queue.add(
            Waiter(
                model=model,
                deadline=deadline,
                since=now,
                wake=wake,
                expire=expire,
                ahead=plan.ahead,
                prefer=plan.prefer,
                patience_until=None if plan.patience is None else now + plan.patience,
                work=plan.work,
                client=b"" if request is None else client_of(request),
                batch=request is not None and not plan.ahead and is_batch(request),
                hold_until=hold_until,
            )
        )
        # A slot may have freed while nobody waited (a failover's own reservation, released
        # as it joins): the offer that would have followed it is made now. Usually every
        # owner is still full, as the request just found, and nothing is scheduled.
        if not self.all_full(owners, model):
            self._offer_soon()
        return waiter

    def retry_after(self, nodes: Sequence[Node], model: str | None) -> int:
        """The work queued ahead, served at the owners' measured rate: how long a refused
        request should wait before it comes back (1 s when nothing is measured yet)."""
        if model is None:
            return RETRY_MIN
        services = self._services(nodes)
        slots = sum(s.total or 1 for s in self.router.standings(nodes, model))
        service = sum(services) / len(services) if services else None
        return fair_retry_after(self.queue.ahead_of(model), slots, service)

    def _services(self, nodes: Sequence[Node]) -> list[float]:
        rates = self.router.rates
        return [
            r.service for n in nodes if (r := rates.get(n.id)) is not None and r.service is not None
        ]

    def unwait(self, waiter: Waiter) -> None:
        self.queue.remove(waiter)

    def hold_offers(self) -> None:
        """A request's end begins: slots it frees are offered when it is done
        (``offer_held``), not in the middle of it, and without a timer."""
        self._holding += 1

    def offer_held(self) -> None:
        """The request's end is done: offer what it freed, now."""
        self._holding -= 1
        if not self._holding and self._offer_due:
            self._offer_due = False
            if self._offer is None:
                self._offer_slots()

    def _offer_soon(self) -> None:
        """Let waiting requests go once this turn's work is done: a slot freed inside an
        attempt's or a stream's end must not start another request in the middle of it.
        Nothing is scheduled while nobody waits, and nothing while a request's end holds
        the offer (the usual way a slot frees: no timer per request in the queue)."""
        if len(self.queue) and self._offer is None:
            if self._holding:
                self._offer_due = True
            else:
                self._offer = self.clock.callLater(0, self._offer_slots)

    def _offer_slots(self) -> None:
        self._offer = None
        queue = self.queue
        contention = self.router.contention
        if contention.changes != self._shared_seen:
            self._shared_seen = contention.changes
            self._hold_waiting()
        for model in queue.models():
            owners = self.router.candidates(model)
            while not self.all_full(owners, model) and queue.wake_first(model, self._may_go):
                owners = self.router.candidates(model)  # ordered again: one slot was taken
            # Those whose hold ran out go even to a full owner, into its engine's queue, while
            # another's work is still there (else they wait for a slot as any other).
            if self.router.contention.shared([n.id for n in owners], self.clock.seconds()):
                while queue.wake_first(model, _forced):
                    pass

    def _hold_waiting(self) -> None:
        """A node was found shared: requests already waiting for its models get the bounded
        hold too, counted from when each began to wait (docs/decisions.md#fair-share)."""
        router = self.router
        now = self.clock.seconds()
        for model in self.queue.models():
            owners = router.candidates(model)
            if router.contention.shared([n.id for n in owners], now):
                self.queue.hold(model, hold_for(self._services(owners)))

    def _may_go(self, waiter: Waiter) -> bool:
        """A waiter for its preferred node goes when that node is free (or no longer one it
        may wait for); a waiter without one, whenever a slot is free."""
        if waiter.prefer is None:
            return True
        nodes = self.router.candidates(waiter.model)
        if waiter.prefer not in {n.id for n in nodes}:
            return True
        return not any(
            s.full
            for s in self.router.standings(
                [n for n in nodes if n.id == waiter.prefer], waiter.model
            )
        )

    def affinity_wait(
        self,
        nodes: Sequence[Node],
        model: str,
        affine: str,
        size: int,
        kept: float | None = None,
        kept_size: int | None = None,
    ) -> Wait | None:
        """The spill rule (docs/decisions.md#affinity): when the conversation's node is full
        while another owner is free, wait for it if the work ahead of this request there is
        expected to cost less than the extra it would read elsewhere; None to go elsewhere
        now (or when there is nothing to decide).

        The work ahead: what is left of the request in its slot (its time to serve one less
        how long it has run), then the uncached work of the requests already waiting for it,
        each at the node's prompt rate plus its tail, over its slots. The extra wait
        tolerated: the whole body read at the free owners' best prompt rate, less the part
        its node would read anew anyway (the tokens past what it keeps: ``kept`` tokens, as
        the conversation's last answer saw them, or the tokens of ``kept_size`` bytes of a
        shared head; all of it when neither is known). Both come from the rates the nodes
        already measure, so the rule calibrates itself to the engines and the workload."""
        if nodes and nodes[0].id == affine:
            # The usual case: ranked first, which (every owner not being full, as the request
            # just found) means free, or held or cooling, where it goes or is passed over
            # without waiting either way.
            return None
        router = self.router
        now = self.clock.seconds()
        # Looked up by id, not searched for among the owners: at scale this is every turn of
        # a conversation whose node is not ranked first (docs/decisions.md#rank-index).
        node = router.nodes.get(affine)
        if (
            node is None
            or not node.advertises(model)
            or router.is_held(affine, now)
            or router.is_cooling(affine, now)
        ):
            return None
        mine = router.standings([node], model)[0]
        if not mine.full:
            return None  # the usual case: its node is free, and goes first (``place``)
        rates = router.rates.get(affine)
        if rates is None or rates.prompt_rate is None or rates.service is None:
            return None  # nothing measured: never wait for it
        free = self._free_besides(affine, nodes, model, now)
        if not free:
            return None
        tokens = rates.tokens(size)
        if kept is None:
            kept = tokens if kept_size is None else rates.tokens(kept_size)
        anew = max(0.0, tokens - kept)
        elsewhere = [
            r.prompt_rate
            for s in free
            if (r := router.rates.get(s.node_id)) is not None and r.prompt_rate
        ]
        tolerated = tokens / max(elsewhere or [rates.prompt_rate]) - anew / rates.prompt_rate
        slots = max(1, mine.total or 1)
        ahead = (
            rates.residual(now, unseen=mine.busy > router.ours(affine))
            + self.queue.work_for(affine) / slots
        )
        if ahead >= tolerated:
            return None
        return Wait(ahead=False, prefer=affine, patience=tolerated, work=rates.cost(anew))

    def _free_besides(
        self, affine: str, nodes: Sequence[Node], model: str, now: float
    ) -> list[Standing]:
        """The free owners other than ``affine``, at most ``FREE_WEIGHED``: ``nodes`` are
        ranked, free before full, so the walk stops at the first full one."""
        router = self.router
        free: list[Standing] = []
        for node in nodes:
            if node.id == affine:
                continue
            standing = router.standings([node], model)[0]
            if standing.full:
                break
            if not router.is_held(node.id, now):
                free.append(standing)
                if len(free) >= FREE_WEIGHED:
                    break
        return free


_NODE_ID = attrgetter("id")
#: A placement reason from how affinity placed a request.
_BY_AFFINITY = {"hit": "affine", "head": "head", "spill": "spill"}
#: How many free owners the spill rule weighs for the best prompt rate elsewhere.
FREE_WEIGHED = 8


def _forced(waiter: Waiter) -> bool:
    return waiter.forced
