"""``bench/soak --restarts N``: restarts and reloads under a steady load, audited
(docs/operations.md#restarts, docs/testing.md#restart-soak).

This script plays systemd: it holds the facade's and the admin's listening sockets
(``nvpair-proxy-*.socket``) and starts every proxy on them (``LISTEN_FDS``). A simulated
fleet serves short chats (model ``short``: 4 tokens at once) and long streams (model ``long``:
40 tokens 50 ms apart, 2 s). Client threads keep a steady mix going on fresh connections
while the proxy is, N times:

- reloaded (``systemctl reload``: SIGHUP), four times in five: a successor starts on the same
  sockets and the old process drains;
- restarted (``systemctl restart``) every fifth time: SIGTERM, the drain, the exit, then a new
  process on the same sockets; in between the kernel queues new connections.

Then the load stops, the last process gets SIGTERM, and the counts are printed; each must be 0:

- connections refused;
- streams cut before their end (all end well within the 30 s drain);
- requests that got no answer or an error status;
- admitted requests (``workload:submitted``, keyed by each process's ``runId``) without
  exactly one terminal event, in the one log every process appends to;
- proxy processes that exited with a status other than 0, or log a traceback.
"""

from __future__ import annotations

import collections
import ctypes
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nvpair_proxy.testing import processes  # noqa: E402

HOST = "127.0.0.1"
DRAIN = "30s"
CLIENT_TIMEOUT = 60.0
FLEET = """
[[node]]
id = "quick-{n}"
dialect = "ollama"
models = ["short"]
tokens = 4
token_delay = 0

[[node]]
id = "slow-{n}"
dialect = "ollama"
models = ["long"]
tokens = 40
token_delay = 0.05
"""
# Every process's successor names itself here once its predecessor hands over.
HANDED = re.compile(r"handed over to pid (\d+); draining")


class Load:
    """Client threads on fresh connections: a long stream in three requests of ten, else a
    short chat; each outcome kept."""

    def __init__(self, port: int, clients: int, seed: int) -> None:
        self.port, self.clients = port, clients
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(CLIENT_TIMEOUT + 5)

    def run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                stream = self.rng.random() < 0.3
            outcome = self.one(stream)
            with self.lock:
                self.outcomes[outcome] += 1

    def one(self, stream: bool) -> str:
        body = json.dumps(
            {
                "model": "long" if stream else "short",
                "stream": stream,
                "messages": [{"role": "user", "content": "hello"}],
            }
        )
        conn = http.client.HTTPConnection(HOST, self.port, timeout=CLIENT_TIMEOUT)
        try:
            conn.request("POST", "/api/chat", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            data = answer.read()
        except ConnectionRefusedError:
            return "refused"
        except (OSError, http.client.HTTPException) as exc:
            return f"stream cut ({type(exc).__name__})" if stream else f"error ({exc})"
        finally:
            conn.close()
        if answer.status != 200:
            return f"status {answer.status}"
        if stream:
            last = data.strip().rsplit(b"\n", 1)[-1]
            return "stream ok" if b'"done":true' in last.replace(b" ", b"") else "stream cut"
        return "short ok"


def audit_log(path: str) -> tuple[int, int, int]:
    """(admitted workloads, those without exactly one terminal event, traceback lines)."""
    submitted: set[tuple[str, str]] = set()
    terminal: collections.Counter[tuple[str, str]] = collections.Counter()
    tracebacks = 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if "Traceback" in line or "Unhandled Error" in line:
                tracebacks += 1
            for name in ("workload:submitted", "workload:completed", "workload:errored"):
                marker = f"event {name} "
                if marker in line:
                    info = json.loads(line.split(marker, 1)[1])["workloadInfo"]
                    key = (info["runId"], info["id"])
                    if name == "workload:submitted":
                        submitted.add(key)
                    else:
                        terminal[key] += 1
    wrong = sum(1 for key in submitted if terminal[key] != 1)
    wrong += sum(1 for key in terminal if key not in submitted)
    return len(submitted), wrong, tracebacks


def wait_for(predicate, seconds: float, what: str):
    """The first value of ``predicate`` that is not None, polled; RuntimeError at the end."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = predicate()
        if value is not None:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"no {what} within {seconds:g} s")


def handed_over_to(log: str, seen: int) -> int | None:
    with open(log, encoding="utf-8", errors="replace") as handle:
        found = HANDED.findall(handle.read())
    return int(found[seen]) if len(found) > seen else None


def exited(pid: int) -> int | None:
    """The exit status of ``pid`` (our child, or an orphan we reap), None while it runs."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def run_restarts(restarts: int, seconds: float, clients: int, seed: int, keep: bool) -> int:
    # Orphaned proxies (a successor whose predecessor exited) become our children, so their
    # exit statuses can be read, as systemd reads its service's.
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    workdir = tempfile.mkdtemp(prefix="nvpair-restarts-")
    log = os.path.join(workdir, "proxy.log")
    fleet_path = os.path.join(workdir, "fleet.toml")
    with open(fleet_path, "w") as handle:
        handle.write(FLEET.format(n=1) + FLEET.format(n=2))
    fleet, ports = processes.spawn_fleet(fleet_path)
    nodes = os.path.join(workdir, "nodes.toml")
    with open(nodes, "w") as handle:
        handle.write(
            processes.nodes_toml(
                [
                    (node, "ollama", port, ["short" if "quick" in node else "long"])
                    for node, port in sorted(ports.items())
                ]
            )
        )
    facade, admin = processes.listening_socket(), processes.listening_socket()
    inherit = [("ollama", facade.fileno()), ("admin", admin.fileno())]
    args = ["--engine", "ollama:0", "--nodes", nodes, "--admin", f"{HOST}:0"]
    args += ["--drain-timeout", DRAIN, "--log-level", "debug"]

    def start() -> subprocess.Popen:
        folder = tempfile.mkdtemp(prefix="nvp-", dir=workdir)
        return processes.spawn_proxy(folder, args, log, inherit=inherit)

    statuses: dict[int, int | None] = {}
    proc = start()
    main = proc.pid
    popen = {proc.pid: proc}
    load = Load(facade.getsockname()[1], clients, seed)
    reloads = restarts_done = 0
    began = time.monotonic()
    try:
        load.start()
        for step in range(1, restarts + 1):
            time.sleep(seconds)
            if step % 5 == 0:
                os.kill(main, signal.SIGTERM)
                statuses[main] = wait_for(lambda m=main: _exit_of(m, popen), 40, "exit")
                proc = start()
                main = proc.pid
                popen[main] = proc
                restarts_done += 1
            else:
                os.kill(main, signal.SIGHUP)
                successor = wait_for(lambda: handed_over_to(log, reloads), 40, "successor")
                statuses[main] = wait_for(lambda m=main: _exit_of(m, popen), 40, "drain and exit")
                main = successor
                reloads += 1
        time.sleep(seconds)
        load.finish()
        os.kill(main, signal.SIGTERM)
        statuses[main] = wait_for(lambda: _exit_of(main, popen), 40, "exit")
    finally:
        load.stop.set()
        if main not in statuses:
            try:
                os.kill(main, signal.SIGKILL)
            except ProcessLookupError:
                pass
        processes.stop(fleet)
        facade.close()
        admin.close()
    elapsed = time.monotonic() - began
    admitted, without_one, tracebacks = audit_log(log)
    outcomes = load.outcomes
    refused = outcomes["refused"]
    cut = sum(n for what, n in outcomes.items() if what.startswith("stream cut"))
    failed = sum(
        n for what, n in outcomes.items() if what.startswith("status") or what.startswith("error")
    )
    bad_exits = sum(1 for status in statuses.values() if status != 0)
    print(
        f"restarts: {reloads} reloads (hot handoffs) and {restarts_done} restarts (drain, then a "
        f"new process on the held sockets) in {elapsed:.0f} s, {clients} clients"
    )
    print(
        f"requests: {outcomes['short ok']} short chats and {outcomes['stream ok']} long streams "
        f"answered; {admitted} workloads admitted by {len(statuses)} processes"
    )
    print(f"connections refused: {refused}")
    print(f"streams cut before their end: {cut}")
    print(f"requests without an answer or with an error status: {failed}")
    print(f"admitted requests without exactly one terminal event: {without_one}")
    print(f"processes that exited other than 0: {bad_exits}; traceback lines: {tracebacks}")
    for what, n in sorted(outcomes.items()):
        if what not in ("short ok", "stream ok"):
            print(f"  {what}: {n}")
    ok = not (refused or cut or failed or without_one or bad_exits or tracebacks)
    ok = ok and reloads + restarts_done == restarts
    if ok and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work directory kept: {workdir}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _exit_of(pid: int, popen: dict[int, subprocess.Popen]) -> int | None:
    if pid in popen:
        return popen[pid].poll()
    return exited(pid)
