"""Engine definitions loaded from the declarative files in ``engines/``.

Everything engine-specific lives in those files (docs/references.md#engine-files): adding an engine
is adding a file, and this loader is the only code that reads them. It validates every field and
names the file and field on error, because a typo in a route table would otherwise surface as
silently unclassified (and so unretried) traffic.
"""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from typing import Iterable, Literal, Mapping, overload

import attrs

from ..body.frames import TERMINAL_FRAMES
from ..core.files import read_regular_file
from ..core.validate import is_port

ROUTE_CLASSES = ("inference", "models")
MODEL_RULES = ("implied-latest", "exact")
INVENTORY_SOURCES = ("models", "loaded")
ENVELOPES = ("openai", "ollama")
# The keys of an engine file's ``[truth]`` table: the routes that say, without side effects,
# what an engine is doing (enginetruth.py reads each shape).
TRUTH_ROUTES = ("slots", "loaded", "models")
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")


class EngineFileError(ValueError):
    """An engine file is missing, unreadable or has a bad field."""


@attrs.frozen
class Ports:
    own: int
    relocated: int
    standalone: int
    reserved: tuple[int, ...] = ()


@attrs.frozen
class Route:
    method: str
    path: str
    kind: str
    upstream_path: str | None = None
    envelope: str | None = None
    terminal: str | None = None

    @property
    def is_inference(self) -> bool:
        return self.kind == "inference"

    @property
    def is_models(self) -> bool:
        return self.kind == "models"


@attrs.frozen
class ModelList:
    upstream_path: str
    envelope: str


@attrs.frozen
class TruthRoutes:
    """Where an engine says what it is doing; None where it cannot say.

    ``slots``: llama.cpp's array of slots (``is_processing`` each); ``loaded``: the models
    held in memory (Ollama's ``/api/ps``); ``models``: every model with its state (LM Studio's
    ``state``, a llama.cpp router's ``status.value``). None of them loads a model.
    """

    slots: str | None = None
    loaded: str | None = None
    models: str | None = None


@attrs.frozen
class Engine:
    id: str
    service_key: str
    ports: Ports
    persisted_port_file: str
    model_rule: str
    inventory_source: str
    model_list: ModelList
    routes: tuple[Route, ...]
    host_variable: str | None = None
    truth: TruthRoutes = TruthRoutes()
    _table: Mapping[tuple[str, str], Route] = attrs.field(
        init=False,
        repr=False,
        eq=False,
        default=attrs.Factory(
            lambda self: {(r.method, r.path): r for r in self.routes}, takes_self=True
        ),
    )

    def classify(self, method: str | bytes, path: str | bytes) -> Route | None:
        """The route class of a request, or None: unlisted traffic is forwarded verbatim.

        The table is a classifier, not an allowlist; the method is part of the class, so
        ``GET /api/chat`` is not inference.
        """
        if isinstance(method, bytes):
            method = method.decode("latin-1")
        if isinstance(path, bytes):
            path = path.decode("latin-1")
        return self._table.get((method.upper(), path.split("?", 1)[0]))

    def normalize_model(self, name: str) -> str:
        """The id a model is compared by (docs/references.md#owner-filter)."""
        name = name.strip()
        if self.model_rule == "implied-latest" and name:
            last = name.rsplit("/", 1)[-1]
            if ":" not in last and "@" not in last:
                name += ":latest"
        return name


def _field(data: Mapping, key: str, kind: type | tuple, where: str, required: bool = True):
    if key not in data:
        if required:
            raise EngineFileError(f"{where}: missing field {key!r}")
        return None
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise EngineFileError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _choice(data: Mapping, key: str, choices: tuple, where: str, required: bool = True):
    value = _field(data, key, str, where, required)
    if value is not None and value not in choices:
        raise EngineFileError(
            f"{where}: field {key!r} must be one of {', '.join(choices)} (got {value!r})"
        )
    return value


def _port(data: Mapping, key: str, where: str) -> int:
    value = _field(data, key, int, where)
    if not is_port(value):
        raise EngineFileError(f"{where}: field {key!r} must be a port 1-65535 (got {value})")
    return value


@overload
def _path(data: Mapping, key: str, where: str, required: Literal[True] = ...) -> str: ...
@overload
def _path(data: Mapping, key: str, where: str, required: bool) -> str | None: ...
def _path(data: Mapping, key: str, where: str, required: bool = True) -> str | None:
    value = _field(data, key, str, where, required)
    if value is not None and not value.startswith("/"):
        raise EngineFileError(f"{where}: field {key!r} must start with '/' (got {value!r})")
    return value


def parse_engine(data: Mapping, source: str) -> Engine:
    """Build an Engine from a decoded engine file; ``source`` names it in errors."""
    known = {
        "id",
        "service_key",
        "persisted_port_file",
        "host_variable",
        "model_rule",
        "inventory_source",
        "ports",
        "model_list",
        "routes",
        "truth",
    }
    for key in data:
        if key not in known:
            raise EngineFileError(f"{source}: unknown field {key!r}")
    engine_id = _field(data, "id", str, source)
    if not engine_id or not engine_id.isidentifier() or engine_id != engine_id.lower():
        raise EngineFileError(
            f"{source}: field 'id' must be a lower-case identifier (got {engine_id!r})"
        )
    ports_data = _field(data, "ports", dict, source)
    where = f"{source}: ports"
    reserved = _field(ports_data, "reserved", list, where, required=False) or []
    for value in reserved:
        if not is_port(value):
            raise EngineFileError(
                f"{where}: field 'reserved' must list ports 1-65535 (got {value!r})"
            )
    ports = Ports(
        own=_port(ports_data, "own", where),
        relocated=_port(ports_data, "relocated", where),
        standalone=_port(ports_data, "standalone", where),
        reserved=tuple(reserved),
    )
    ml = _field(data, "model_list", dict, source)
    model_list = ModelList(
        upstream_path=_path(ml, "upstream_path", f"{source}: model_list"),
        envelope=_choice(ml, "envelope", ENVELOPES, f"{source}: model_list"),
    )
    routes = []
    seen = set()
    for index, raw in enumerate(_field(data, "routes", list, source)):
        where = f"{source}: routes[{index}]"
        if not isinstance(raw, dict):
            raise EngineFileError(f"{where}: must be a table")
        for key in raw:
            if key not in ("method", "path", "class", "upstream_path", "envelope", "terminal"):
                raise EngineFileError(f"{where}: unknown field {key!r}")
        route = Route(
            method=_choice(raw, "method", METHODS, where),
            path=_path(raw, "path", where),
            kind=_choice(raw, "class", ROUTE_CLASSES, where),
            upstream_path=_path(raw, "upstream_path", where, required=False),
            envelope=_choice(raw, "envelope", ENVELOPES, where, required=False),
            terminal=_choice(raw, "terminal", TERMINAL_FRAMES, where, required=False),
        )
        if (route.method, route.path) in seen:
            raise EngineFileError(f"{where}: route {route.method} {route.path} is declared twice")
        seen.add((route.method, route.path))
        if route.is_models and (route.upstream_path is None or route.envelope is None):
            raise EngineFileError(f"{where}: a 'models' route needs 'upstream_path' and 'envelope'")
        if not route.is_inference and route.terminal is not None:
            raise EngineFileError(f"{where}: field 'terminal' applies to inference routes only")
        routes.append(route)
    truth_data = _field(data, "truth", dict, source, required=False) or {}
    for key in truth_data:
        if key not in TRUTH_ROUTES:
            raise EngineFileError(f"{source}: truth: unknown field {key!r}")
    truth = TruthRoutes(
        **{key: _path(truth_data, key, f"{source}: truth", required=False) for key in TRUTH_ROUTES}
    )
    return Engine(
        id=engine_id,
        service_key=_field(data, "service_key", str, source),
        ports=ports,
        persisted_port_file=_field(data, "persisted_port_file", str, source),
        model_rule=_choice(data, "model_rule", MODEL_RULES, source),
        inventory_source=_choice(data, "inventory_source", INVENTORY_SOURCES, source),
        model_list=model_list,
        routes=tuple(routes),
        host_variable=_field(data, "host_variable", str, source, required=False),
        truth=truth,
    )


def load_engine_file(path: str) -> Engine:
    """Load one engine file; every failure is an EngineFileError naming the file."""
    try:
        data = tomllib.loads(read_regular_file(path).decode("utf-8"))
    except OSError as exc:
        raise EngineFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise EngineFileError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise EngineFileError(f"{path}: not UTF-8 text") from None
    return parse_engine(data, path)


def _builtin_files() -> list[str]:
    """The packaged engine files; from a source checkout, its ``engines/`` folder."""
    try:
        folder = resources.files("nvpair_proxy.engine_files")
    except ModuleNotFoundError:
        folder = resources.files("nvpair_proxy").joinpath("..", "engines")
    return sorted(str(entry) for entry in folder.iterdir() if entry.name.endswith(".toml"))


def load_engines(directories: Iterable[str] = ()) -> dict[str, Engine]:
    """The built-in engines plus every ``*.toml`` in ``directories``, keyed by id.

    Extra directories let an operator (or a test) add an engine without touching code.
    """
    files = _builtin_files()
    for directory in directories:
        files.extend(
            sorted(
                os.path.join(directory, name)
                for name in os.listdir(directory)
                if name.endswith(".toml")
            )
        )
    engines: dict[str, Engine] = {}
    for path in files:
        engine = load_engine_file(path)
        if engine.id in engines:
            raise EngineFileError(f"{path}: engine id {engine.id!r} is declared twice")
        engines[engine.id] = engine
    return engines
