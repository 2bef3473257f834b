"""Running the real proxy and the simulated fleet as processes, for the few tests where the
process boundary itself is the point (stdio link, twistd, real client packages).

Waiting is event-driven and bounded: the fleet prints a ready line, the proxy sends systemd's
READY=1 to a socket the test owns, and every read has a deadline.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time

TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
DEADLINE = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_fleet(test, fleet_toml: str) -> dict[str, int]:
    path = os.path.join(test.mktemp() + "-fleet.toml")
    with open(path, "w") as handle:
        handle.write(fleet_toml)
    proc = subprocess.Popen([sys.executable, "-m", "nvpair_proxy.testing.simfleet", path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    test.addCleanup(stop, proc)
    line = read_line(proc.stdout, DEADLINE)
    if not line.startswith("simfleet ready:"):
        test.fail(f"simfleet did not start: {line!r} {proc.stderr.read()}")
    return {k: int(v) for k, v in (item.split("=") for item in line.split(":", 1)[1].split())}


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


class LineReader:
    """Lines from a pipe with a deadline; buffers itself (a text wrapper's buffer would hide
    lines from select)."""

    def __init__(self, stream) -> None:
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


def read_line(stream, timeout: float) -> str:
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


def wait_until(path: str, ready, timeout: float = DEADLINE):
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
            found[:] = [json.loads(line.split(marker, 1)[1])["workloadInfo"]
                        for line in handle if marker in line and line.endswith("\n")]
        return len(found) >= count

    wait_until(path, enough)
    return found[:count]


def start_standalone(test, args: list[str], logfile: str | None = None) -> subprocess.Popen:
    """twistd nvpair-proxy standalone; returns once it reported READY=1.

    With ``logfile`` twistd logs there (at debug, so workload events can be read back).
    """
    workdir = tempfile.mkdtemp(prefix="nvp-")
    test.addCleanup(shutil.rmtree, workdir, True)
    notify_path = os.path.join(workdir, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(DEADLINE)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path)
    logging = ["--logfile", logfile] if logfile else []
    level = ["--log-level", "debug"] if logfile else []
    proc = subprocess.Popen(TWISTD + ["-n", "--pidfile="] + logging + [
                                "nvpair-proxy", "--state-dir", os.path.join(workdir, "state")]
                            + level + args,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    test.addCleanup(stop, proc)
    try:
        test.assertEqual(notify.recv(64), b"READY=1")
    finally:
        notify.close()
    return proc


class BrokerChannel:
    """The broker's side of the stdio link: write requests, collect every line in order."""

    def __init__(self, test, args: list[str] = ()) -> None:
        workdir = os.path.abspath(test.mktemp())
        os.makedirs(workdir)
        self.proc = subprocess.Popen(
            TWISTD + ["-n", "--pidfile=", "nvpair-proxy", "--state-dir",
                      os.path.join(workdir, "state")] + list(args),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(os.environ, NVPAIR_LOG_LEVEL="debug"))
        test.addCleanup(stop, self.proc)
        self.reader = LineReader(self.proc.stdout)
        self.lines: list[dict] = []
        self.raw: list[str] = []
        self.next_id = 1

    def send(self, method: str, params=None, request: bool = True):
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        if request:
            message["id"] = self.next_id
            self.next_id += 1
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()
        return message.get("id")

    def call(self, method: str, params=None) -> dict:
        message_id = self.send(method, params)
        return self.wait(lambda m: m.get("id") == message_id)

    def wait(self, predicate, timeout: float = DEADLINE) -> dict:
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


def nodes_toml(entries: list[tuple[str, str, int, list[str]]]) -> str:
    out = []
    for node_id, engine, port, models in entries:
        out.append(f'[[node]]\nid = "{node_id}"\naddress = "127.0.0.1"\n'
                   f"[node.engines.{engine}]\nport = {port}\nmodels = {json.dumps(models)}\n")
    return "\n".join(out)


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


def status_of(received: bytes) -> int | None:
    parts = received.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
