"""The last fifteen minutes (docs/operations.md#history): a sample every 10 s, 90 kept,
each measured from the counters' growth over its interval."""

from __future__ import annotations

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from nvpair_proxy.admin.admin import AdminService
from nvpair_proxy.admin.history import HISTORY_SAMPLES, History, percentile
from nvpair_proxy.admin.recorder import Recorder
from nvpair_proxy.core.interfaces import IStatusSource
from nvpair_proxy.core.views import EngineView, FacadeView, ProcessSnapshot, RoutingView
from nvpair_proxy.request.events import PromptUse
from nvpair_proxy.test.support import request_ended


def snapshot(queued: int = 0) -> ProcessSnapshot:
    engine = EngineView(
        node="a", slots_total=1, busy=0, ours=0, reported_busy=0, warm=None, read_age=None
    )
    routing = RoutingView(
        pin="", nodes=(), routable=("a",), held=(), cooling=(), engines=(engine,), queued=queued
    )
    facade = FacadeView(engine="llamacpp", port=8080, routing=routing, in_flight=())
    return ProcessSnapshot(running=True, facades=(facade,), reservations={}, streamed={})


class HistoryTests(SynchronousTestCase):
    def test_each_sample_measures_its_own_interval(self):
        recorder, history = Recorder(), History()
        recorder.requests["llamacpp", "inference", "completed"] = 30
        recorder.reasons["llamacpp", "busy"] = 2
        recorder.ttfb_window = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
        # the cache truth's counts so far (cachetruth.py): exact on one node, estimated on another
        cache = recorder.cache
        cache.observe("llamacpp", "a", "m", PromptUse(seen=800, cached=500))
        cache.observe("llamacpp", "b", "m", PromptUse(seen=200, cached=100))
        first = history.take(10.0, recorder, snapshot(queued=4))
        self.assertEqual(
            (first.requests_per_s, first.ttft_p50_ms, first.ttft_p90_ms, first.queued),
            (3.0, 500, 900, 4),
        )
        self.assertEqual((first.prompt_reused_share, first.errors), (0.6, {"busy": 2}))
        recorder.requests["llamacpp", "inference", "completed"] = 35
        recorder.reasons["llamacpp", "busy"] = 2
        recorder.reasons["llamacpp", "transport"] = 1
        cache.observe("llamacpp", "a", "m", PromptUse(seen=1000, cached=900))
        second = history.take(20.0, recorder, snapshot())
        self.assertEqual((second.requests_per_s, second.ttft_p50_ms), (0.5, None))
        self.assertEqual(second.prompt_reused_share, 0.9, "900 of the 1,000 new tokens")
        self.assertEqual(second.errors, {"transport": 1}, "only the interval's")

    def test_fifteen_minutes_are_kept_the_oldest_go(self):
        recorder, history = Recorder(), History()
        for n in range(HISTORY_SAMPLES + 10):
            history.take(10.0 * (n + 1), recorder, snapshot())
        status = history.status()
        self.assertEqual(status["interval_s"], 10.0)
        self.assertEqual(len(status["samples"]), 90)
        self.assertEqual(status["samples"][0]["at"], 110.0)

    def test_the_first_byte_times_kept_between_samples_are_bounded(self):
        from nvpair_proxy.admin.recorder import TTFB_WINDOW

        recorder = Recorder()
        for _ in range(TTFB_WINDOW + 5):
            recorder.request_ended(request_ended(engine="e", duration=1.0, node="a", ttfb=0.5))
        self.assertEqual(len(recorder.take_ttfbs()), TTFB_WINDOW)
        self.assertEqual(recorder.take_ttfbs(), [])

    def test_percentile_is_the_nearest_rank(self):
        self.assertIsNone(percentile([], 0.5))
        self.assertEqual(percentile([3.0], 0.9), 3.0)
        self.assertEqual(percentile([4.0, 1.0, 3.0, 2.0], 0.5), 2.0)


@implementer(IStatusSource)
class Source:
    def snapshot(self) -> ProcessSnapshot:
        return snapshot(queued=1)


class SamplingTests(SynchronousTestCase):
    def test_the_admin_listener_samples_every_10_seconds(self):
        reactor = MemoryReactorClock()
        service = AdminService(Source(), Recorder(), ("127.0.0.1", 0), reactor, "standalone")
        service.privilegedStartService()
        service.startService()
        view = service.view
        reactor.advance(9.9)
        self.assertEqual(len(view.history.samples), 0)
        reactor.advance(0.1)
        reactor.advance(10)
        self.assertEqual([s.at for s in view.history.samples], [10.0, 20.0])
        service.stopService()
        reactor.advance(30)
        self.assertEqual(len(view.history.samples), 2, "stopped with the listener")
