"""One HTTP facade per engine: its parts, the answers given before routing, and its Resource.

The facade speaks its engine's own dialect to clients and hands each request to an Exchange,
or, for the answers the whole fleet gives together, to ``fleet.py``. Its router and reporter
are per engine; the reservation map, the agent pool and the emitter are shared across facades
because one process hosts them all (docs/references.md#one-process). Binding its ports and its place
in the service tree are ``facadeservice.py``'s.
"""

from __future__ import annotations

import enum
from functools import cached_property, partial
from typing import Any, Callable, Mapping

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.iweb import IAgent
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from ..core import constants
from ..core.interfaces import IEmitter, IPlacement, IRequestRecorder
from ..core.views import FacadeView
from ..fleet import cors
from ..fleet.fleet import Fleet, serve_model_list, serve_preflight
from ..http.answers import FACADE_FOR, FORWARDING_LOOP, SHUTTING_DOWN, Reason, send_error
from ..http.loopguard import LoopGuard
from ..http.server import BoundedRequest, BoundedSite
from ..nodes.discovery import Node
from ..nodes.engines import Engine
from ..request.dispatch import Bounds, Upstreams
from ..request.events import REJECTED, ActivityThrottle, Reporter, route_class
from ..request.exchange import UNCLASSIFIED, Exchange, Wiring
from ..routing.affinity import AffinityTable
from ..routing.reservations import ReservationMap
from ..routing.router import Router
from ..routing.slotqueue import SlotQueue
from ..routing.tickets import Brokered, Direct, LateBinding, Policy, Standalone

IDENTITY_PROBE = b"x-nvpair-engine-identity-probe"


@attrs.define(eq=False)
class Facade:
    """One engine's facade: its routing, its voice on the link, how it reaches nodes, and the
    requests in flight. The router, reporter and upstreams are the seams the request path
    receives; nothing outside changes routing except through the router
    (docs/references.md#router-seam)."""

    engine: Engine
    router: Router
    reporter: Reporter
    upstreams: Upstreams
    #: The placement policy, chosen when the facade was made (routing/tickets.py).
    placement: IPlacement = attrs.Factory(Direct)
    in_flight: set = attrs.Factory(set)
    stopping: bool = False
    #: Answers say why they went where they did (``--placement-header``).
    placement_header: bool = False

    @property
    def clock(self) -> IReactorTime:
        return self.upstreams.clock

    def exchange(self, request: BoundedRequest, route=UNCLASSIFIED) -> Exchange:
        """An exchange for ``request``; ``route`` when the caller already classified it."""
        return Exchange(request, self.wiring, route)

    @cached_property
    def wiring(self) -> Wiring:
        """What each of this facade's requests works with, made at its first request."""
        return Wiring(
            engine=self.engine,
            owners=self.router,
            placement=self.placement,
            health=self.router,
            reporter=self.reporter,
            upstreams=self.upstreams,
            in_flight=self.in_flight,
            placement_header=self.placement_header,
        )

    @property
    def fleet(self) -> Fleet:
        """The parts the answers of the whole fleet (preflight, model list) need."""
        return Fleet(
            engine=self.engine, router=self.router, reporter=self.reporter, upstreams=self.upstreams
        )

    def view(self, port: int, slots: Mapping[str, object] | None = None) -> FacadeView:
        """This facade as the admin listener shows it, read now: ``port`` and ``slots`` are
        its service's (facadeservice.py), which binds the port and keeps the broker's slots."""
        return FacadeView(
            engine=self.engine.id,
            port=port,
            routing=self.router.view(),
            in_flight=tuple(exchange.view() for exchange in list(self.in_flight)),
            slots=slots,
        )

    def shutdown(self) -> None:
        """Cancel every request in flight; each reports ``cancelled`` once
        (docs/references.md#shutdown-order).

        From here on a request arriving on a connection still open (a client's pooled
        keep-alive) is refused, so nothing is admitted that the stopping reactor would cut off
        without a terminal event.
        """
        self.stopping = True
        for exchange in list(self.in_flight):
            exchange.shutdown()


def make_facade(
    engine: Engine,
    *,
    clock: IReactorTime,
    agent: IAgent,
    emitter: IEmitter,
    run_id: str,
    random: Callable[[], float],
    bounds: Bounds = Bounds(),
    reservations: ReservationMap | None = None,
    activity: ActivityThrottle | None = None,
    recorder: IRequestRecorder | None = None,
    agent_for_node: Callable[[Node], IAgent] | None = None,
    loop_guard: LoopGuard | None = None,
    policy: Policy = Policy(),
) -> Facade:
    """A facade from the parts every facade of a process shares (docs/references.md#one-process).

    ``agent_for_node`` dials nodes that need their own agent (nodes-file TLS or keys, pinned
    peers); without it every node shares ``agent``. ``policy`` says how it places requests.
    """
    if activity is None:
        activity = ActivityThrottle(emitter, clock.seconds)
    queue = None
    if policy.queue_depth is not None:
        waited = (
            None
            if recorder is None
            else (
                lambda waiter, seconds: recorder.queue_left(
                    engine.id, seconds, "batch" if waiter.batch else "normal"
                )
            )
        )
        queue = SlotQueue(clock, policy.queue_depth, on_leave=waited)
    table = AffinityTable(spill_keeps=policy.spill_keeps) if policy.affinity else None
    router = Router(
        engine=engine,
        clock=clock,
        reservations=ReservationMap() if reservations is None else reservations,
        scheduling=policy.ranking,
        queue=queue,
        affinity=table,
    )
    return Facade(
        engine=engine,
        router=router,
        placement=placement_for(router, reservations, policy.ranking, queue, table),
        placement_header=policy.placement_header,
        reporter=Reporter(
            engine=engine.id,
            emitter=emitter,
            clock=clock.seconds,
            run_id=run_id,
            activity=activity,
            recorder=recorder,
        ),
        upstreams=Upstreams(
            clock=clock,
            agent=agent,
            random=random,
            bounds=bounds,
            agent_for_node=agent_for_node,
            loop_guard=loop_guard or LoopGuard(),
        ),
    )


def placement_for(
    router: Router,
    reservations: ReservationMap | None,
    scheduling: bool,
    queue: SlotQueue | None,
    affinity: AffinityTable | None,
) -> IPlacement:
    """The facade's placement policy, chosen once here: none without a reservation map,
    standalone ranking (with late binding when it has a ``queue``), or the broker's
    chooser."""
    if reservations is None:
        if scheduling or queue is not None:
            raise ValueError("standalone placement needs the process's reservation map")
        return Direct()
    if not scheduling:
        return Brokered(router, reservations, affinity)
    if queue is None:
        return Standalone(router, reservations, affinity)
    return LateBinding(router, reservations, queue, affinity)


def report_rejection(
    facade: Facade,
    method: bytes,
    path: bytes,
    status: int,
    reason: Reason,
    detail: str = "",
    route=UNCLASSIFIED,
) -> None:
    """``proxy/request`` for an answer given before a request reached routing
    (docs/references.md#request-events); ``route`` when the caller already classified it."""
    error = reason.says(detail)
    reporter = facade.reporter
    path = path.split(b"?", 1)[0]
    reporter.request_finished(
        reporter.next_request_id(),
        method.decode("latin-1"),
        path.decode("latin-1"),
        "",
        status,
        0.0,
        error=error,
    )
    reporter.request_ended(
        route=route_class(facade.engine.classify(method, path) if route is UNCLASSIFIED else route),
        outcome=REJECTED,
        status=status,
        duration=0.0,
        reason=reason,
    )


# The front door: what a request is, decided once (docs/architecture.md).


@attrs.frozen
class Refusal:
    """An answer given before routing: its status, the reason it is reported with, the body
    text and its ``code``, and whether the connection closes after it."""

    status: int
    reason: Reason
    text: str
    detail: str = ""
    code: str | None = None
    retry_after: int = 0
    close: bool = False


class Door(enum.Enum):
    """Where a request past the refusals goes."""

    #: A CORS preflight: every routable engine is asked (fleet.py).
    PREFLIGHT = "preflight"
    #: A model list: the whole fleet's, merged (fleet.py).
    MODEL_LIST = "model list"
    #: Everything else: routed to a node by an Exchange (an unlisted path forwarded verbatim).
    FORWARD = "forward"


PREFLIGHT, MODEL_LIST, FORWARD = Door


def refused_before_routing(facade: Facade, request: Request) -> Refusal | None:
    """The answers every ingress gives before anything is routed, in this order: the
    identity probe (docs/references.md#identity-probe: 409 naming the engine, so nothing
    mistakes the proxy for the engine itself), a forwarding loop (508 at once, whatever the
    route: docs/references.md#forwarding-loop), and a new request while the process stops
    (503, and the connection closes)."""
    if request.getHeader(IDENTITY_PROBE) == b"1":
        engine = facade.engine.id
        return Refusal(
            409, Reason.IDENTITY_PROBE, FACADE_FOR + engine, detail=engine, code="proxy-facade"
        )
    if facade.upstreams.loop_guard.seen(request.requestHeaders):
        return Refusal(508, Reason.FORWARDING_LOOP, FORWARDING_LOOP)
    if facade.stopping:
        return Refusal(503, Reason.SHUTTING_DOWN, SHUTTING_DOWN, retry_after=1, close=True)
    return None


def decide(facade: Facade, request: Request) -> tuple[Refusal | Door, Any]:
    """What the facade does with ``request``, and its engine route (classified once here)."""
    route = facade.engine.classify(request.method, request.path)
    refusal = refused_before_routing(facade, request)
    if refusal is not None:
        return refusal, route
    if cors.is_preflight(request.method, request.requestHeaders):
        return PREFLIGHT, route
    if route is not None and route.is_models:
        return MODEL_LIST, route
    return FORWARD, route


def refuse(facade: Facade, request: Request, refusal: Refusal, route=UNCLASSIFIED) -> None:
    """Answer a refusal and report it, in one call."""
    report_rejection(
        facade, request.method, request.path, refusal.status, refusal.reason, refusal.detail, route
    )
    if refusal.close:
        request.setHeader(b"Connection", b"close")
    send_error(
        request, refusal.status, refusal.text, code=refusal.code, retry_after=refusal.retry_after
    )


def forward(exchange: Exchange) -> None:
    """Start ``exchange``; a bug costs this request only
    (docs/references.md#request-containment)."""
    try:
        exchange.start()
    except Exception:
        exchange.crashed(Failure())


class FacadeResource(Resource):
    """Every path of the facade: one decision, one handler; nothing is an allowlist."""

    isLeaf = True

    def __init__(self, facade: Facade) -> None:
        super().__init__()
        self.facade = facade

    def render(self, request: BoundedRequest):
        facade = self.facade
        decision, route = decide(facade, request)
        if isinstance(decision, Refusal):
            refuse(facade, request, decision, route)
        elif decision is FORWARD:
            forward(facade.exchange(request, route))
        elif decision is MODEL_LIST:
            serve_model_list(facade.fleet, request, route)
        else:
            serve_preflight(facade.fleet, request)
        return NOT_DONE_YET


def facade_site(facade: Facade, reactor=None) -> BoundedSite:
    """The Site serving one facade; idle timeout equal to the pool's
    (docs/references.md#server-timeouts)."""
    return BoundedSite(
        FacadeResource(facade),
        reactor=reactor,
        timeout=constants.SERVER_IDLE_TIMEOUT,
        on_rejected=partial(report_rejection, facade),
    )
