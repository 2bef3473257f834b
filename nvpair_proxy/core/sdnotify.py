"""systemd notifications (``Type=notify``), hand-written: one datagram, no new dependency."""

from __future__ import annotations

import os
import socket

from twisted.application.internet import TimerService


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


def watchdog(clock, environ=os.environ) -> TimerService | None:
    """``WATCHDOG=1`` at half the interval systemd asks for, when it asks; None otherwise.

    Half, so one late tick under load never lets systemd's deadline pass.
    """
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    service = TimerService(int(usec) / 2e6, notify, "WATCHDOG=1", environ)
    service.clock = clock
    service.setName("watchdog")
    return service
