"""One dispatch to one node, as an explicit state machine (docs/references.md#first-byte-commit,
#commit-cancel-claim).

dialing -> peeking -> committed, or -> failed / cancelled. The state field is the single
claim that decides commit versus cancel: the first transition out of ``dialing`` or
``peeking`` wins and the loser is a no-op, so an attempt can never be both served and
abandoned. A delivered first byte commits before any later cancel can land, because both run
in the reactor thread and the byte's arrival changes the state synchronously.
"""

from __future__ import annotations

import enum
from typing import Callable, cast

import attrs
from twisted.internet import error as ierror
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse
from zope.interface import implementer

from ..core.interfaces import IAttemptSink, IPeek, IWatchedAttempt
from ..core.memo import Memo
from ..core.timers import cancel_pending
from ..http.relay import BodyRelay, clean_end
from ..http.requestbody import BytesProducer
from ..nodes.discovery import Node, host_port
from ..routing.reservations import Reservation
from ..standalone.engineaccess import tls_problem


class State(enum.Enum):
    DIALING = "dialing"
    PEEKING = "peeking"
    COMMITTED = "committed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    # Members are singletons compared by identity, so their identity is their hash: the
    # transition table is asked at every move, and Enum's own hash runs Python code.
    __hash__ = object.__hash__


DIALING, PEEKING, COMMITTED, FAILED, CANCELLED = State

# Every move an attempt can make; the three outcomes are final. Commit versus cancel is
# decided by whichever leaves DIALING/PEEKING first (docs/references.md#commit-cancel-claim): the
# other finds no way out.
TRANSITIONS: dict[State, frozenset[State]] = {
    DIALING: frozenset({PEEKING, COMMITTED, FAILED, CANCELLED}),
    PEEKING: frozenset({COMMITTED, FAILED, CANCELLED}),
    COMMITTED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A move the table does not allow: a bug, never a race (the reactor thread decides)."""


class AttemptFailure(enum.StrEnum):
    """How an attempt ended without commit. Its value is its ``result`` label on
    ``nvpair_proxy_dispatches_total`` (a committed dispatch's is ``committed``)."""

    #: The node answered a status another node may fix (failed over from).
    STATUS = "refused_status"
    #: No answer: a refused or dropped connection, or headers that never came.
    TRANSPORT = "transport"
    #: Headers, then no first body byte within the cap.
    NO_CONTENT = "no_content"
    #: Abandoned: the request ended, or the node left the routable set.
    CANCELLED = "cancelled"


STATUS, TRANSPORT, NO_CONTENT, ATTEMPT_CANCELLED = AttemptFailure

# Failures while connecting mean "try the node's next address"
# (docs/references.md#multi-homed-dial).
_DIAL_ERRORS = (ierror.ConnectError, ierror.TimeoutError, ierror.DNSLookupError)

# A failed-over response with a known body at most this long is read out so its connection
# goes back to the pool; anything else is aborted (twisted-notes: never left dangling).
_DRAIN_LIMIT = 64 * 1024


@attrs.frozen
class UpstreamRequest:
    """What is sent to a node, the same on every dispatch of one request: built once at
    admission, so a dispatch hands over this value rather than re-passing its parts."""

    method: bytes
    #: The request target as the client sent it (path and query), appended to the origin.
    target: bytes
    headers: Headers
    body: bytes
    #: A 2xx waits for its first body byte (docs/references.md#first-byte-commit); every other
    #: answer commits on headers.
    inference: bool
    #: Which statuses another node may fix (docs/references.md#status-handling), unless the dispatch
    #: is the final one.
    retryable: Callable[[int], bool]
    #: The header cap, then the first-content cap (docs/references.md#attempt-caps); 0 disables
    #: both.
    response_timeout: float


@attrs.frozen
class Committed:
    """The attempt won: its response is the client's answer, body waiting in ``relay``.

    The dispatch hands its reservation over with it: whoever holds the value owns the claim
    on the node and releases it when the request ends.
    """

    node: Node
    address: str
    response: IResponse
    relay: "BodyRelay"
    reservation: Reservation | None = None


@attrs.frozen
class Failed:
    """The attempt ended without commit; ``kind`` says how, ``status`` for a refused answer."""

    node: Node
    kind: AttemptFailure
    reason: str
    status: int | None = None
    #: The attempt ran out its header or first-content cap: the node took a whole budget
    #: and gave nothing for it (docs/decisions.md#stall-cooldown).
    spent: bool = False


class AddressMemory:
    """The address of each node that last answered, tried first next time
    (docs/references.md#multi-homed-dial)."""

    def __init__(self) -> None:
        self._answered: dict[str, str] = {}

    def order(self, node: Node) -> list[str]:
        addresses = node.dial_order()
        preferred = self._answered.get(node.id)
        if preferred in addresses:
            addresses.remove(preferred)
            addresses.insert(0, preferred)
        return addresses

    def answered(self, node: Node, address: str) -> None:
        self._answered[node.id] = address

    def forget(self, node: Node) -> None:
        self._answered.pop(node.id, None)


# A body being read out must arrive within this long, or its connection is aborted.
_DRAIN_TIMEOUT = 5.0


class _Drain(Protocol):
    def __init__(self) -> None:
        self.timer: IDelayedCall | None = None
        self.done = False

    def dataReceived(self, data: bytes) -> None:
        pass

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.done = True
        cancel_pending(self.timer)
        self.timer = None

    def abort(self) -> None:
        # A response body's transport is its producer (``IResponse.deliverBody``).
        cast(IPushProducer, self.transport).stopProducing()


def discard(response: IResponse, clock: IReactorTime) -> None:
    """Read out a small answer we fail over from, abort anything else (twisted-notes)."""
    drain = _Drain()
    response.deliverBody(drain)
    if not (isinstance(response.length, int) and response.length <= _DRAIN_LIMIT):
        drain.abort()
    elif not drain.done:
        drain.timer = clock.callLater(_DRAIN_TIMEOUT, drain.abort)


_ORIGINS: Memo[tuple[str, str, int], bytes] = Memo(4096)


def origin_of(scheme: str, address: str, port: int) -> bytes:
    """``scheme://host:port`` as bytes, made once per address (a fleet has a handful)."""
    key = (scheme, address, port)
    origin = _ORIGINS.get(key)
    if origin is None:
        origin = _ORIGINS.remember(key, f"{scheme}://{host_port(address, port)}".encode())
    return origin


@implementer(IWatchedAttempt, IPeek)
class Attempt:
    """One dispatch: dial the node's addresses, wait for headers, peek the first body byte.

    ``request.inference`` makes a 2xx wait for its first body byte
    (docs/references.md#first-byte-commit); every other answer commits on its headers
    (docs/references.md#commit-on-headers). ``sink`` is the loop that made it: asked whether
    this answer is the client's whatever its status (docs/references.md#final-attempt-answers),
    and told the outcome, once. The loop lets go of an attempt that ended, so the attempt may
    keep its sink (docs/decisions.md#no-cycles).
    """

    def __init__(
        self,
        *,
        agent: IAgent,
        clock: IReactorTime,
        addresses: AddressMemory,
        node: Node,
        request: UpstreamRequest,
        sink: IAttemptSink,
    ):
        self.agent, self.clock, self.addresses, self.node = agent, clock, addresses, node
        self.request, self.sink = request, sink
        self.response_timeout = request.response_timeout
        self.state = DIALING
        self._request: Deferred[IResponse] | None = None
        self._timer: IDelayedCall | None = None
        self._relay: BodyRelay | None = None
        self._response: IResponse | None = None
        self._pending_addresses: list[str] = []
        self._address = ""

    def start(self) -> None:
        """Begin; the sink hears ``attempt_ended`` once, with Committed or Failed.

        A declared sink, not a Deferred: a Deferred per attempt was a measurable share of a
        request's CPU (docs/references.md#bare-proxy-cpu).
        """
        self._pending_addresses = self.addresses.order(self.node)
        if self.response_timeout > 0:
            self._timer = self.clock.callLater(self.response_timeout, self._timed_out)
        self._dial_next()

    def cancel(self, reason: str) -> bool:
        """Abandon the attempt unless it already committed or ended; True if this call won."""
        if self.state not in (DIALING, PEEKING):
            return False
        self._end(Failed(self.node, ATTEMPT_CANCELLED, reason), CANCELLED)
        return True

    def _dial_next(self) -> None:
        self._address = self._pending_addresses.pop(0)
        sent = self.request
        url = origin_of(self.node.scheme, self._address, self.node.port) + sent.target
        request = maybeDeferred(
            self.agent.request,
            sent.method,
            url,
            sent.headers,
            BytesProducer(sent.body) if sent.body else None,
        )
        self._request = request
        request.addCallbacks(self._got_response, self._dial_failed)

    def _dial_failed(self, failure: Failure) -> None:
        self._request = None
        if self.state != DIALING:
            return
        if failure.check(*_DIAL_ERRORS) and self._pending_addresses:
            self._dial_next()
            return
        self.addresses.forget(self.node)
        self._end(Failed(self.node, TRANSPORT, _reason(failure)), FAILED)

    def _got_response(self, response: IResponse) -> None:
        self._request = None
        if self.state != DIALING:
            discard(response, self.clock)
            return
        self.addresses.answered(self.node, self._address)
        self._response = response
        status = response.code
        if not self.sink.is_final() and self.request.retryable(status):
            discard(response, self.clock)
            self._end(Failed(self.node, STATUS, f"upstream returned HTTP {status}", status), FAILED)
            return
        relay = self._relay = BodyRelay(self)
        if self.request.inference and 200 <= status < 300:
            self._enter(PEEKING)
            if self._timer is not None and self._timer.active():
                # The first-content cap starts with the headers (docs/references.md#attempt-caps):
                # the header cap's timer moves rather than a second one being made.
                self._timer.reset(self.response_timeout)
            response.deliverBody(relay)
            return
        response.deliverBody(relay)
        self._commit()

    # What the relay tells while it holds the body (IPeek).

    def first_data(self) -> None:
        if self.state == PEEKING:
            self._commit()

    def body_ended(self, reason: Failure) -> None:
        if self.state != PEEKING:
            return
        if clean_end(reason):
            self._commit()
        else:
            self.addresses.forget(self.node)
            self._end(Failed(self.node, TRANSPORT, _reason(reason)), FAILED)

    def _commit(self) -> None:
        # Only a response with its relay in place commits (``_got_response`` set both).
        assert self._response is not None and self._relay is not None
        self._enter(COMMITTED)
        self._cancel_timer()
        # Handed over with the commit: the attempt keeps neither (the relay still names it).
        response, relay, self._response, self._relay = self._response, self._relay, None, None
        self.sink.attempt_ended(Committed(self.node, self._address, response, relay))

    def _timed_out(self) -> None:
        self._timer = None
        if self.state == DIALING:
            self._end(
                Failed(self.node, TRANSPORT, "timeout awaiting response headers", spent=True),
                FAILED,
            )
        elif self.state == PEEKING:
            self._end(
                Failed(
                    self.node,
                    NO_CONTENT,
                    "upstream sent no response body within the first-byte budget",
                    spent=True,
                ),
                FAILED,
            )

    def _end(self, outcome: Failed, state: State) -> None:
        self._enter(state)
        self._cancel_timer()
        if self._request is not None:
            request, self._request = self._request, None
            request.cancel()
        if self._relay is not None:
            self._relay.abort()
            self._relay = None
        self._response = None
        self.sink.attempt_ended(outcome)

    def _enter(self, state: State) -> None:
        if state not in TRANSITIONS[self.state]:
            raise InvalidTransition(
                f"attempt on {self.node.id}: {self.state.value} -> {state.value}"
            )
        self.state = state

    def _cancel_timer(self) -> None:
        cancel_pending(self._timer)
        self._timer = None


def _reason(failure: Failure) -> str:
    """Short, body-free text for an upstream failure (docs/references.md#no-content-logging:
    operational detail only)."""
    tls = tls_problem(failure)
    if tls is not None:
        return f"TLS: {tls}"
    value = failure.value
    inner = getattr(value, "reasons", None)
    if inner:
        value = inner[0].value
        if isinstance(value, CancelledError):
            return "request cancelled"
    if isinstance(value, ierror.ConnectionRefusedError):
        return "connection refused"
    if isinstance(value, (ierror.TimeoutError, ierror.TCPTimedOutError)):
        return "dial timeout"
    if isinstance(value, ierror.ConnectionLost) or isinstance(value, ierror.ConnectionDone):
        return "connection closed before the response completed"
    text = str(value).strip() or type(value).__name__
    return text.splitlines()[0][:200]
