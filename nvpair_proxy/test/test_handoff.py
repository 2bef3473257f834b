"""Socket activation and hot handoff (docs/operations.md#restarts): the listening sockets a
process is handed (``process/sockets.py``) and the successor it hands them to on SIGHUP
(``process/handoff.py``). Pure parsing and a fake reactor here; the real processes, signals
and sockets in ``HandoffProcessTests`` and ``SocketActivationProcessTests``."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

from twisted.internet.task import Clock
from twisted.logger import formatEvent
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.process.handoff import HANDOFF_NOTIFY, Handoff, successor_argv, take_over_notify
from nvpair_proxy.process.sockets import inherited_sockets
from nvpair_proxy.test.support import LogCapture, read_answer, start_fleet, start_standalone
from nvpair_proxy.testing import processes
from nvpair_proxy.testing.processes import free_port, listening_socket, nodes_toml

NEVER_READY = (
    "hot handoff failed: it did not report READY=1 within 30s; " + "this process keeps serving"
)


class InheritedTests(SynchronousTestCase):
    def environ(self, count: str, names: str, pid: int = 4242) -> dict[str, str]:
        return {"LISTEN_FDS": count, "LISTEN_PID": str(pid), "LISTEN_FDNAMES": names, "X": "y"}

    def test_each_role_gets_its_descriptor_from_3_up_and_the_variables_go(self):
        environ = self.environ("2", "ollama:admin")
        inherited = inherited_sockets(environ, pid=4242)
        self.assertEqual(environ, {"X": "y"}, "no child may take them for its own")
        self.assertEqual((inherited.take("ollama"), inherited.take("admin")), (3, 4))
        self.assertIsNone(inherited.take("ollama"), "taken once")
        self.assertEqual(inherited.unused(), [])

    def test_sockets_meant_for_another_process_are_not_ours(self):
        environ = self.environ("1", "ollama", pid=1)
        self.assertFalse(inherited_sockets(environ, pid=4242))
        self.assertNotIn("LISTEN_FDS", environ)

    def test_a_set_that_cannot_be_used_is_one_line(self):
        for count, names, says in (
            ("x", "ollama", "LISTEN_FDS must be a count of descriptors (got 'x')"),
            ("2", "ollama", "LISTEN_FDNAMES must name each of the 2 inherited sockets"),
            ("2", "ollama:ollama", "LISTEN_FDNAMES names 'ollama' twice"),
        ):
            with self.assertRaises(ValueError) as raised:
                inherited_sockets(self.environ(count, names), pid=4242)
            self.assertIn(says, str(raised.exception))

    def test_names_left_by_twisteds_own_reading_still_count(self):
        """twisted.internet.endpoints reads LISTEN_FDS at its import and deletes it with
        LISTEN_PID once it has checked the pid, leaving LISTEN_FDNAMES."""
        environ = {"LISTEN_FDNAMES": "llamacpp:admin"}
        inherited = inherited_sockets(environ, pid=4242)
        self.assertEqual((inherited.take("llamacpp"), inherited.take("admin")), (3, 4))
        self.assertEqual(environ, {})

    def test_what_nothing_took_is_named(self):
        inherited = inherited_sockets(self.environ("2", "ollama:lmstudio"), pid=4242)
        inherited.take("ollama")
        self.assertEqual(inherited.unused(), ["lmstudio"])


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid, self.signals = pid, []

    def signalProcess(self, number) -> None:
        self.signals.append(number)


class FakeDatagramPort:
    def __init__(self, path: str, protocol) -> None:
        self.path, self.protocol, self.open = path, protocol, True

    def stopListening(self) -> None:
        self.open = False


class ProcessReactor(Clock):
    """A clock that records the processes and datagram ports asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[tuple] = []
        self.ports: list[FakeDatagramPort] = []

    def spawnProcess(self, protocol, executable, args, env, childFDs):
        process = FakeProcess(1000 + len(self.spawned))
        self.spawned.append((protocol, executable, list(args), dict(env), dict(childFDs)))
        return process

    def listenUNIXDatagram(self, path, protocol):
        port = FakeDatagramPort(path, protocol)
        self.ports.append(port)
        return port


class HandoffTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = ProcessReactor()
        self.drained: list[bool] = []
        # systemd's notification socket, as this process sees it
        folder = tempfile.mkdtemp(prefix="nvp-")
        self.addCleanup(shutil.rmtree, folder, True)
        self.systemd_path = os.path.join(folder, "systemd")
        self.systemd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.systemd.bind(self.systemd_path)
        self.systemd.settimeout(5)
        self.addCleanup(self.systemd.close)
        self.environ = {"NOTIFY_SOCKET": self.systemd_path, "LISTEN_FDS": "9", "KEEP": "1"}
        self.handoff = Handoff(
            self.reactor,
            lambda: [("ollama", 17), ("admin", 19)],
            lambda: self.drained.append(True),
            argv=["/bin/sh", "-c", "x"],
            environ=self.environ,
        )
        self.addCleanup(self.handoff.stop)

    def test_the_successor_inherits_each_socket_by_role_and_reports_to_us(self):
        self.assertTrue(self.handoff.start())
        _, executable, argv, env, fds = self.reactor.spawned[0]
        self.assertEqual((executable, argv), ("/bin/sh", ["/bin/sh", "-c", "x"]))
        self.assertEqual(fds, {0: 0, 1: 1, 2: 2, 3: 17, 4: 19})
        self.assertEqual((env["LISTEN_FDS"], env["LISTEN_FDNAMES"]), ("2", "ollama:admin"))
        self.assertEqual(env["NOTIFY_SOCKET"], self.reactor.ports[0].path)
        self.assertEqual(env[HANDOFF_NOTIFY], self.systemd_path)
        self.assertEqual(env["KEEP"], "1")
        self.assertFalse(self.handoff.start(), "one handoff at a time")

    def test_ready_names_the_successor_main_process_then_drains(self):
        self.handoff.start()
        port = self.reactor.ports[0]
        port.protocol.datagramReceived(b"STATUS=starting", None)
        self.assertEqual(self.drained, [])
        port.protocol.datagramReceived(b"READY=1", None)
        self.assertEqual(self.systemd.recv(64), b"MAINPID=1000\nREADY=1")
        self.assertEqual(self.drained, [True])
        self.assertFalse(port.open)
        self.assertEqual(self.reactor.getDelayedCalls(), [], "the 30 s timer is gone")
        self.assertFalse(self.handoff.start(), "handed over already")

    def test_a_successor_never_ready_is_killed_and_this_process_serves_on(self):
        captured = LogCapture(self)
        self.handoff.start()
        process = self.handoff.process
        self.reactor.advance(29.9)
        self.assertEqual(process.signals, [])
        self.reactor.advance(0.1)
        self.assertEqual(process.signals, [signal.SIGKILL])
        self.assertEqual(self.drained, [])
        self.assertEqual(
            [formatEvent(e) for e in captured.at("error")],
            [NEVER_READY],
        )
        self.assertTrue(self.handoff.start(), "a later SIGHUP tries again")

    def test_a_successor_that_exits_leaves_this_process_serving(self):
        captured = LogCapture(self)
        self.handoff.start()
        protocol = self.reactor.spawned[0][0]
        protocol.ended("exit status 1")
        self.assertEqual(self.drained, [])
        self.assertEqual(
            [formatEvent(e) for e in captured.at("error")],
            [
                "hot handoff failed: it exited before it was ready (exit status 1); "
                "this process keeps serving"
            ],
        )
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_stop_while_a_successor_starts_kills_it_and_leaves_no_folder(self):
        self.handoff.start()
        process = self.handoff.process
        folder = os.path.dirname(self.reactor.ports[0].path)
        self.assertTrue(os.path.isdir(folder))
        self.handoff.stop()
        self.assertEqual(process.signals, [signal.SIGKILL])
        self.assertFalse(os.path.exists(folder))
        self.assertFalse(self.reactor.ports[0].open)
        self.assertEqual(self.reactor.getDelayedCalls(), [], "the 30 s timer is gone")
        self.assertEqual(self.drained, [])
        self.handoff.stop()
        self.assertEqual(process.signals, [signal.SIGKILL], "a second stop does nothing")
        self.assertFalse(self.handoff.start(), "a SIGHUP while stopping starts nothing")
        self.assertEqual(len(self.reactor.spawned), 1)

    def test_the_successor_is_this_command_line_again_with_its_own_pid(self):
        argv = successor_argv(["-c", "--logfile", "x", "nvpair-proxy", "--engine", "ollama"], "py")
        self.assertEqual(argv[:2], ["/bin/sh", "-c"])
        self.assertEqual(argv[3:6], ["sh", "py", "-c"])
        self.assertIn("twistd", argv[6])
        self.assertEqual(argv[7:], ["--logfile", "x", "nvpair-proxy", "--engine", "ollama"])
        out = subprocess.run(
            ["/bin/sh", "-c", argv[2], "sh", "/bin/sh", "-c", "echo $LISTEN_PID $$"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        self.assertEqual(out[0], out[1], "LISTEN_PID names the successor itself")

    def test_a_successor_notifies_systemd_itself_once_it_serves(self):
        environ = {"NOTIFY_SOCKET": "/ours", HANDOFF_NOTIFY: "/systemd"}
        take_over_notify(environ)
        self.assertEqual(environ, {"NOTIFY_SOCKET": "/systemd"})
        environ = {"NOTIFY_SOCKET": "/ours", HANDOFF_NOTIFY: ""}
        take_over_notify(environ)
        self.assertEqual(environ, {})


FLEET = (
    '[[node]]\nid = "gpu"\ndialect = "ollama"\nmodels = ["llama3:latest"]\n'
    "tokens = {tokens}\ntoken_delay = {delay}\n"
)
CHAT = {"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}


def chat_over(sock: socket.socket, stream: bool = False) -> None:
    body = json.dumps(dict(CHAT, stream=stream)).encode()
    sock.sendall(
        b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class SocketActivationProcessTests(SynchronousTestCase):
    """A standalone proxy started as systemd starts a socket-activated service: its facade
    and admin sockets already listening, handed over as descriptors 3 and 4."""

    def fleet(self, tokens: int = 3, delay: float = 0.0) -> str:
        ports = start_fleet(self, FLEET.format(tokens=tokens, delay=delay))
        nodes = os.path.abspath(self.mktemp())
        with open(nodes, "w") as handle:
            handle.write(nodes_toml([("gpu", "ollama", ports["gpu"], ["llama3:latest"])]))
        return nodes

    def test_a_connection_made_before_the_process_started_is_served(self):
        facade, admin = listening_socket(), listening_socket()
        self.addCleanup(facade.close)
        self.addCleanup(admin.close)
        early = socket.create_connection(facade.getsockname(), timeout=30)
        self.addCleanup(early.close)
        chat_over(early)  # queued by the kernel: nothing accepts yet
        nodes = self.fleet()
        start_standalone(
            self,
            # Ports that differ from the inherited ones: the inherited sockets are served.
            ["--engine", f"ollama:{free_port()}", "--nodes", nodes, "--admin", "127.0.0.1:0"],
            inherit=[("ollama", facade.fileno()), ("admin", admin.fileno())],
        )
        facade.close()  # the proxy holds its own copy now
        head = early.recv(65536)
        self.assertTrue(head.startswith(b"HTTP/1.1 200 "), head[:40])
        self.assertEqual(http_get(admin.getsockname()[1], "/healthz"), (200, b"ok\n"))

    def test_an_inherited_socket_no_flag_serves_stops_start_up_with_one_line(self):
        stray = listening_socket()
        self.addCleanup(stray.close)
        launcher, env = processes.activated([("lmstudio", stray.fileno())])
        result = subprocess.run(
            launcher
            + processes.TWISTD
            + ["-n", "--pidfile=", "nvpair-proxy", "--engine", f"ollama:{free_port()}"]
            + ["--state-dir", os.path.abspath(self.mktemp())],
            env=dict(os.environ, **env),
            pass_fds=(stray.fileno(),),
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertNotEqual(result.returncode, 0)
        # Found once the facades are open, as a bad nodes file is: twistd's log (stdout
        # here) ends with the one line.
        self.assertTrue(
            result.stdout.strip()
            .splitlines()[-1]
            .endswith(
                "nvpair-proxy: an inherited socket is named 'lmstudio', which no --engine "
                "or --admin of this command line serves"
            ),
            result.stdout[-500:],
        )


class HandoffProcessTests(SynchronousTestCase):
    """SIGHUP to a standalone proxy: a successor takes the same sockets, the stream in flight
    finishes on the old process, new connections are never refused, the old one exits 0."""

    def test_a_reload_hands_over_without_cutting_a_stream_or_refusing_a_connection(self):
        ports = start_fleet(self, FLEET.format(tokens=30, delay=0.1))
        nodes = os.path.abspath(self.mktemp())
        with open(nodes, "w") as handle:
            handle.write(nodes_toml([("gpu", "ollama", ports["gpu"], ["llama3:latest"])]))
        port, admin = free_port(), free_port()
        log = os.path.abspath(self.mktemp())
        old = start_standalone(
            self,
            ["--engine", f"ollama:{port}", "--nodes", nodes, "--admin", f"127.0.0.1:{admin}"],
            logfile=log,
        )
        stream = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.addCleanup(stream.close)
        chat_over(stream, stream=True)
        self.assertTrue(stream.recv(65536).startswith(b"HTTP/1.1 200 "))
        old.send_signal(signal.SIGHUP)
        successor = None
        served = 0
        # Until the old process has exited, every new connection is accepted and answered
        # (by one process or the other); bounded: 20,000 requests.
        for _ in range(20000):
            client = socket.create_connection(("127.0.0.1", port), timeout=30)
            client.sendall(b"GET /api/tags HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = read_until_closed_or_answered(client)
            client.close()
            self.assertTrue(answer.startswith(b"HTTP/1.1 200 "), answer[:60])
            served += 1
            if old.poll() is not None:
                break
        self.assertEqual(old.wait(timeout=30), 0)
        with open(log, encoding="utf-8") as handle:
            text = handle.read()
        found = re.search(r"starting a successor \(pid (\d+)\)", text)
        self.assertIsNotNone(found, "no successor was started")
        successor = int(found.group(1))
        self.addCleanup(kill, successor)
        tail = read_answer(stream)
        self.assertIn(b'"done":true', tail, "the stream was cut")
        self.assertIn(f"handed over to pid {successor}; draining", text)
        self.assertEqual(http_get(admin, "/healthz"), (200, b"ok\n"))
        self.assertGreater(served, 0)
        # the successor serves on alone
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        chat_over(client)
        self.assertTrue(read_until_closed_or_answered(client).startswith(b"HTTP/1.1 200 "))
        client.close()


def read_until_closed_or_answered(sock: socket.socket) -> bytes:
    """A non-streamed answer: its head and its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: (\d+)", head)
    want = int(length.group(1)) if length else 0
    while len(body) < want:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def kill(pid: int) -> None:
    for number in (signal.SIGTERM, signal.SIGTERM):
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        select.select([], [], [], 0.1)
    os.kill(pid, signal.SIGKILL)


class RestartSoakTests(SynchronousTestCase):
    """``bench/soak --restarts``, small: short chats and long streams keep going through
    reloads and a restart on held sockets (docs/testing.md#restart-soak)."""

    def test_five_reloads_and_restarts_under_load_refuse_cut_and_lose_nothing(self):
        soak = os.path.join(os.path.dirname(processes.__file__), "..", "..", "bench", "soak")
        result = subprocess.run(
            [sys.executable, soak, "--restarts", "5", "--every", "1", "--clients", "4"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        out = result.stdout
        self.assertEqual(result.returncode, 0, out[-2000:] + result.stderr[-2000:])
        self.assertIn("4 reloads (hot handoffs) and 1 restarts", out)
        for line in (
            "connections refused: 0",
            "streams cut before their end: 0",
            "requests without an answer or with an error status: 0",
            "admitted requests without exactly one terminal event: 0",
            "processes that exited other than 0: 0; traceback lines: 0",
        ):
            self.assertIn(line, out.splitlines())
        answered = re.search(r"(\d+) short chats and (\d+) long streams answered", out)
        self.assertIsNotNone(answered)
        self.assertGreater(int(answered.group(2)), 0, "no stream ran through the restarts")


class BadSuccessorProcessTests(SynchronousTestCase):
    def test_a_successor_that_cannot_start_leaves_the_old_process_serving(self):
        """The nodes file went missing before the reload: the successor stops at start-up,
        and the old process says why in one line and serves on."""
        ports = start_fleet(self, FLEET.format(tokens=2, delay=0))
        nodes = os.path.abspath(self.mktemp())
        with open(nodes, "w") as handle:
            handle.write(nodes_toml([("gpu", "ollama", ports["gpu"], ["llama3:latest"])]))
        port = free_port()
        log = os.path.abspath(self.mktemp())
        proxy = start_standalone(
            self, ["--engine", f"ollama:{port}", "--nodes", nodes], logfile=log
        )
        os.remove(nodes)
        proxy.send_signal(signal.SIGHUP)

        def failed() -> str | None:
            with open(log, encoding="utf-8") as handle:
                lines = [line for line in handle if "hot handoff failed" in line]
            return lines[0] if lines else None

        line = processes.wait_until(log, failed, 60)
        self.assertIsNotNone(line, "no handoff failure was logged")
        self.assertIn("hot handoff failed: it exited before it was ready", line)
        self.assertIn("this process keeps serving", line)
        self.assertIsNone(proxy.poll())
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        chat_over(client)
        self.assertTrue(read_until_closed_or_answered(client).startswith(b"HTTP/1.1 200 "))
        client.close()
