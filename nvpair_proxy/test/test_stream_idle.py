"""``--stream-idle-timeout``: the spec's known gap (5.2) closed opt-in (issue 13, item 4)."""

from __future__ import annotations

from nvpair_proxy.request.dispatch import Bounds
from nvpair_proxy.test.support import LogCapture
from nvpair_proxy.test.world import WorldTestCase

IDLE_NOTE = "upstream sent nothing for 5s after commit"


class StreamIdleTests(WorldTestCase):
    def committed(self, stream_idle: float = 5.0):
        w, client, upstream = self.streaming()
        w.facade.upstreams.bounds = Bounds(stream_idle=stream_idle)
        upstream.write(b'{"message":{"content":"a"},"done":false}\n')
        return w, client, upstream

    def test_a_silent_committed_upstream_is_closed_and_the_job_stays_completed(self):
        logged = LogCapture(self).events
        w, client, upstream = self.committed()
        w.clock.advance(4.9)
        upstream.write(b'{"message":{"content":"b"},"done":false}\n')  # refreshes the wait
        w.clock.advance(4.9)
        self.assertFalse(upstream.transport.stopped)
        self.assertFalse(client.transport.disconnecting)
        w.clock.advance(0.1)
        self.assertTrue(upstream.transport.stopped)
        self.assertTrue(client.transport.disconnecting)
        response = client.response()
        self.assertEqual(
            response.body,
            b'{"message":{"content":"a"},"done":false}\n{"message":{"content":"b"},"done":false}\n',
        )
        self.assertFalse(response.complete)  # no last chunk: the client sees the truncation
        self.assertEqual(w.workload_events()[-1], ("workload:completed", "completed", "a"))
        self.assertIsNone(w.emitter.workload()[-1][1]["error"])
        ((_, finished),) = [(m, p) for m, p in w.emitter.sent if m == "ollama:proxy/request"]
        self.assertEqual((finished["status"], finished["error"]), (200, IDLE_NOTE))
        warns = [
            e
            for e in logged
            if e.get("log_level").name == "warn" and "sent nothing" in e.get("log_format", "")
        ]
        self.assertEqual(len(warns), 1)
        self.assertEqual(warns[0]["node"], "a")

    def test_chunks_do_not_add_timers(self):
        # Not one timer per chunk, and not one re-made per chunk either: no callLater while
        # chunks flow, and the same pending calls, due when they were, after 100 of them.
        w, client, upstream = self.committed()
        scheduled = []
        call_later = w.clock.callLater
        self.patch(
            w.clock,
            "callLater",
            lambda *args, **kwargs: scheduled.append(args) or call_later(*args, **kwargs),
        )
        before = [(call, call.getTime()) for call in w.clock.getDelayedCalls()]
        self.assertIn(5.0, [due for _, due in before], "the idle timer, due 5 s after commit")
        for index in range(100):
            upstream.write(b'{"done":false}\n')
            w.clock.advance(0.01)
        self.assertEqual(scheduled, [])
        after = w.clock.getDelayedCalls()
        self.assertEqual(len(after), len(before))
        for call, (kept, due) in zip(after, before):
            self.assertIs(call, kept)
            self.assertEqual(call.getTime(), due)
        upstream.write(b'{"done":true}\n')
        upstream.finish()
        self.assertEqual(w.workload_events()[-1][0], "workload:completed")

    def test_off_by_default(self):
        w, client, upstream = self.streaming()
        self.assertEqual(w.facade.upstreams.bounds.stream_idle, 0)
        upstream.write(b'{"done":false}\n')
        w.clock.advance(3600)
        self.assertFalse(upstream.transport.stopped)
        self.assertFalse(client.transport.disconnecting)
        upstream.write(b'{"done":true}\n')
        upstream.finish()
        self.assertTrue(client.response().complete)

    def test_a_client_that_stops_reading_is_the_dead_client_deadlines_business(self):
        w, client, upstream = self.committed()
        client.pause()
        w.clock.advance(29)
        self.assertFalse(upstream.transport.stopped)
        w.clock.advance(1)
        self.assertEqual(
            w.emitter.workload()[-1][1]["error"], "client disconnected before completion"
        )
