"""The standalone fleet: a TOML nodes file, re-read when it changes (docs/references.md#nodes-file).

An engine entry may reach its engine over https, with a client certificate or a key
(``engineaccess.py``); the files it names are read with the nodes file.

A reload that fails keeps the last good snapshot and logs why: an operator mid-edit must not
take the fleet down. At start-up a bad file is fatal instead, with one clear line.
"""

from __future__ import annotations

import os
import tomllib
from typing import Callable, Mapping

import attrs
from twisted.application.internet import TimerService
from twisted.internet.interfaces import IReactorTime

from ..core import constants
from ..core.files import FileWatch, Stamps, read_regular_file
from ..core.logs import logger
from ..core.validate import is_int, is_port
from ..nodes.discovery import Node, make_node
from ..nodes.engines import Engine
from .engineaccess import (
    ACCESS_FIELDS,
    TLS_FILE_FIELDS,
    AccessError,
    EngineAccess,
    EngineTLS,
    access_from,
    resolve_path,
)

log = logger()


class NodesFileError(ValueError):
    """The nodes file cannot be read or has a bad field; the text names the file and field."""


@attrs.frozen
class ConfiguredNodes:
    """Standalone mode's nodes as configured (a nodes file, or this machine's engine): per
    engine id its nodes, and the (engine, node) ids whose inventory must be probed.

    A value read once per load; the routers are given its nodes (``Standalone.apply``).
    """

    nodes: Mapping[str, tuple[Node, ...]]
    probed: frozenset[tuple[str, str]] = frozenset()


def parse_nodes(text: str, engines: Mapping[str, Engine], source: str) -> ConfiguredNodes:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise NodesFileError(f"{source}: not valid TOML: {exc}") from None
    unknown = set(data) - {"node"}
    if unknown:
        raise NodesFileError(f"{source}: unknown table {sorted(unknown)[0]!r} (expected [[node]])")
    raw_nodes = data.get("node", [])
    if not isinstance(raw_nodes, list):
        raise NodesFileError(f"{source}: 'node' must be an array of tables ([[node]])")
    nodes: dict[str, list[Node]] = {engine_id: [] for engine_id in engines}
    probed = set()
    seen = set()
    for index, raw in enumerate(raw_nodes):
        where = f"{source}: node[{index}]"
        if not isinstance(raw, dict):
            raise NodesFileError(f"{where}: must be a table")
        for key in raw:
            if key not in ("id", "name", "address", "addresses", "engines"):
                raise NodesFileError(f"{where}: unknown field {key!r}")
        node_id = raw.get("id")
        if not isinstance(node_id, str) or not node_id:
            raise NodesFileError(f"{where}: field 'id' must be a non-empty string")
        if node_id in seen:
            raise NodesFileError(f"{where}: node id {node_id!r} appears twice")
        seen.add(node_id)
        where = f"{source}: node {node_id!r}"
        addresses = raw.get("addresses", [raw["address"]] if "address" in raw else None)
        if (
            not isinstance(addresses, list)
            or not addresses
            or not all(isinstance(a, str) and a for a in addresses)
        ):
            raise NodesFileError(f"{where}: needs 'address' (a string) or 'addresses' (a list)")
        name = raw.get("name", node_id)
        if not isinstance(name, str):
            raise NodesFileError(f"{where}: field 'name' must be a string")
        node_engines = raw.get("engines")
        if not isinstance(node_engines, dict) or not node_engines:
            raise NodesFileError(f"{where}: needs at least one [node.engines.<engine>] table")
        for engine_id, spec in node_engines.items():
            engine = engines.get(engine_id)
            if engine is None:
                raise NodesFileError(
                    f"{where}: unknown engine {engine_id!r}; want one of "
                    f"{', '.join(sorted(engines))}"
                )
            ewhere = f"{where}: engines.{engine_id}"
            if not isinstance(spec, dict):
                raise NodesFileError(f"{ewhere}: must be a table")
            for key in spec:
                if key not in ("port", "models", "slots") + ACCESS_FIELDS:
                    raise NodesFileError(f"{ewhere}: unknown field {key!r}")
            try:
                scheme, access = access_from(spec, os.path.dirname(source))
            except AccessError as exc:
                raise NodesFileError(f"{ewhere}: {exc}") from None
            port = spec.get("port", engine.ports.own)
            if not is_port(port):
                raise NodesFileError(f"{ewhere}: field 'port' must be 1-65535 (got {port!r})")
            models = spec.get("models")
            if models is not None and (
                not isinstance(models, list) or not all(isinstance(m, str) for m in models)
            ):
                raise NodesFileError(f"{ewhere}: field 'models' must be a list of strings")
            if models is None:
                probed.add((engine_id, node_id))
            slots = spec.get("slots")
            if slots is not None and (not is_int(slots) or slots < 1):
                raise NodesFileError(
                    f"{ewhere}: field 'slots' must be a whole number of at least 1 (got {slots!r})"
                )
            nodes[engine_id].append(
                make_node(
                    engine,
                    id=node_id,
                    name=name,
                    port=port,
                    addresses=addresses,
                    models=models,
                    source="standalone",
                    scheme=scheme,
                    access=access,
                    slots=slots,
                )
            )
    return ConfiguredNodes({k: tuple(v) for k, v in nodes.items()}, frozenset(probed))


def load_nodes_file(path: str, engines: Mapping[str, Engine]) -> ConfiguredNodes:
    try:
        text = read_regular_file(path).decode("utf-8")
    except OSError as exc:
        raise NodesFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise NodesFileError(f"{path}: not UTF-8 text") from None
    return parse_nodes(text, engines, path)


class NodesFileWatcher(TimerService):
    """Checks the file every 2 s and applies a changed, valid file
    (docs/references.md#probe-periods).

    The TLS files its nodes name (``ca_file``, ``cert_file``, ``key_file``) are watched with
    it: a rotated CA or client certificate reloads the file, and the changed material is a
    new TLS configuration, so no connection made with the old one is reused.

    A TimerService, so the watch runs exactly while the standalone tree does.
    """

    def __init__(
        self,
        path: str,
        engines: Mapping[str, Engine],
        clock: IReactorTime,
        apply: Callable[[ConfiguredNodes], None],
        interval: float = constants.NODES_FILE_CHECK_INTERVAL,
    ) -> None:
        super().__init__(interval, self.check)
        self.path, self.engines, self.clock, self.apply = path, engines, clock, apply
        self._tls_files: tuple[str, ...] = ()
        self._watch = FileWatch(lambda: (self.path, *self._tls_files))

    def load(self) -> ConfiguredNodes:
        """The first load: errors propagate, because a bad file must stop start-up."""
        configured = self._read()
        self.apply(configured)
        return configured

    def check(self) -> None:
        before = self._watch.changed()
        if before is None:
            return
        try:
            configured = self._read(before)
        except (NodesFileError, ValueError, TypeError) as exc:
            log.warn("nodes file not reloaded, keeping the last good one: {why}", why=str(exc))
            return
        log.info("nodes file reloaded: {path}", path=self.path)
        self.apply(configured)

    def _read(self, before: Stamps | None = None) -> ConfiguredNodes:
        """Load the file, watching it and the TLS files it names (see ``FileWatch.read``).

        When the load fails, the TLS files the file names are watched all the same: a nodes
        file that names a CA file not yet in place is loaded once that file arrives, without
        another edit.
        """
        return self._watch.read(before, self._load)

    def _load(self) -> ConfiguredNodes:
        try:
            configured = load_nodes_file(self.path, self.engines)
        except (NodesFileError, ValueError, TypeError):
            self._tls_files = named_tls_files(self.path)
            raise
        self._tls_files = tls_files(configured)
        return configured


def named_tls_files(path: str) -> tuple[str, ...]:
    """The TLS files a nodes file names, read leniently (for a file that does not load)."""
    try:
        data = tomllib.loads(read_regular_file(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return ()
    base = os.path.dirname(path)  # as the loader resolves them (parse_nodes)
    paths = set()
    listed = data.get("node")
    for node in listed if isinstance(listed, list) else []:
        engines = node.get("engines") if isinstance(node, dict) else None
        for spec in engines.values() if isinstance(engines, dict) else ():
            for field in TLS_FILE_FIELDS:
                value = spec.get(field) if isinstance(spec, dict) else None
                if isinstance(value, str) and value:
                    paths.add(resolve_path(base, value))
    return tuple(sorted(paths))


def tls_configs(configured: ConfiguredNodes) -> set[EngineTLS]:
    """The TLS configurations the configured nodes use."""
    return {
        node.access.tls
        for nodes in configured.nodes.values()
        for node in nodes
        if isinstance(node.access, EngineAccess) and node.access.tls is not None
    }


def tls_files(configured: ConfiguredNodes) -> tuple[str, ...]:
    """Every TLS file the configured nodes name, once each, in a stable order."""
    return tuple(
        sorted(
            {
                path
                for tls in tls_configs(configured)
                for path in (tls.ca_file, tls.cert_file, tls.key_file)
                if path
            }
        )
    )
