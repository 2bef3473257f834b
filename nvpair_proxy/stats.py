"""Tail-only reading of a response body as it streams to the client
(docs/references.md#terminal-frames, #stats-sources).

The proxy hands every relayed chunk to a :class:`BodyObserver`, the composition of two ideas,
each in its own module:

* :mod:`nvpair_proxy.frames`: the framing, the terminal frame and the stream events, and the
  bounded tail the body leaves behind. :attr:`BodyObserver.terminal_seen` answers whether the
  stream's terminal frame has arrived (docs/references.md#terminal-frames): a client that closes
  after it is ``completed``, not ``cancelled``.
* :mod:`nvpair_proxy.tokens`: the token figures read from that tail.
  :meth:`BodyObserver.measure` gives the ``stats`` block of the terminal workload event
  (docs/references.md#stats-block, #stats-sources, #engine-decode-rate) when the response ends.

The observer never keeps the body: the last :data:`TAIL_LIMIT` bytes at most. Reading the tail
of a body is allowed; logging it is not (docs/references.md#no-content-logging). These modules log
nothing, and an observer's ``repr`` never shows body bytes.
"""

from __future__ import annotations

from typing import Any

from . import tokens
from .frames import LINE_LIMIT, TAIL_LIMIT, FrameReader

__all__ = ["BodyObserver", "LINE_LIMIT", "TAIL_LIMIT"]


class BodyObserver:
    """Watch a response body go by: its terminal frame and its stats, from a bounded tail.

    ``terminal`` is the route's terminal frame rule from the engine file (``sse-done``,
    ``sse-message-stop``, ``sse-response-completed``, ``ndjson-done``) or ``None``;
    ``content_type`` is the response's ``Content-Type`` (``str`` or ``bytes``), which wins over
    the rule when it names a framing. Unknown rules raise ``ValueError``.

    :meth:`feed` is the frame reader's own, bound once here, so a chunk costs no extra call.
    """

    def __init__(self, terminal: str | None, content_type: str | bytes | None = None) -> None:
        self._frames = FrameReader(terminal, content_type)
        self.terminal = terminal
        self.feed = self._frames.feed  # type: ignore[method-assign]  # bound once: no extra call

    def __repr__(self) -> str:
        frames = self._frames
        return (f"<BodyObserver terminal={self.terminal!r} bytes_seen={frames.bytes_seen} "
                f"events_seen={frames.events_seen} terminal_seen={frames.terminal_seen}>")

    def feed(self, data: bytes) -> None:  # replaced per instance by the reader's feed
        """Observe the next relayed chunk (split anywhere)."""
        self._frames.feed(data)

    @property
    def bytes_seen(self) -> int:
        """Body bytes fed so far."""
        return self._frames.bytes_seen

    @property
    def events_seen(self) -> int:
        """Stream events counted so far (see :mod:`nvpair_proxy.frames`); 0 for a JSON document."""
        return self._frames.events_seen

    @property
    def terminal_seen(self) -> bool:
        """Whether the body's terminal frame has arrived (docs/references.md#terminal-frames).
        Sticky once true."""
        return self._frames.terminal_seen

    @property
    def _tail(self) -> bytearray:
        return self._frames.tail

    def measure(
        self, *, admitted_at: float, first_byte_at: float | None, ended_at: float
    ) -> dict[str, Any] | None:
        """The ``stats`` block of the terminal workload event, or ``None`` if nothing was measured.

        Times are seconds on one clock: ``admitted_at`` the workload's admission,
        ``first_byte_at`` the first body byte (``None`` if there was none), ``ended_at`` the end.
        """
        frames = self._frames
        return tokens.measure(frames.tail, frames.events_seen, admitted_at=admitted_at,
                              first_byte_at=first_byte_at, ended_at=ended_at)
