"""The SIGUSR1 vitals line bench/soak reads: exact counts, logged through the reactor."""

from __future__ import annotations

import json
import os
import signal

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.http.pool import ConnectionPool
from nvpair_proxy.process import vitals
from nvpair_proxy.routing.reservations import ReservationMap
from nvpair_proxy.test.support import LogCapture


class Idle:
    """An idle connection as the pool holds it: its origin and when it went idle."""

    def __init__(self, key: tuple) -> None:
        self.key, self.idle_until = key, 0.0


class Facade:
    def __init__(self, in_flight: int) -> None:
        self.in_flight = set(range(in_flight))


class VitalsTests(SynchronousTestCase):
    def test_snapshot_counts(self) -> None:
        reactor = MemoryReactorClock()
        reactor.callLater(5, lambda: None)
        reactor.callLater(9, lambda: None)
        reservations = ReservationMap()
        reservations.reserve("a")
        reservations.reserve("a")
        reservations.reserve("b")
        pool = ConnectionPool(reactor)
        for key in (("http", b"h", 1), ("http", b"h", 1), ("http", b"h", 2)):
            pool.give(Idle(key))
        got = vitals.snapshot(reactor, pool, reservations, [Facade(2), Facade(0), Facade(1)])
        self.assertEqual(
            {k: got[k] for k in ("pending_calls", "pooled", "reservations", "in_flight")},
            {"pending_calls": 3, "pooled": 3, "reservations": 3, "in_flight": 3},
            "two timers plus the pool's one idle sweep",
        )
        self.assertEqual(got["fds"], len(os.listdir("/proc/self/fd")))
        self.assertGreater(got["rss_kib"], 1000)

    def test_sigusr1_logs_one_line_from_the_reactor(self) -> None:
        previous = signal.getsignal(signal.SIGUSR1)
        self.addCleanup(signal.signal, signal.SIGUSR1, previous)
        reactor = MemoryReactorClock()
        calls = []
        reactor.callFromThread = lambda f, *a: calls.append((f, a))
        lines = LogCapture(self).events
        vitals.report_on_sigusr1(reactor, lambda: {"pooled": 4, "in_flight": 0})
        os.kill(os.getpid(), signal.SIGUSR1)
        # The handler only queued the work; nothing was logged inside the signal handler.
        self.assertEqual(len(calls), 1)
        self.assertEqual([e for e in lines if "vitals" in str(e.get("log_format"))], [])
        function, args = calls[0]
        function(*args)
        (event,) = [e for e in lines if e.get("log_format") == "vitals {vitals}"]
        self.assertEqual(json.loads(event["vitals"]), {"in_flight": 0, "pooled": 4})


class WiringTests(SynchronousTestCase):
    """tap reads the process tree: its runtime and the facades it holds now."""

    def runtime(self):
        class Runtime:
            pool = ConnectionPool(MemoryReactorClock())
            reservations = ReservationMap()

        Runtime.pool.give(Idle(("http", b"h", 1)))
        return Runtime()

    def test_the_facades_of_the_tree(self) -> None:
        from twisted.application.service import MultiService, Service

        from nvpair_proxy.process import tap
        from nvpair_proxy.process.service import ProcessService

        root = ProcessService(MemoryReactorClock())
        root.runtime, root.facades = self.runtime(), MultiService()
        for count in (2, 1):
            child = Service()
            child.facade = Facade(count)
            child.setServiceParent(root.facades)
        got = tap._vitals(root, MemoryReactorClock())
        self.assertEqual((got["in_flight"], got["pooled"]), (3, 1))

    def test_before_start_up_there_is_nothing_to_report(self) -> None:
        from nvpair_proxy.process import tap
        from nvpair_proxy.process.service import ProcessService

        self.assertIsNone(tap._vitals(ProcessService(MemoryReactorClock()), MemoryReactorClock()))
