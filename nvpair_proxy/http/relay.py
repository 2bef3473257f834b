"""The committed body's way from the engine to the client (docs/references.md#first-byte-commit,
#terminal-frames, #dead-client-deadline).

``BodyRelay`` holds the upstream body until the stream attaches, which is what lets the
first byte be peeked and spliced back (the stream it attaches to, request/stream.py, is the
producer the client connection sees, with the dead-client deadline); ``StreamIdle`` is the
opt-in deadline on a committed upstream that went silent.
"""

from __future__ import annotations

from typing import Callable, cast

from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

from ..core.interfaces import IBodySink, IPeek
from ..core.timers import cancel_pending


class BodyRelay(Protocol):
    """Receives the upstream body; holds it until an IBodySink attaches, then streams it
    through.

    Holding is what lets the first byte be peeked and spliced back in front of the stream.
    While unattached the upstream transport is paused, so nothing but the first chunk is held,
    and ``peek`` hears of the first chunk and of an end; once attached, only the sink hears.
    """

    def __init__(self, peek: IPeek):
        self._peek = peek
        self._held: list[bytes] = []
        self._ended: Failure | None = None
        self._sink: IBodySink | None = None
        self._paused = False

    def dataReceived(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:  # every chunk after the first: straight through
            if data:  # an empty write would end a chunked response early
                sink.write(data)
            return
        if not data:
            return
        first = not self._held
        self._held.append(data)
        if first:
            self._peek.first_data()  # usually commits and attaches, in this same call
        if self._sink is None and not self._paused:
            self._paused = True
            self._upstream().pauseProducing()

    def _upstream(self) -> IPushProducer:
        """The upstream body's transport: a response body is delivered by a producer."""
        return cast(IPushProducer, self.transport)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._ended = reason
        sink = self._sink
        if sink is not None:
            # Nothing follows the end: the relay lets go of the sink, which holds it
            # (docs/decisions.md#no-cycles).
            self._sink = None
            sink.upstream_done(reason)
            return
        self._peek.body_ended(reason)

    def attach(self, sink: IBodySink) -> None:
        """Deliver what was held to ``sink`` and stream the rest into it."""
        held, self._held = self._held, []
        self._sink = sink
        for data in held:
            sink.write(data)
        if self._ended is not None:
            self._sink = None  # the body ended while held: nothing more arrives
            sink.upstream_done(self._ended)
        elif self._paused:
            self._paused = False
            self._upstream().resumeProducing()

    def head(self) -> bytes:
        """The first chunk while it is held (before a sink attaches), else nothing."""
        return self._held[0] if self._held else b""

    def abort(self) -> None:
        if self.transport is not None and self._ended is None:
            self._upstream().stopProducing()


def clean_end(reason: Failure) -> bool:
    """A body that ended as the framing said it would (close-delimited counts)."""
    # isinstance, not Failure.check: check walks the class hierarchy of each name given,
    # once per response (docs/references.md#bare-proxy-cpu).
    return isinstance(reason.value, (ResponseDone, PotentialDataLoss))


class StreamIdleTimeout(Exception):
    """The committed upstream was closed for silence (``--stream-idle-timeout``)."""


class StreamIdle:
    """Closes a committed upstream that sent nothing for ``limit`` seconds
    (docs/references.md#silent-upstream-gap, the spec's known gap, closed opt-in with
    ``--stream-idle-timeout``).

    One timer per stream, not per chunk: a chunk only stamps the time, and the timer, when it
    fires, re-arms for what is left. Time the client spends not reading does not count: the
    upstream is paused by us then, and the dead-client deadline is the one that applies.
    """

    def __init__(
        self, clock, limit: float, client_paused: Callable[[], bool], on_idle: Callable[[], None]
    ) -> None:
        self.clock, self.limit = clock, limit
        self.client_paused, self.on_idle = client_paused, on_idle
        self.last = clock.seconds()
        self.timer: IDelayedCall | None = clock.callLater(limit, self._check)

    def touch(self, now: float) -> None:
        """A chunk arrived at ``now`` (the caller's clock read, shared with its other uses)."""
        self.last = now

    def _check(self) -> None:
        now = self.clock.seconds()
        if self.client_paused():
            self.last = now
        due = self.last + self.limit
        if now < due:
            self.timer = self.clock.callLater(due - now, self._check)
            return
        self.timer = None
        self.on_idle()

    def stop(self) -> None:
        cancel_pending(self.timer)
        self.timer = None
