"""The real proxy and the simulated fleet as processes: the few tests where the process
boundary itself is the point (stdio link, twistd, real client packages), ``bin/demo`` and the
benchmarks all start them here, so each child is started, awaited and stopped one way.

Waiting is event-driven and bounded: the fleet prints a ready line, the proxy sends systemd's
READY=1 to a socket its starter owns, and every read has a deadline. Nothing here knows a test
framework; a child that does not come up is stopped and raises ``StartFailed``.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import selectors
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

# twistd of this interpreter's environment, whatever the PATH holds.
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
DEADLINE = 30.0
SIMFLEET = [sys.executable, "-m", "nvpair_proxy.testing.simfleet"]

_T = TypeVar("_T")

# What systemd does before it runs a socket-activated service: the descriptors given before
# ``--`` become 3, 4, ... and LISTEN_PID names the process, which exec keeps.
_ACTIVATE = """
import fcntl, os, sys
at = sys.argv.index("--")
given = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 100) for fd in sys.argv[1:at]]
for target, fd in enumerate(given, 3):
    os.dup2(fd, target)
for fd in given + [int(fd) for fd in sys.argv[1:at] if int(fd) >= 3 + len(given)]:
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[at + 1], sys.argv[at + 1 :])
"""


class Readable(Protocol):
    """What LineReader reads: anything with a file descriptor (a pipe, a socket's file)."""

    def fileno(self) -> int: ...


class StartFailed(Exception):
    """A child process did not report that it was ready; the message says what it said."""


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: held bound together until all are chosen, since two
    ports chosen one after the other may be the same one."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def listening_socket(backlog: int = 1024) -> socket.socket:
    """A listening socket on a free loopback port: what systemd holds for a socket-activated
    service, to hand a proxy (``spawn_proxy(inherit=...)``)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


def stop(*procs: subprocess.Popen | None) -> None:
    """SIGTERM each child still running; a second SIGTERM to one still draining 5 s later
    (a proxy then stops at once, docs/operations.md#restarts), SIGKILL to one that has not
    exited 10 s after that; close the pipes of every one."""
    for proc in procs:
        if proc is None:
            continue
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def spawn_fleet(
    fleet_path: str, stderr: int | None = subprocess.PIPE
) -> tuple[subprocess.Popen, dict[str, int]]:
    """The simulated fleet of ``fleet_path`` (simfleet's TOML) once it printed its ready line:
    (the process, each simulated node's port by id). ``stderr=None`` lets it write to ours."""
    proc = subprocess.Popen(SIMFLEET + [fleet_path], stdout=subprocess.PIPE, stderr=stderr)
    assert proc.stdout is not None
    line = read_line(proc.stdout, DEADLINE)
    if not line.startswith("simfleet ready:"):
        if proc.poll() is None:
            proc.kill()
        said = proc.stderr.read().decode(errors="replace") if proc.stderr is not None else ""
        stop(proc)
        raise StartFailed(f"simfleet did not start: {line!r} {said}")
    return proc, {k: int(v) for k, v in (item.split("=") for item in line.split(":", 1)[1].split())}


def activated(inherit: Sequence[tuple[str, int]]) -> tuple[list[str], dict[str, str]]:
    """What runs a command with ``inherit``'s listening sockets handed over as systemd's
    socket activation hands them, (role, descriptor) each: the launcher to put before the
    command (run it with ``pass_fds`` of those descriptors) and the environment it needs."""
    if not inherit:
        return [], {}
    launcher = [sys.executable, "-c", _ACTIVATE, *(str(fd) for _, fd in inherit), "--"]
    names = ":".join(role for role, _ in inherit)
    return launcher, {"LISTEN_FDS": str(len(inherit)), "LISTEN_FDNAMES": names}


def spawn_proxy(
    workdir: str,
    args: Sequence[str],
    logfile: str | None = None,
    *,
    stdout: int | None = subprocess.DEVNULL,
    stderr: int | None = subprocess.PIPE,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    inherit: Sequence[tuple[str, int]] = (),
) -> subprocess.Popen:
    """``twistd nvpair-proxy`` (standalone unless ``args`` say otherwise) with its state under
    ``workdir``, once it sent READY=1. ``workdir`` holds the notification socket, so its path
    must be short (a mkdtemp in /tmp is). With ``logfile`` twistd logs there; ``env`` adds to
    the environment (a benchmark's ``PYTHONPATH`` of another checkout). ``inherit`` hands it
    listening sockets as systemd's socket activation does: (role, descriptor) each."""
    notify_path = os.path.join(workdir, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(DEADLINE)
    logging = ["--logfile", logfile] if logfile else []
    launcher, activation = activated(inherit)
    extra = dict(env or {}, NOTIFY_SOCKET=notify_path, **activation)
    try:
        proc = subprocess.Popen(
            launcher
            + TWISTD
            + ["-n", "--pidfile="]
            + logging
            + ["nvpair-proxy", "--state-dir", os.path.join(workdir, "state")]
            + list(args),
            env=dict(os.environ, **extra),
            cwd=cwd,
            stdout=stdout,
            stderr=stderr,
            pass_fds=tuple(fd for _, fd in inherit),
        )
        try:
            message = notify.recv(64)
        except socket.timeout:
            message = b""
    finally:
        notify.close()
    if message != b"READY=1":
        stop(proc)
        raise StartFailed(
            f"the proxy did not report READY=1 within {DEADLINE:.0f} s (it sent {message!r})"
        )
    return proc


class LineReader:
    """Lines from a pipe with a deadline; buffers itself (a text wrapper's buffer would hide
    lines from select)."""

    def __init__(self, stream: Readable) -> None:
        self.fd = stream.fileno()
        self.buffer = b""
        self.closed = False

    def read_line(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = end - time.monotonic()
            if remaining <= 0 or self.closed:
                return ""
            selector = selectors.DefaultSelector()
            selector.register(self.fd, selectors.EVENT_READ)
            try:
                ready = selector.select(remaining)
            finally:
                selector.close()
            if ready:
                data = os.read(self.fd, 65536)
                if not data:
                    self.closed = True
                self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode().strip()


def read_line(stream: Readable, timeout: float) -> str:
    return LineReader(stream).read_line(timeout)


class FileWatch:
    """Wakes when a file is written (Linux inotify), so a test waits on the writer rather than
    on a timer; ``wait`` returns at the next write or at ``timeout``."""

    IN_MODIFY = 0x2

    def __init__(self, path: str) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(path), self.IN_MODIFY) < 0:
            raise OSError(ctypes.get_errno(), f"cannot watch {path}")

    def wait(self, timeout: float) -> None:
        if select.select([self.fd], [], [], max(0.0, timeout))[0]:
            try:
                os.read(self.fd, 65536)  # the events themselves say nothing more
            except BlockingIOError:
                pass

    def close(self) -> None:
        os.close(self.fd)


def wait_until(path: str, ready: Callable[[], _T], timeout: float = DEADLINE) -> _T:
    """``ready()`` re-checked each time ``path`` is written, until it returns something true
    or ``timeout`` passes; returns its last value."""
    end = time.monotonic() + timeout
    watch = FileWatch(path)
    try:
        while True:
            value = ready()
            remaining = end - time.monotonic()
            if value or remaining <= 0:
                return value
            watch.wait(remaining)
    finally:
        watch.close()


def logged_workloads(path: str, count: int, method: str = "workload:completed") -> list[dict]:
    """The workloadInfo of the first ``count`` ``method`` events in a debug log, waiting (at
    most DEADLINE) for the proxy to write them."""
    marker = f" event {method} "
    found: list[dict] = []

    def enough() -> bool:
        with open(path, encoding="utf-8") as handle:
            found[:] = [
                json.loads(line.split(marker, 1)[1])["workloadInfo"]
                for line in handle
                if marker in line and line.endswith("\n")
            ]
        return len(found) >= count

    wait_until(path, enough)
    return found[:count]


class BrokerChannel:
    """The broker's side of the stdio link to a proxy in broker mode (state under ``workdir``):
    write requests, collect every line in order."""

    def __init__(self, workdir: str, args: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen(
            TWISTD
            + ["-n", "--pidfile=", "nvpair-proxy", "--state-dir", os.path.join(workdir, "state")]
            + list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, NVPAIR_LOG_LEVEL="debug"),
        )
        assert self.proc.stdout is not None
        self.reader = LineReader(self.proc.stdout)
        self.lines: list[dict] = []
        self.raw: list[str] = []
        self.next_id = 1

    def close(self) -> None:
        stop(self.proc)

    def send(self, method: str, params: object = None, request: bool = True) -> int | None:
        message: dict[str, object] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        message_id = None
        if request:
            message_id = message["id"] = self.next_id
            self.next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()
        return message_id

    def call(self, method: str, params: object = None) -> dict:
        message_id = self.send(method, params)
        return self.wait(lambda m: m.get("id") == message_id)

    def wait(self, predicate: Callable[[dict], bool], timeout: float = DEADLINE) -> dict:
        for message in self.lines:
            if predicate(message):
                return message
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = self.reader.read_line(end - time.monotonic())
            if not line:
                if self.proc.poll() is not None:
                    break
                continue
            self.raw.append(line)
            message = json.loads(line)
            self.lines.append(message)
            if predicate(message):
                return message
        raise AssertionError(f"no matching message; got {self.lines}")


def nodes_toml(
    entries: Iterable[tuple[str, str, int, list[str] | None]],
    slots: Mapping[tuple[str, str], int] | None = None,
) -> str:
    """A nodes file on loopback from (node id, engine, port, models): one ``[[node]]`` per id,
    in first-seen order, with a table per engine; models ``None`` leaves them to the probe.
    ``slots`` gives ``slots = N`` to the (node id, engine) entries it names."""
    tables: dict[str, list[str]] = {}
    for node_id, engine, port, models in entries:
        table = f"[node.engines.{engine}]\nport = {port}\n"
        if models is not None:
            table += f"models = {json.dumps(models)}\n"
        if slots and (node_id, engine) in slots:
            table += f"slots = {slots[node_id, engine]}\n"
        tables.setdefault(node_id, []).append(table)
    return "\n".join(
        f'[[node]]\nid = "{node_id}"\naddress = "127.0.0.1"\n' + "".join(engines)
        for node_id, engines in tables.items()
    )


def exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send ``data``, read until the server closes or ``timeout``; (bytes read, closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            return b"", True
        return drain(sock, timeout)


def drain(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Read until the server closes or ``timeout``; (bytes read, closed)."""
    received = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received, True
        except socket.timeout:
            break
        if not chunk:
            return received, True
        received += chunk
    return received, False


def metrics(port: int) -> dict[str, float]:
    """The Prometheus text page on 127.0.0.1:``port`` (a proxy's admin listener, a
    llama-server's ``--metrics``) as {series: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def status_of(received: bytes) -> int | None:
    parts = received.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
