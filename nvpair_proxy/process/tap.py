"""The twistd application maker: ``Options`` and ``makeService`` (what ServiceMaker loads)."""

from __future__ import annotations

from functools import partial

from twisted.application.service import IService

from .options import Options

__all__ = ["Options", "makeService"]


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    from .service import build_service
    from .vitals import report_on_sigusr1

    service = build_service(options.config)
    service.offer_log_observer = partial(_offer_log_observer, options)
    reactor.callWhenRunning(report_on_sigusr1, reactor, lambda: _vitals(service, reactor))
    return service


def _offer_log_observer(options: Options, application) -> None:
    """Our observer for twistd to start: its destination, our format and level filter."""
    from ..core.logformat import observer, offer

    twistd = getattr(options, "parent", None) or {}
    offer(application, lambda: observer(options.config.log_format, twistd), twistd)


def _vitals(service, reactor) -> dict | None:
    """The process tree's runtime and its facades as they are now."""
    from .vitals import snapshot

    if service.runtime is None:
        return None
    return snapshot(
        reactor,
        service.runtime.pool,
        service.runtime.reservations,
        [child.facade for child in service.facades],
    )
