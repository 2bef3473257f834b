"""The broker link's process side: the link on stdio (the real stdout claimed for it) or the
``--ipc`` socket, and how the process stops (docs/references.md#rpc-transport, #shutdown-order)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ReactorNotRunning
from twisted.internet.protocol import Factory
from twisted.internet.stdio import StandardIO
from twisted.python.failure import Failure

from ..broker.rpc import RpcLink
from ..core import constants
from ..core.logs import logger

log = logger()


def stop_once(reactor) -> None:
    """Stop the reactor unless it is already stopping: a broker's ``shutdown`` followed by
    SIGTERM, or Ctrl-C twice, must not log a ReactorNotRunning traceback."""
    try:
        reactor.stop()
    except ReactorNotRunning:
        pass


def stop_on_signals(reactor, drain: Callable[[], bool] | None = None) -> None:
    """SIGTERM and SIGINT are orderly stops here (docs/references.md#shutdown-order: exit 0).

    The reactor's own handlers remember the signal, and twistd re-raises it once shutdown
    has finished, so the process would die by signal (status 143) after a clean shutdown.
    Ours, installed once the reactor's are (it is running), only stop the reactor; the first
    one asks ``drain`` to stop gracefully instead (docs/operations.md#restarts), which
    answers False when there is nothing to drain for, and a second one stops at once.
    """
    signalled = []

    def stop(number: int, frame) -> None:
        name = signal.Signals(number).name
        signalled.append(name)
        if len(signalled) == 1 and drain is not None:
            reactor.callFromThread(_drain_or_stop, reactor, drain, name)
            return
        log.info("received {signal}, shutting down", signal=name)
        reactor.callFromThread(stop_once, reactor)

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stop)


def _drain_or_stop(reactor, drain: Callable[[], bool], name: str) -> None:
    if drain():
        log.info(
            "received {signal}, draining: admitted requests finish, new connections go "
            "elsewhere; a second {signal} stops at once",
            signal=name,
        )
        return
    log.info("received {signal}, shutting down", signal=name)
    stop_once(reactor)


def claim_stdout() -> int:
    """Give the link the real stdout and point fd 1 at stderr (docs/references.md#stdout-for-link).

    After this, a stray print or a library writing to stdout lands in the log, never in the
    middle of a JSON-RPC line.
    """

    sys.stdout.flush()
    link_fd = os.dup(1)
    os.dup2(2, 1)
    return link_fd


def connect_ipc(path: str):
    """Connect to the broker's socket at start-up; failure is one clear line
    (docs/references.md#ready-and-ipc)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"nvpair-proxy: --ipc: cannot connect to {path}: {exc.strerror or exc}"
        ) from None
    return sock


class LinkService(Service):
    """The broker link: stdio (the claimed fd 1) or the ``--ipc`` socket
    (docs/references.md#rpc-transport)."""

    name = "link"  # type: ignore[assignment]  # Twisted leaves Service.name untyped (None)

    def __init__(self, reactor, ipc: str | None, dispatch) -> None:
        self.reactor, self.ipc = reactor, ipc
        self.sock = None
        # Before twistd starts its log observer on stdout (makeService runs first).
        self.link_fd = None if ipc else claim_stdout()
        self.link = RpcLink(dispatch, on_closed=self._closed)

    def privilegedStartService(self) -> None:
        if self.ipc:
            self.sock = connect_ipc(self.ipc)

    def startService(self) -> None:
        super().startService()
        if self.sock is not None:
            factory = Factory.forProtocol(lambda: self.link.framer)
            self.reactor.adoptStreamConnection(self.sock.fileno(), socket.AF_UNIX, factory)
            self.sock.close()
        else:
            # POSIX's StandardIO; mypy reads stdio's Windows branch, which takes no fds.
            StandardIO(
                self.link.framer,
                stdin=0,
                stdout=self.link_fd,  # type: ignore[call-arg]
                reactor=self.reactor,
            )
        log.info("nvpair-proxy broker link up ({channel})", channel=self.ipc or "stdio")

    def is_up(self) -> bool:
        """Running, and the link to the broker open: what ``/healthz`` and the
        ``broker_link_up`` gauge report."""
        return bool(self.running and self.link.is_open())

    def _closed(self) -> None:
        """EOF ends the process (docs/references.md#shutdown-order), unless it is already ending."""
        if self.running and self.parent is not None and self.parent.running:
            log.info("broker link closed; shutting down")
            stop_once(self.reactor)

    def stopService(self) -> Deferred:
        """Flush what the link still holds (the shutdown answer, the cancelled events)
        before the reactor tears connections down; at most the grace."""
        super().stopService()
        transport = self.link.framer.transport
        if transport is None or getattr(transport, "disconnected", False):
            return succeed(None)
        flushed: Deferred[None] = Deferred()

        def closed(reason: Failure) -> None:
            if not flushed.called:
                flushed.callback(None)

        self.link.framer.on_closed = closed
        transport.loseConnection()
        flushed.addTimeout(constants.FACADE_SHUTDOWN_GRACE, self.reactor)
        return flushed.addErrback(lambda _: None)
