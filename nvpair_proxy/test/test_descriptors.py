"""Running out of file descriptors (docs/decisions.md#descriptor-limit): the accept guard on a
Clock, then a running proxy whose ``RLIMIT_NOFILE`` is lowered to 128 meeting 300 clients at
once, in front of an engine that answers once released and in front of one that never
answers. Every wait is bounded; traffic stays on loopback.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import selectors
import socket
import sys
import threading
import time

from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core.acceptguard import (
    AcceptGuard,
    Clients,
    GuardedSocket,
    raise_descriptor_limit,
)
from nvpair_proxy.core.constants import ACCEPT_LOG_INTERVAL, ACCEPT_PAUSE, ACCEPT_RESERVE
from nvpair_proxy.test.support import start_standalone
from nvpair_proxy.testing.processes import free_port, nodes_toml, status_of

LIMIT = 128
CLIENTS = 300
CHAT = json.dumps({"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}).encode()
REQUEST = (
    b"POST /api/chat HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: "
    b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
)
ANSWER_BODY = json.dumps(
    {
        "model": "llama3",
        "created_at": "2026-01-01T00:00:00Z",
        "message": {"role": "assistant", "content": "ok"},
        "done": True,
        "done_reason": "stop",
        "prompt_eval_count": 1,
        "eval_count": 1,
    }
).encode()
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER_BODY), ANSWER_BODY)
)
CONDITION = "out of file descriptors"

# A spinning accept loop (Twisted's, when accept fails and the socket stays readable) keeps
# one core busy: close to 1.0 of a core. The guarded proxy at the limit measured about 0.01
# (a timer every 0.25 s and nothing else to do); 0.3 leaves room for a loaded 2-core machine
# charging the process its scheduling and its other timers (the engine poller), and still
# tells a loop that runs without pause from one that waits.
CPU_BOUND = 0.3
WINDOW = 2.0


class FakeListener:
    """A listening socket: ``accept`` hands out clients until told to fail."""

    def __init__(self) -> None:
        self.calls = 0
        self.error: int | None = None
        self.made: list[socket.socket] = []

    def accept(self):
        self.calls += 1
        if self.error is not None:
            raise OSError(self.error, os.strerror(self.error))
        left, right = socket.socketpair()
        self.made.append(right)
        return left, ("127.0.0.1", 1000 + self.calls)


class AcceptGuardTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.events: list[dict] = []
        self.reading = True
        self.clients = Clients()
        self.guard = AcceptGuard(
            "facade port 1",
            self.clock,
            self.pause,
            self.resume,
            clients=self.clients,
            limit=lambda: LIMIT,
            log=Logger(observer=self.events.append),
        )
        self.listener = FakeListener()
        self.sock = GuardedSocket(self.listener, self.guard)  # type: ignore[arg-type]
        self.accepted: list[socket.socket] = []
        self.addCleanup(self.close_all)

    def close_all(self) -> None:
        for sock in self.accepted + self.listener.made:
            sock.close()

    def pause(self) -> None:
        self.assertTrue(self.reading)
        self.reading = False

    def resume(self) -> None:
        self.assertFalse(self.reading)
        self.reading = True

    def accept_loop(self, most: int = 100) -> int:
        """What Twisted's doRead does while the port is readable: accept until EAGAIN."""
        for count in range(most):
            try:
                client, _ = self.sock.accept()
            except BlockingIOError as exc:
                self.assertEqual(exc.errno, errno.EAGAIN)
                return count
            self.accepted.append(client)
        return most

    def lines(self) -> list[str]:
        return [e["log_format"] for e in self.events]

    def test_emfile_pauses_accepting_for_one_pause_with_one_line(self) -> None:
        self.assertEqual(self.accept_loop(3), 3)
        self.listener.error = errno.EMFILE
        self.assertEqual(self.accept_loop(), 0)
        self.assertFalse(self.reading)
        self.assertEqual(len(self.lines()), 1)
        self.assertIn(CONDITION, self.lines()[0])
        self.assertEqual(
            self.events[0]["why"],
            "accept failed with EMFILE; 3 client connections, descriptor limit 128",
        )
        calls = self.listener.calls
        # A reactor that still called doRead would get EAGAIN without an accept(2).
        self.assertEqual(self.accept_loop(), 0)
        self.assertEqual(self.listener.calls, calls)
        self.clock.advance(ACCEPT_PAUSE - 0.01)
        self.assertFalse(self.reading)
        self.clock.advance(0.01)
        self.assertTrue(self.reading)
        self.listener.error = None
        self.assertEqual(self.accept_loop(2), 2)
        self.assertEqual(len(self.lines()), 2)
        self.assertIn("accepting connections again", self.lines()[1])

    def test_each_exhaustion_error_pauses_and_others_are_raised(self) -> None:
        for code in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            self.listener.error = code
            self.assertEqual(self.accept_loop(), 0, code)
            self.assertFalse(self.reading, code)
            self.clock.advance(ACCEPT_PAUSE)
            self.assertTrue(self.reading, code)
        self.listener.error = errno.EBADF
        self.assertRaises(OSError, self.sock.accept)

    def test_a_lasting_condition_is_logged_once_per_interval_with_a_count(self) -> None:
        self.listener.error = errno.EMFILE
        for _ in range(int(3 * ACCEPT_LOG_INTERVAL / ACCEPT_PAUSE)):  # 30 s of pauses
            self.accept_loop()
            self.clock.advance(ACCEPT_PAUSE)
        # One accept(2) per pause, and a line at 0, 10 and 20 s, each with the pauses between.
        self.assertEqual(self.listener.calls, 120)
        self.assertEqual(len(self.lines()), 3)
        self.assertEqual([e["count"] for e in self.events], [0, 39, 39])

    def test_clients_at_half_the_free_descriptors_pause_until_one_leaves(self) -> None:
        half = (LIMIT - ACCEPT_RESERVE) // 2
        self.assertEqual(self.accept_loop(), half)  # the last one accepted, then paused
        self.assertFalse(self.reading)
        self.assertEqual(self.clients.count, half)
        self.assertEqual(len(self.lines()), 1)
        for _ in range(10):  # still full: no accept(2) at all
            self.clock.advance(ACCEPT_PAUSE)
            self.assertFalse(self.reading)
        self.assertEqual(self.listener.calls, half)
        self.accepted.pop().close()
        self.accepted.pop().close()
        self.assertEqual(self.clients.count, half - 2)
        self.clock.advance(ACCEPT_PAUSE)
        self.assertTrue(self.reading)
        self.assertEqual(self.accept_loop(1), 1)
        self.assertEqual(len(self.lines()), 2)
        self.assertIn("accepting connections again", self.lines()[1])
        self.accepted[-1].close()
        self.accepted[-1].close()  # a second close is no second release
        self.assertEqual(self.clients.count, half - 2)

    def test_a_closed_port_keeps_no_timer(self) -> None:
        self.listener.error = errno.EMFILE
        self.accept_loop()
        self.guard.close()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertFalse(self.reading)


class RawEngine:
    """An ollama-shaped engine on loopback that reads each request and holds it, answering
    none, until ``release``: then it answers those held and every later one with a chat
    answer. One thread, one selector, stopped at cleanup."""

    def __init__(self, test: SynchronousTestCase) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        # Notified whenever a connection from the proxy closes (it let go of it).
        self.closed = threading.Condition(self.lock)
        self.answering = False
        self.requests = 0
        self.held: list[socket.socket] = []
        self.buffers: dict[socket.socket, bytes] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        test.addCleanup(self.stop)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        for sock in list(self.buffers) + self.held:
            sock.close()
        self.listener.close()

    def release(self) -> None:
        with self.lock:
            self.answering = True

    def wait_open_at_most(self, count: int, timeout: float) -> bool:
        """Block until the proxy holds at most ``count`` connections to this engine (woken by
        each close it makes, not by polling); False if ``timeout`` passed first."""
        with self.closed:
            return self.closed.wait_for(lambda: len(self.buffers) <= count, timeout)

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        while not self.stopped.is_set():
            for key, _ in selector.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.listener:
                    try:
                        client, _ = self.listener.accept()
                    except BlockingIOError:
                        continue
                    with self.lock:
                        self.buffers[client] = b""
                    selector.register(client, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(sock)
                    with self.closed:
                        self.buffers.pop(sock, None)
                        self.closed.notify_all()
                    if sock in self.held:
                        self.held.remove(sock)
                    sock.close()
                    continue
                self.buffers[sock] += data
                if b"\r\n\r\n" in self.buffers[sock] and sock not in self.held:
                    # Chats are counted; the engine poller's reads are held the same way.
                    self.requests += self.buffers[sock].startswith(b"POST /api/chat ")
                    self.held.append(sock)
            with self.lock:
                answering = self.answering
            if answering:
                for sock in self.held:
                    try:
                        sock.sendall(ANSWER)
                    except OSError:
                        pass
                self.held.clear()
        selector.close()


class Burst:
    """CLIENTS connections opened at once, each sending REQUEST as soon as it connects."""

    def __init__(self, port: int) -> None:
        self.socks = []
        for _ in range(CLIENTS):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            self.socks.append(sock)
        self.received = {sock: b"" for sock in self.socks}
        self.ended: set[socket.socket] = set()
        self.selector = selectors.DefaultSelector()
        for sock in self.socks:
            self.selector.register(sock, selectors.EVENT_WRITE)

    def pump(self, timeout: float) -> None:
        """Send and read for ``timeout`` at most, returning early once every client ended."""
        end = time.monotonic() + timeout
        while len(self.ended) < len(self.socks) and time.monotonic() < end:
            for key, events in self.selector.select(min(0.1, max(0.0, end - time.monotonic()))):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if events & selectors.EVENT_WRITE:
                    try:
                        sock.sendall(REQUEST)  # small: fits an empty send buffer
                    except OSError:
                        self.end(sock)
                        continue
                    self.selector.modify(sock, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if data:
                    self.received[sock] += data
                else:
                    self.end(sock)

    def end(self, sock: socket.socket) -> None:
        self.ended.add(sock)
        self.selector.unregister(sock)

    def answered(self) -> int:
        """Clients whose whole answer came: a 200 with the engine's body."""
        return sum(
            1
            for sock in self.ended
            if status_of(self.received[sock]) == 200
            and self.received[sock].endswith(b"}")
            and b'"done":true' in self.received[sock].replace(b" ", b"")
        )

    def close(self) -> None:
        self.selector.close()
        for sock in self.socks:
            sock.close()


def cpu_seconds(pid: int) -> float:
    """User plus system time the process used so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class AtTheLimitTests(SynchronousTestCase):
    """A standalone proxy in front of a RawEngine, its RLIMIT_NOFILE lowered to LIMIT once it
    is up, and a burst of CLIENTS."""

    def setUp(self) -> None:
        self.engine = RawEngine(self)
        nodes = os.path.abspath(self.mktemp())
        with open(nodes, "w") as handle:
            handle.write(nodes_toml([("gpu", "ollama", self.engine.port, ["llama3:latest"])]))
        self.port = free_port()
        self.log = os.path.abspath(self.mktemp())
        self.proc = start_standalone(
            self, ["--engine", f"ollama:{self.port}", "--nodes", nodes], logfile=self.log
        )
        self.resting = descriptors(self.proc.pid)
        resource.prlimit(self.proc.pid, resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
        self.began = time.monotonic()

    def condition_lines(self) -> list[str]:
        with open(self.log, encoding="utf-8") as handle:
            return [line for line in handle if CONDITION in line]

    def at_the_limit(self, burst: Burst) -> None:
        """Pump the burst until the engine holds chats and no more arrive for half a second
        (the proxy took in what it will); then, still at the limit, the proxy's CPU over
        WINDOW stays under CPU_BOUND."""
        end = time.monotonic() + 20
        seen, since = -1, time.monotonic()
        while time.monotonic() < end:
            burst.pump(0.1)
            if self.engine.requests != seen:
                seen, since = self.engine.requests, time.monotonic()
            elif seen > 0 and time.monotonic() - since >= 0.5:
                break
        self.assertGreater(self.engine.requests, 0)
        before, began = cpu_seconds(self.proc.pid), time.monotonic()
        burst.pump(WINDOW)  # the window itself: clients keep connecting and waiting
        used = (cpu_seconds(self.proc.pid) - before) / (time.monotonic() - began)
        self.assertLess(used, CPU_BOUND, f"{used:.2f} of a core while at the limit")
        self.assertIsNone(self.proc.poll())
        self.cpu = used

    def check_log(self) -> None:
        """The condition at a bounded rate (a warn line per interval and one info line after
        each), nothing per client, no traceback."""
        with open(self.log, encoding="utf-8") as handle:
            text = handle.read()
        for unwanted in ("EMFILE encountered", "EMFILE recovery", "Could not accept", "Traceback"):
            self.assertEqual(text.count(unwanted), 0, f"{unwanted!r} logged")
        lines = self.condition_lines()
        elapsed = time.monotonic() - self.began
        self.assertGreaterEqual(len(lines), 1)
        self.assertLessEqual(len(lines), 2 * (elapsed / ACCEPT_LOG_INTERVAL + 1), lines)
        self.condition_count = len(lines)

    def released(self) -> None:
        """Once the clients left, the proxy's descriptors come back to what it held at rest.
        It closes a client's connection before it lets go of that request's upstream one, so
        once the engine has seen every upstream connection close (at most one engine-truth
        read may be open; at most 10 s) the count is read once."""
        self.assertTrue(
            self.engine.wait_open_at_most(1, 10),
            "the proxy still holds its connections to the engine",
        )
        self.assertLessEqual(descriptors(self.proc.pid), self.resting + 4)

    def serves_normally(self) -> None:
        """A chat is answered."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(REQUEST)
            received = b""
            while not received.endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        self.assertEqual(status_of(received), 200, received[:300])
        self.assertIsNone(self.proc.poll())

    def test_a_burst_waits_at_the_limit_and_every_client_is_served(self) -> None:
        burst = Burst(self.port)
        self.addCleanup(burst.close)
        self.at_the_limit(burst)
        held = self.engine.requests
        self.engine.release()
        burst.pump(30)
        self.assertEqual(burst.answered(), CLIENTS)
        self.assertEqual(self.engine.requests, CLIENTS)  # each sent once, none retried
        burst.close()
        self.check_log()
        self.released()
        self.serves_normally()
        # Clients held half of what the process's own files leave; the rest waited.
        self.assertLessEqual(held, (LIMIT - ACCEPT_RESERVE) // 2)
        print(
            f"\ndescriptors: burst answered, {self.cpu:.3f} of a core at the limit, "
            f"{self.condition_count} condition lines",
            file=sys.stderr,
        )

    def test_an_engine_that_never_answers_holds_the_limit_and_the_proxy_recovers(self):
        burst = Burst(self.port)
        self.addCleanup(burst.close)
        self.at_the_limit(burst)
        held = self.engine.requests
        self.assertEqual(burst.answered(), 0)
        burst.close()  # the clients give up; the engine still answers nothing
        self.check_log()
        self.released()  # so the proxy let go of their upstream connections itself
        self.engine.release()  # the engine comes back, for the next client
        self.serves_normally()
        self.assertLessEqual(held, (LIMIT - ACCEPT_RESERVE) // 2)
        print(
            f"\ndescriptors: silent engine, {self.cpu:.3f} of a core at the limit, "
            f"{self.condition_count} condition lines",
            file=sys.stderr,
        )


class FakeRlimit:
    """What ``raise_descriptor_limit`` asks of the ``resource`` module."""

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.limits, self.refuse = (soft, hard), refuse

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        if self.refuse:
            raise ValueError("not allowed")
        self.limits = limits


class RaiseLimitTests(SynchronousTestCase):
    def test_the_soft_limit_goes_up_to_the_hard_one(self) -> None:
        rlimit = FakeRlimit(1024, 65536)
        self.assertEqual(raise_descriptor_limit(rlimit), (1024, 65536))
        self.assertEqual(rlimit.limits, (65536, 65536))

    def test_an_unlimited_hard_limit_raises_it_to_the_kernels_ceiling(self) -> None:
        rlimit = FakeRlimit(1024, FakeRlimit.RLIM_INFINITY)
        self.assertEqual(raise_descriptor_limit(rlimit), (1024, 1 << 20))

    def test_a_limit_already_at_the_top_or_that_cannot_move_stays(self) -> None:
        self.assertEqual(raise_descriptor_limit(FakeRlimit(4096, 4096)), (4096, 4096))
        refused = FakeRlimit(1024, 65536, refuse=True)
        self.assertEqual(raise_descriptor_limit(refused), (1024, 1024))
        self.assertEqual(refused.limits, (1024, 65536))


class RaisedAtStartTests(SynchronousTestCase):
    def test_the_proxy_starts_at_its_hard_limit_and_says_so_once(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        low = min(soft, 512)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        log = os.path.abspath(self.mktemp())
        try:
            proc = start_standalone(self, ["--engine", f"ollama:{free_port()}"], logfile=log)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        with open(f"/proc/{proc.pid}/limits", encoding="ascii") as handle:
            line = next(row for row in handle if row.startswith("Max open files"))
        self.assertEqual(line.split()[3:5], [str(hard), str(hard)])
        with open(log, encoding="utf-8") as handle:
            said = [row for row in handle if "descriptors: at most" in row]
        self.assertEqual(len(said), 1)
        self.assertIn(f"at most {hard} open (soft RLIMIT_NOFILE, raised from {low})", said[0])
