"""systemd notifications (``Type=notify``), hand-written: one datagram, no new dependency."""

from __future__ import annotations

import os
import socket

from twisted.internet.task import LoopingCall


def notify(state: str, environ=os.environ) -> bool:
    """Send ``state`` to $NOTIFY_SOCKET; False when not under systemd or the send fails."""
    path = environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(path)
            sock.sendall(state.encode())
        return True
    except OSError:
        return False


def start_watchdog(clock, environ=os.environ) -> LoopingCall | None:
    """``WATCHDOG=1`` at half the interval systemd asks for, when it asks."""
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    loop = LoopingCall(notify, "WATCHDOG=1", environ)
    loop.clock = clock
    loop.start(int(usec) / 2e6, now=True)
    return loop
