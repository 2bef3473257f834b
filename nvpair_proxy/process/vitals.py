"""What the process holds right now, as one log line on SIGUSR1: a debug channel for soaks.

A long run proves nothing grows only if someone can see the counts that would grow:
delayed calls on the reactor, idle connections in the pool, reservations, requests in
flight, memory and descriptors. Reading them costs a few attribute lookups and two reads of
``/proc/self``, so the line is produced only when asked for (``kill -USR1 <pid>``), never on
a timer that would itself be one more pending call.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Callable, Iterable

from ..core.logs import logger

log = logger()


def rss_kib() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def snapshot(reactor, pool, reservations, facades: Iterable) -> dict:
    facades = list(facades)
    return {
        "pending_calls": len(reactor.getDelayedCalls()),
        "pooled": pool.idle_count(),
        "reservations": sum(reservations.reservations.values()),
        "in_flight": sum(len(facade.in_flight) for facade in facades),
        "rss_kib": rss_kib(),
        "fds": open_fds(),
    }


def report_on_sigusr1(reactor, gather: Callable[[], dict | None]) -> None:
    """Log ``vitals {json}`` once per SIGUSR1; the handler only hands over to the reactor."""

    def report() -> None:
        vitals = gather()
        if vitals is not None:
            log.info("vitals {vitals}", vitals=json.dumps(vitals, sort_keys=True))

    signal.signal(signal.SIGUSR1, lambda number, frame: reactor.callFromThread(report))
