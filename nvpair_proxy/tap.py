"""The twistd application maker: ``Options`` and ``makeService`` (what ServiceMaker loads)."""

from __future__ import annotations

from twisted.application.service import IService

from .options import Options

__all__ = ["Options", "makeService"]


def makeService(options: Options) -> IService:
    from .service import build_service
    return build_service(options)
