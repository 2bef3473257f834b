"""What several test modules share, in one place, so no test module imports another."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections import Counter
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import error as ierror
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import EventLoggingObserver, MemoryReactorClock, StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from zope.interface import implementer

from nvpair_proxy.admin.metrics import registry, scrape
from nvpair_proxy.admin.status import ProcessView
from nvpair_proxy.core import logs
from nvpair_proxy.core.interfaces import IAttemptSink
from nvpair_proxy.lan.apikeys import KeyStore, LanGate, parse_cidrs
from nvpair_proxy.nodes.discovery import Node
from nvpair_proxy.request.attempt import AddressMemory, Attempt, UpstreamRequest
from nvpair_proxy.request.events import RequestEnded
from nvpair_proxy.testing import FakeAgent, processes

KEY = "k" * 24 + "-._~+/=0123"  # 35 characters of the LAN keys' alphabet


class LogCapture:
    """Every event the global log publisher sees while a test runs, removed at its end.

    ``events`` is live (Twisted's ``EventLoggingObserver``): read it after the code under test
    ran. ``level`` sets the process level for the test and puts it back after.
    """

    def __init__(self, test, level: str | None = None) -> None:
        if level is not None:
            test.addCleanup(logs.at_level(level))
        self.events = EventLoggingObserver.createWithCleanup(test, globalLogPublisher)
        self._taken = 0

    def ours(self) -> list[dict]:
        """The proxy's own events (its namespace), in order."""
        return [e for e in self.events if e.get("log_namespace") == logs.COMPONENT]

    def at(self, level: str) -> list[dict]:
        return [
            e
            for e in self.ours()
            if e.get("log_level") is not None and e["log_level"].name == level
        ]

    def take(self) -> list[dict]:
        """The events since the last ``take``."""
        taken = list(self.events)[self._taken :]
        self._taken += len(taken)
        return taken


def rewrite(path: str, text: str) -> None:
    """A rotation as an editor does it: new content, a new mtime."""
    stamp = os.stat(path).st_mtime_ns
    with open(path, "w") as handle:
        handle.write(text)
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))


def gate(clock: Clock, env: str | None = KEY, path: str | None = None, cidrs: str = "") -> LanGate:
    return LanGate(KeyStore(clock, env=env, path=path), allowed=parse_cidrs(cidrs))


def failures(gate: LanGate, host: str) -> int:
    """Failed attempts from ``host`` in its current window, as the gate counts them."""
    entry = gate._failures.get(host)
    return 0 if entry is None else entry[1]


class Collect(Protocol):
    """A response body delivered whole: its chunks, then why it ended."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.reason: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)

    def connectionLost(self, reason) -> None:
        self.reason = reason

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


class Wire:
    """The engine's end of one dialled connection."""

    def __init__(self, reactor: MemoryReactorClock, index: int = -1) -> None:
        self.host, self.port, factory = reactor.tcpClients[index][:3]
        self.protocol = factory.buildProtocol(None)
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)

    def sent(self) -> bytes:
        data = self.transport.value()
        self.transport.clear()
        return data

    def reply(self, data: bytes) -> None:
        self.protocol.dataReceived(data)

    def close(self, reason=ierror.ConnectionDone) -> None:
        self.protocol.connectionLost(Failure(reason()))


# Nodes files (test_nodesfile, test_files_hostile).
TWO_NODES = """\
[[node]]
id = "gpu-a"
name = "GPU A"
address = "127.0.0.1"
[node.engines.ollama]
port = 11434
models = ["llama3", "qwen2:7b"]
[node.engines.lmstudio]
models = ["Qwen", " phi-3 "]

[[node]]
id = "gpu-b"
addresses = ["192.168.1.20", "fd00::20"]
[node.engines.ollama]
port = 11500
"""

ONE_NODE = """\
[[node]]
id = "gpu-a"
address = "127.0.0.1"
[node.engines.ollama]
models = ["llama3"]
"""


# A complete engine file for an engine the code has never heard of.
VLLM = """\
id = "vllm"
service_key = "vl"
persisted_port_file = "vllm-proxy-port.json"
model_rule = "exact"
inventory_source = "models"

[ports]
own = 8000
relocated = 8001
standalone = 8000
reserved = [8001]

[model_list]
upstream_path = "/v1/models"
envelope = "openai"

[[routes]]
method = "POST"
path = "/v1/chat/completions"
class = "inference"
terminal = "sse-done"

[[routes]]
method = "GET"
path = "/v1/models"
class = "models"
upstream_path = "/v1/models"
envelope = "openai"
"""


def read_answer(sock: socket.socket) -> bytes:
    """Everything a blocking socket receives until the far end closes, then closed."""
    with sock:
        parts = []
        while chunk := sock.recv(65536):
            parts.append(chunk)
    return b"".join(parts)


# The real processes (nvpair_proxy.testing.processes), bound to a test: stopped at its end.
def start_fleet(test, fleet_toml: str) -> dict[str, int]:
    """The simulated fleet of ``fleet_toml`` as a process; each node's port by id."""
    path = test.mktemp() + "-fleet.toml"
    with open(path, "w") as handle:
        handle.write(fleet_toml)
    try:
        proc, ports = processes.spawn_fleet(path)
    except processes.StartFailed as failed:
        test.fail(str(failed))
    test.addCleanup(processes.stop, proc)
    return ports


def start_standalone(
    test, args: list[str], logfile: str | None = None, inherit: Sequence[tuple[str, int]] = ()
) -> subprocess.Popen:
    """twistd nvpair-proxy standalone, once it reported READY=1. With ``logfile`` twistd logs
    there at debug, so workload events can be read back; ``inherit`` hands it listening
    sockets, (role, descriptor) each, as systemd's socket activation does."""
    workdir = tempfile.mkdtemp(prefix="nvp-")  # short: the notification socket lives there
    test.addCleanup(shutil.rmtree, workdir, True)
    level = ["--log-level", "debug"] if logfile else []
    try:
        proc = processes.spawn_proxy(workdir, level + list(args), logfile, inherit=inherit)
    except processes.StartFailed as failed:
        test.fail(str(failed))
    test.addCleanup(processes.stop, proc)
    return proc


def broker_channel(test, args: list[str] | tuple[str, ...] = ()) -> processes.BrokerChannel:
    """A proxy in broker mode on a stdio link the test speaks for the broker."""
    workdir = os.path.abspath(test.mktemp())
    os.makedirs(workdir)
    link = processes.BrokerChannel(workdir, args)
    test.addCleanup(link.close)
    return link


@implementer(IAttemptSink)
class Outcomes(list):
    """The loop an attempt reports to, recording each outcome: never the final attempt."""

    def is_final(self) -> bool:
        return False

    def attempt_ended(self, outcome) -> None:
        self.append(outcome)


def attempt(agent: FakeAgent, clock: Clock, sink: Outcomes | None = None) -> Attempt:
    node = Node(id="a", name="a", port=11434, addresses=("10.0.0.1",))
    request = UpstreamRequest(
        method=b"POST",
        target=b"/api/chat",
        headers=Headers(),
        body=b"{}",
        inference=True,
        retryable=lambda status: status >= 500,
        response_timeout=60,
    )
    return Attempt(
        agent=agent,
        clock=clock,
        addresses=AddressMemory(),
        node=node,
        request=request,
        sink=Outcomes() if sink is None else sink,
    )


def scraped(view: ProcessView) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape, by name and sorted labels."""
    samples = {}
    for family in text_string_to_metric_families(scrape(registry(view)).decode()):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def total(samples: dict, name: str, **labels) -> float:
    return sum(
        value
        for (sample, key), value in samples.items()
        if sample == name and all((k, v) in key for k, v in labels.items())
    )


def by_labels(samples: dict, name: str, *labels: str) -> Counter:
    """One family's samples summed by some of its labels (one label: its value as the key)."""
    out: Counter = Counter()
    for (sample, key), value in samples.items():
        if sample == name:
            values = tuple(dict(key)[label] for label in labels)
            out[values if len(values) > 1 else values[0]] += value
    return out


def request_ended(**fields) -> RequestEnded:
    """A finished request as the recorder learns it: an Ollama inference completed 200 at
    0 s in no time, unless ``fields`` say otherwise."""
    ended = dict(
        engine="ollama", at=0.0, route="inference", outcome="completed", status=200, duration=0.0
    )
    return RequestEnded(**{**ended, **fields})
