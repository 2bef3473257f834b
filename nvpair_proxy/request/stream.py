"""A committed response on its way to the client (docs/references.md#first-byte-commit,
#terminal-frames, #stats-sources and #dead-client-deadline).

Built once a node commits, a :class:`Stream` owns everything that lives only while a body
streams: the producer the client connection sees (backpressure and the dead-client deadline),
the opt-in idle deadline on the upstream, the body observer that reads the terminal frame and
the stats, the byte and time counters, and the activity throttle. It is the sink the
committed relay streams into, and it owns what the commit handed over: the relay and the
reservation.

It decides nothing about the request's outcome. Whatever happens to the stream is reported
to its conductor (``IConductor.streamed``), as a :class:`StreamEvent`; the exchange decides
how the request ends, stops the stream once, and lets go of it.
"""

from __future__ import annotations

import enum
from typing import Callable, cast

import attrs
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.python.failure import Failure
from twisted.web.server import Request
from zope.interface import implementer

from ..body.tokens import BodyObserver, Figures
from ..core import constants
from ..core.interfaces import IBodySink, IConductor
from ..core.timers import cancel_pending
from ..core.twisted_workarounds import channel_paused
from ..http.relay import StreamIdle, StreamIdleTimeout, clean_end
from .attempt import Committed
from .events import PromptUse


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


@implementer(IBodySink, IPushProducer)
class Stream:
    """The committed body streaming from ``committed``'s relay into ``request``.

    ``terminal`` is the route's terminal frame rule (None: no rule); ``idle_limit`` 0 keeps
    a silent upstream open (the spec's behaviour); ``activity`` reports bytes from the node and
    answers the time before which reporting again is moot (docs/references.md#node-activity);
    ``conductor`` hears every :class:`StreamEvent`.

    It is also the producer registered with the client connection: a client that stops
    reading pauses the upstream socket (backpressure) and starts the dead-client deadline;
    resuming stops it (docs/references.md#dead-client-deadline).
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
        conductor: IConductor,
    ) -> None:
        self.request, self.committed, self.clock = request, committed, clock
        self.node_id = committed.node.id
        self.activity, self.conductor = activity, conductor
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
        self.upstream = cast(IPushProducer, committed.relay.transport)
        #: The dead-client deadline, running while the client takes nothing.
        self.timer: IDelayedCall | None = None
        self.idle: StreamIdle | None = None

    def start(self) -> None:
        """Register with the client connection and take the body, held bytes first."""
        request = self.request
        request.registerProducer(self, True)
        if self.idle_limit > 0:
            self.idle = StreamIdle(
                self.clock, self.idle_limit, self._client_paused, self._upstream_idle
            )
        self.committed.relay.attach(self)
        if not self.stopped and channel_paused(request):
            # The channel does not pause a producer registered while it is itself paused.
            self.pauseProducing()

    # The producer the client connection sees.

    def pauseProducing(self) -> None:
        self.upstream.pauseProducing()
        if self.timer is None and not self.stopped:
            self.timer = self.clock.callLater(
                constants.DEAD_CLIENT_WRITE_DEADLINE, self._client_stalled
            )

    def resumeProducing(self) -> None:
        self.stop_timer()
        self.upstream.resumeProducing()

    def stopProducing(self) -> None:
        self.stop_timer()
        self.upstream.stopProducing()

    def stop_timer(self) -> None:
        cancel_pending(self.timer)
        self.timer = None

    def _client_paused(self) -> bool:
        return self.timer is not None

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
            self.conductor.streamed(StreamEvent(Happened.CRASHED, Failure()))

    def upstream_done(self, reason: Failure) -> None:
        """The body ended; cleanly or not, a committed request is the caller's
        (docs/references.md#caller-promise)."""
        if self.stopped:
            return
        self.request.unregisterProducer()
        if self.first_byte_at is None:
            self.first_byte_at = self.clock.seconds()
        self.conductor.streamed(StreamEvent(Happened.UPSTREAM_DONE, reason))
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

    def prompt_use(self, dispatched_at: float | None) -> PromptUse | None:
        """What the engine reused of the prompt (docs/operations.md#cache-truth), None when
        its answer does not say how long the prompt was. Without the engine's own prefill
        time, a stream's dispatch to first byte stands for it: an engine streams its first
        token once it has read the prompt; a whole answer's first byte comes after all of
        it, so it stands for nothing."""
        figures = self.figures()
        if figures is None or not figures.prompt_seen:
            return None
        prefill = figures.prompt_seconds
        if (
            prefill is None
            and dispatched_at is not None
            and self.first_byte_at is not None
            and self.observer is not None
            and self.observer.events_seen > 1
        ):
            prefill = max(0.0, self.first_byte_at - dispatched_at)
        return PromptUse(seen=figures.prompt_seen, cached=figures.prompt_cached, prefill=prefill)

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
        self.stop_timer()
        self.committed.relay.abort()

    def stop(self) -> None:
        """The request ended: no timer of the stream stays, no chunk is relayed any more, and
        the reservation the commit handed over is released (idempotent)."""
        self.stopped = True
        self.stop_timer()
        if self.idle is not None:
            # The idle deadline is the stream's part: stopped, it is let go of (it names the
            # stream: docs/decisions.md#no-cycles).
            idle, self.idle = self.idle, None
            idle.stop()
        if self.committed.reservation is not None:
            self.committed.reservation.release()

    def _client_stalled(self) -> None:
        self.timer = None
        self.conductor.streamed(StreamEvent(Happened.CLIENT_STALLED))

    def _upstream_idle(self) -> None:
        """A committed engine went silent: close it; the client sees a truncated body and
        the workload stays completed (docs/references.md#caller-promise), with the note on
        ``proxy/request``."""
        self.idle_note = f"upstream sent nothing for {self.idle_limit:g}s after commit"
        self.conductor.streamed(StreamEvent(Happened.UPSTREAM_IDLE))
        self.committed.relay.abort()
        self.upstream_done(Failure(StreamIdleTimeout(self.idle_note)))
