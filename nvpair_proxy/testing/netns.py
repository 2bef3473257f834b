"""Three hosts on one machine: network namespaces, real interfaces, real processes.

The topology (every interface and address lives inside the namespaces; the root namespace
gets nothing, so nothing is routed outside the machine)::

    namespace SW:  br0 (10.213.0.0/24)          br1 (10.213.1.0/24)
                    |       |       |             |           |
    namespace A:  eth0 .0.1 |       |           eth1 .1.1     |
    namespace B:          eth0 .0.2 |                         |
    namespace C:                  eth0 .0.3                 eth1 .1.3

C is the multi-homed host: it is published with ``ips`` = [10.213.1.3, 10.213.0.3]. A has a
leg on br1 so it can reach C's first address at all; B has none (its dial of C's first
address fails at once with "network unreachable" and it uses the second).

Each host runs the simulated engine on its own 127.0.0.1:11434, the proxy in broker mode
(``--ipc`` to a scripted broker in this process, ``--cluster-dir`` with its own certificate
and pins for the two others), its facade on port 11435 of every address of its namespace.
The scripted broker enables the Ollama facade, names the engine with
``node/set-local-backend`` and sends a ``discovery:nodes`` snapshot of the three hosts by
their namespace addresses.

Names carry this process's pid and a random suffix (``nvpmh-<pid>-<rand>-a``), so parallel
runs never collide; a namespace whose pid is dead is a leftover and is removed (its
processes killed) before a new topology is built. Every process is started in its own
session with a parent-death signal, and ``close`` kills each process group, then deletes
the namespaces (which takes their veths and bridges with them).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nvpair_proxy.testing.certs import make_certificate, write_admission, write_identity, write_pin
from nvpair_proxy.testing.processes import LineReader

PREFIX = "nvpmh-"
FACADE_PORT = 11435
ENGINE_PORT = 11434
RELAY_PORT = 11436
MODEL = "llama3:latest"
DEADLINE = 30.0
TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_tools.py")
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]

# host key -> (engine id, [(bridge, address)]) ; the first address is eth0's.
LAYOUT = {
    "a": ("gpu-a", [(0, "10.213.0.1"), (1, "10.213.1.1")]),
    "b": ("gpu-b", [(0, "10.213.0.2")]),
    "c": ("gpu-c", [(0, "10.213.0.3"), (1, "10.213.1.3")]),
}


class Unavailable(Exception):
    """Namespaces cannot be made here; the message says why (the tests skip with it)."""


def _run(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run("ip", "-n", probe, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot create bridges or veth pairs: {exc}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _delete_namespace(name: str) -> None:
    """Kill whatever still runs in the namespace, then delete it (its links go with it)."""
    for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", name, check=False)


def _owner_alive(name: str) -> bool:
    owner = name[len(PREFIX) :].split("-", 1)[0]
    return owner.isdigit() and _alive(int(owner))


def remove_leftovers() -> list[str]:
    """Delete namespaces (and work folders) of ours whose creating process is gone, killing
    what still runs in them."""
    removed = []
    for entry in os.listdir(tempfile.gettempdir()):
        if entry.startswith(PREFIX) and not _owner_alive(entry):
            shutil.rmtree(os.path.join(tempfile.gettempdir(), entry), ignore_errors=True)
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or _owner_alive(name):
            continue
        _delete_namespace(name)
        removed.append(name)
    return removed


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def fingerprint(cert_pem: bytes) -> str:
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


class ScriptedBroker:
    """The broker's side of one proxy's ``--ipc`` link: it listens, the proxy connects."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.conn: socket.socket | None = None
        self.reader: LineReader | None = None
        self.messages: list[dict] = []
        self.next_id = 1

    def accept(self, timeout: float = DEADLINE) -> None:
        self.listener.settimeout(timeout)
        conn, _ = self.listener.accept()
        conn.settimeout(None)
        self.conn = conn
        self.reader = LineReader(conn.makefile("rb", buffering=0))

    def send(self, method: str, params=None, request: bool = True):
        message: dict = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        if request:
            message["id"] = self.next_id
            self.next_id += 1
        assert self.conn is not None, "accept() first"
        self.conn.sendall(json.dumps(message).encode() + b"\n")
        return message.get("id")

    def call(self, method: str, params=None, timeout: float = DEADLINE) -> dict:
        message_id = self.send(method, params)
        answer = self.wait(lambda m: m.get("id") == message_id, timeout)
        if "error" in answer:
            raise AssertionError(f"{method}: {answer['error']}")
        return answer["result"]

    def pump(self, timeout: float = 0.05) -> None:
        """Read whatever arrived (waiting up to ``timeout`` for the first line)."""
        wait = timeout
        assert self.reader is not None, "accept() first"
        while True:
            line = self.reader.read_line(wait)
            if not line:
                return
            self.messages.append(json.loads(line))
            wait = 0.01

    def wait(self, predicate, timeout: float = DEADLINE) -> dict:
        seen = 0
        end = time.monotonic() + timeout
        assert self.reader is not None, "accept() first"
        while True:
            for message in self.messages[seen:]:
                if predicate(message):
                    return message
            seen = len(self.messages)
            remaining = end - time.monotonic()
            if remaining <= 0 or self.reader.closed:
                raise AssertionError(
                    f"no matching message within {timeout}s; last: {self.messages[-5:]}"
                )
            line = self.reader.read_line(min(remaining, 0.5))
            if line:
                self.messages.append(json.loads(line))

    def workloads(self) -> dict[str, list[dict]]:
        """``workload:*`` events by workload id: each its workloadInfo plus ``event``."""
        self.pump()
        out: dict[str, list[dict]] = {}
        for message in self.messages:
            method = message.get("method", "")
            if method.startswith("workload:"):
                info = message["params"]["workloadInfo"]
                out.setdefault(info["id"], []).append(dict(info, event=method))
        return out

    def terminal(self, count: int = 1, timeout: float = DEADLINE) -> dict[str, list[dict]]:
        """Wait until ``count`` workloads have a terminal event; all workloads' events."""

        def done(message) -> bool:
            return message.get("method") in ("workload:completed", "workload:errored")

        end = time.monotonic() + timeout
        while sum(1 for m in self.messages if done(m)) < count:
            if time.monotonic() > end:
                raise AssertionError(
                    f"fewer than {count} terminal workload events; got {self.workloads()}"
                )
            self.pump(0.2)
        return self.workloads()

    def close(self) -> None:
        for sock in (self.conn, self.listener):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass


class Host:
    def __init__(self, key: str, namespace: str, workdir: str) -> None:
        self.key = key
        self.engine_id, legs = LAYOUT[key]
        self.name = self.engine_id
        self.uuid = str(uuid.uuid4())  # hostUuid: the routing id
        # clusterUuid: the principal that names the certificate and selects the pin. A
        # different value from the routing id, so pins keyed by the wrong one fail the tests.
        self.principal = str(uuid.uuid4())
        self.namespace = namespace
        self.legs = legs
        self.addresses = [address for _, address in legs]
        self.cluster_dir = os.path.join(workdir, f"cluster-{key}")
        self.workdir = workdir
        self.cert, self.key_pem = make_certificate(self.principal)
        self.port = FACADE_PORT  # what the others are told (the relay's port when delayed)
        self._broker: ScriptedBroker | None = None
        self.engine: subprocess.Popen | None = None
        self.proxy: subprocess.Popen | None = None

    @property
    def broker(self) -> ScriptedBroker:
        """The scripted broker this host's proxy talks to (the topology sets it as it starts)."""
        assert self._broker is not None, "the topology has not started"
        return self._broker

    @property
    def ip(self) -> str:
        return self.addresses[0]

    def published_ips(self) -> list[str]:
        """C is published second-leg first: its first address is the one a test can cut."""
        return list(reversed(self.addresses)) if self.key == "c" else list(self.addresses)

    def pin_path(self, peer: "Host") -> str:
        return os.path.join(self.cluster_dir, "trusted", f"{peer.principal}.json")

    def file(self, name: str) -> str:
        return os.path.join(self.workdir, f"{self.key}-{name}")


class Topology:
    """Build with ``start()``; always ``close()`` (tests: ``addCleanup(topology.close)``)."""

    def __init__(
        self,
        *,
        delay_host: str | None = None,
        delay: float = 0.1,
        header_timeout: str = "2",
        tokens: int = 6,
        token_delay: float = 0.02,
        keepalive: str | None = None,
        log=None,
    ) -> None:
        self.run_id = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.workdir = tempfile.mkdtemp(prefix=f"{self.run_id}-")
        self.switch = f"{self.run_id}-sw"
        self.hosts = {key: Host(key, f"{self.run_id}-{key}", self.workdir) for key in LAYOUT}
        self.delay_host, self.delay = delay_host, delay
        self.delay_mode = ""
        self.header_timeout = header_timeout
        self.keepalive = keepalive  # --upstream-keepalive, when not the default
        self.tokens, self.token_delay = tokens, token_delay
        self.namespaces: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self.log = log or (lambda text: None)
        self.closed = False

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> "Topology":
        try:
            remove_leftovers()
            self._build_network()
            self._write_cluster_dirs()
            self._start_processes()
            self._drive_brokers()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for host in self.hosts.values():
            if host._broker is not None:
                host._broker.close()
        for proc in self.processes:
            self._kill(proc)
        for namespace in reversed(self.namespaces):
            _delete_namespace(namespace)
        shutil.rmtree(self.workdir, ignore_errors=True)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> "Topology":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- network --------------------------------------------------------------------------

    def ip(self, namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "-n", namespace, *args, check=check)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        self.ip(name, "link", "set", "lo", "up")

    def _build_network(self) -> None:
        self._add_namespace(self.switch)
        for name in ("br0", "br1"):
            self.ip(self.switch, "link", "add", name, "type", "bridge")
            self.ip(self.switch, "link", "set", name, "up")
        for host in self.hosts.values():
            self._add_namespace(host.namespace)
            for index, (bridge, address) in enumerate(host.legs):
                outer, inner = self.veth(host, bridge), f"eth{index}"
                self.ip(
                    self.switch,
                    "link",
                    "add",
                    outer,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    inner,
                    "netns",
                    host.namespace,
                )
                self.ip(self.switch, "link", "set", outer, "master", f"br{bridge}", "up")
                self.ip(host.namespace, "addr", "add", f"{address}/24", "dev", inner)
                self.ip(host.namespace, "link", "set", inner, "up")
                # An unanswered ARP gives up after 0.5 s (default 3 s): a dead first address
                # costs half a second, not three.
                self._sysctl(host, f"net/ipv4/neigh/{inner}/mcast_solicit", "2")
                self._sysctl(host, f"net/ipv4/neigh/{inner}/retrans_time_ms", "250")
        if self.delay_host:
            self._delay(self.hosts[self.delay_host])

    def _sysctl(self, host: Host, key: str, value: str) -> None:
        _run(
            "ip",
            "netns",
            "exec",
            host.namespace,
            "sh",
            "-c",
            f"echo {value} > /proc/sys/{key}",
            check=False,
        )

    def veth(self, host: Host, bridge: int = 0) -> str:
        """The switch-side end of a host's leg on ``br<bridge>``."""
        return f"v{host.key}{bridge}"

    def cut(self, key: str, bridge: int = 0) -> None:
        """``ip link set ... down`` on the host's veth: its leg on that bridge goes dark."""
        self.ip(self.switch, "link", "set", self.veth(self.hosts[key], bridge), "down")

    def restore(self, key: str, bridge: int = 0) -> None:
        self.ip(self.switch, "link", "set", self.veth(self.hosts[key], bridge), "up")

    def _delay(self, host: Host) -> None:
        """netem on both ends of every leg of the host (a multi-homed host is reached on
        either), else a user-space relay."""
        ms = f"{int(self.delay * 1000)}ms"
        netem = (
            _run(
                "tc",
                "-n",
                host.namespace,
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "netem",
                "delay",
                ms,
                check=False,
            )
            if shutil.which("tc")
            else None
        )
        if netem is not None and netem.returncode == 0:
            for index, (bridge, _) in enumerate(host.legs):
                if index:
                    _run(
                        "tc",
                        "-n",
                        host.namespace,
                        "qdisc",
                        "add",
                        "dev",
                        f"eth{index}",
                        "root",
                        "netem",
                        "delay",
                        ms,
                    )
                _run(
                    "tc",
                    "-n",
                    self.switch,
                    "qdisc",
                    "add",
                    "dev",
                    self.veth(host, bridge),
                    "root",
                    "netem",
                    "delay",
                    ms,
                )
            self.delay_mode = "netem"
        else:
            self.delay_mode = "relay"  # started with the processes, published on RELAY_PORT
            host.port = RELAY_PORT

    def flush_neighbours(self, key: str) -> None:
        self.ip(self.hosts[key].namespace, "neigh", "flush", "all", check=False)

    def neighbour(self, key: str, address: str) -> str:
        return self.ip(
            self.hosts[key].namespace, "neigh", "show", address, check=False
        ).stdout.strip()

    def kill_connections(self, key: str, address: str) -> str:
        """``ss -K``: end the host's TCP sockets to ``address`` (what a keepalive would do)."""
        return _run(
            "ip",
            "netns",
            "exec",
            self.hosts[key].namespace,
            "ss",
            "-K",
            "-t",
            "dst",
            address,
            check=False,
        ).stdout

    # -- cluster directories -----------------------------------------------------------------

    def _write_cluster_dirs(self) -> None:
        for host in self.hosts.values():
            write_identity(host.cluster_dir, host.cert, host.key_pem)
            write_admission(host.cluster_dir, cluster_id=self.run_id)
            for peer in self.hosts.values():
                if peer is not host:
                    write_pin(host.cluster_dir, peer.principal, peer.cert)

    def unpin(self, holder: str, peer: str) -> None:
        os.unlink(self.hosts[holder].pin_path(self.hosts[peer]))

    # -- processes --------------------------------------------------------------------------

    def spawn(
        self, key: str, argv: list[str], *, log_name: str | None = None, stdout=subprocess.PIPE
    ) -> subprocess.Popen:
        host = self.hosts[key]
        log = open(host.file(log_name), "ab") if log_name else None
        err = subprocess.DEVNULL if log is None else log
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace] + argv,
                stdin=subprocess.DEVNULL,
                stdout=err if stdout is None else stdout,
                stderr=err,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                cwd=self.workdir,
            )
        finally:
            if log is not None:
                log.close()
        self.processes.append(proc)
        return proc

    def _start_processes(self) -> None:
        for host in self.hosts.values():
            fleet = host.file("fleet.toml")
            with open(fleet, "w") as handle:
                handle.write(
                    f'[[node]]\nid = "{host.engine_id}"\ndialect = "ollama"\n'
                    f"port = {ENGINE_PORT}\nmodels = [{json.dumps(MODEL)}]\n"
                    f"tokens = {self.tokens}\ntoken_delay = {self.token_delay}\n"
                )
            host.engine = self.spawn(
                host.key,
                [sys.executable, "-m", "nvpair_proxy.testing.simfleet", fleet],
                log_name="engine.log",
            )
            host._broker = ScriptedBroker(host.file("broker.sock"))
            host.proxy = self.spawn(
                host.key,
                TWISTD
                + [
                    "-n",
                    "--pidfile=",
                    "nvpair-proxy",
                    "--ipc",
                    host.broker.path,
                    "--cluster-dir",
                    host.cluster_dir,
                    "--state-dir",
                    host.file("state"),
                    "--response-header-timeout",
                    self.header_timeout,
                    "--log-level",
                    "debug",
                    *(["--upstream-keepalive", self.keepalive] if self.keepalive else []),
                ],
                log_name="proxy.log",
                stdout=None,
            )
        if self.delay_mode == "relay":
            assert self.delay_host is not None
            host = self.hosts[self.delay_host]
            relay = self.spawn(
                host.key,
                [
                    sys.executable,
                    TOOLS,
                    "relay",
                    json.dumps(
                        {
                            "host": "0.0.0.0",
                            "port": RELAY_PORT,
                            "target_host": "127.0.0.1",
                            "target_port": FACADE_PORT,
                            "delay": self.delay,
                        }
                    ),
                ],
                log_name="relay.log",
            )
            self._expect_line(relay, '{"event": "ready"}', "relay")
        for host in self.hosts.values():
            assert host.engine is not None
            self._expect_line(host.engine, "simfleet ready:", f"{host.name} engine")

    def _expect_line(self, proc: subprocess.Popen, start: str, what: str) -> str:
        assert proc.stdout is not None
        line = LineReader(proc.stdout).read_line(DEADLINE)
        if not line.startswith(start):
            raise RuntimeError(f"{what} did not start: {line!r}")
        return line

    def directory_node(self, host: Host, viewer: Host) -> dict:
        port = FACADE_PORT if host is viewer else host.port
        ips = host.published_ips()
        return {
            "hostUuid": host.uuid,
            "name": host.name,
            "ip": ips[0],
            "ips": ips,
            "clusterUuid": host.principal,
            "trusted": True,
            "services": {"ol": {"port": port}},
            "models": [MODEL],
            "modelsByEngine": {"ollama": [MODEL]},
            "lastSeen": int(time.time()),
        }

    def snapshot(self, viewer: str, hosts: list[str] | None = None) -> None:
        """``ollama:discovery:nodes`` to ``viewer``'s proxy naming ``hosts`` (default: all)."""
        me = self.hosts[viewer]
        nodes = [self.directory_node(self.hosts[k], me) for k in (hosts or list(self.hosts))]
        me.broker.send("ollama:discovery:nodes", {"nodes": nodes}, request=False)

    def _drive_brokers(self) -> None:
        for host in self.hosts.values():
            try:
                host.broker.accept()
            except socket.timeout:
                raise RuntimeError(
                    f"{host.name} proxy never connected to its broker; "
                    f"log: {self.tail(host.key, 'proxy.log')}"
                ) from None
        for host in self.hosts.values():
            result = host.broker.call(
                "facade/enable",
                {"engine": "ollama", "port": FACADE_PORT, "ignorePersistedPort": True},
            )
            assert result["port"] == FACADE_PORT, result
            host.broker.call(
                "ollama:node/set-local-backend",
                {"engine": "ollama", "host": "127.0.0.1", "port": ENGINE_PORT, "healthy": True},
            )
            self.snapshot(host.key)
        for host in self.hosts.values():
            self.wait_owners(host.key, {h.uuid for h in self.hosts.values()})

    # -- what a test asks ---------------------------------------------------------------------

    def owners(self, key: str) -> list[str]:
        return self.hosts[key].broker.call("ollama:node/model-owners", {"model": MODEL})["nodes"]

    def wait_owners(self, key: str, expected: set[str], timeout: float = 10.0) -> float:
        """Ask ``node/model-owners`` until it is ``expected``; the seconds it took.

        A pin's removal changes the owners without a message (the trust watch reads the
        folder), so this asks again, each time after reading the link for up to 50 ms."""
        start = time.monotonic()
        broker = self.hosts[key].broker
        while True:
            got = set(self.owners(key))
            if got == expected:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"{key}: owners {got}, want {expected}")
            broker.pump(0.05)

    def set_priority(self, key: str, order: list[str], generation: int = 1) -> None:
        self.hosts[key].broker.call(
            "node/set-priority",
            {"generation": generation, "nodes": [self.hosts[k].uuid for k in order]},
        )

    def client(self, key: str, requests: list[dict]) -> "Client":
        """Start ``requests`` at once from inside host ``key``'s namespace."""
        proc = self.spawn(
            key,
            [sys.executable, TOOLS, "request", json.dumps({"requests": requests})],
            log_name="client.log",
        )
        return Client(proc)

    def chat(
        self,
        key: str = "a",
        *,
        count: int = 1,
        host: str = "127.0.0.1",
        port: int = FACADE_PORT,
        tls: dict | None = None,
        path: str = "/api/chat",
        body: dict | None = None,
        timeout: float = 30,
    ) -> "Client":
        body = body or {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
        }
        spec = {
            "method": "POST",
            "host": host,
            "port": port,
            "path": path,
            "body": json.dumps(body),
            "timeout": timeout,
        }
        if tls:
            spec["tls"] = tls
        return self.client(key, [dict(spec) for _ in range(count)])

    def tls_as(
        self,
        key: str,
        peer: str | None = None,
        cert_pem: bytes | None = None,
        key_pem: bytes | None = None,
    ) -> dict:
        """Client TLS settings: ``key``'s node certificate (or the given one), pinning
        ``peer``'s certificate when named."""
        host = self.hosts[key]
        cert_pem, key_pem = cert_pem or host.cert, key_pem or host.key_pem
        name = hashlib.sha256(cert_pem).hexdigest()[:8]
        cert_path, key_path = host.file(f"{name}.crt"), host.file(f"{name}.key")
        for path, data in ((cert_path, cert_pem), (key_path, key_pem)):
            with open(path, "wb") as handle:
                handle.write(data)
        tls = {"cert": cert_path, "key": key_path}
        if peer:
            tls["pin_sha256"] = fingerprint(self.hosts[peer].cert)
        return tls

    def engine_admin(self, key: str, path: str, body: dict | None = None) -> dict:
        """``/_sim/fault`` or ``/_sim/state`` of the host's engine, asked inside its namespace."""
        spec = {
            "method": "POST" if body is not None else "GET",
            "host": "127.0.0.1",
            "port": ENGINE_PORT,
            "path": path,
            "body": json.dumps(body) if body else "",
            "timeout": 10,
        }
        result = self.client(key, [spec]).result()[0]
        if result["status"] != 200:
            raise AssertionError(f"{path} on {key}: {result}")
        return json.loads(result["body"])

    def fault(self, key: str, **changes) -> None:
        self.engine_admin(key, "/_sim/fault", changes)

    def served(self, key: str) -> int:
        return self.engine_admin(key, "/_sim/state")["served_count"]

    def tail(self, key: str, name: str, lines: int = 30) -> str:
        try:
            with open(self.hosts[key].file(name), errors="replace") as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return ""


class Client:
    """A request helper running in a namespace: wait for its first body byte, then its end."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        assert proc.stdout is not None
        self.reader = LineReader(proc.stdout)
        self.started = time.monotonic()

    def _next(self, timeout: float) -> dict:
        line = self.reader.read_line(timeout)
        if not line:
            raise AssertionError(f"client said nothing within {timeout}s")
        return json.loads(line)

    def wait_body(self, timeout: float = DEADLINE) -> float:
        """Seconds until the first body byte reached the client."""
        event = self._next(timeout)
        if event.get("event") != "body":
            raise AssertionError(f"client ended before any body: {event}")
        return time.monotonic() - self.started

    def result(self, timeout: float = DEADLINE) -> list[dict]:
        while True:
            event = self._next(timeout)
            if event.get("event") == "done":
                self.proc.wait(timeout=5)
                return event["results"]
