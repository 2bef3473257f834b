"""A regression guard that measures work, not time (issue 10, item 3).

One proxied streaming request in standalone mode, at the default log level, through the real
listener, server, facade, exchange, dispatch and attempt (in memory): the timers it schedules,
the Deferreds it makes and the log events it emits are counted and held to a budget. A change
that adds per-request work fails here, not in a benchmark nobody runs. The budget is today's
count; lower it when a change does less.
"""

from __future__ import annotations

from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import globalLogPublisher

from nvpair_proxy.core import logs
from nvpair_proxy.http.client import Client
from nvpair_proxy.request.events import LogEmitter
from nvpair_proxy.test.support import Wire
from nvpair_proxy.test.world import WorldTestCase

NDJSON = {"Content-Type": "application/x-ndjson"}

# Per request, on a new client connection (its accept deadline and idle timeout included):
BUDGET = {"timers": 6, "deferreds": 3, "log events": 0}
# The same with the proxy's own upstream client instead of the fake agent (which makes one
# Deferred more than the client does).
CLIENT_BUDGET = {"timers": 6, "deferreds": 2, "log events": 0}


def count_work(test, w, *clocks) -> dict[str, int]:
    """Count, from now on, the timers scheduled on the world's clocks (and ``clocks``), the
    Deferreds made and the log events emitted."""
    counts = dict.fromkeys(BUDGET, 0)
    original_init = defer.Deferred.__init__

    def counting_init(deferred, *args, **kwargs):
        counts["deferreds"] += 1
        original_init(deferred, *args, **kwargs)

    test.patch(defer.Deferred, "__init__", counting_init)
    for clock in (w.clock, w.site_clock, *clocks):

        def counting_call_later(*args, _original=clock.callLater, **kwargs):
            counts["timers"] += 1
            return _original(*args, **kwargs)

        test.patch(clock, "callLater", counting_call_later)

    def observe(event) -> None:
        counts["log events"] += 1

    globalLogPublisher.addObserver(observe)
    test.addCleanup(globalLogPublisher.removeObserver, observe)
    return counts


NDJSON_STREAM = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
    b'2a\r\n{"message":{"content":"hi"},"done":false}\n\r\n'
    b'33\r\n{"done":true,"eval_count":1,"prompt_eval_count":2}\n\r\n'
    b"0\r\n\r\n"
)


def through_the_client(test):
    """A world at info level whose upstream is the proxy's own client, and a function that
    proxies one streamed chat through it, the engine's end an in-memory wire: the first call
    dials, the next ones reuse that pooled connection. Returns the world, that function, the
    wires made so far and the client's reactor."""
    test.addCleanup(logs.set_level, logs.level_name())
    logs.set_level("info")
    reactor = MemoryReactorClock()
    w = test.world(emitter=LogEmitter(), agent=Client(reactor))
    w.add("a")
    wires: list = []

    def proxied():
        client = w.chat()
        if len(reactor.tcpClients) > len(wires):
            wires.append(Wire(reactor))
        wires[-1].reply(NDJSON_STREAM)
        return client

    return w, proxied, wires, reactor


class WorkBudgetTests(WorldTestCase):
    def count(self, w, *clocks) -> dict[str, int]:
        return count_work(self, w, *clocks)

    def proxied(self, w):
        client = w.chat()
        upstream = w.agent.last.respond(200, NDJSON)
        upstream.write(b'{"message":{"content":"hi"},"done":false}\n')
        upstream.write(b'{"done":true,"eval_count":1,"prompt_eval_count":2}\n')
        upstream.finish()
        return client

    def test_one_streaming_request_stays_within_its_budget(self):
        self.addCleanup(logs.set_level, logs.level_name())
        logs.set_level("info")
        w = self.world(emitter=LogEmitter())
        w.add("a")
        self.proxied(w)  # warm: first-use work (imports, caches) is not per request
        counts = self.count(w)
        for _ in range(3):
            client = self.proxied(w)
            self.assertEqual(client.response().status, 200)
        per_request = {name: count / 3 for name, count in counts.items()}
        self.assertEqual(
            {name: per_request[name] <= BUDGET[name] for name in BUDGET},
            dict.fromkeys(BUDGET, True),
            per_request,
        )

    def test_through_the_proxys_own_client_on_a_pooled_connection(self):
        """The same request with the real upstream client (client.py) in place of the fake
        agent, the engine's end an in-memory wire: the client's whole share is one Deferred
        (its ``IAgent.request`` answer) and no timer, its connection reused from the pool."""
        w, proxied, wires, reactor = through_the_client(self)
        proxied()  # warm: the first request dials; the rest reuse that connection
        counts = self.count(w, reactor)
        for _ in range(3):
            client = proxied()
            self.assertEqual(client.response().status, 200)
            self.assertIn(b'"eval_count":1', client.response().body)
        self.assertEqual(len(wires), 1, "one connection, reused")
        per_request = {name: count / 3 for name, count in counts.items()}
        self.assertEqual(
            {name: per_request[name] <= CLIENT_BUDGET[name] for name in BUDGET},
            dict.fromkeys(BUDGET, True),
            per_request,
        )

    def test_the_guard_sees_work_added_to_the_request_path(self):
        """The counter is live: one extra timer per request is seen (a guard that cannot fail
        guards nothing)."""
        w = self.world(emitter=LogEmitter())
        w.add("a")
        counts = self.count(w)
        self.proxied(w)
        before = counts["timers"]
        w.clock.callLater(1, lambda: None)
        w.clock.advance(1)
        self.assertEqual(counts["timers"], before + 1)
        self.assertGreater(counts["deferreds"], 0)


class SchedulerBudgetTests(WorldTestCase):
    """Standalone placement, late binding and affinity add no timer, Deferred or log event to
    a request that does not wait, and a conversation's digest hashes at most 16 KiB however
    long the context."""

    def test_the_scheduler_adds_no_work_to_a_request_that_does_not_wait(self):
        from nvpair_proxy.routing import affinity
        from nvpair_proxy.routing.enginetruth import EngineTruth, Slots

        self.addCleanup(logs.set_level, logs.level_name())
        logs.set_level("info")
        hashed: list[int] = []
        real = affinity.hashlib.blake2b

        class Counting:
            def __init__(self, data: bytes = b"", **kwargs) -> None:
                self.inner = real(data, **kwargs)

            def update(self, data: bytes) -> None:
                hashed[-1] += len(data)
                self.inner.update(data)

            def digest(self) -> bytes:
                return self.inner.digest()

        self.patch(affinity.hashlib, "blake2b", Counting)
        w = self.world(emitter=LogEmitter(), scheduling=True, queue_depth=100, affinity=True)
        for node, address in (("a", "10.0.0.1"), ("b", "10.0.0.2")):
            w.add(node, addresses=(address,))
            w.facade.router.set_truth(
                node, EngineTruth(read_at=0, slots=Slots(4, 0), warm=frozenset({"llama3:latest"}))
            )
        context = "x" * 200 * 1024

        def proxied():
            hashed.append(0)
            client = w.send(
                "POST",
                "/api/chat",
                {
                    "model": "llama3",
                    "messages": [
                        {"role": "system", "content": context},
                        {"role": "user", "content": context},
                    ],
                },
            )
            upstream = w.agent.last.respond(200, NDJSON)
            upstream.write(b'{"done":true,"eval_count":1,"prompt_eval_count":2}\n')
            upstream.finish()
            return client

        proxied()
        counts = count_work(self, w)
        for _ in range(3):
            self.assertEqual(proxied().response().status, 200)
        per_request = {name: count / 3 for name, count in counts.items()}
        self.assertEqual(
            {name: per_request[name] <= BUDGET[name] for name in BUDGET},
            dict.fromkeys(BUDGET, True),
            per_request,
        )
        self.assertEqual(len(hashed), 4)
        first, *later = hashed
        # A first turn also hashes its shared head once (docs/decisions.md#affinity): at most
        # 16 KiB of it, and 1 KiB of its first message for the longer digest.
        self.assertTrue(16 * 1024 <= first - 16 * 1024 <= 17 * 1024 + 128, hashed)
        self.assertTrue(all(16 * 1024 <= count <= 16 * 1024 + 64 for count in later), hashed)


class QueueBudgetTests(WorldTestCase):
    """A request that waits in the proxy's queue costs no timer more than one that does not:
    the queue keeps one deadline timer, and a slot freed by a request's end goes to the next
    waiter as that end completes, not through a timer."""

    def timers_for(self, slots: int) -> int:
        from nvpair_proxy.routing.enginetruth import EngineTruth, Slots

        self.addCleanup(logs.set_level, logs.level_name())
        logs.set_level("info")
        w = self.world(emitter=LogEmitter(), scheduling=True, queue_depth=100)
        for node, address in (("a", "10.0.0.1"), ("b", "10.0.0.2")):
            w.add(node, addresses=(address,))
            w.facade.router.set_truth(node, EngineTruth(read_at=0, slots=Slots(slots, 0)))
        w.clock.advance(0)
        counts = count_work(self, w)
        clients = [w.chat() for _ in range(8)]
        served = 0
        while served < 8:
            pending = [r for r in w.agent.requests if r.pending]
            self.assertTrue(pending, "every waiter is woken as a slot frees, in this turn")
            upstream = pending[0].respond(200, NDJSON)
            upstream.write(b'{"done":true}\n')
            upstream.finish()
            served += 1
        self.assertEqual([c.response().status for c in clients], [200] * 8)
        w.clock.advance(0)
        return counts["timers"]

    def test_waiting_in_the_queue_adds_no_timer_per_request(self):
        waiting = self.timers_for(slots=1)  # 2 dispatched at once, 6 wait their turn
        free = self.timers_for(slots=8)  # all 8 dispatched at once
        self.assertLessEqual(waiting, free + 1, (waiting, free))  # + the queue's one timer


class NoCycleTests(WorldTestCase):
    """A finished request leaves no reference cycle (docs/decisions.md#no-cycles): its
    exchange, loop, attempts, stream and relay are freed as their last reference goes, not by
    the garbage collector, whose collections a request's cyclic garbage would trigger and
    feed (5 % of a proxied request's CPU in process). No part swaps in a null callable at its
    end: the parts below the exchange point up only through a fired Deferred or a declared
    sink, and each owner lets go of a part whose work ended."""

    def parts_at_the_end(self) -> list[list]:
        """Weak references to each ended request's exchange, loop, job, stream, relay,
        workload and attempts, taken as it ends."""
        import weakref

        from nvpair_proxy.request import exchange as exchange_module
        from nvpair_proxy.request.attempt import Attempt

        attempts: list = []
        start = Attempt.start

        def starting(attempt):
            attempts.append(weakref.ref(attempt))
            start(attempt)

        self.patch(Attempt, "start", starting)
        ended: list = []
        original = exchange_module.Exchange._ended

        def recording(exchange, *args):
            stream, dispatch = exchange.stream, exchange.dispatch
            parts = [exchange, dispatch, dispatch.job, exchange.workload, stream]
            if stream is not None:
                parts.append(stream.committed.relay)
            ended.append([weakref.ref(part) for part in parts if part is not None] + attempts)
            attempts.clear()
            original(exchange, *args)

        self.patch(exchange_module.Exchange, "_ended", recording)
        return ended

    def assert_freed(self, refs: list, parts: int) -> None:
        alive = [type(ref()).__name__ for ref in refs if ref() is not None]
        self.assertEqual((len(refs), alive), (parts, []))

    def collector_off(self) -> None:
        import gc

        self.addCleanup(gc.enable)
        gc.disable()

    def test_a_finished_request_is_freed_with_the_collector_off(self):
        w, through, _, _ = through_the_client(self)
        ended = self.parts_at_the_end()

        def proxied():
            client = through()
            self.assertEqual(client.response().status, 200)
            client.disconnect()

        proxied()  # warm: the first request dials; the next reuses that connection
        self.collector_off()
        proxied()
        self.assertEqual(len(ended), 2)
        # exchange, loop, job, workload, stream, relay and the one attempt
        self.assert_freed(ended[1], 7)

    def test_a_client_that_leaves_mid_stream_leaves_nothing_behind(self):
        w, _, wires, reactor = through_the_client(self)
        ended = self.parts_at_the_end()
        self.collector_off()
        client = w.chat()
        wire = Wire(reactor)
        wire.reply(NDJSON_STREAM[: NDJSON_STREAM.index(b"33\r\n")])  # headers, one chunk
        client.disconnect()
        wire.close()  # the aborted upstream connection's end
        self.assertEqual((len(ended), w.facade.in_flight), (1, set()))
        self.assert_freed(ended[0], 7)

    def test_a_request_that_failed_over_leaves_nothing_behind(self):
        w, _, wires, reactor = through_the_client(self)
        w.add("b", addresses=("10.0.0.2",))
        ended = self.parts_at_the_end()
        self.collector_off()
        client = w.chat()
        Wire(reactor).reply(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n")
        Wire(reactor).reply(NDJSON_STREAM)
        self.assertEqual(client.response().status, 200)
        client.disconnect()
        # exchange, loop, job, workload, stream, relay and both attempts
        self.assert_freed(ended[0], 8)
