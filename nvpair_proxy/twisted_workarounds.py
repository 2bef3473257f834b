"""The one place the proxy touches a private Twisted attribute, and why (issue 9).

``HTTPChannel.registerProducer`` (Twisted 26.10) stores a push producer without pausing it when
the client's transport has already paused the channel (its send buffer is full and
``pauseProducing`` came before the producer existed). The transport asks only once: it will
not pause the channel again until it has resumed it, so the new producer would stream into a
client that reads nothing, and the upstream body would pile up in memory instead of stalling
the upstream socket. The channel records that state only in ``_waitingForTransport``.

No upstream ticket was found for this (the installed Twisted source and tests name none;
HTTPChannel's own docstrings cite #8868 and #8488, which are about other problems). Delete this
module when HTTPChannel.registerProducer pauses a producer registered while paused.
"""

from __future__ import annotations

from twisted.web.server import Request


def channel_paused(request: Request) -> bool:
    """Whether the client connection has asked the request's channel to stop producing (and
    not yet to resume): a producer registered now must be paused by its registrant."""
    return request.channel is not None and bool(request.channel._waitingForTransport)
