"""One HTTP facade per engine: its parts, its Resource, and the answers of the whole fleet.

The facade speaks its engine's own dialect to clients and hands each request to an Exchange.
Its router and reporter are per engine; the reservation map, the agent pool and the emitter
are shared across facades because one process hosts them all (spec 3.1).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from . import constants, cors
from .answers import (INVENTORY_UNAVAILABLE, NO_PREFLIGHT_ANSWER, ORIGIN_DENIED,
                      answer_internal_error, send_error, send_whole)
from .discovery import Node
from .dispatch import NO_CANDIDATE, Bounds, Upstreams
from .engines import Engine
from .events import ActivityThrottle, Reporter
from .exchange import Exchange
from .hopbyhop import end_to_end
from .interfaces import IEmitter
from .inventory import (MODEL_LIST_STRIPPED, Reply, ask_fleet, fetch, listed_models,
                        merged_list, node_url)
from .logs import logger
from .reservations import ReservationMap
from .router import Router
from .server import BoundedSite

log = logger()

IDENTITY_PROBE = b"x-nvpair-engine-identity-probe"


@attrs.define(eq=False)
class Facade:
    """One engine's facade: its routing, its voice on the link, how it reaches nodes, and the
    requests in flight. The router, reporter and upstreams are the seams the request path
    receives; nothing outside changes routing except through the router (issue 9)."""

    engine: Engine
    router: Router
    reporter: Reporter
    upstreams: Upstreams
    in_flight: set = attrs.Factory(set)

    @property
    def clock(self) -> IReactorTime:
        return self.upstreams.clock

    def exchange(self, request: Request) -> Exchange:
        return Exchange(request, engine=self.engine, router=self.router, reporter=self.reporter,
                        upstreams=self.upstreams, in_flight=self.in_flight)

    def ask_fleet(self, nodes: list[Node], method: bytes, path: bytes, headers: Headers, *,
                  timeout: float, limit: int, width: int | None = None) -> Deferred:
        """Ask every node once, without a body, at the address that last answered."""
        upstreams = self.upstreams

        def ask(node: Node, time_left: float) -> Deferred:
            url = node_url(node, path.decode("latin-1"), upstreams.addresses.order(node)[0])
            return fetch(upstreams.agent_for(node), self.clock, url, headers, timeout=time_left,
                         limit=limit, method=method)

        return ask_fleet(nodes, ask, self.clock, timeout=timeout, width=width)

    def shutdown(self) -> None:
        """Cancel every request in flight; each reports ``cancelled`` once (protocol 1)."""
        for exchange in list(self.in_flight):
            exchange.shutdown()


def make_facade(engine: Engine, *, clock: IReactorTime, agent: IAgent, emitter: IEmitter,
                run_id: str, random: Callable[[], float], bounds: Bounds = Bounds(),
                reservations: ReservationMap | None = None,
                activity: ActivityThrottle | None = None) -> Facade:
    """A facade from the parts every facade of a process shares (spec 3.1)."""
    if activity is None:
        activity = ActivityThrottle(emitter, clock.seconds)
    return Facade(engine=engine,
                  router=Router(engine=engine, clock=clock, reservations=reservations),
                  reporter=Reporter(engine=engine.id, emitter=emitter, clock=clock.seconds,
                                    run_id=run_id, activity=activity),
                  upstreams=Upstreams(clock=clock, agent=agent, random=random, bounds=bounds))


def report_rejection(facade: Facade, method: bytes, path: bytes, status: int, error: str) -> None:
    """``proxy/request`` for an answer given before a request reached routing (protocol 4)."""
    reporter = facade.reporter
    reporter.request_finished(reporter.next_request_id(), method.decode("latin-1"),
                              path.split(b"?", 1)[0].decode("latin-1"), "", status, 0.0,
                              error=error)


def answered_identity_probe(facade: Facade, request: Request) -> bool:
    """A client asking whether this port is a proxy facade gets 409 naming the engine, on
    every ingress, so nothing mistakes the proxy for the engine itself (protocol 5)."""
    if request.getHeader(IDENTITY_PROBE) != b"1":
        return False
    text = f"this port is the nvpair-proxy facade for {facade.engine.id}"
    report_rejection(facade, request.method, request.path, 409, text)
    send_error(request, 409, text, code="proxy-facade")
    return True


class FacadeResource(Resource):
    """Every path of the facade: classify and hand to an Exchange; nothing is an allowlist."""

    isLeaf = True

    def __init__(self, facade: Facade) -> None:
        super().__init__()
        self.facade = facade

    def render(self, request: Request):
        if answered_identity_probe(self.facade, request):
            return NOT_DONE_YET
        if cors.is_preflight(request.method, request.requestHeaders):
            serve_preflight(self.facade, request)
            return NOT_DONE_YET
        route = self.facade.engine.classify(request.method, request.path)
        if route is not None and route.is_models:
            serve_model_list(self.facade, request, route)
            return NOT_DONE_YET
        exchange = self.facade.exchange(request)
        try:
            exchange.start()
        except Exception:
            exchange.crashed(Failure())
        return NOT_DONE_YET


class FleetAnswer:
    """A request the whole fleet answers together (model list, preflight): no workload, no
    reservation, one ``proxy/request`` with target ``cluster`` (protocol 4)."""

    def __init__(self, facade: Facade, request: Request) -> None:
        self.facade, self.request = facade, request
        self.started = facade.clock.seconds()
        self.id = facade.reporter.next_request_id()
        self.asking: Deferred | None = None
        self.finished = False
        request.notifyFinish().addErrback(self._client_gone)

    def ask(self, nodes: list[Node], method: bytes, path: bytes, headers: Headers,
            answer: Callable[[list[Reply]], None], **limits) -> None:
        self.asking = self.facade.ask_fleet(nodes, method, path, headers, **limits)
        self.asking.addCallback(self._answer, answer).addErrback(self._crashed)

    def _client_gone(self, _: Failure) -> None:
        if not self.finished and self.asking is not None:
            self.asking.cancel()

    def _answer(self, replies: list[Reply], answer: Callable[[list[Reply]], None]) -> None:
        self.finished = True
        if self.request.client_gone:
            self.report(499)
            return
        answer(replies)

    def _crashed(self, failure: Failure) -> None:
        """Spec 3.2: a bug costs this request only: logged with its traceback, answered 500."""
        log.failure("unexpected error handling {method} {path}", failure, method=self._method(),
                    path=self._path(), engine=self.facade.engine.id)
        answer_internal_error(self.request)
        self.report(500, error="internal error")

    def _method(self) -> str:
        return self.request.method.decode("latin-1")

    def _path(self) -> str:
        return self.request.path.decode("latin-1")

    def error(self, status: int, text: str, headers: Headers | None = None,
              node: Node | None = None) -> None:
        send_error(self.request, status, text, headers=headers)
        self.report(status, error=text, node=node)

    def whole(self, status: int, headers: Headers, body: bytes, phrase: bytes | None = None,
              node: Node | None = None) -> None:
        self.report_started(node)
        send_whole(self.request, status, headers, body, phrase)
        self.report(status, node=node)

    def report_started(self, node: Node | None) -> None:
        self.facade.reporter.request_started(self.id, self._method(), self._path(), "cluster",
                                             node.id if node else None)

    def report(self, status: int, error: str | None = None, node: Node | None = None) -> None:
        self.facade.reporter.request_finished(
            self.id, self._method(), self._path(), "cluster", status,
            self.facade.clock.seconds() - self.started, node_id=node.id if node else None,
            error=error)


def serve_preflight(facade: Facade, request: Request) -> None:
    """Spec 5.8: every routable engine is asked, and the browser gets what all of them allow.

    Candidates are ordered as for any request (pin, priority, id), which decides whose
    denial is shown when several refuse. The caller's credentials never reach the fleet.
    """
    fleet = FleetAnswer(facade, request)
    nodes = facade.router.candidates(None)
    if not nodes:
        fleet.error(502, NO_CANDIDATE)
        return
    origin = request.getHeader(b"origin")
    headers = end_to_end(request.requestHeaders, drop=cors.PREFLIGHT_STRIPPED)

    def answer(replies: list[Reply]) -> None:
        if not replies:
            fleet.error(502, NO_PREFLIGHT_ANSWER)
            return
        verdict = cors.judge_preflight(replies, origin, len(nodes))
        if isinstance(verdict, Reply):
            fleet.whole(verdict.status, verdict.headers, verdict.body, verdict.phrase,
                        node=verdict.node)
        else:
            fleet.whole(204, verdict, b"")

    fleet.ask(nodes, b"OPTIONS", request.uri, headers, answer, timeout=cors.PREFLIGHT_TIMEOUT,
              limit=cors.PREFLIGHT_MAX_BODY, width=cors.PREFLIGHT_WIDTH)


def serve_model_list(facade: Facade, request: Request, route) -> None:
    """A model list covers the whole fleet, whatever the selection (spec 5).

    Without an Origin, invalid and unavailable lists are skipped. With one, every engine
    that answered must agree (spec 5.8): a refusal of the origin is a 403, and an answer
    that is not a valid inventory makes the whole list a 502 rather than a partial one.
    """
    fleet = FleetAnswer(facade, request)
    origin = request.getHeader(b"origin")
    query = request.uri.partition(b"?")[2]
    path = route.upstream_path.encode() + (b"?" + query if query else b"")
    headers = end_to_end(request.requestHeaders, drop=MODEL_LIST_STRIPPED)

    def answer(replies: list[Reply]) -> None:
        listed = [listed_models(reply, route.envelope) for reply in replies]
        valid = [(reply, pairs) for reply, pairs in zip(replies, listed) if pairs is not None]
        if origin is None:
            if not valid:
                fleet.error(503, INVENTORY_UNAVAILABLE)
                return
            send_list([reply for reply, _ in valid], [pairs for _, pairs in valid], Headers())
            return
        verdict, denial = cors.judge_inventory(replies, origin, len(valid) == len(replies))
        if verdict == cors.DENIED:
            fleet.error(403, ORIGIN_DENIED, Headers({b"Vary": [b"Origin"]}), node=denial.node)
        elif verdict == cors.INVALID:
            fleet.error(502, INVENTORY_UNAVAILABLE, cors.combined(replies, origin))
        else:
            send_list(replies, listed, cors.combined(replies, origin))

    def send_list(replies: list[Reply], inventories: list, permission: Headers) -> None:
        headers = Headers({b"Content-Type": [b"application/json"]})
        for name, values in permission.getAllRawHeaders():
            headers.setRawHeaders(name, list(values))
        if not headers.hasHeader(b"vary"):
            vary = cors.vary(replies)
            if vary is not None:
                headers.setRawHeaders(b"Vary", [vary])
        fleet.whole(200, headers, merged_list(inventories, route.envelope))

    fleet.ask(facade.router.routable(), b"GET", path, headers, answer,
              timeout=constants.MODEL_LIST_TIMEOUT, limit=constants.MODEL_LIST_MAX_BODY)


def facade_site(facade: Facade, reactor=None) -> BoundedSite:
    """The Site serving one facade; idle timeout equal to the pool's (protocol 7)."""
    return BoundedSite(FacadeResource(facade), reactor=reactor,
                       timeout=constants.SERVER_IDLE_TIMEOUT,
                       on_rejected=partial(report_rejection, facade))
