"""Stopping a delayed call whatever became of it (timers.py)."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core.timers import cancel_pending


class CancelPendingTests(SynchronousTestCase):
    def test_a_pending_call_never_runs(self):
        clock, ran = Clock(), []
        call = clock.callLater(1, ran.append, "fired")
        cancel_pending(call)
        clock.advance(2)
        self.assertEqual((ran, clock.getDelayedCalls()), ([], []))

    def test_a_call_that_ran_or_was_cancelled_or_none_is_left_alone(self):
        clock, ran = Clock(), []
        fired = clock.callLater(1, ran.append, "fired")
        clock.advance(1)
        cancelled = clock.callLater(1, ran.append, "cancelled")
        cancelled.cancel()
        for call in (fired, cancelled, None):
            cancel_pending(call)  # Twisted's own cancel raises for the first two
        self.assertEqual(ran, ["fired"])
