"""Fair share on a shared fleet (issue 34, docs/decisions.md#fair-share): no proxy starves
another's requests, the queue takes turns across clients, batch work yields and ages, a busy
answer says when to come back, and no client's key or address shows anywhere."""

from __future__ import annotations

import json
import selectors
import socket
import time
import urllib.request

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from nvpair_proxy.admin.recorder import Recorder
from nvpair_proxy.http.answers import Reason
from nvpair_proxy.routing.enginetruth import EngineTruth, Slots
from nvpair_proxy.routing.fairshare import (
    HOLD_DEFAULT,
    HOLD_MAX,
    HOLD_MIN,
    Contention,
    hold_for,
    retry_after,
)
from nvpair_proxy.routing.slotqueue import SlotQueue, Waiter
from nvpair_proxy.test.support import (
    LogCapture,
    read_answer,
    scraped,
    start_fleet,
    start_standalone,
    total,
)
from nvpair_proxy.test.world import WorldStatus, WorldTestCase, view_of
from nvpair_proxy.testing.processes import DEADLINE, free_port, nodes_toml

NDJSON = {"Content-Type": "application/x-ndjson"}
ADDRESS = {"a": "10.0.0.1", "b": "10.0.0.2"}
NODE_OF = {address: node for node, address in ADDRESS.items()}
KEY = {name: f"{name}-key-0123456789abcdef0123456789abcdef" for name in ("ann", "bob", "cy")}
CHAT = {"model": "llama3", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def node_of(request) -> str:
    return NODE_OF[request.uri.decode().split("//", 1)[1].split(":", 1)[0]]


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {KEY[name]}"}


class QueueTurnTests(SynchronousTestCase):
    """The queue's order, with nothing else around it."""

    def setUp(self) -> None:
        self.went: list = []

    def waiter(self, client: bytes, since: float, **kwargs) -> tuple[Waiter, list]:
        waiter = Waiter(
            model="m",
            deadline=600,
            since=since,
            wake=lambda: self.went.append((client, since)),
            expire=lambda: None,
            client=client,
            **kwargs,
        )
        return waiter, self.went

    def order(self, queue: SlotQueue, count: int) -> list:
        """The next ``count`` to go, one a second."""
        self.went.clear()
        for _ in range(count):
            queue.clock.advance(1)
            self.assertTrue(queue.wake_first("m"))
        return list(self.went)

    def test_clients_take_turns_and_each_clients_own_go_in_arrival_order(self):
        clock = Clock()
        queue = SlotQueue(clock, 100)
        for since, client in enumerate([b"A", b"A", b"A", b"B", b"C", b"B"]):
            queue.add(self.waiter(client, float(since))[0])
        self.assertEqual(
            self.order(queue, 6),
            [(b"A", 0.0), (b"B", 3.0), (b"C", 4.0), (b"A", 1.0), (b"B", 5.0), (b"A", 2.0)],
        )
        queue.close()

    def test_a_failover_goes_before_every_turn(self):
        queue = SlotQueue(Clock(), 100)
        queue.add(self.waiter(b"A", 0.0)[0])
        queue.add(self.waiter(b"B", 1.0, ahead=True)[0])
        self.assertEqual(self.order(queue, 2), [(b"B", 1.0), (b"A", 0.0)])
        queue.close()

    def test_batch_waits_behind_every_other_until_it_aged(self):
        clock = Clock()
        queue = SlotQueue(clock, 100)
        queue.add(self.waiter(b"A", 0.0, batch=True)[0])
        queue.add(self.waiter(b"B", 1.0)[0])
        queue.add(self.waiter(b"B", 2.0)[0])
        self.assertEqual(queue.batch_waiting(), 1)
        self.assertEqual(self.order(queue, 1), [(b"B", 1.0)])
        clock.advance(29)  # the batch request has waited 30 s at the next wake: it takes turns
        self.assertEqual(self.order(queue, 2), [(b"A", 0.0), (b"B", 2.0)])
        self.assertEqual(queue.batch_waiting(), 0)
        queue.close()

    def test_equally_busy_clients_get_equal_shares(self):
        queue = SlotQueue(Clock(), 10_000)
        arrivals = 0.0
        for _ in range(100):  # three clients keep 100 requests each waiting, interleaved
            for client in (b"A", b"B", b"C"):
                arrivals += 1
                queue.add(self.waiter(client, arrivals)[0])
        went = [client for client, _ in self.order(queue, 90)]
        shares = {client: went.count(client) / 90 for client in (b"A", b"B", b"C")}
        self.assertEqual(
            {c: abs(s - 1 / 3) <= 0.1 / 3 for c, s in shares.items()},
            dict.fromkeys(shares, True),
            shares,
        )
        queue.close()

    def test_turns_rotate_when_slots_free_at_one_clock_reading(self):
        """Several slots can free at once (an engine's report, a burst of ends): each goes
        to the next client in rotation, not all to the client whose requests came first."""
        queue = SlotQueue(Clock(), 100)
        arrivals = 0.0
        for client in (b"A", b"B", b"C"):  # each client's requests together, A's first
            for _ in range(3):
                arrivals += 1
                queue.add(self.waiter(client, arrivals)[0])
        self.went.clear()
        for _ in range(9):
            self.assertTrue(queue.wake_first("m"))  # the clock never moves
        self.assertEqual([client for client, _ in self.went], [b"A", b"B", b"C"] * 3)
        queue.close()

    def test_a_flooding_client_does_not_hold_back_a_quiet_one(self):
        queue = SlotQueue(Clock(), 100)
        for since in range(20):
            queue.add(self.waiter(b"flood", float(since))[0])
        queue.add(self.waiter(b"quiet", 20.0)[0])
        went = self.order(queue, 2)
        self.assertEqual(went[1], (b"quiet", 20.0), "second, not 21st")
        queue.close()

    def test_status_counts_clients_never_names_them(self):
        queue = SlotQueue(Clock(), 100)
        for since, client in enumerate([b"A", b"A", b"B"]):
            queue.add(self.waiter(client, float(since))[0])
        self.assertEqual((queue.clients(), queue.ahead_of("m")), (2, 3))
        queue.close()


class FiguresTests(SynchronousTestCase):
    def test_the_hold_is_the_shortest_measured_service_within_bounds(self):
        self.assertEqual(hold_for([]), HOLD_DEFAULT)
        self.assertEqual(hold_for([3.0, 2.0]), 2.0)
        self.assertEqual(hold_for([0.01]), HOLD_MIN)
        self.assertEqual(hold_for([500.0]), HOLD_MAX)

    def test_retry_after_serves_the_queue_at_the_measured_rate_within_bounds(self):
        self.assertEqual(retry_after(3, 1, None), 1, "nothing measured: the least")
        self.assertEqual(retry_after(3, 1, 4.0), 16)  # 4 requests of 4 s on one slot
        self.assertEqual(retry_after(3, 2, 4.0), 8)
        self.assertEqual(retry_after(0, 4, 0.1), 1)
        self.assertEqual(retry_after(1000, 1, 30.0), 60)

    def test_only_busy_slots_beyond_ours_are_someone_elses(self):
        contention = Contention()
        truth = EngineTruth(read_at=0, slots=Slots(total=2, busy=2))
        contention.read("a", truth, ours=2, ended=0, now=0)
        contention.read("b", truth, ours=1, ended=1, now=0)  # one of ours just ended
        self.assertFalse(contention.shared(["a", "b"], now=0))
        contention.read("c", truth, ours=1, ended=0, now=0)
        self.assertTrue(contention.shared(["a", "c"], now=10))
        self.assertFalse(contention.shared(["c"], now=31), "forgotten after 30 s")
        contention.read("c", truth, ours=1, ended=0, now=40)
        self.assertTrue(contention.shared(["c"], now=41))
        contention.read("c", truth, ours=2, ended=0, now=42)
        self.assertFalse(contention.shared(["c"], now=42), "a read of only ours clears it")


class LateBindingWorld(WorldTestCase):
    def scheduled(self, *nodes: str, depth: int = 100):
        w = self.world(scheduling=True, queue_depth=depth)
        for node in nodes:
            w.add(node, addresses=(ADDRESS[node],))
        return w

    def tell(self, w, node: str, total: int, busy: int) -> None:
        w.facade.router.set_truth(
            node, EngineTruth(read_at=w.clock.seconds(), slots=Slots(total=total, busy=busy))
        )

    def chat(self, w, who: str, extra: dict | None = None):
        return w.send("POST", "/api/chat", CHAT, {**auth(who), **(extra or {})})

    def finish(self, request) -> None:
        request.respond(200, NDJSON, b'{"done":true}\n', finish=True)

    def drain(self, w, stream, first, waiting: list) -> None:
        """End the running ``stream`` (``first``'s), then serve each waiting request."""
        stream.write(b'{"done":true}\n')
        stream.finish()
        for _ in waiting:
            w.clock.advance(0)
            self.finish(w.agent.last)
        self.assertEqual([c.response().status for c in [first, *waiting]], [200] * 3)


class TwoProxiesTests(LateBindingWorld):
    """Proxy A's flood keeps the node's one slot busy; this proxy (B) sees it busy at every
    read, with none of it ours: its request must not wait for a free slot it will never see."""

    def test_a_request_starved_by_another_proxy_joins_the_engines_queue_after_the_hold(self):
        w = self.scheduled("a")
        self.tell(w, "a", total=1, busy=1)  # A's request runs there; we sent nothing
        waiting = self.chat(w, "bob")
        self.assertEqual(w.agent.requests, [], "a slot we see free would be better")
        for _ in range(3):  # A refills the slot before each of our reads
            w.clock.advance(HOLD_DEFAULT / 4)
            self.tell(w, "a", total=1, busy=1)
        self.assertEqual(w.agent.requests, [])
        w.clock.advance(HOLD_DEFAULT / 4)
        self.assertEqual([node_of(r) for r in w.agent.requests], ["a"], "into a's own queue")
        self.finish(w.agent.last)  # its engine serves it in arrival order
        self.assertEqual(waiting.response().status, 200)

    def test_the_hold_follows_the_owners_measured_service_time(self):
        w = self.scheduled("a")
        w.facade.router.rates_of("a").served(4.0)
        self.tell(w, "a", total=1, busy=1)
        self.chat(w, "bob")
        w.clock.advance(3.9)
        self.assertEqual(w.agent.requests, [])
        w.clock.advance(0.1)
        self.assertEqual(len(w.agent.requests), 1)
        self.finish(w.agent.last)

    def test_a_request_already_waiting_when_anothers_work_shows_is_held_from_its_start(self):
        w = self.scheduled("a")
        self.tell(w, "a", total=1, busy=0)
        warm = self.chat(w, "ann")
        self.finish(w.agent.last)
        self.assertEqual(warm.response().status, 200)
        # A's request took the slot; this read may still count ours that just ended.
        self.tell(w, "a", total=1, busy=1)
        waiting = self.chat(w, "bob")
        w.clock.advance(0.5)
        self.assertEqual(len(w.agent.requests), 1, "waiting, with no bound yet")
        self.tell(w, "a", total=1, busy=1)  # still busy, none of it ours: shared
        for _ in range(3):
            w.clock.advance(0)
        # Its hold (the node's measured service, at least 0.25 s) ran from when it began.
        self.assertEqual(len(w.agent.requests), 2)
        self.finish(w.agent.last)
        self.assertEqual(waiting.response().status, 200)

    def test_on_a_fleet_only_we_use_a_request_waits_for_a_free_slot_as_before(self):
        w = self.scheduled("a")
        self.tell(w, "a", total=1, busy=0)
        first = self.chat(w, "ann")
        running = w.agent.last.respond(200, NDJSON)
        self.tell(w, "a", total=1, busy=1)  # the busy slot is ours: nobody else works here
        waiting = self.chat(w, "bob")
        w.clock.advance(60)
        self.assertEqual(len(w.agent.requests), 1, "no hold without another's work")
        running.write(b'{"done":true}\n')
        running.finish()
        self.assertEqual(first.response().status, 200)
        w.clock.advance(0)
        self.assertEqual(len(w.agent.requests), 2)
        self.finish(w.agent.last)
        self.assertEqual(waiting.response().status, 200)


class OneProxyTurnTests(LateBindingWorld):
    """Inside one proxy, when a slot frees the next client in rotation goes."""

    def busy(self, w):
        """One one-slot owner running ann's first request."""
        self.tell(w, "a", total=1, busy=0)
        first = self.chat(w, "ann")
        return first, w.agent.last.respond(200, NDJSON)

    def free(self, w, stream) -> None:
        stream.write(b'{"done":true}\n')
        stream.finish()
        w.clock.advance(0)

    def sender(self, request) -> str | None:
        keys = request.headers.getRawHeaders(b"authorization")
        return None if keys is None else next(n for n, k in KEY.items() if k.encode() in keys[0])

    def serve_all(self, w, stream, waiting: int) -> list:
        """End the running stream and each of ``waiting`` requests that follow it in turn:
        whose each was (by key, None without one)."""
        went = []
        for _ in range(waiting):
            self.free(w, stream)
            went.append(self.sender(w.agent.last))
            stream = w.agent.last.respond(200, NDJSON)
        self.free(w, stream)
        return went

    def test_a_quiet_client_goes_before_a_busy_clients_queue(self):
        w = self.scheduled("a")
        first, stream = self.busy(w)
        flood = [self.chat(w, "ann") for _ in range(3)]
        quiet = self.chat(w, "bob")
        view = view_of(w, Recorder())
        self.assertEqual(total(scraped(view), "nvpair_proxy_queue_clients", engine="ollama"), 2)
        went = self.serve_all(w, stream, 4)
        self.assertEqual(total(scraped(view), "nvpair_proxy_queue_clients", engine="ollama"), 0)
        # ann's first waiter and bob's had never had a turn: the earlier goes; then bob,
        # whose client was served longest ago, before ann's other two.
        self.assertEqual(went, ["ann", "bob", "ann", "ann"])
        self.assertEqual([c.response().status for c in [first, *flood, quiet]], [200] * 5)

    def test_equally_busy_clients_get_equal_shares_through_the_proxy(self):
        """Three clients keep four requests each waiting: every three dispatches that follow,
        each client has one, whatever order they arrived in."""
        w = self.scheduled("a")
        first, stream = self.busy(w)
        waiting = [self.chat(w, who) for who in ["ann"] * 4 + ["bob"] * 4 + ["cy"] * 4]
        went = self.serve_all(w, stream, 12)
        for turn in range(0, 12, 3):
            self.assertEqual(sorted(went[turn : turn + 3]), ["ann", "bob", "cy"], went)
        self.assertEqual([c.response().status for c in [first, *waiting]], [200] * 13)

    def test_a_client_without_a_key_is_its_address(self):
        w = self.scheduled("a")
        first, stream = self.busy(w)
        flood = [self.chat(w, "ann") for _ in range(2)]
        other = w.send("POST", "/api/chat", CHAT)  # loopback, no key: its own client
        went = self.serve_all(w, stream, 3)
        self.assertEqual(went, ["ann", None, "ann"])
        self.assertEqual([c.response().status for c in [first, other, *flood]], [200] * 4)

    def test_batch_work_yields_and_is_not_forwarded(self):
        w = self.scheduled("a")
        first, stream = self.busy(w)
        batch = self.chat(w, "ann", {"X-NVPAIR-Priority": "batch"})
        normal = self.chat(w, "ann")
        self.assertEqual(w.facade.router.view().queued, 2)
        self.free(w, stream)
        self.assertIsNone(w.agent.last.headers.getRawHeaders(b"x-nvpair-priority"))
        self.free(w, w.agent.last.respond(200, NDJSON))
        self.assertEqual(normal.response().status, 200, "the later normal request went first")
        self.assertIsNone(
            w.agent.last.headers.getRawHeaders(b"x-nvpair-priority"), "never forwarded"
        )
        self.free(w, w.agent.last.respond(200, NDJSON))
        self.assertEqual([first.response().status, batch.response().status], [200, 200])

    def test_batch_work_that_waited_30_s_takes_its_turn(self):
        w = self.scheduled("a")
        first, stream = self.busy(w)
        batch = self.chat(w, "ann", {"X-NVPAIR-Priority": "batch"})
        w.clock.advance(30)
        normal = self.chat(w, "bob")
        self.free(w, stream)
        self.assertIsNotNone(w.agent.last.headers.getRawHeaders(b"authorization"), "a request went")
        self.assertEqual(self.sender(w.agent.last), "ann", "aged: it went before bob's")
        self.free(w, w.agent.last.respond(200, NDJSON))
        self.assertEqual(batch.response().status, 200)
        self.assertEqual(self.sender(w.agent.last), "bob")
        self.free(w, w.agent.last.respond(200, NDJSON))
        self.assertEqual([first.response().status, normal.response().status], [200, 200])


class RetryAfterTests(LateBindingWorld):
    def test_the_busy_answer_says_when_the_queue_ahead_will_have_been_served(self):
        w = self.scheduled("a", depth=2)
        w.facade.router.rates_of("a").served(5.0)
        self.tell(w, "a", total=1, busy=0)
        first = self.chat(w, "ann")
        stream = w.agent.last.respond(200, NDJSON)
        waiting = [self.chat(w, "ann") for _ in range(2)]
        refused = self.chat(w, "bob").response()
        # Two waiting and this one, 5 s each, on one slot: come back in 15 s.
        self.assertEqual((refused.status, refused.header("retry-after")), (503, "15"))
        self.assertEqual(refused.json(), {"error": Reason.ALL_OWNERS_BUSY.text})
        self.drain(w, stream, first, waiting)

    def test_a_request_that_waited_out_its_deadline_is_told_when_to_come_back(self):
        w = self.scheduled("a")
        w.facade.router.rates_of("a").served(3.0)
        self.tell(w, "a", total=1, busy=0)
        first = self.chat(w, "ann")
        stream = w.agent.last.respond(200, NDJSON)
        waiting = self.chat(w, "bob")
        w.clock.advance(600)
        response = waiting.response()
        self.assertEqual((response.status, response.header("retry-after")), (503, "3"))
        stream.write(b'{"done":true}\n')
        stream.finish()
        self.assertEqual(first.response().status, 200)


class NothingShownTests(LateBindingWorld):
    def test_no_key_digest_or_address_in_the_log_status_or_metrics(self):
        from nvpair_proxy.admin.metrics import registry, scrape
        from nvpair_proxy.admin.recorder import Recorder
        from nvpair_proxy.admin.status import ProcessView, status
        from nvpair_proxy.routing.clients import client_of

        captured = LogCapture(self, level="debug")
        recorder = Recorder()
        w = self.world(scheduling=True, queue_depth=10, recorder=recorder)
        w.add("a", addresses=(ADDRESS["a"],))
        view = ProcessView(
            source=WorldStatus(w),
            recorder=recorder,
            mode="standalone",
            clock=w.clock.seconds,
            started=w.clock.seconds(),
        )
        self.tell(w, "a", total=1, busy=0)
        first = self.chat(w, "ann")
        stream = w.agent.last.respond(200, NDJSON)
        peer = IPv4Address("TCP", "10.9.8.7", 5555)
        keyless = w.send("POST", "/api/chat", CHAT, peer=peer)  # a LAN peer: refused here
        waiting = [self.chat(w, "bob"), self.chat(w, "bob", {"X-NVPAIR-Priority": "batch"})]
        shown = json.dumps(status(view)) + scrape(registry(view)).decode()
        engine = status(view)["engines"][0]
        self.assertEqual((engine["clients_waiting"], engine["batch_waiting"]), (1, 1))
        self.drain(w, stream, first, waiting)
        self.assertEqual(keyless.response().status, 403)
        shown += scrape(registry(view)).decode() + json.dumps(status(view))
        self.assertIn(
            'nvpair_proxy_queue_wait_seconds_count{engine="ollama",priority="batch"} 1.0', shown
        )
        self.assertIn("nvpair_proxy_queue_clients", shown)
        logged = " ".join(repr(e) for e in captured.events)
        digests = [client_of(_KeyOnly(KEY[name])) for name in ("ann", "bob")]
        secrets = [KEY["ann"], KEY["bob"], "10.9.8.7"]
        secrets += [d.hex() for d in digests] + [repr(d) for d in digests]
        self.assertEqual([s for s in secrets if s in shown + logged], [])


class _KeyOnly:
    """Just enough of a request for ``client_of``: a key presented, no kept digest."""

    def __init__(self, key: str) -> None:
        self.client_digest = None
        self.requestHeaders = Headers({b"authorization": [f"Bearer {key}".encode()]})


def _send(port: int, body: dict, key: str) -> socket.socket:
    """A streamed chat on its own connection, sent whole; the answer is read later."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Authorization: Bearer %b\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (key.encode(), len(payload), payload)
    )
    sock.setblocking(False)
    return sock


def _engine_report(admin: int, node: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/status", timeout=DEADLINE) as answer:
        document = json.loads(answer.read())
    (entry,) = [n for n in document["nodes"] if n["id"] == node]
    return entry["engines"][0]["engine_report"] or {}


class TwoProxiesProcessTests(SynchronousTestCase):
    """Two real proxies in front of one simulated llama.cpp node with one slot, whose
    ``/slots`` both read: proxy A's flood refills the slot as each of its requests ends, so
    proxy B never reads it free. B's quiet request is served while the flood still runs."""

    def test_a_quiet_request_through_another_proxy_is_served_during_a_flood(self):
        fleet = start_fleet(
            self,
            '[[node]]\nid = "gpu-c"\ndialect = "llamacpp"\nmodels = ["m"]\n'
            "slots = 1\nprompt_delay = 0.15\ntokens = 3\ntoken_delay = 0.05\n",
        )
        nodes = self.mktemp() + ".toml"
        with open(nodes, "w") as handle:
            handle.write(nodes_toml([("gpu-c", "llamacpp", fleet["gpu-c"], ["m"])]))
        a, b, admin_b = free_port(), free_port(), free_port()
        start_standalone(self, ["--engine", f"llamacpp:{a}", "--nodes", nodes])
        start_standalone(
            self,
            ["--engine", f"llamacpp:{b}", "--nodes", nodes, "--admin", f"127.0.0.1:{admin_b}"],
        )
        chat = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        # B serves one request first, so it reads the engine while traffic flows.
        warm = _send(b, chat, "quiet-key-0123456789abcdef0123456789abcdef")
        warm.setblocking(True)
        self.assertTrue(read_answer(warm).startswith(b"HTTP/1.1 200 "))
        flood_key = "flood-key-0123456789abcdef0123456789abcdef"
        selector = selectors.DefaultSelector()
        self.addCleanup(selector.close)
        budget, answered, quiet, quiet_sent = 36, 0, None, 0.0
        received: dict = {}
        for _ in range(3):  # three closed-loop clients through A
            sock = _send(a, chat, flood_key)
            selector.register(sock, selectors.EVENT_READ, "flood")
            budget -= 1
        deadline = time.monotonic() + 60
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1.0):
                sock = key.fileobj
                chunk = sock.recv(65536)
                received[sock] = received.get(sock, b"") + chunk
                if chunk:
                    continue
                selector.unregister(sock)
                sock.close()
                answer = received.pop(sock)
                self.assertTrue(answer.startswith(b"HTTP/1.1 200 "), answer[:200])
                if key.data == "quiet":
                    quiet = (time.monotonic() - quiet_sent, budget)
                    continue
                answered += 1
                if budget > 0:
                    again = _send(a, chat, flood_key)
                    selector.register(again, selectors.EVENT_READ, "flood")
                    budget -= 1
            if quiet_sent == 0.0 and answered >= 3:
                report = _engine_report(admin_b, "gpu-c")
                if report.get("reported_busy") == 1 and report.get("ours") == 0:
                    # B read the slot busy with A's work: its quiet request would wait.
                    sock = _send(b, chat, "quiet-key-0123456789abcdef0123456789abcdef")
                    selector.register(sock, selectors.EVENT_READ, "quiet")
                    quiet_sent = time.monotonic()
        self.assertIsNotNone(quiet, "the quiet request was sent and answered")
        assert quiet is not None
        took, flood_left = quiet
        # Served within a few of A's requests (each about 0.3 s), not after A's flood.
        self.assertLess(took, 5.0)
        self.assertGreater(flood_left, 0, "while A's flood still had requests to send")
