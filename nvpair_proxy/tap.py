"""The twistd application maker: ``Options`` and ``makeService`` (what ServiceMaker loads)."""

from __future__ import annotations

from twisted.application.service import IService

from .options import Options

__all__ = ["Options", "makeService"]


def makeService(options: Options) -> IService:
    from twisted.internet import reactor

    from .service import build_service
    from .vitals import report_on_sigusr1
    service = build_service(options)
    reactor.callWhenRunning(report_on_sigusr1, reactor, lambda: _vitals(service, reactor))
    return service


def _vitals(service, reactor) -> dict | None:
    """Standalone services keep their facades; broker ones find them through the broker."""
    from .vitals import snapshot
    runtime = getattr(service, "runtime", None)
    if runtime is None:
        return None
    if hasattr(service, "facades"):
        facades = service.facades.values()
    else:
        facades = [running.facade for running in service.broker.running.values()]
    return snapshot(reactor, runtime.pool, runtime.reservations, facades)
