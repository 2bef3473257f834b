"""A committed response on its way to the client (docs/references.md#first-byte-commit,
#terminal-frames, #stats-sources and #dead-client-deadline).

Built once a node commits, a :class:`Stream` owns everything that lives only while a body
streams: the producer the client connection sees (backpressure and the dead-client deadline),
the opt-in idle deadline on the upstream, the body observer that reads the terminal frame and
the stats, the byte and time counters, and the activity throttle. It is the sink the
committed relay streams into, and it owns what the commit handed over: the relay and the
reservation.

It decides nothing about the request's outcome. Whatever happens to the stream is reported
through the one callback, as a :class:`StreamEvent`; the exchange decides how the request
ends and then stops the stream, once.
"""

from __future__ import annotations

import enum
from typing import Callable, cast

import attrs
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.python.failure import Failure
from twisted.web.server import Request
from zope.interface import implementer

from ..body.tokens import BodyObserver, Figures
from ..core import constants
from ..core.interfaces import IBodySink
from ..core.twisted_workarounds import channel_paused
from ..http.relay import ClientWatch, StreamIdle, StreamIdleTimeout, clean_end
from .attempt import Committed


class Happened(enum.Enum):
    #: The upstream body ended, cleanly or not; the client's response is finished after the
    #: report (so the outcome is known before the backstop could see it finished).
    UPSTREAM_DONE = "upstream done"
    #: The upstream was silent for the idle limit; it is closed next, and the stream then
    #: reports UPSTREAM_DONE with :attr:`Stream.idle_note` set.
    UPSTREAM_IDLE = "upstream idle"
    #: The client took nothing for the dead-client deadline
    #: (docs/references.md#dead-client-deadline).
    CLIENT_STALLED = "client stalled"
    #: A bug while relaying a chunk; ``failure`` has its traceback
    #: (docs/references.md#request-containment).
    CRASHED = "crashed"


@attrs.frozen
class StreamEvent:
    """One thing that happened to the stream, for its owner to act on."""

    happened: Happened
    failure: Failure | None = None


def _unheard(event: StreamEvent) -> None:
    pass


def _unheard_stall() -> None:
    pass


@implementer(IBodySink)
class Stream:
    """The committed body streaming from ``committed``'s relay into ``request``.

    ``terminal`` is the route's terminal frame rule (None: no rule); ``idle_limit`` 0 keeps
    a silent upstream open (the spec's behaviour); ``activity`` reports bytes from the node and
    answers the time before which reporting again is moot (docs/references.md#node-activity);
    ``report`` hears every :class:`StreamEvent`.
    """

    def __init__(
        self,
        request: Request,
        committed: Committed,
        *,
        clock: IReactorTime,
        terminal: str | None,
        idle_limit: float,
        activity: Callable[[str], float],
        report: Callable[[StreamEvent], None],
    ) -> None:
        self.request, self.committed, self.clock = request, committed, clock
        self.node_id = committed.node.id
        self.activity, self.report = activity, report
        response = committed.response
        self.status: int = response.code
        self.observer: BodyObserver | None = None
        if response.code < 400:
            self.observer = BodyObserver(
                terminal, response.headers.getRawHeaders(b"content-type", [b""])[0]
            )
        self.first_byte_at: float | None = None
        self.bytes_written = 0
        self.activity_due = 0.0
        #: Why a completed stream was cut short, said on ``proxy/request`` only.
        self.idle_note: str | None = None
        self.idle_limit = idle_limit
        self.stopped = False
        # A response body's transport is its producer (``IResponse.deliverBody``).
        self.watch = ClientWatch(
            cast(IPushProducer, committed.relay.transport),
            clock,
            self._client_stalled,
            constants.DEAD_CLIENT_WRITE_DEADLINE,
        )
        self.idle: StreamIdle | None = None

    def start(self) -> None:
        """Register with the client connection and take the body, held bytes first."""
        request, watch = self.request, self.watch
        request.registerProducer(watch, True)
        if self.idle_limit > 0:
            self.idle = StreamIdle(
                self.clock, self.idle_limit, lambda: watch.timer is not None, self._upstream_idle
            )
        self.committed.relay.attach(self)
        if not self.stopped and channel_paused(request):
            # The channel does not pause a producer registered while it is itself paused.
            watch.pauseProducing()

    # The sink the committed relay streams into.

    def write(self, data: bytes) -> None:
        """One relayed chunk: the per-token path, so it is kept to plain attribute work."""
        if self.stopped:
            return
        try:
            now = self.clock.seconds()
            if self.first_byte_at is None:
                self.first_byte_at = now
            if self.observer is not None:
                self.observer.feed(data)
            if self.idle is not None:
                self.idle.touch(now)
            self.bytes_written += len(data)
            self.request.write(data)
            if now >= self.activity_due:
                # The throttle says when this node may next be reported
                # (docs/references.md#node-activity): until then a chunk costs only this comparison.
                self.activity_due = self.activity(self.node_id)
        except Exception:
            self.report(StreamEvent(Happened.CRASHED, Failure()))

    def upstream_done(self, reason: Failure) -> None:
        """The body ended; cleanly or not, a committed request is the caller's
        (docs/references.md#caller-promise)."""
        if self.stopped:
            return
        self.request.unregisterProducer()
        if self.first_byte_at is None:
            self.first_byte_at = self.clock.seconds()
        self.report(StreamEvent(Happened.UPSTREAM_DONE, reason))
        if clean_end(reason):
            self.request.finish()
        else:
            self.request.loseConnection()

    # What the stream knows when the request ends.

    def delivered_terminal(self) -> bool:
        """The stream's terminal frame, or its declared length, reached the client
        (docs/references.md#terminal-frames)."""
        if self.observer is not None and self.observer.terminal_seen:
            return True
        length = self.committed.response.length
        return isinstance(length, int) and self.bytes_written >= length

    def figures(self) -> Figures | None:
        """What the engine reported in the body's tail, None without an observer."""
        return None if self.observer is None else self.observer.figures()

    def measure(self, admitted_at: float) -> dict | None:
        """The terminal event's ``stats`` (docs/references.md#stats-sources), None without an
        observer; may raise on a body the reader cannot measure."""
        if self.observer is None:
            return None
        return self.observer.measure(
            admitted_at=admitted_at, first_byte_at=self.first_byte_at, ended_at=self.clock.seconds()
        )

    # Its end.

    def abort(self) -> None:
        """Stop the upstream: the request ends without the rest of this body."""
        self.watch.stop_timer()
        self.committed.relay.abort()

    def stop(self) -> None:
        """The request ended: no timer of the stream stays, no chunk is relayed any more, and
        the reservation the commit handed over is released (idempotent)."""
        self.stopped = True
        self.watch.stop_timer()
        if self.idle is not None:
            self.idle.stop()
        if self.committed.reservation is not None:
            self.committed.reservation.release()
        # A stopped stream reports nothing more: it lets go of its owner, and its watch of
        # it (docs/decisions.md#no-cycles).
        self.report = _unheard
        self.watch.on_dead = _unheard_stall

    def _client_stalled(self) -> None:
        self.report(StreamEvent(Happened.CLIENT_STALLED))

    def _upstream_idle(self) -> None:
        """A committed engine went silent: close it; the client sees a truncated body and
        the workload stays completed (docs/references.md#caller-promise), with the note on
        ``proxy/request``."""
        self.idle_note = f"upstream sent nothing for {self.idle_limit:g}s after commit"
        self.report(StreamEvent(Happened.UPSTREAM_IDLE))
        self.committed.relay.abort()
        self.upstream_done(Failure(StreamIdleTimeout(self.idle_note)))
