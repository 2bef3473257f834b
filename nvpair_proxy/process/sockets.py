"""Listening sockets the process is handed instead of binding its own: by systemd (socket
activation) or by the process it succeeds in a hot handoff (docs/operations.md#restarts).

Both speak systemd's protocol: descriptors from 3 up, ``LISTEN_FDS`` of them, for the process
``LISTEN_PID`` names, each named in ``LISTEN_FDNAMES`` (colon-separated) by the role it plays
here: a standalone facade's engine id (``ollama``, ``lmstudio``, ``llamacpp``) or ``admin``.
A port that was handed over is never closed between two processes, so a restart refuses no
connection: the kernel queues them until the new process accepts.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, MutableMapping

from ..core.acceptguard import guard
from ..core.logs import logger

log = logger()

#: The first inherited descriptor (systemd's SD_LISTEN_FDS_START).
LISTEN_FDS_START = 3
_VARIABLES = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


class Inherited:
    """The listening sockets handed to this process, by role; each is taken at most once."""

    def __init__(self, by_name: dict[str, int] | None = None) -> None:
        self._by_name = dict(by_name or {})
        self._taken: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._by_name)

    def take(self, name: str) -> int | None:
        """The descriptor handed over for ``name``, once; None when there is none."""
        if name in self._taken:
            return None
        fd = self._by_name.get(name)
        if fd is not None:
            self._taken.add(name)
        return fd

    def unused(self) -> list[str]:
        """The roles handed over that nothing took: a unit and a command line that disagree."""
        return sorted(set(self._by_name) - self._taken)


def inherited_sockets(
    environ: MutableMapping[str, str] = os.environ, pid: int | None = None
) -> Inherited:
    """The sockets ``environ`` hands to process ``pid`` (this one by default), read once and
    removed from ``environ`` so that no child takes them for its own. Raises ValueError with
    the one line start-up stops with when they cannot be used."""
    count = environ.get("LISTEN_FDS")
    owner = environ.get("LISTEN_PID")
    names = environ.get("LISTEN_FDNAMES", "")
    for variable in _VARIABLES:
        environ.pop(variable, None)
    if count is None:
        if not names:
            return Inherited()
        # twisted.internet.endpoints, imported before this runs, reads the set once at its
        # import (twisted.python.systemd.ListenFDs): it deletes LISTEN_PID and LISTEN_FDS
        # once it has checked that LISTEN_PID is this process, and leaves the names, which
        # then count the descriptors.
        count = str(len(names.split(":")))
    elif owner != str(os.getpid() if pid is None else pid):
        return Inherited()  # meant for another process (a parent that left them set)
    if not count.isdigit():
        raise ValueError(f"LISTEN_FDS must be a count of descriptors (got {count!r})")
    roles = names.split(":") if names else []
    if len(roles) != int(count):
        raise ValueError(
            f"LISTEN_FDNAMES must name each of the {count} inherited sockets by its role "
            f"(an --engine id or admin; got {names!r})"
        )
    by_name: dict[str, int] = {}
    for fd, role in enumerate(roles, LISTEN_FDS_START):
        if role in by_name:
            raise ValueError(f"LISTEN_FDNAMES names {role!r} twice; one socket each")
        by_name[role] = fd
    return Inherited(by_name)


def adopt(reactor, fd: int, factory, name: str):
    """Serve ``factory`` on the inherited listening socket ``fd``, with the accept guard a
    bound port gets (``acceptguard.listen_tcp``). Raises ValueError when ``fd`` is not a
    listening TCP socket. Twisted keeps its own copy of the descriptor; ``fd`` is closed."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ValueError(f"inherited socket {name} (fd {fd}): {exc.strerror or exc}") from None
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if sock.type != socket.SOCK_STREAM or not listening:
            raise ValueError(f"inherited socket {name} (fd {fd}) is not a listening TCP socket")
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise ValueError(f"inherited socket {name} (fd {fd}) is not an IP socket")
        # systemd hands sockets over blocking, and Twisted adopts a socket as it is: one
        # blocking accept would stop the reactor. The flag belongs to the socket, so
        # Twisted's copy of the descriptor shares it.
        sock.setblocking(False)
        port = reactor.adoptStreamPort(sock.fileno(), sock.family, factory)
    finally:
        sock.close()
    guard(port, f"{name} port {port.getHost().port}")
    log.info(
        "{name}: serving the inherited socket on port {port}", name=name, port=port.getHost().port
    )
    return port


def adopting(
    reactor,
    inherited: Inherited,
    name: str,
    listen: Callable,
    refuse: Callable[[object], str | None] = lambda port: None,
) -> Callable:
    """``listen(port, factory, interface)`` that serves the socket inherited for ``name``
    the first time it is asked, and binds as ``listen`` does otherwise (nothing was
    inherited for it, or it was taken: an alias). An inherited socket that cannot be served,
    or that ``refuse`` says why not to serve (the adopted port given), stops start-up with
    one line."""

    def listen_or_adopt(port: int, factory, interface: str):
        fd = inherited.take(name)
        if fd is None:
            return listen(port, factory, interface)
        try:
            adopted = adopt(reactor, fd, factory, name)
        except ValueError as exc:
            raise SystemExit(f"nvpair-proxy: {exc}") from None
        why = refuse(adopted)
        if why is not None:
            adopted.stopListening()
            raise SystemExit(f"nvpair-proxy: {why}")
        return adopted

    return listen_or_adopt
