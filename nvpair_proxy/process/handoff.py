"""Hot handoff (docs/operations.md#restarts): on SIGHUP (``systemctl reload``) a standalone
proxy starts its successor on its own listening sockets, waits for the successor's READY=1,
tells systemd the successor is the service's main process now, then drains.

The listening sockets never close: the successor inherits them (``sockets.py``, systemd's
``LISTEN_FDS`` protocol), so from the clients' side nothing is refused while two processes
serve, one finishing what it admitted and one taking everything new. The successor is the
same command line run again, so the nodes file, the keys and the flags are read as at any
start (a changed nodes file or an upgraded package is what a reload is for).

The successor's READY=1 comes here, not to systemd: its ``NOTIFY_SOCKET`` is a datagram
socket of ours, and ``NVPAIR_HANDOFF_NOTIFY`` keeps systemd's for it to use once it serves
(``take_over_notify``). Only then does this process send ``MAINPID=<successor>`` (with
``NotifyAccess=main`` only the main process may), so a successor that exits or never gets
ready within ``HANDOFF_TIMEOUT`` is stopped and leaves this process serving, as if the
reload had not been asked: one log line says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Sequence

from twisted.internet.protocol import DatagramProtocol, ProcessProtocol

from ..core import sdnotify
from ..core.logs import logger
from ..core.timers import cancel_pending

log = logger()

#: Seconds a successor has to report READY=1.
HANDOFF_TIMEOUT = 30.0
#: Where a successor finds systemd's notification socket once it serves (empty: none).
HANDOFF_NOTIFY = "NVPAIR_HANDOFF_NOTIFY"
#: The shell line that starts the successor: LISTEN_PID must name the successor's own pid,
#: which only the child knows; ``exec`` keeps the shell's.
_WITH_OWN_PID = 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"'


#: twistd, run by this interpreter whatever the PATH holds.
_TWISTD = "from twisted.scripts.twistd import run; run()"


def successor_argv(argv: Sequence[str] = sys.argv, python: str = sys.executable) -> list[str]:
    """This process's command line again: twistd's arguments, however twistd was started
    (its script or ``python -c``), run by this interpreter."""
    return ["/bin/sh", "-c", _WITH_OWN_PID, "sh", python, "-c", _TWISTD, *argv[1:]]


def take_over_notify(environ=os.environ) -> None:
    """In a successor, once its READY=1 went to its predecessor: notify systemd directly from
    now on (watchdog pings, STOPPING=1, its own handoffs)."""
    if HANDOFF_NOTIFY in environ:
        systemd = environ.pop(HANDOFF_NOTIFY)
        if systemd:
            environ["NOTIFY_SOCKET"] = systemd
        else:
            environ.pop("NOTIFY_SOCKET", None)


class _Ready(DatagramProtocol):
    def __init__(self, heard: Callable[[bytes], None]) -> None:
        self.heard = heard

    def datagramReceived(self, datagram: bytes, addr) -> None:
        self.heard(datagram)


class _Successor(ProcessProtocol):
    def __init__(self, ended: Callable[[object], None]) -> None:
        self.ended = ended

    def processEnded(self, reason) -> None:
        self.ended(reason.value)


class Handoff:
    """One process's handoffs: at most one under way; ``sockets()`` names the listening
    ports to hand over, ``drain()`` is called once the successor is ready."""

    def __init__(
        self,
        reactor,
        sockets: Callable[[], list[tuple[str, int]]],
        drain: Callable[[], None],
        argv: Sequence[str] | None = None,
        environ=os.environ,
        timeout: float = HANDOFF_TIMEOUT,
    ) -> None:
        self.reactor, self.sockets, self.drain = reactor, sockets, drain
        self.argv = list(argv) if argv is not None else successor_argv()
        self.environ, self.timeout = environ, timeout
        #: The successor while it starts (an IProcessTransport), None otherwise.
        self.process: Any = None
        self._dir: str | None = None
        self._port = None
        self._timer = None
        self.handed_over = False
        #: This process stops (a drain or a stop began): no successor may start any more.
        self.stopped = False

    def start(self) -> bool:
        """Start a successor; False when one is already starting, this process has handed
        over already, or it is stopping."""
        if self.stopped:
            log.info("SIGHUP: this process is stopping; no handoff")
            return False
        if self.process is not None or self.handed_over:
            log.info("SIGHUP: a handoff is already under way")
            return False
        named = self.sockets()
        self._dir = tempfile.mkdtemp(prefix="nvp-handoff-")
        path = os.path.join(self._dir, "notify")
        self._port = self.reactor.listenUNIXDatagram(path, _Ready(self._heard))
        env = {k: v for k, v in self.environ.items() if not k.startswith("LISTEN_")}
        env.update(
            LISTEN_FDS=str(len(named)),
            LISTEN_FDNAMES=":".join(name for name, _ in named),
            NOTIFY_SOCKET=path,
        )
        env[HANDOFF_NOTIFY] = self.environ.get("NOTIFY_SOCKET", "")
        env.pop("WATCHDOG_PID", None)
        child_fds: dict[int, int | str] = {0: 0, 1: 1, 2: 2}
        for at, (_, fd) in enumerate(named, 3):
            child_fds[at] = fd
        try:
            self.process = self.reactor.spawnProcess(
                _Successor(self._ended), self.argv[0], self.argv, env, childFDs=child_fds
            )
        except OSError as exc:
            self._failed(f"it could not be started: {exc.strerror or exc}")
            return False
        self._timer = self.reactor.callLater(
            self.timeout, self._failed, f"it did not report READY=1 within {self.timeout:g}s"
        )
        log.info(
            "SIGHUP: starting a successor (pid {pid}) on {count} listening sockets",
            pid=self.process.pid,
            count=len(named),
        )
        return True

    def _heard(self, datagram: bytes) -> None:
        process = self.process
        if process is None or b"READY=1" not in datagram.split(b"\n"):
            return
        pid = process.pid
        self._close()
        self.process = None
        self.handed_over = True
        sdnotify.notify(f"MAINPID={pid}\nREADY=1", self.environ)
        log.info("handed over to pid {pid}; draining", pid=pid)
        self.drain()

    def _ended(self, reason: object) -> None:
        if self.process is not None:
            self.process = None
            self._failed(f"it exited before it was ready ({reason})")

    def _failed(self, why: str) -> None:
        log.error("hot handoff failed: {why}; this process keeps serving", why=why)
        self._end_successor()

    def stop(self) -> None:
        """The process stops (a SIGTERM's drain begins, or the stop itself): a successor
        still starting (``systemctl stop`` during a reload) is killed, as the stop was asked
        of the service, before its READY=1 could name it the main process; its notification
        socket's folder goes with it; and no later SIGHUP starts another."""
        self.stopped = True
        process = self._end_successor()
        if process is not None:
            log.info(
                "stopping: the successor that was starting (pid {pid}) is killed", pid=process.pid
            )

    def _end_successor(self):
        """Kill the successor still starting, if any, and close what waited for it: the
        process that was killed, None when none was starting."""
        process, self.process = self.process, None
        self._close()
        if process is not None:
            try:
                process.signalProcess(signal.SIGKILL)
            except Exception:
                pass  # it ended meanwhile
        return process

    def _close(self) -> None:
        cancel_pending(self._timer)
        self._timer = None
        if self._port is not None:
            self._port.stopListening()
            self._port = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
