"""The command line of ``twistd nvpair-proxy`` (docs/references.md#command-line).

Every bad value stops start-up with one line naming the flag, never a usage dump: under
systemd the journal shows the last line, and it must say what to fix. What the process runs
with is :class:`Config`, built from the flags, the environment and the defaults once; the
options themselves keep what was typed.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Callable, Mapping, TypeVar

import attrs
from twisted.python import usage

from .. import __version__
from ..core import constants
from ..core.logs import LEVELS, LOG_FORMATS
from ..core.validate import ip_of, parse_port, split_host_port
from ..nodes.engines import Engine, EngineFileError, load_engines

DEFAULT_STATE_DIR = os.path.join("~", ".config", "Nvidia Corporation", "Personal AI Router")

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``1.5``, or a Go duration (``90s``, ``30m``, ``1h30m``)."""
    text = text.strip()
    if not re.fullmatch(r"\d+(\.\d+)?", text) and not _DURATION.match(text):
        raise ValueError(f"not a duration: {text!r} (use seconds or e.g. 90s, 30m, 1h30m)")
    try:
        value = float(text)
    except ValueError:
        pos, total = 0, 0.0
        for match in _DURATION.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNIT[match.group(2)]
            pos = match.end()
        if pos != len(text) or not text:
            raise ValueError(f"not a duration: {text!r} (use seconds or e.g. 90s, 30m, 1h30m)")
        return total
    if value < 0 or value != value or value == float("inf"):
        raise ValueError(f"not a duration: {text!r} (use seconds or e.g. 90s, 30m, 1h30m)")
    return value


def admin_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6, ``localhost`` for 127.0.0.1); raises ValueError
    with the one line start-up stops with."""
    try:
        host, port = split_host_port(text, zero=True)
    except ValueError:
        raise ValueError(f"--admin: want HOST:PORT, e.g. 127.0.0.1:9464 (got {text!r})") from None
    assert port is not None  # the port is required here
    if host == "localhost":
        host = "127.0.0.1"
    address = ip_of(host)
    if address is None or not address.is_loopback:  # validate.is_loopback, parsed once
        raise ValueError(
            f"--admin: {host} is not a loopback address; the admin listener "
            f"serves this machine only (use 127.0.0.1 or ::1)"
        )
    return str(address), port


def parse_within_an_hour(text: str) -> float:
    """A duration of at most an hour: a keepalive period (0 turns keepalive off), a drain
    timeout (0 stops at once)."""
    value = parse_duration(text)
    if value > 3600:
        raise ValueError(f"at most 1h (got {text.strip()!r})")
    return value


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_T = TypeVar("_T")


@attrs.frozen
class Config:
    """The process's configuration: every flag parsed and every default applied, once.

    Built by :class:`Options` after its checks, so a value here is always valid; the wiring
    reads only this, never the options' raw strings.
    """

    #: The built-in engines plus any ``--engines-dir`` files, by id.
    engines: Mapping[str, Engine]
    log_level: str
    log_format: str
    access_log: bool
    #: Seconds: the header and first-content cap (0 disables both).
    response_timeout: float
    #: Seconds a committed upstream may be silent (0: never closed for it).
    stream_idle: float
    #: Seconds of idle before TCP keepalive probes (0: off).
    upstream_keepalive: float
    state_dir: str
    #: The admin listener's loopback (host, port), or None.
    admin: tuple[str, int] | None = None
    #: ``--engine``: (engine id, port) per standalone facade; empty in broker mode.
    facades: tuple[tuple[str, int], ...] = ()
    nodes: str | None = None
    cluster_dir: str | None = None
    ipc: str | None = None
    #: LAN keys given in the environment, checked when read (see ``apikeys``).
    api_keys: str | None = None
    api_keys_file: str = ""
    allowed_cidrs: tuple[Network, ...] = ()
    #: Standalone late binding: requests wait in the facade's queue (at most ``queue_depth``)
    #: when every owner is full; False sends them to the engines as before.
    late_binding: bool = True
    queue_depth: int = constants.QUEUE_DEPTH
    #: Affinity: on by default in standalone mode (``--no-affinity``), opt-in under the
    #: broker (``--affinity``), where it only breaks the chooser's ties.
    affinity: bool = False
    #: Affinity: a spilled conversation stays bound to its node before (``keep``) or moves
    #: to the node it spilled to (``move``, the default).
    affinity_spill: str = "move"
    #: Seconds a SIGTERM lets admitted requests finish (0: cancel them at once, as the broker
    #: protocol has it; docs/operations.md#restarts).
    drain_timeout: float = 0.0
    #: Answers carry ``X-NVPAIR-Placement`` (``--placement-header``; node ids may be private).
    placement_header: bool = False

    @property
    def standalone(self) -> bool:
        return bool(self.facades)


class Options(usage.Options):
    synopsis = (
        "[--ipc PATH] [--cluster-dir DIR] [--log-level LEVEL] "
        "[--response-header-timeout DURATION] [--stream-idle-timeout DURATION] "
        "[--upstream-keepalive DURATION] "
        "[--state-dir DIR] [--api-keys-file FILE] [--allowed-cidrs LIST] "
        "[--admin HOST:PORT] [--log-format text|json] [--access-log] [--version] "
        "[--engine ENGINE[:PORT]]... [--nodes FILE] [--engines-dir DIR] "
        "[--queue-depth N] [--no-late-binding] [--no-affinity] [--affinity] "
        "[--affinity-spill move|keep] [--drain-timeout DURATION] [--placement-header]"
    )
    longdesc = (
        "Broker mode (default): JSON-RPC on stdin/stdout or --ipc. Standalone mode: any "
        "--engine; the fleet comes from --nodes, else this machine's engine."
    )

    optParameters = [
        ["ipc", None, None, "Unix socket of the broker to connect to (default: stdin/stdout)."],
        ["cluster-dir", None, None, "Cluster directory (node identity, pins) for mTLS."],
        [
            "log-level",
            None,
            None,
            "debug, info, warn or error (default $NVPAIR_LOG_LEVEL, else info).",
        ],
        [
            "response-header-timeout",
            None,
            None,
            "Header and first-content cap: seconds or 30m-style (default "
            "$NVPAIR_PROXY_RESPONSE_HEADER_TIMEOUT, else 30m; 0 disables both).",
        ],
        [
            "stream-idle-timeout",
            None,
            None,
            "After commit, close an upstream silent this long: seconds or 30m-style (default "
            "$NVPAIR_PROXY_STREAM_IDLE_TIMEOUT, else 0: off, the spec's behaviour).",
        ],
        [
            "upstream-keepalive",
            None,
            None,
            "TCP keepalive toward engines and peers: probe after this long idle, then as often; "
            "4 unanswered end the connection (default $NVPAIR_PROXY_UPSTREAM_KEEPALIVE, else "
            "15s; 0 disables).",
        ],
        [
            "state-dir",
            None,
            None,
            "Where persisted ports live (default $STATE_DIRECTORY, else "
            "~/.config/Nvidia Corporation/Personal AI Router).",
        ],
        ["nodes", None, None, "Standalone fleet: a TOML nodes file, reloaded on change."],
        ["engines-dir", None, None, "Extra directory of engine files (*.toml)."],
        [
            "api-keys-file",
            None,
            None,
            "LAN API keys, one per line, mode 600 (default "
            "$NVPAIR_PROXY_API_KEYS_FILE, else <state-dir>/proxy-api-keys).",
        ],
        [
            "allowed-cidrs",
            None,
            None,
            "LAN sources allowed to present a key, comma-separated "
            "(default $NVPAIR_PROXY_ALLOWED_CIDRS, else any).",
        ],
        [
            "admin",
            None,
            None,
            "Admin listener HOST:PORT, loopback only: /metrics, /status, "
            "/healthz and the status page at /.",
        ],
        ["log-format", None, "text", "text, or json: one JSON object per line."],
        [
            "queue-depth",
            None,
            str(constants.QUEUE_DEPTH),
            "Standalone: requests one facade keeps waiting for a free slot; one more gets the "
            "busy 503.",
        ],
        [
            "drain-timeout",
            None,
            None,
            "On SIGTERM stop accepting and let admitted requests finish for at most this long, "
            f"then cancel the rest (default {constants.DRAIN_TIMEOUT:g}s standalone; 0 in broker "
            "mode, where the broker's shutdown always cancels at once; 0 stops at once).",
        ],
        [
            "affinity-spill",
            None,
            "move",
            "Standalone: where a conversation that spilled to another node is bound after: "
            "move (to that node) or keep (its node before, so short congestion does not "
            "migrate it).",
        ],
    ]
    optFlags = [
        [
            "access-log",
            None,
            "Log one line per HTTP request (method, path without query, "
            "status, size; never bodies).",
        ],
        [
            "placement-header",
            None,
            "Answers say why they went where they did: X-NVPAIR-Placement: <reason>; "
            "node=<id>; waited=<ms> (off by default: node ids may be private).",
        ],
        [
            "no-late-binding",
            None,
            "Standalone: send a request to an engine even when every "
            "owner is full, instead of waiting in the proxy for a slot.",
        ],
        [
            "no-affinity",
            None,
            "Standalone: place a conversation's next turn like any other "
            "request, not on the node that holds its cache.",
        ],
        [
            "affinity",
            None,
            "Broker mode: among candidates equally loaded, prefer the node that "
            "holds the conversation's cache.",
        ],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["engine"] = []

    def opt_version(self) -> None:
        """Print the nvpair-proxy version and exit."""
        print(f"nvpair-proxy {__version__}")
        raise SystemExit(0)

    def opt_engine(self, value: str) -> None:
        """Standalone facade ENGINE[:PORT] (repeatable); port 0 or omitted: the standalone port."""
        self["engine"].append(value)

    #: What the process runs with; set once the options parsed.
    config: Config

    def postOptions(self) -> None:
        try:
            self.config = self._config()
        except ValueError as exc:
            raise SystemExit(f"nvpair-proxy: {exc}") from None

    def _config(self) -> Config:
        try:
            self.engines = load_engines([self["engines-dir"]] if self["engines-dir"] else [])
        except (EngineFileError, OSError) as exc:
            raise ValueError(f"--engines-dir: {exc}") from None
        level, source = self["log-level"], "--log-level"
        if level is None:
            level, source = os.environ.get("NVPAIR_LOG_LEVEL") or "info", "NVPAIR_LOG_LEVEL"
        if level not in LEVELS:
            raise ValueError(f"{source} must be one of {', '.join(LEVELS)} (got {level!r})")
        response_timeout = self._parsed(
            "response-header-timeout",
            "NVPAIR_PROXY_RESPONSE_HEADER_TIMEOUT",
            str(constants.DEFAULT_RESPONSE_TIMEOUT),
            parse_duration,
        )
        stream_idle = self._parsed(
            "stream-idle-timeout", "NVPAIR_PROXY_STREAM_IDLE_TIMEOUT", "0", parse_duration
        )
        keepalive = self._parsed(
            "upstream-keepalive",
            "NVPAIR_PROXY_UPSTREAM_KEEPALIVE",
            str(constants.UPSTREAM_KEEPALIVE),
            parse_within_an_hour,
        )
        admin = None if self["admin"] is None else admin_address(self["admin"])
        if self["log-format"] not in LOG_FORMATS:
            raise ValueError(f"--log-format must be text or json (got {self['log-format']!r})")
        state_dir = os.path.expanduser(
            self["state-dir"] or os.environ.get("STATE_DIRECTORY") or DEFAULT_STATE_DIR
        )
        facades = self._facades()
        if self["nodes"] is not None and not facades:
            raise ValueError("--nodes needs at least one --engine (standalone mode)")
        if self["nodes"] is not None and not os.path.isfile(self["nodes"]):
            raise ValueError(f"--nodes: no such file: {self['nodes']}")
        if self["cluster-dir"] is not None and not os.path.isdir(self["cluster-dir"]):
            raise ValueError(f"--cluster-dir: no such directory: {self['cluster-dir']}")
        if self["ipc"] is not None and facades:
            raise ValueError("--ipc is for broker mode; it cannot be combined with --engine")
        api_keys, api_keys_file, allowed_cidrs = self._lan_keys(state_dir)
        depth = str(self["queue-depth"]).strip()
        if not depth.isdigit() or int(depth) < 1:
            raise ValueError(
                f"--queue-depth must be a whole number of at least 1 (got {self['queue-depth']!r})"
            )
        queue_depth = int(depth)
        if facades and self["affinity"]:
            raise ValueError(
                "--affinity is for broker mode (standalone mode has it on; "
                "--no-affinity turns it off)"
            )
        if not facades and self["no-affinity"]:
            raise ValueError(
                "--no-affinity is for standalone mode (broker mode has it off; "
                "--affinity turns it on)"
            )
        affinity = bool(self["affinity"]) if not facades else not self["no-affinity"]
        spill = str(self["affinity-spill"]).strip()
        if spill not in ("move", "keep"):
            raise ValueError(f"--affinity-spill must be move or keep (got {spill!r})")
        drain_timeout = self._parsed(
            "drain-timeout",
            "NVPAIR_PROXY_DRAIN_TIMEOUT",
            str(constants.DRAIN_TIMEOUT) if facades else "0",
            parse_within_an_hour,
        )
        return Config(
            engines=self.engines,
            log_level=level,
            log_format=self["log-format"],
            access_log=bool(self["access-log"]),
            response_timeout=response_timeout,
            stream_idle=stream_idle,
            upstream_keepalive=keepalive,
            state_dir=state_dir,
            admin=admin,
            facades=tuple(facades),
            nodes=self["nodes"],
            cluster_dir=self["cluster-dir"],
            ipc=self["ipc"],
            api_keys=api_keys,
            api_keys_file=api_keys_file,
            allowed_cidrs=allowed_cidrs,
            late_binding=not self["no-late-binding"],
            queue_depth=queue_depth,
            affinity=affinity,
            affinity_spill=spill,
            drain_timeout=drain_timeout,
            placement_header=bool(self["placement-header"]),
        )

    def _lan_keys(self, state_dir: str) -> tuple[str | None, str, tuple[Network, ...]]:
        """Opt-in LAN keys: the environment's keys, the keys file and the allowed
        sources. The keys themselves are checked when read, so a bad one turns the gate off
        (logged) rather than stopping start-up."""
        from ..lan.apikeys import KEYS_FILE_NAME, parse_cidrs

        path = (
            self["api-keys-file"]
            or os.environ.get("NVPAIR_PROXY_API_KEYS_FILE")
            or os.path.join(state_dir, KEYS_FILE_NAME)
        )
        allowed = self._parsed("allowed-cidrs", "NVPAIR_PROXY_ALLOWED_CIDRS", "", parse_cidrs)
        return os.environ.get("NVPAIR_PROXY_API_KEYS") or None, path, tuple(allowed)

    def _parsed(self, name: str, variable: str, default: str, parse: Callable[[str], _T]) -> _T:
        """The flag's value, else the environment's (set but empty counts as unset), else
        ``default``, parsed; a bad value stops start-up with one line naming its source."""
        raw, source = self[name], f"--{name}"
        if raw is None:
            raw, source = os.environ.get(variable) or default, variable
        try:
            return parse(raw)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    def _facades(self) -> list[tuple[str, int]]:
        facades: list[tuple[str, int]] = []
        for spec in self["engine"]:
            engine_id, colon, port_text = spec.partition(":")
            engine = self.engines.get(engine_id)
            if engine is None:
                raise ValueError(
                    f"--engine: unknown engine {engine_id!r}; want one of "
                    f"{', '.join(sorted(self.engines))}"
                )
            port = engine.ports.standalone
            if colon:
                try:
                    port = parse_port(port_text, zero=True) or engine.ports.standalone
                except ValueError:
                    raise ValueError(f"--engine {spec}: port must be between 1 and 65535") from None
            if any(engine_id == seen for seen, _ in facades):
                raise ValueError(f"--engine: {engine_id} is given twice")
            facades.append((engine_id, port))
        return facades
