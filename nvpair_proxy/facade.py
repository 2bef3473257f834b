"""One HTTP facade per engine: its state, its Resource, and the request class that bounds bodies.

The facade speaks its engine's own dialect to clients and hands each request to an Exchange.
Its state (node set, pin, counters) is per engine; the reservation map, the agent pool and
the emitter are shared across facades because one process hosts them all (spec 3.1).
"""

from __future__ import annotations

import itertools
from typing import Callable

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from .logs import logger
from twisted.web.iweb import IAgent
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from . import constants
from .answers import BODY_TOO_LARGE, raw_error, send_error
from .attempt import AddressMemory
from .discovery import Node, NodeSet
from .dispatch import Bounds
from .engines import Engine
from .events import ActivityThrottle, Workload
from .exchange import Exchange
from .hopbyhop import end_to_end
from .interfaces import IEmitter
from .reservations import ReservationMap
from .inventory import MODEL_LIST_STRIPPED, fleet_model_list

log = logger()

IDENTITY_PROBE = b"x-nvpair-engine-identity-probe"


@attrs.define(eq=False)
class Facade:
    """Everything one engine's facade routes with."""

    engine: Engine
    clock: IReactorTime
    agent: IAgent
    emitter: IEmitter
    run_id: str
    random: Callable[[], float]
    bounds: Bounds = Bounds()
    reservations: ReservationMap | None = None
    activity: ActivityThrottle | None = None
    nodes: NodeSet = attrs.Factory(NodeSet)
    addresses: AddressMemory = attrs.Factory(AddressMemory)
    pin: str = ""
    agent_for_node: Callable[[Node], IAgent] | None = None
    in_flight: set = attrs.Factory(set)
    _request_ids: itertools.count = attrs.Factory(lambda: itertools.count(1))
    _workload_ids: itertools.count = attrs.Factory(lambda: itertools.count(1))

    def __attrs_post_init__(self) -> None:
        if self.activity is None:
            self.activity = ActivityThrottle(self.emitter, self.clock.seconds)

    def next_request_id(self) -> str:
        return str(next(self._request_ids))

    def new_workload(self, model: str, created_at: float) -> Workload:
        return Workload(emitter=self.emitter, clock=self.clock.seconds, run_id=self.run_id,
                        engine=self.engine.id, id=str(next(self._workload_ids)), model=model,
                        created_at=created_at)

    def priority(self) -> tuple[str, ...]:
        return self.reservations.priority if self.reservations is not None else ()

    def agent_for(self, node: Node) -> IAgent:
        if self.agent_for_node is not None:
            return self.agent_for_node(node)
        return self.agent

    def notify(self, method: str, params: dict) -> None:
        self.emitter.notify(method, params, engine=self.engine.id)

    def shutdown(self) -> None:
        """Cancel every request in flight; each reports ``cancelled`` once (protocol 1)."""
        for exchange in list(self.in_flight):
            exchange.shutdown()


def report_rejection(facade: Facade, method: bytes, path: bytes, status: int, error: str) -> None:
    """``proxy/request`` for an answer given before a request reached routing (protocol 4)."""
    facade.notify("proxy/request", {
        "id": facade.next_request_id(), "method": method.decode("latin-1"),
        "path": path.split(b"?", 1)[0].decode("latin-1"), "target": "", "status": status,
        "duration_ms": 0, "error": error})


class FacadeResource(Resource):
    """Every path of the facade: classify and hand to an Exchange; nothing is an allowlist."""

    isLeaf = True

    def __init__(self, facade: Facade) -> None:
        super().__init__()
        self.facade = facade

    def render(self, request: Request):
        if request.getHeader(IDENTITY_PROBE) == b"1":
            text = f"this port is the nvpair-proxy facade for {self.facade.engine.id}"
            report_rejection(self.facade, request.method, request.path, 409, text)
            send_error(request, 409, text, code="proxy-facade")
            return NOT_DONE_YET
        route = self.facade.engine.classify(request.method, request.path)
        if route is not None and route.is_models:
            serve_model_list(self.facade, request, route)
            return NOT_DONE_YET
        exchange = Exchange(self.facade, request)
        try:
            exchange.start()
        except Exception:
            exchange.crashed(Failure())
        return NOT_DONE_YET


def serve_model_list(facade: Facade, request: Request, route) -> None:
    """A model list covers the whole fleet, whatever the selection (spec 5)."""
    started = facade.clock.seconds()
    request_id = facade.next_request_id()
    query = request.uri.partition(b"?")[2]
    path = route.upstream_path + ("?" + query.decode("latin-1") if query else "")
    headers = end_to_end(request.requestHeaders, drop=MODEL_LIST_STRIPPED)
    listing = fleet_model_list(facade.agent, facade.clock, facade.nodes.routable(), path,
                               route.envelope, headers)
    finished = []
    request.notifyFinish().addErrback(lambda _: (finished or listing.cancel()))

    def answer(body):
        finished.append(True)
        status = 200
        if request._disconnected:
            status = 499
        elif body is None:
            status = 502 if request.getHeader(b"origin") else 503
            send_error(request, status, "model inventory unavailable")
        else:
            facade.notify("proxy/request-started", {
                "id": request_id, "method": request.method.decode("latin-1"),
                "path": request.path.decode("latin-1"), "target": "cluster"})
            request.setHeader(b"content-type", b"application/json")
            request.setHeader(b"content-length", str(len(body)).encode())
            request.write(body)
            request.finish()
        params = {"id": request_id, "method": request.method.decode("latin-1"),
                  "path": request.path.decode("latin-1"), "target": "cluster", "status": status,
                  "duration_ms": int(round((facade.clock.seconds() - started) * 1000))}
        if status != 200:
            params["error"] = "model inventory unavailable"
        facade.notify("proxy/request", params)

    listing.addCallback(answer).addErrback(
        lambda f: log.failure("model list failed", f, engine=facade.engine.id))


class BoundedRequest(Request):
    """A request whose body may not exceed 32 MiB (protocol 5), chunked bodies included.

    twisted.web has no limit of its own and reads the body before ``render``; over the limit
    we answer 413 at once, close, and keep none of the excess.
    """

    max_body = constants.MAX_REQUEST_BODY
    header_timeout = constants.SERVER_HEADER_READ_TIMEOUT

    def __init__(self, channel, *args, **kwargs):
        super().__init__(channel, *args, **kwargs)
        # Created at the request line: the headers must follow within 10 s (protocol 7),
        # so a client trickling headers cannot hold a connection for the idle timeout.
        self._header_timer = channel.callLater(self.header_timeout, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self.channel.transport.abortConnection()

    def gotLength(self, length):
        if self._header_timer is not None and self._header_timer.active():
            self._header_timer.cancel()
        self._header_timer = None
        self._received = 0
        self._rejected = False
        if length is not None and length > self.max_body:
            self._reject()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._rejected:
            return
        self._received += len(data)
        if self._received > self.max_body:
            self._reject()
            return
        super().handleContentChunk(data)

    def connectionLost(self, reason):
        if self._header_timer is not None and self._header_timer.active():
            self._header_timer.cancel()
        self._header_timer = None
        super().connectionLost(reason)

    def process(self):
        if getattr(self, "_rejected", False):
            return
        return super().process()

    def _reject(self) -> None:
        self._rejected = True
        self.content = None
        # Answered now, so no "100 Continue" may follow the final answer.
        self.requestHeaders.removeHeader(b"expect")
        facade = getattr(getattr(getattr(self.channel, "site", None), "resource", None),
                         "facade", None)
        if facade is not None:
            report_rejection(facade, getattr(self.channel, "_command", b""),
                             getattr(self.channel, "_path", b""), 413, BODY_TOO_LARGE)
        transport = self.channel.transport
        transport.write(raw_error(413, BODY_TOO_LARGE))
        transport.loseConnection()


def facade_site(facade: Facade, reactor=None) -> Site:
    """The Site serving one facade; idle timeout equal to the pool's (protocol 7)."""
    site = Site(FacadeResource(facade), timeout=constants.SERVER_IDLE_TIMEOUT, reactor=reactor)
    site.requestFactory = BoundedRequest
    site.displayTracebacks = False
    site.noisy = False
    return site
