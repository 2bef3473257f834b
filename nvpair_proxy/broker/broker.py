"""The broker's methods (docs/references.md#rpc-addressing, #broker-methods): addressing,
validation, answers, notifications.

Each facade-scoped method names its engine (``ollama:nodes/list``), because one process hosts
every facade (docs/references.md#facade-addressing); an unaddressed one resolves to no facade rather
than guessing. The notifications a method causes go out before its answer
(docs/references.md#notifications-before-answer). Binding and running a facade is
``facadeservice.py``'s; how a discovered node is reached is ``admission.py``'s.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import attrs
from twisted.internet.error import CannotListenError

from .. import __version__
from ..core.logs import LEVELS, logger, set_level
from ..core.validate import is_int, is_loopback, is_port
from ..facade.facade import Facade
from ..facade.facadeservice import Facades, FacadeService
from ..nodes.discovery import make_node, project
from ..nodes.engines import Engine
from ..nodes.selfcheck import is_local_address
from ..nodes.slots import parse_slots
from ..routing.reservations import Rank
from .aliases import parse_aliases
from .ports import read_port, write_port
from .rpc import (
    BIND_FAILED,
    INVALID_PARAMS,
    NO_FACADE,
    SERVER_ERROR,
    MethodNotFound,
    NoAnswer,
    RpcError,
)

log = logger()


@attrs.define(eq=False)
class Running:
    """An enabled facade and what the broker has told it: its running service, the local
    backend, nodes reported unreachable, and manual nodes to probe. The backend's slots are
    kept on the service, where the admin listener's ``/status`` reads them too."""

    _service: FacadeService | None = None
    local_backend: tuple[str, int] | None = None
    unreachable: set = attrs.Factory(set)
    probed: set = attrs.Factory(set)

    @property
    def service(self) -> FacadeService:
        """The facade's service: set as the facade opens, before the broker keeps it."""
        if self._service is None:
            raise RuntimeError("the facade is not open yet")
        return self._service

    @service.setter
    def service(self, service: FacadeService) -> None:
        self._service = service

    @property
    def facade(self) -> Facade:
        return self.service.facade

    def backend(self) -> tuple[str, int] | None:
        """The local backend, unless it points at this facade itself
        (docs/references.md#self-by-address): the ingress and the self node would then send requests
        back to us."""
        backend = self.local_backend
        if backend is None or self._service is None or backend[1] in self._service.own_ports():
            return None
        return backend


def _params(params: Any) -> dict:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "params must be an object")
    return params


def _int(params: dict, key: str, default=None):
    value = params.get(key, default)
    if value is None:
        return None
    if not is_int(value):
        raise RpcError(INVALID_PARAMS, f"{key} must be an integer")
    return value


class Broker:
    """Handles every inbound method; ``facades`` (the service tree's node) opens facades."""

    def __init__(
        self,
        *,
        engines: Mapping[str, Engine],
        emitter,
        reservations,
        state_dir: str,
        facades: Facades,
        on_shutdown: Callable[[], None],
        after_answer: Callable[[Callable], None],
        is_local: Callable[[str], bool] = is_local_address,
    ) -> None:
        self.engines, self.emitter, self.reservations = engines, emitter, reservations
        self.state_dir, self.facades = state_dir, facades
        self.on_shutdown, self.after_answer = on_shutdown, after_answer
        self.is_local = is_local
        self.running: dict[str, Running] = {}
        self._process = {
            "facade/enable": self.enable,
            "node/set-priority": self.set_priority,
            "log/set-level": self.set_level,
            "shutdown": self.shutdown,
        }
        self._facade = {
            "set-port": self.set_port,
            "discovery:nodes": self.discovery_nodes,
            "node/select": self.select,
            "node/selected": self.selected,
            "nodes/list": self.nodes_list,
            "node/add-manual": self.add_manual,
            "node/remove-manual": self.remove_manual,
            "node/set-local-backend": self.set_local_backend,
            "node/model-owners": self.model_owners,
        }

    # Addressing (docs/references.md#rpc-addressing).

    def dispatch(self, method: str, params: Any) -> Any:
        engine_id, sep, bare = method.partition(":")
        if not sep or engine_id not in self.engines:
            engine_id, bare = "", method
        if not engine_id:
            if bare in self._process:
                return self._process[bare](_params(params))
            if bare == "discovery:nodes":
                log.warn("ignored discovery:nodes without an engine")
                raise NoAnswer()
            if bare in self._facade:
                raise RpcError(NO_FACADE, 'no facade is enabled for engine "" on this proxy')
            raise MethodNotFound(method)
        if bare == "node/set-priority":
            return self.set_priority(_params(params))
        if bare not in self._facade:
            raise MethodNotFound(method)
        running = self.running.get(engine_id)
        if bare == "discovery:nodes":
            if running is None:
                log.debug("ignored discovery:nodes for {engine}: no facade", engine=engine_id)
            elif not isinstance(params, dict):
                log.warn("ignored discovery:nodes whose params are not an object", engine=engine_id)
            else:
                try:
                    self.discovery_nodes(running, params)
                except Exception:
                    log.failure("internal error handling {method}", method=method)
            raise NoAnswer()
        if running is None:
            raise RpcError(
                NO_FACADE, f'no facade is enabled for engine "{engine_id}" on this proxy'
            )
        return self._facade[bare](running, _params(params))

    def notify(self, engine_id: str, method: str, params: dict) -> None:
        self.emitter.notify(method, params, engine=engine_id)

    # Process-scoped methods.

    def enable(self, params: dict) -> dict:
        engine_id = params.get("engine", "")
        if not isinstance(engine_id, str):
            raise RpcError(INVALID_PARAMS, "engine must be a string")
        engine = self.engines.get(engine_id)
        if engine is None:
            raise RpcError(
                SERVER_ERROR,
                f'unknown engine "{engine_id}"; want one of '
                f"{', '.join(_engine_order(self.engines))}",
            )
        port = _int(params, "port", 0) or 0  # null reads as omitted
        if not is_port(port, zero=True):
            raise RpcError(SERVER_ERROR, f"port must be between 1 and 65535 (got {port})")
        ignore = params.get("ignorePersistedPort", False)
        if not isinstance(ignore, bool):
            raise RpcError(INVALID_PARAMS, "ignorePersistedPort must be a boolean")
        alias_values = params.get("aliasAddresses")
        if alias_values is not None and not isinstance(alias_values, list):
            raise RpcError(INVALID_PARAMS, "aliasAddresses must be a list")
        if engine_id in self.running:
            return {"engine": engine_id, "port": self.running[engine_id].service.port}
        if alias_values and engine.host_variable is None:
            raise RpcError(SERVER_ERROR, f"aliasAddresses are not supported for {engine_id}")
        persisted = None if ignore else read_port(self.state_dir, engine)
        port = persisted or port or engine.ports.standalone
        aliases = parse_aliases(alias_values, port)
        running = Running()
        try:
            running.service = self.facades.open(
                engine,
                port,
                should_probe=lambda node: node.id in running.probed,
                local_backend=running.backend,
                is_local=self.is_local,
            )
        except CannotListenError as exc:
            reason = _reason(exc)
            self.notify(
                engine_id,
                "error",
                {
                    "code": "bind-failed",
                    "message": f"failed to bind port {port}: {reason}",
                    "port": port,
                },
            )
            raise RpcError(BIND_FAILED, f"facade bind failed: port {port}: {reason}") from None
        self.running[engine_id] = running
        if aliases is not None:
            self._bind_aliases(running, *aliases)
        self.notify(engine_id, "ready", {"version": __version__, "port": port})
        self.notify(engine_id, "discovery:subscribe", {"services": [engine.service_key]})
        self.facades.add(running.service)
        log.info("{engine} facade enabled on port {port}", engine=engine_id, port=port)
        return {"engine": engine_id, "port": port}

    def _bind_aliases(self, running: Running, hosts: list[str], port: int) -> None:
        """An occupied alias is only a warning: clients using the host variable miss us."""
        engine_id = running.facade.engine.id
        alert = f"{engine_id}-proxy:{engine_id}-host-alias-blocked"
        refused = running.service.bind_aliases(hosts, port)
        if refused is not None:
            variable = running.facade.engine.host_variable
            self.notify(
                engine_id,
                "errors:report",
                {
                    "id": alert,
                    "severity": "warning",
                    "action": "none",
                    "message": f"{variable} alias port {port} is in use by another process "
                    f"({_reason(refused)}); clients using {variable} will not reach the proxy",
                },
            )
            return
        self.notify(engine_id, "errors:clear", {"id": alert})

    def set_priority(self, params: dict) -> dict:
        generation = params.get("generation")
        if not is_int(generation) or generation <= 0:
            raise RpcError(INVALID_PARAMS, "generation is required and must be greater than 0")
        nodes = params.get("nodes") or []
        ranks = params.get("ranks") or []
        if not isinstance(nodes, list) or not isinstance(ranks, list):
            raise RpcError(INVALID_PARAMS, "nodes and ranks must be lists")
        parsed = []
        for rank in ranks:
            if isinstance(rank, dict) and isinstance(rank.get("id"), str):
                parsed.append(
                    Rank(
                        id=rank["id"],
                        pending=_number(rank.get("pending")),
                        gpu_pressure=_number(rank.get("gpuPressure")),
                        rank=_whole(rank.get("rank")),
                    )
                )
        self.reservations.set_priority(generation, [n for n in nodes if isinstance(n, str)], parsed)
        return {"count": self.reservations.count}

    def set_level(self, params: dict) -> dict:
        level = params.get("level")
        if not isinstance(level, str) or level not in LEVELS:
            raise RpcError(INVALID_PARAMS, "level must be one of debug, info, warn, error")
        set_level(level)
        return {"level": level}

    def shutdown(self, params: dict) -> None:
        self.after_answer(self.on_shutdown)
        return None

    # Facade-scoped methods.

    def set_port(self, running: Running, params: dict) -> dict:
        port = _int(params, "port")
        if not is_port(port):
            raise RpcError(INVALID_PARAMS, f"port must be between 1 and 65535 (got {port})")
        engine = running.facade.engine
        if port == running.service.port:
            self._persist(engine, port)
            return {"version": __version__, "port": port}
        try:
            running.service.move(port, confirm=lambda: self._persist(engine, port))
        except CannotListenError as exc:
            raise RpcError(SERVER_ERROR, f"failed to bind port {port}: {_reason(exc)}") from None
        self.notify(engine.id, "ready", {"version": __version__, "port": port})
        return {"version": __version__, "port": port}

    def _persist(self, engine: Engine, port: int) -> None:
        try:
            write_port(self.state_dir, engine, port)
        except OSError as exc:
            raise RpcError(
                SERVER_ERROR, f"failed to persist port {port}: {exc.strerror or exc}"
            ) from None

    def discovery_nodes(self, running: Running, params: dict) -> None:
        facade = running.facade
        engine = facade.engine
        raw = params.get("nodes")
        if not isinstance(raw, list):
            log.warn("ignored discovery:nodes without a nodes list", engine=engine.id)
            return
        projected = [project(engine, item) for item in raw]
        pin = facade.router.pin
        change = facade.router.replace_discovered([n for n in projected if n is not None])
        for kind, nodes in (
            ("node/discovered", change.discovered),
            ("node/updated", change.updated),
            ("node/removed", change.removed),
        ):
            for node in nodes:
                self.notify(engine.id, kind, node.describe())
        for node in change.removed:
            running.unreachable.add(node.id)
            self.notify(
                engine.id,
                "errors:report",
                {
                    "id": f"{engine.id}-proxy:upstream-unreachable:{node.id}",
                    "message": f'Upstream node "{node.name}" is no longer reachable '
                    "(dropped from discovery)",
                    "severity": "warning",
                    "action": "none",
                },
            )
        for node in change.discovered:
            if node.id in running.unreachable:
                running.unreachable.discard(node.id)
                self.notify(
                    engine.id,
                    "errors:clear",
                    {"id": f"{engine.id}-proxy:upstream-unreachable:{node.id}"},
                )
        if pin != facade.router.pin:
            self.notify(engine.id, "node/selection-changed", {"id": ""})

    def select(self, running: Running, params: dict) -> dict:
        node_id = params.get("id", "")
        if not isinstance(node_id, str):
            raise RpcError(INVALID_PARAMS, "id must be a string")
        try:
            running.facade.router.set_pin(node_id)
        except KeyError:
            raise RpcError(INVALID_PARAMS, f'node "{node_id}" not found') from None
        self.notify(running.facade.engine.id, "node/selection-changed", {"id": node_id})
        return {"id": node_id}

    def selected(self, running: Running, params: dict) -> dict:
        return {"id": running.facade.router.pin}

    def nodes_list(self, running: Running, params: dict) -> dict:
        """Every known node; the self node also shows the local engine's slots when set."""
        nodes = []
        for node in running.facade.router.nodes.all():
            shown = node.describe()
            if node.local and running.service.slots is not None:
                shown["slots"] = running.service.slots.describe()
            nodes.append(shown)
        return {"nodes": nodes}

    def add_manual(self, running: Running, params: dict) -> dict:
        node_id, port = params.get("id"), params.get("port")
        addresses = params.get("addresses")
        # A bare string is not a list of addresses (it would be split into characters).
        addresses = (
            [a for a in addresses if isinstance(a, str) and a]
            if isinstance(addresses, list)
            else None
        )
        if not isinstance(node_id, str) or not node_id or not is_port(port) or not addresses:
            raise RpcError(INVALID_PARAMS, "id, port, and at least one address are required")
        models = params.get("models")
        if models is not None and (
            not isinstance(models, list) or not all(isinstance(m, str) for m in models)
        ):
            raise RpcError(INVALID_PARAMS, "models must be a list of strings")
        txt = params.get("txt")
        if txt is not None and (
            not isinstance(txt, list) or not all(isinstance(t, str) for t in txt)
        ):
            raise RpcError(INVALID_PARAMS, 'txt must be a list of "key=value" strings')
        host = params.get("host") if isinstance(params.get("host"), str) else node_id
        facade = running.facade
        node = make_node(
            facade.engine,
            id=node_id,
            name=host or node_id,
            port=port,
            addresses=addresses,
            models=models,
            source="manual",
            txt=None if txt is None else tuple(txt),
        )
        if models is None:
            running.probed.add(node_id)
        else:
            running.probed.discard(node_id)
        added = facade.router.put_manual(node)
        self.notify(
            facade.engine.id, "node/discovered" if added else "node/updated", node.describe()
        )
        routable = facade.router.nodes.get(node_id)
        if models is None and routable is not None:
            # As a request would reach it: self through the local backend, never our facade.
            running.service.prober.probe(routable)
        return {"added": added}

    def remove_manual(self, running: Running, params: dict) -> dict:
        node_id = params.get("id")
        if not isinstance(node_id, str) or not node_id:
            raise RpcError(INVALID_PARAMS, "id is required")
        facade = running.facade
        pin = facade.router.pin
        node = facade.router.remove_manual(node_id)
        running.probed.discard(node_id)
        if node is None:
            return {"removed": False}
        self.notify(facade.engine.id, "node/removed", node.describe())
        if pin != facade.router.pin:
            self.notify(facade.engine.id, "node/selection-changed", {"id": ""})
        return {"removed": True}

    def set_local_backend(self, running: Running, params: dict) -> dict:
        engine_id = running.facade.engine.id
        if params.get("engine", engine_id) != engine_id:
            raise RpcError(INVALID_PARAMS, f"engine must be {engine_id!r}")
        host = params.get("host") or "127.0.0.1"
        port = params.get("port", 0)
        healthy = params.get("healthy", True)
        if not isinstance(healthy, bool):
            raise RpcError(INVALID_PARAMS, "healthy must be a boolean")
        if not isinstance(host, str) or not is_loopback(host, name=True, scoped=False):
            raise RpcError(INVALID_PARAMS, "host must be a loopback address")
        if not is_port(port, zero=True):
            raise RpcError(INVALID_PARAMS, "port must be between 0 and 65535")
        try:
            slots = parse_slots(running.facade.engine, params.get("slots"))
        except ValueError as exc:
            raise RpcError(INVALID_PARAMS, str(exc)) from None
        running.local_backend = (host.strip("[]"), port) if port and healthy is not False else None
        # Slots describe the backend just named: none sent, or no backend, means none known.
        running.service.slots = slots if running.local_backend is not None else None
        running.facade.router.admission_changed()
        return {"ok": True}

    def model_owners(self, running: Running, params: dict) -> dict:
        model = params.get("model")
        if not isinstance(model, str) or not model.strip():
            raise RpcError(INVALID_PARAMS, "model is required")
        facade = running.facade
        return {"nodes": facade.router.model_owners(facade.engine.normalize_model(model))}


# The order the unknown-engine message lists them in (docs/references.md#engine-order).
ENGINE_ORDER = ("ollama", "lmstudio", "llamacpp")


def _engine_order(engines: Mapping[str, Engine]) -> list[str]:
    known = [e for e in ENGINE_ORDER if e in engines]
    return known + sorted(e for e in engines if e not in ENGINE_ORDER)


def _whole(value) -> int:
    number = _number(value)
    return int(number) if math.isfinite(number) else 0


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _reason(exc: CannotListenError) -> str:
    error = exc.socketError
    return getattr(error, "strerror", None) or str(error)
