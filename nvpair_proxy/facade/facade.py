"""One HTTP facade per engine: its parts, the answers given before routing, and its Resource.

The facade speaks its engine's own dialect to clients and hands each request to an Exchange,
or, for the answers the whole fleet gives together, to ``fleet.py``. Its router and reporter
are per engine; the reservation map, the agent pool and the emitter are shared across facades
because one process hosts them all (docs/references.md#one-process). Binding its ports and its place
in the service tree are ``facadeservice.py``'s.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping

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
from ..request.exchange import UNCLASSIFIED, Exchange
from ..routing.affinity import AffinityTable
from ..routing.reservations import ReservationMap
from ..routing.router import Router
from ..routing.slotqueue import SlotQueue
from ..routing.tickets import Brokered, Direct, LateBinding, Standalone

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

    @property
    def clock(self) -> IReactorTime:
        return self.upstreams.clock

    def exchange(self, request: Request, route=UNCLASSIFIED) -> Exchange:
        """An exchange for ``request``; ``route`` when the caller already classified it."""
        return Exchange(
            request,
            engine=self.engine,
            owners=self.router,
            placement=self.placement,
            health=self.router,
            reporter=self.reporter,
            upstreams=self.upstreams,
            in_flight=self.in_flight,
            route=route,
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
    scheduling: bool = False,
    queue_depth: int | None = None,
    affinity: bool = False,
) -> Facade:
    """A facade from the parts every facade of a process shares (docs/references.md#one-process).

    ``agent_for_node`` dials nodes that need their own agent (nodes-file TLS or keys, pinned
    peers); without it every node shares ``agent``. ``scheduling`` ranks owners by what their
    engines report (standalone mode); ``queue_depth`` turns late binding on with that bound;
    ``affinity`` sends a conversation back to the node that holds its cache.
    """
    if activity is None:
        activity = ActivityThrottle(emitter, clock.seconds)
    queue = None
    if queue_depth is not None:
        waited = (
            None
            if recorder is None
            else (lambda waiter, seconds: recorder.queue_left(engine.id, seconds))
        )
        queue = SlotQueue(clock, queue_depth, on_leave=waited)
    table = AffinityTable() if affinity else None
    router = Router(
        engine=engine,
        clock=clock,
        reservations=ReservationMap() if reservations is None else reservations,
        scheduling=scheduling,
        queue=queue,
        affinity=table,
    )
    return Facade(
        engine=engine,
        router=router,
        placement=placement_for(router, reservations, scheduling, queue, table),
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
        return Direct()
    if not scheduling:
        return Brokered(router, reservations, affinity)
    if queue is None:
        return Standalone(router, reservations, affinity)
    return LateBinding(router, reservations, queue, affinity)


def report_rejection(
    facade: Facade, method: bytes, path: bytes, status: int, reason: Reason, detail: str = ""
) -> None:
    """``proxy/request`` for an answer given before a request reached routing
    (docs/references.md#request-events)."""
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
        route=route_class(facade.engine.classify(method, path)),
        outcome=REJECTED,
        status=status,
        duration=0.0,
        reason=reason,
    )


def answered_stopping(facade: Facade, request: Request) -> bool:
    """While the process stops, a new request gets 503 and the connection closes."""
    if not facade.stopping:
        return False
    report_rejection(facade, request.method, request.path, 503, Reason.SHUTTING_DOWN)
    request.setHeader(b"Connection", b"close")
    send_error(request, 503, SHUTTING_DOWN, retry_after=1)
    return True


def answered_loop(facade: Facade, request: Request) -> bool:
    """A request carrying our own Via token came back to us: 508 at once, no dispatch and
    no workload (docs/references.md#forwarding-loop), whatever its route: a model list asked in a
    loop loops too."""
    if not facade.upstreams.loop_guard.seen(request.requestHeaders):
        return False
    report_rejection(facade, request.method, request.path, 508, Reason.FORWARDING_LOOP)
    send_error(request, 508, FORWARDING_LOOP)
    return True


def answered_before_routing(facade: Facade, request: Request) -> bool:
    """The answers every ingress gives before anything is routed: the identity probe, a
    forwarding loop, and a new request while the process stops."""
    return (
        answered_identity_probe(facade, request)
        or answered_loop(facade, request)
        or answered_stopping(facade, request)
    )


def answered_identity_probe(facade: Facade, request: Request) -> bool:
    """A client asking whether this port is a proxy facade gets 409 naming the engine, on
    every ingress, so nothing mistakes the proxy for the engine itself
    (docs/references.md#identity-probe)."""
    if request.getHeader(IDENTITY_PROBE) != b"1":
        return False
    text = FACADE_FOR + facade.engine.id
    report_rejection(
        facade, request.method, request.path, 409, Reason.IDENTITY_PROBE, facade.engine.id
    )
    send_error(request, 409, text, code="proxy-facade")
    return True


class FacadeResource(Resource):
    """Every path of the facade: classify and hand to an Exchange; nothing is an allowlist."""

    isLeaf = True

    def __init__(self, facade: Facade) -> None:
        super().__init__()
        self.facade = facade

    def render(self, request: BoundedRequest):
        if answered_before_routing(self.facade, request):
            return NOT_DONE_YET
        if cors.is_preflight(request.method, request.requestHeaders):
            serve_preflight(self.facade.fleet, request)
            return NOT_DONE_YET
        route = self.facade.engine.classify(request.method, request.path)
        if route is not None and route.is_models:
            serve_model_list(self.facade.fleet, request, route)
            return NOT_DONE_YET
        exchange = self.facade.exchange(request, route)
        try:
            exchange.start()
        except Exception:
            exchange.crashed(Failure())
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
