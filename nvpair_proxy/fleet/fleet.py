"""Answers the whole fleet gives together: the CORS preflight and the model list
(docs/references.md#fleet-model-list, #browser-policy).

They are not requests routed to one node: every routable engine is asked at once, the replies
are judged or merged, and there is no workload and no reservation. They live apart from the
facade, which only classifies a request and hands it here or to an Exchange.
"""

from __future__ import annotations

from typing import Callable

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from ..core import constants
from ..core.logs import logger
from ..http.answers import Reason, answer_internal_error, send_error, send_whole
from ..http.hopbyhop import end_to_end
from ..http.server import BoundedRequest
from ..nodes.discovery import Node
from ..nodes.engines import Engine
from ..request.dispatch import Upstreams
from ..request.events import CANCELLED, COMPLETED, FAILED, MODELS, PREFLIGHT, Reporter
from ..routing.router import Router
from . import cors
from .inventory import (
    MODEL_LIST_STRIPPED,
    Reply,
    ask_fleet,
    fetch,
    listed_models,
    merged_list,
    node_url,
)

log = logger()


@attrs.frozen
class Fleet:
    """What a fleet answer needs of its facade: whom to ask (the router), how to reach them
    (the upstreams) and where to report (the reporter)."""

    engine: Engine
    router: Router
    reporter: Reporter
    upstreams: Upstreams

    @property
    def clock(self) -> IReactorTime:
        return self.upstreams.clock

    def ask(
        self,
        nodes: list[Node],
        method: bytes,
        path: bytes,
        headers: Headers,
        *,
        timeout: float,
        limit: int,
        width: int | None = None,
    ) -> Deferred:
        """Ask every node once, without a body, at the address that last answered."""
        upstreams = self.upstreams
        headers = upstreams.loop_guard.stamp(headers.copy())

        def ask(node: Node, time_left: float) -> Deferred:
            url = node_url(node, path.decode("latin-1"), upstreams.addresses.order(node)[0])
            return fetch(
                upstreams.agent_for(node),
                self.clock,
                url,
                headers,
                timeout=time_left,
                limit=limit,
                method=method,
            )

        return ask_fleet(nodes, ask, self.clock, timeout=timeout, width=width)


class FleetAnswer:
    """A request the whole fleet answers together (model list, preflight): no workload, no
    reservation, one ``proxy/request`` with target ``cluster``
    (docs/references.md#request-events)."""

    def __init__(self, fleet: Fleet, request: BoundedRequest, route: str) -> None:
        self.fleet, self.request, self.route = fleet, request, route
        self.started = fleet.clock.seconds()
        self.id = fleet.reporter.next_request_id()
        self.asking: Deferred | None = None
        self.finished = False
        request.notifyFinish().addErrback(self._client_gone)

    def ask(
        self,
        nodes: list[Node],
        method: bytes,
        path: bytes,
        headers: Headers,
        answer: Callable[[list[Reply]], None],
        **limits,
    ) -> None:
        self.asking = self.fleet.ask(nodes, method, path, headers, **limits)
        self.asking.addCallback(self._answer, answer).addErrback(self._crashed)

    def _client_gone(self, _: Failure) -> None:
        if not self.finished and self.asking is not None:
            self.asking.cancel()

    def _answer(self, replies: list[Reply], answer: Callable[[list[Reply]], None]) -> None:
        self.finished = True
        if self.request.client_gone:
            self.report(499, reason=Reason.CLIENT_GONE)
            return
        answer(replies)

    def _crashed(self, failure: Failure) -> None:
        """A bug costs this request only: logged with its traceback, answered 500
        (docs/references.md#request-containment)."""
        log.failure(
            "unexpected error handling {method} {path}",
            failure,
            method=self._method(),
            path=self._path(),
            engine=self.fleet.engine.id,
        )
        answer_internal_error(self.request)
        self.report(500, reason=Reason.INTERNAL)

    def _method(self) -> str:
        return self.request.method.decode("latin-1")

    def _path(self) -> str:
        return self.request.path.decode("latin-1")

    def error(
        self, status: int, reason: Reason, headers: Headers | None = None, node: Node | None = None
    ) -> None:
        send_error(self.request, status, reason.text, headers=headers)
        self.report(status, reason=reason, node=node)

    def whole(
        self,
        status: int,
        headers: Headers,
        body: bytes,
        phrase: bytes | None = None,
        node: Node | None = None,
    ) -> None:
        self.report_started(node)
        send_whole(self.request, status, headers, body, phrase)
        self.report(status, node=node)

    def report_started(self, node: Node | None) -> None:
        self.fleet.reporter.request_started(
            self.id, self._method(), self._path(), "cluster", node.id if node else None
        )

    def report(self, status: int, reason: Reason | None = None, node: Node | None = None) -> None:
        """``proxy/request`` (docs/references.md#request-events); without a reason of ours the
        status is the engine's."""
        error = reason.says() if reason is not None else None
        duration = self.fleet.clock.seconds() - self.started
        node_id = node.id if node else None
        self.fleet.reporter.request_finished(
            self.id,
            self._method(),
            self._path(),
            "cluster",
            status,
            duration,
            node_id=node_id,
            error=error,
        )
        outcome = CANCELLED if status == 499 else COMPLETED if status < 400 else FAILED
        self.fleet.reporter.request_ended(
            route=self.route,
            outcome=outcome,
            status=status,
            duration=duration,
            node=node_id,
            reason=reason,
        )


def serve_preflight(fleet: Fleet, request: BoundedRequest) -> None:
    """Every routable engine is asked, and the browser gets what all of them allow
    (docs/references.md#browser-policy).

    Candidates are ordered as for any request (pin, priority, id), which decides whose
    denial is shown when several refuse. The caller's credentials never reach the fleet.
    """
    answering = FleetAnswer(fleet, request, PREFLIGHT)
    nodes = fleet.router.candidates(None)
    if not nodes:
        answering.error(502, Reason.NO_CANDIDATE)
        return
    origin = request.getHeader(b"origin") or b""  # present: cors.is_preflight asked for it
    headers = end_to_end(request.requestHeaders, drop=cors.PREFLIGHT_STRIPPED)

    def answer(replies: list[Reply]) -> None:
        if not replies:
            answering.error(502, Reason.NO_PREFLIGHT_ANSWER)
            return
        verdict = cors.judge_preflight(replies, origin, len(nodes))
        if isinstance(verdict, Reply):
            answering.whole(
                verdict.status, verdict.headers, verdict.body, verdict.phrase, node=verdict.node
            )
        else:
            answering.whole(204, verdict, b"")

    answering.ask(
        nodes,
        b"OPTIONS",
        request.uri,
        headers,
        answer,
        timeout=cors.PREFLIGHT_TIMEOUT,
        limit=cors.PREFLIGHT_MAX_BODY,
        width=cors.PREFLIGHT_WIDTH,
    )


def serve_model_list(fleet: Fleet, request: BoundedRequest, route) -> None:
    """A model list covers the whole fleet, whatever the selection
    (docs/references.md#fleet-model-list).

    Without an Origin, invalid and unavailable lists are skipped. With one, every engine
    that answered must agree (docs/references.md#browser-policy): a refusal of the origin is a 403,
    and an answer that is not a valid inventory makes the whole list a 502 rather than a partial
    one.
    """
    answering = FleetAnswer(fleet, request, MODELS)
    origin = request.getHeader(b"origin")
    query = request.uri.partition(b"?")[2]
    path = route.upstream_path.encode() + (b"?" + query if query else b"")
    headers = end_to_end(request.requestHeaders, drop=MODEL_LIST_STRIPPED)

    def answer(replies: list[Reply]) -> None:
        listed = [listed_models(reply, route.envelope) for reply in replies]
        valid = [(reply, pairs) for reply, pairs in zip(replies, listed) if pairs is not None]
        if origin is None:
            if not valid:
                answering.error(503, Reason.INVENTORY_UNAVAILABLE)
                return
            send_list([reply for reply, _ in valid], [pairs for _, pairs in valid], Headers())
            return
        verdict, denial = cors.judge_inventory(replies, origin, len(valid) == len(replies))
        if verdict is cors.DENIED:
            answering.error(
                403,
                Reason.ORIGIN_DENIED,
                Headers({b"Vary": [b"Origin"]}),
                node=denial.node if denial is not None else None,
            )
        elif verdict is cors.INVALID:
            answering.error(502, Reason.INVENTORY_UNAVAILABLE, cors.combined(replies, origin))
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
        answering.whole(
            200, headers, merged_list(inventories, route.envelope, fleet.engine.normalize_model)
        )

    answering.ask(
        fleet.router.routable(),
        b"GET",
        path,
        headers,
        answer,
        timeout=constants.MODEL_LIST_TIMEOUT,
        limit=constants.MODEL_LIST_MAX_BODY,
    )
