"""Listening ports at the descriptor limit: stop accepting for a while, then try again
(docs/decisions.md#descriptor-limit).

Twisted's accept loop, left alone, answers ``EMFILE`` by accepting and closing every waiting
client, three info lines per client, and the other exhaustion errors (``ENFILE``,
``ENOBUFS``, ``ENOMEM``) by returning with the socket still readable, so the reactor calls it
straight back (twisted_workarounds.py says where). And a process whose every descriptor holds
a client has none left to reach an engine for them: each dispatch fails to connect, and no
client is served.

An ``AcceptGuard`` stands between one port and its accepts:

- once the client connections of every guarded port hold half of the descriptors the
  process's own files leave (``ACCEPT_RESERVE`` of the limit; each accepted socket is counted
  until Twisted closes it), or an accept fails for want of
  descriptors or memory, the port stops reading for ``ACCEPT_PAUSE``, one timer. The clients
  beyond wait in the kernel's backlog instead of being closed, and are accepted once
  descriptors are free again. The other half is left to the upstream connections that serve
  the accepted clients (one each at a time) and the process's own files;
- at the end of a pause it pauses again, without an accept, while the clients still hold
  their half;
- it logs at most one warn line per ``ACCEPT_LOG_INTERVAL`` (with how many pauses since the
  last), and after each at most one info line, when a client is accepted below the limit
  again: never a line per client or per attempt.
"""

from __future__ import annotations

import errno
import resource
import socket
from typing import Callable, cast

from twisted.internet import tcp
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from .constants import ACCEPT_BACKLOG, ACCEPT_LOG_INTERVAL, ACCEPT_PAUSE, ACCEPT_RESERVE
from .logs import logger
from .timers import cancel_pending
from .twisted_workarounds import guard_accepts

log = logger()

# accept(2) failing for want of a descriptor (the process's or the system's) or of memory.
EXHAUSTED = {
    errno.EMFILE: "EMFILE",
    errno.ENFILE: "ENFILE",
    errno.ENOBUFS: "ENOBUFS",
    errno.ENOMEM: "ENOMEM",
}


#: Where the soft limit is raised to when the hard one is unlimited: the kernel's default
#: ``fs.nr_open``, the most a process may open.
NOFILE_CEILING = 1 << 20


def raise_descriptor_limit(rlimit=resource) -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (docs/decisions.md#descriptor-limit):
    a default soft limit of 1,024 is a few hundred streams, each holding a client's and an
    engine's descriptor. (before, after); after is before when it could not be raised. The
    guard reads the limit each time (``descriptor_limit``), so its thresholds follow."""
    soft, hard = rlimit.getrlimit(rlimit.RLIMIT_NOFILE)
    target = hard if hard != rlimit.RLIM_INFINITY else NOFILE_CEILING
    if soft == rlimit.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        rlimit.setrlimit(rlimit.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def stop_accepting(port) -> None:
    """Stop accepting on a listening ``port`` that a successor serves now (a hot handoff),
    leaving its socket open until the process exits: Twisted closes a port it bound with
    ``shutdown`` first, which would shut the successor's copy of the socket too. The guard
    reads ``disconnecting`` before it resumes a paused port (``guard``): this one stays
    stopped."""
    port.stopReading()
    port.disconnecting = True


def descriptor_limit() -> int:
    """The process's soft ``RLIMIT_NOFILE``, read each time (``prlimit`` can change it)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


class Clients:
    """The client connections open on every guarded port of the process."""

    def __init__(self) -> None:
        self.count = 0


CLIENTS = Clients()


class AcceptGuard:
    """Pauses one listening port at the descriptor limit (see the module docstring).

    ``pause`` and ``resume`` stop and restart the port's reading; ``name`` says which port in
    the log lines; ``clients`` is shared by every port of the process.
    """

    def __init__(
        self,
        name: str,
        clock: IReactorTime,
        pause: Callable[[], None],
        resume: Callable[[], None],
        *,
        clients: Clients = CLIENTS,
        limit: Callable[[], int] = descriptor_limit,
        log: Logger = log,
    ) -> None:
        self.name, self.clock, self.clients = name, clock, clients
        self._pause, self._resume = pause, resume
        self.limit, self.log = limit, log
        self.timer: IDelayedCall | None = None
        self.started: float | None = None  # when the condition began; None: not at it
        self.logged_at: float | None = None  # the last warn line
        self.warned = False  # a warn line since the last info line
        self.unlogged = 0  # pauses since the last warn line
        self.stopped = False  # the port's reading stopped by us
        self.closed = False

    @property
    def paused(self) -> bool:
        return self.timer is not None

    def accepted(self) -> None:
        """A client was accepted (``released`` is called once when it closes)."""
        self.clients.count += 1
        if self.full():
            self.hold(self.describe())
        elif self.started is not None:
            self.recovered()

    def released(self) -> None:
        self.clients.count -= 1

    def failed(self, code: int) -> None:
        """accept(2) failed with ``code``, one of EXHAUSTED."""
        self.hold(f"accept failed with {EXHAUSTED.get(code, code)}; {self.describe()}")

    def full(self) -> bool:
        """Whether the clients hold half of the descriptors the process's own files leave."""
        return self.clients.count >= max(1, (self.limit() - ACCEPT_RESERVE) // 2)

    def describe(self) -> str:
        return f"{self.clients.count} client connections, descriptor limit {self.limit()}"

    def hold(self, why: str) -> None:
        """Stop reading for one pause; a warn line if none came in ``ACCEPT_LOG_INTERVAL``."""
        if self.closed:
            return
        now = self.clock.seconds()
        self.unlogged += 1
        if self.started is None:
            self.started = now
        if self.logged_at is None or now - self.logged_at >= ACCEPT_LOG_INTERVAL:
            self.log.warn(
                "{name}: out of file descriptors ({why}); not accepting new "
                "connections, retrying every {pause} s ({count} pauses since the "
                "last such line)",
                name=self.name,
                why=why,
                pause=ACCEPT_PAUSE,
                count=self.unlogged - 1,
            )
            self.logged_at, self.unlogged, self.warned = now, 0, True
        if not self.stopped:
            self._pause()
            self.stopped = True
        cancel_pending(self.timer)
        self.timer = self.clock.callLater(ACCEPT_PAUSE, self.retry)

    def retry(self) -> None:
        """The pause is over: accept again, unless the clients still hold half the limit
        (then pause once more, without an accept)."""
        self.timer = None
        if self.closed:
            return
        if self.full():
            self.hold(self.describe())
            return
        self.stopped = False
        self._resume()

    def recovered(self) -> None:
        """A client was accepted below the limit: the condition is over. Said once per warn
        line, so the two together come at most twice per ``ACCEPT_LOG_INTERVAL``."""
        assert self.started is not None
        if self.warned:
            self.log.info(
                "{name}: accepting connections again after {seconds:.1f} s out of file descriptors",
                name=self.name,
                seconds=self.clock.seconds() - self.started,
            )
            self.warned = False
        self.started = None

    def close(self) -> None:
        """The port stopped listening: no more timers."""
        self.closed = True
        cancel_pending(self.timer)
        self.timer = None


class CountedSocket(socket.socket):
    """An accepted client's socket that tells its guard once when it is closed (Twisted's
    transport closes the socket it was given when the connection ends)."""

    def __init__(self, client: socket.socket, guard: AcceptGuard) -> None:
        super().__init__(client.family, client.type, client.proto, fileno=client.detach())
        self.guard: AcceptGuard | None = guard

    def close(self) -> None:
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.released()
        super().close()


class GuardedSocket:
    """A listening socket whose ``accept`` consults an AcceptGuard: while it is paused, and
    when accept(2) fails for want of descriptors, the caller sees ``EAGAIN`` (no client
    waiting), which ends Twisted's accept loop quietly. Everything else is the socket's."""

    def __init__(self, sock: socket.socket, guard: AcceptGuard) -> None:
        self.sock, self.guard = sock, guard

    def accept(self) -> tuple[socket.socket, object]:
        if self.guard.paused:
            raise BlockingIOError(errno.EAGAIN, "accepting is paused")
        try:
            client, address = self.sock.accept()
        except OSError as exc:
            if exc.errno not in EXHAUSTED:
                raise
            self.guard.failed(exc.errno)
            raise BlockingIOError(errno.EAGAIN, "accepting is paused") from None
        counted = CountedSocket(client, self.guard)
        self.guard.accepted()
        return counted, address

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def guard(port, name: str) -> AcceptGuard | None:
    """Put an AcceptGuard on ``port`` (a listening port ``listenTCP`` returned); a port that
    is not Twisted's TCP port (a test's memory reactor) is left as it is."""
    if not isinstance(port, tcp.Port):
        return None

    def resume() -> None:
        if port.connected and not port.disconnecting:
            port.startReading()

    accept_guard = AcceptGuard(name, cast(IReactorTime, port.reactor), port.stopReading, resume)
    guard_accepts(port, lambda sock: GuardedSocket(sock, accept_guard), accept_guard.close)
    return accept_guard


def listen_tcp(reactor, port: int, factory, interface: str, name: str):
    """``reactor.listenTCP`` with an AcceptGuard on the port, and a backlog of
    ``ACCEPT_BACKLOG`` (Twisted's 50 would drop most of a burst's SYNs while accepting is
    paused, each client then waiting for its retransmission, 1 s, 3 s, 7 s later)."""
    listening = reactor.listenTCP(port, factory, backlog=ACCEPT_BACKLOG, interface=interface)
    guard(listening, f"{name} port {listening.getHost().port}")
    return listening
