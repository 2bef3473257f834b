"""One client request through a facade, top to bottom (docs/references.md#request-path).

The exchange is the request's one conductor (docs/architecture.md#request-path): admit
(classify, name the model, filter to owners: none is a local 502) -> the ticket -> run the
loop (dispatch.py, whose ``run`` answers with a Deferred) -> commit (status, headers, the
spliced first byte) -> stream with backpressure (stream.py, which reports here through
``IConductor``) -> end. Every way a request can end funnels into ``_end``, which runs once: it
is the one place the outcome is decided and reported, and it stops the stream (which releases
the reservation the commit handed over) and lets go of it.
"""

from __future__ import annotations

import enum
import json
from typing import cast

import attrs
from twisted.internet.interfaces import ITCPTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from ..core.interfaces import IConductor, IHealth, IOwners, IPlacement, ITicket
from ..core.logs import logger
from ..core.views import InFlightView
from ..http.answers import Reason, answer_internal_error, send_error
from ..http.hopbyhop import copy_end_to_end, end_to_end
from ..http.server import BoundedRequest
from ..nodes.discovery import host_port
from ..nodes.engines import Engine
from ..routing.clients import PRIORITY_HEADER
from ..routing.router import retry_after
from ..routing.tickets import PASS
from .attempt import Committed, UpstreamRequest
from .dispatch import Answer, Dispatch, Gone, Job, Upstreams, retryable_status
from .events import (
    CANCELLED,
    COMPLETED,
    FAILED,
    Outcome,
    PromptUse,
    Reporter,
    Workload,
    ms,
    route_class,
)
from .stream import Happened, Stream, StreamEvent

log = logger()


def read_body(body: bytes) -> dict | None:
    """The body as a JSON object, None when it is not one."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def requested_model(body: bytes | dict | None) -> str | None:
    """The ``model`` a body names, or None (docs/references.md#no-model-named): not JSON, not
    a string, empty."""
    data = read_body(body) if isinstance(body, bytes) else body
    model = data.get("model") if data is not None else None
    if not isinstance(model, str) or not model.strip():
        return None
    return model


# Request headers that end here: the framing this hop sets again, and the proxy's own
# priority (docs/decisions.md#fair-share).
NOT_FORWARDED = (b"host", b"content-length", PRIORITY_HEADER)

# "The caller did not classify the request": the route may be None (unlisted), so None
# cannot say it.
UNCLASSIFIED = object()


class Phase(enum.Enum):
    ADMITTING = "admitting"
    DISPATCHING = "dispatching"
    STREAMING = "streaming"
    ENDED = "ended"

    # Members are singletons compared by identity, so their identity is their hash: the
    # phase table is asked at every move, and Enum's own hash runs Python code.
    __hash__ = object.__hash__


# A request is admitted (or answered at once), dispatched until a node commits (or the loop
# answers), streamed, and ended exactly once; nothing leads back.
PHASES: dict[Phase, frozenset[Phase]] = {
    Phase.ADMITTING: frozenset({Phase.DISPATCHING, Phase.ENDED}),
    Phase.DISPATCHING: frozenset({Phase.STREAMING, Phase.ENDED}),
    Phase.STREAMING: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
}


ENDED = Phase.ENDED


class InvalidPhase(RuntimeError):
    """A move the table does not allow: a bug, contained to its request
    (docs/references.md#request-containment)."""


#: The opt-in header that says why a request went where it did.
PLACEMENT_HEADER = b"X-NVPAIR-Placement"


@attrs.frozen
class Wiring:
    """What every request of one facade works with, made once when the facade is: its engine,
    owners, placement and health, its voice, how it reaches nodes, and the requests in flight.

    ``inference`` None follows each request's route; False forwards in one pass without reading
    a model (the ingress: the originating node already routed). ``bad_gateway_code`` is the
    ``code`` every 502 the proxy answers carries (the ingress's backend error). ``health``
    hears what inference dispatches learn of their nodes (None: nothing)."""

    engine: Engine
    owners: IOwners
    placement: IPlacement
    health: IHealth | None
    reporter: Reporter
    upstreams: Upstreams
    in_flight: set
    inference: bool | None = None
    bad_gateway_code: str | None = None
    #: Answers say why they went where they did (``--placement-header``).
    placement_header: bool = False


@implementer(IConductor)
class Exchange:
    """A client request's whole life in one facade, its one conductor: it admits, runs the
    loop (dispatch.py) and takes its answer, owns the committed stream (stream.py) and hears
    from it and from the client's request, and ends once, letting go of its parts."""

    def __init__(self, request: BoundedRequest, wiring: Wiring, route=UNCLASSIFIED) -> None:
        self.request, self.wiring = request, wiring
        self.admitted_at = wiring.upstreams.clock.seconds()
        self.id = wiring.reporter.next_request_id()
        self.route = (
            wiring.engine.classify(request.method, request.path) if route is UNCLASSIFIED else route
        )
        inference = wiring.inference
        self.inference = (
            self.route is not None and self.route.is_inference if inference is None else inference
        )
        # The model the body named, as the client spelled it: for the admin listener's recent
        # requests, including those answered before a workload existed (no owner, busy).
        self.model: str | None = None
        self.workload: Workload | None = None
        #: The request's routing, made at admission by the facade's placement.
        self.ticket: ITicket = PASS
        self.dispatch: Dispatch | None = None
        #: The committed body on its way to the client, from the commit to the end.
        self.stream: Stream | None = None
        self.phase = Phase.ADMITTING

    @property
    def method(self) -> str:
        return self.request.method.decode("latin-1")

    @property
    def path(self) -> str:
        return self.request.path.decode("latin-1")

    # Admission.

    def start(self) -> None:
        content = self.request.content
        assert content is not None  # twisted.web has the whole body before it renders
        body = content.read()
        # The bytes are all that is kept: a request that waits in the queue would otherwise
        # hold its body twice, in this buffer too (docs/performance.md#scale).
        content.close()
        self.request.content = None
        wiring, inference = self.wiring, self.inference
        data = read_body(body) if inference else None
        model = self.model = requested_model(data)
        wanted = None if model is None else wiring.engine.normalize_model(model)
        no_candidate = Reason.NO_CANDIDATE if model is None else Reason.NO_OWNER
        candidates = wiring.owners.candidates(wanted)
        if not candidates:
            self._answer(Answer(502, no_candidate))
            return
        held = None if wanted is None else wiring.owners.busy_for(wanted)
        if held is not None:
            # Engines that just said they are full get no new work for a moment
            # (docs/decisions.md#busy-hold).
            self._answer(Answer(503, Reason.ALL_OWNERS_BUSY, retry_after=retry_after(held)))
            return
        placement = wiring.placement
        if wanted is not None and placement.refuses(candidates, wanted):
            # Late binding: every owner is full and the queue has no room left.
            retry = placement.retry_after(candidates, wanted)
            self._answer(Answer(503, Reason.ALL_OWNERS_BUSY, retry_after=retry))
            return
        request = self.request
        ticket = self.ticket = placement.ticket(
            wanted, len(body), request, data, reserve=model is not None and inference
        )
        reporter = wiring.reporter
        if model is not None:
            self.workload = reporter.new_workload(model, self.admitted_at)
            self.workload.admitted()
        log.debug(
            "request {id} admitted: {method} {path} model={model} job={job}",
            id=self.id,
            method=self.method,
            path=self.path,
            model=model,
            job=self.workload.id if self.workload else None,
            engine=wiring.engine.id,
        )
        wiring.in_flight.add(self)
        request.conduct(self)
        upstreams = wiring.upstreams
        sent = UpstreamRequest(
            method=request.method,
            target=request.uri,
            headers=upstreams.loop_guard.stamp(
                end_to_end(request.requestHeaders, drop=NOT_FORWARDED)
            ),
            body=body,
            inference=inference,
            retryable=retryable_status(inference),
            response_timeout=upstreams.bounds.response_timeout,
        )
        dispatch = self.dispatch = Dispatch(
            Job(
                request=sent,
                owners=wiring.owners,
                upstreams=upstreams,
                model=wanted,
                created_at=self.admitted_at,
                no_candidate=no_candidate,
                reporter=reporter,
                id=self.id,
                ticket=ticket,
                health=wiring.health if inference else None,
                workload=self.workload,
            )
        )
        self._enter(Phase.DISPATCHING)
        dispatch.run(candidates).addCallbacks(self._dispatched, self.crashed)

    @property
    def ended(self) -> bool:
        return self.phase is ENDED

    @property
    def node_id(self) -> str | None:
        """The node serving the request: set at the commit."""
        stream = self.stream
        return stream.node_id if stream is not None else None

    def target(self) -> str:
        """Where the request went: the committed address, else the latest dispatch's node."""
        stream = self.stream
        if stream is not None:
            committed = stream.committed
            return host_port(committed.address, committed.node.port)
        node = self.dispatch.node if self.dispatch is not None else None
        if node is None:
            return ""
        return host_port(node.addresses[0] if node.addresses else "", node.port)

    def view(self) -> InFlightView:
        """What the admin listener shows of this request while it is in flight: the node
        serving it (committed, else its attempt's) and whether it waits for an owner."""
        dispatch, node = self.dispatch, self.node_id
        if node is None and dispatch is not None:
            node = dispatch.attempting()
        return InFlightView(
            node=node,
            waiting_for_owner=dispatch is not None and dispatch.waiting_for_owner,
            queued=dispatch is not None and dispatch.queued,
        )

    def _enter(self, phase: Phase) -> None:
        if phase not in PHASES[self.phase]:
            raise InvalidPhase(f"request {self.id}: {self.phase.value} -> {phase.value}")
        self.phase = phase

    # The loop's answer.

    def _dispatched(self, result: Committed | Answer | Gone) -> None:
        try:
            self._take(result)
        except Exception:
            self.crashed(Failure())

    def _take(self, result: Committed | Answer | Gone) -> None:
        if self.ended:
            if isinstance(result, Committed):
                result.relay.abort()
                if result.reservation is not None:
                    result.reservation.release()
            return
        if isinstance(result, Answer):
            self._answer(result)
        elif isinstance(result, Committed):
            self._commit(result)

    def _answer(self, answer: Answer) -> None:
        code = self.wiring.bad_gateway_code
        if answer.status == 502 and code is not None:
            answer = attrs.evolve(answer, code=code)
        self._end(FAILED, answer.reason, answer.detail, status=answer.status)
        if not self.request.finished and not self.request.client_gone:
            send_error(
                self.request,
                answer.status,
                answer.text,
                code=answer.code,
                retry_after=answer.retry_after,
            )

    def _commit(self, committed: Committed) -> None:
        """The first byte (or a non-retried answer's headers) made this node ours
        (docs/references.md#first-byte-commit)."""
        self._enter(Phase.STREAMING)
        wiring = self.wiring
        # From here the stream owns the relay and the reservation the commit handed over: a
        # crash below still aborts the one and releases the other.
        stream = self.stream = Stream(
            self.request,
            committed,
            clock=wiring.upstreams.clock,
            terminal=self.route.terminal if self.route else None,
            idle_limit=wiring.upstreams.bounds.stream_idle,
            activity=wiring.reporter.activity_on,
            conductor=self,
        )
        response, node = committed.response, committed.node
        log.debug(
            "request {id} committed to node {node} with HTTP {status}",
            id=self.id,
            node=node.id,
            status=response.code,
            engine=wiring.engine.id,
        )
        if self.workload is not None:
            self.workload.started(node.id)
        wiring.reporter.request_started(self.id, self.method, self.path, self.target(), node.id)
        request = self.request
        request.setResponseCode(response.code, response.phrase)
        request.defaultContentType = None
        copy_end_to_end(response.headers, request.responseHeaders)
        if wiring.placement_header:
            placed = self.ticket.placed
            if placed.reason is not None:
                # Opt-in (``--placement-header``): node ids may be private
                # (docs/operations.md#placement).
                request.responseHeaders.setRawHeaders(
                    PLACEMENT_HEADER,
                    [f"{placed.reason}; node={node.id}; waited={ms(placed.waited)}"],
                )
        stream.start()

    # What the parts below tell (IConductor).

    def streamed(self, event: StreamEvent) -> None:
        """What the committed stream reports: the request's end follows from it."""
        happened = event.happened
        if happened is Happened.UPSTREAM_DONE:
            if not self.ended:
                self._end_committed()
        elif happened is Happened.UPSTREAM_IDLE:
            seconds = self.stream.idle_limit if self.stream is not None else 0.0
            log.warn(
                "request {id}: node {node} sent nothing for {seconds:g}s after commit; closing it",
                id=self.id,
                node=self.node_id,
                seconds=seconds,
                engine=self.wiring.engine.id,
            )
        elif happened is Happened.CLIENT_STALLED:
            self._client_stalled()
        else:
            assert event.failure is not None
            self.crashed(event.failure)

    def response_finished(self) -> None:
        """The backstop: a response that ended without reporting still reports, once."""
        if not self.ended:
            log.error(
                "request {id} finished without an outcome", id=self.id, engine=self.wiring.engine.id
            )
            if self.dispatch is not None:
                self.dispatch.stop(Reason.BACKSTOP)
            self._end(FAILED, Reason.BACKSTOP, status=500)

    def client_gone(self) -> None:
        if self.ended:
            return
        if self.stream is not None and self.stream.delivered_terminal():
            self.stream.abort()
            self._end_committed()
            return
        self._stop_upstream(Reason.CLIENT_GONE)
        self._end(CANCELLED, Reason.CLIENT_GONE)

    def _end_committed(self) -> None:
        stream = self.stream
        assert stream is not None
        code = stream.status
        stats = prompt = None
        wiring = self.wiring
        reporter = wiring.reporter
        dispatched_at = self.dispatch.dispatched_at if self.dispatch is not None else None
        if code < 400 and reporter.listening:
            try:
                stats = stream.measure(self.admitted_at)
                if reporter.recorder is not None:
                    prompt = stream.prompt_use(dispatched_at)
            except Exception:
                # Stats and the cache truth are additive; a body the reader cannot measure
                # still completes.
                log.failure(
                    "could not measure the response of request {id}",
                    id=self.id,
                    engine=wiring.engine.id,
                )
        if code < 400 and dispatched_at is not None:
            elapsed = wiring.upstreams.clock.seconds() - dispatched_at
            self.ticket.measured(stream.node_id, elapsed, stream.figures)
        if 200 <= code < 300:
            self._end(
                COMPLETED, None, status=code, stats=stats, note=stream.idle_note, prompt=prompt
            )
        else:
            self._end(FAILED, Reason.UPSTREAM_STATUS, str(code), status=code, stats=stats)

    # The client side going away.

    def _client_stalled(self) -> None:
        """A client that took nothing for 30 s is gone (docs/references.md#dead-client-deadline). It
        is cancelled even when the terminal frame was relayed: a client that stopped reading never
        received it."""
        transport = self._client_transport()
        self._stop_upstream(Reason.CLIENT_GONE)
        self._end(CANCELLED, Reason.CLIENT_GONE)
        if transport is not None:
            transport.abortConnection()

    def _client_transport(self) -> ITCPTransport | None:
        """The client's connection, to abort (its transport aborts; ``ITransport`` cannot)."""
        channel = self.request.channel
        return cast("ITCPTransport | None", channel.transport if channel else None)

    def shutdown(self) -> None:
        """Our own shutdown cancels in-flight requests (docs/references.md#shutdown-cancels)."""
        if self.ended:
            return
        self._stop_upstream(Reason.SHUTDOWN)
        self._end(CANCELLED, Reason.SHUTDOWN)
        transport = self._client_transport()
        if transport is not None:
            transport.abortConnection()

    def _stop_upstream(self, reason: Reason) -> None:
        if self.dispatch is not None:
            self.dispatch.stop(reason)
        if self.stream is not None:
            self.stream.abort()

    def crashed(self, failure: Failure) -> None:
        """A bug costs this request only: logged with its traceback, answered 500
        (docs/references.md#request-containment)."""
        log.failure(
            "unexpected error handling {method} {path}",
            failure,
            method=self.method,
            path=self.path,
            engine=self.wiring.engine.id,
        )
        self._stop_upstream(Reason.BACKSTOP)
        self._end(FAILED, Reason.BACKSTOP, status=500)
        answer_internal_error(self.request)

    # The one end.

    def _end(
        self,
        state: Outcome,
        reason: Reason | None,
        detail: str = "",
        *,
        status: int | None = None,
        stats: dict | None = None,
        note: str | None = None,
        prompt: PromptUse | None = None,
    ) -> None:
        """The one end: ``reason`` (None when it completed) and its detail say why, in its
        text on the wire and by its label in the metrics. ``note`` is said on
        ``proxy/request`` only: why a completed request's stream was cut."""
        if self.ended:
            return
        # A slot this end frees goes to a waiting request once the end is done, in this turn.
        placement = self.wiring.placement
        placement.hold_offers()
        try:
            self._ended(state, reason, detail, status, stats, note, prompt)
        finally:
            placement.offer_held()

    def _ended(
        self,
        state: Outcome,
        reason: Reason | None,
        detail: str,
        status: int | None,
        stats: dict | None,
        note: str | None,
        prompt: PromptUse | None,
    ) -> None:
        error = reason.says(detail) if reason is not None else None
        self._enter(Phase.ENDED)
        wiring = self.wiring
        stream = self.stream
        if stream is not None:
            stream.stop()
        wiring.in_flight.discard(self)
        engine = wiring.engine.id
        log.debug(
            "request {id} ended {state} ({error})",
            id=self.id,
            state=state,
            error=error or "ok",
            engine=engine,
        )
        if self.workload is not None:
            self.workload.terminal(state, error, stats)
        first_byte_at = stream.first_byte_at if stream is not None else None
        ttfb = None if first_byte_at is None else first_byte_at - self.admitted_at
        status = status if status is not None else 499
        duration = wiring.upstreams.clock.seconds() - self.admitted_at
        node_id, target = self.node_id, self.target()
        # A finished conductor lets go of its stream, which names it: nothing of the request
        # is left in a reference cycle (docs/decisions.md#no-cycles).
        self.stream = None
        reporter = wiring.reporter
        reporter.request_finished(
            self.id,
            self.method,
            self.path,
            target,
            status,
            duration,
            node_id=node_id,
            ttfb=ttfb,
            error=error or note,
        )
        if reporter.recorder is not None:
            placed = self.ticket.placed
            reporter.request_ended(
                route=route_class(self.route),
                outcome=state,
                status=status,
                duration=duration,
                node=node_id,
                model=self.model,
                reason=reason,
                ttfb=ttfb,
                stats=stats,
                dispatches=self.dispatch.dispatches if self.dispatch else 0,
                affinity=placed.affinity,
                placement=placed.reason,
                waited=placed.waited,
                prompt=prompt,
            )
