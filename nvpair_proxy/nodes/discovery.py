"""The nodes a facade can route to, whatever their source.

A facade's node set is the union of discovered nodes (broker snapshots, replaced wholesale),
manual nodes (``node/add-manual``, which survive snapshots) and, in standalone mode, the
nodes file. Every resolution reads this set as it is now ("no memory of nodes seen in the past":
docs/references.md#no-node-memory), so the set is the single source of truth for "routable right
now".
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import attrs

from ..core.validate import is_loopback, is_port
from ..core.views import NodeView
from .engines import Engine
from .selfcheck import never_self


def host_port(host: str, port: int) -> str:
    """``host:port`` with IPv6 literals bracketed, as in a URL."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@attrs.frozen
class Node:
    """One routable node of one engine.

    ``models`` holds normalized model ids; None means the inventory is not known yet
    (a probed node before its first probe), which advertises nothing. ``txt`` is the
    node's ``key=value`` strings as the broker gave them, None when it gave none
    (docs/references.md#node-shape: the existing implementation's node carries a string list, never
    an object).
    """

    id: str
    name: str
    port: int
    addresses: tuple[str, ...]
    source: str = "manual"
    models: frozenset[str] | None = None
    advertised: tuple[str, ...] | None = None
    scheme: str = "http"
    cluster_uuid: str = ""
    txt: tuple[str, ...] | None = None
    local: bool = False
    #: A nodes file's ``slots = N``: what the engine runs at once when it does not say
    #: itself (Ollama with OLLAMA_NUM_PARALLEL), or a cap on what it says.
    slots: int | None = None
    # Standalone TLS and key settings of this engine (engineaccess.py); never in a repr.
    access: object = attrs.field(default=None, repr=False)
    _dial: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)

    def advertises(self, model: str) -> bool:
        return self.models is not None and model in self.models

    def dial_order(self) -> list[str]:
        """Addresses to dial: loopback first, then the published order, de-duplicated."""
        return list(self._dial)

    @_dial.default
    def _dial_default(self) -> tuple[str, ...]:
        # Computed once per node, not per dispatch: parsing addresses was a measurable share
        # of a request (docs/references.md#bare-proxy-cpu).
        seen: set[str] = set()
        ordered: list[str] = []
        for address in sorted(self.addresses, key=lambda a: not is_loopback(a)):
            if address and address not in seen:
                seen.add(address)
                ordered.append(address)
        return tuple(ordered)

    def describe(self) -> dict:
        """The Node object of ``nodes/list`` and the node diffs (docs/references.md#node-shape)."""
        out: dict = {
            "id": self.id,
            "host": self.name,
            "port": self.port,
            "addresses": list(self.addresses),
            "txt": None if self.txt is None else list(self.txt),
        }
        if self.advertised is not None:
            out["models"] = list(self.advertised)
        if self.addresses:
            out["ip"] = self.addresses[0]
        return out

    def view(self) -> NodeView:
        """What ``/status`` shows of the node: its models as advertised, else the ids it is
        known to own (sorted), else None; never its access settings."""
        models = (
            self.advertised
            if self.advertised is not None
            else tuple(sorted(self.models))
            if self.models is not None
            else None
        )
        return NodeView(
            id=self.id,
            name=self.name,
            port=self.port,
            addresses=self.addresses,
            models=models,
            local=self.local,
        )


def make_node(
    engine: Engine,
    *,
    id: str,
    name: str | None = None,
    port: int,
    addresses: Sequence[str],
    models: Iterable[str] | None = None,
    source: str = "manual",
    **extra,
) -> Node:
    """A Node whose advertised models are normalized by the engine's model-id rule."""
    advertised = None if models is None else tuple(models)
    normalized = (
        None if advertised is None else frozenset(engine.normalize_model(m) for m in advertised)
    )
    return Node(
        id=id,
        name=name or id,
        port=port,
        addresses=tuple(addresses),
        source=source,
        models=normalized,
        advertised=advertised,
        **extra,
    )


@attrs.frozen
class Diff:
    discovered: tuple[Node, ...] = ()
    updated: tuple[Node, ...] = ()
    removed: tuple[Node, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.discovered or self.updated or self.removed)


def _changed(old: Node, new: Node) -> bool:
    return (old.models, old.addresses, old.port) != (new.models, new.addresses, new.port)


def diff(old: Mapping[str, Node], new: Mapping[str, Node]) -> Diff:
    """Discovered, updated (models or address changed) and removed nodes, each in id order."""
    return Diff(
        discovered=tuple(new[i] for i in sorted(new) if i not in old),
        updated=tuple(new[i] for i in sorted(new) if i in old and _changed(old[i], new[i])),
        removed=tuple(old[i] for i in sorted(old) if i not in new),
    )


def admit_unless_self(node: Node) -> Node | None:
    """Standalone admission: every node as written, except one that is this proxy (a
    request sent there would come back to us without end)."""
    return None if node.local else node


@attrs.define
class NodeSet:
    """One facade's nodes: discovered (replaced wholesale) plus manual (kept across snapshots).

    ``admit`` decides at read time how a node is reached, or that it is not (a peer without a
    live pin, self without a local backend), so a trust change needs no new snapshot to take
    effect (docs/references.md#routable-set). Every node is asked, manual ones included: a manual
    node can be this proxy too (docs/references.md#self-by-address). ``Node.local`` says whether a
    node is this facade; it is stamped on as nodes enter the set and again when the facade's ports
    move.
    """

    discovered: dict[str, Node] = attrs.field(factory=dict)
    manual: dict[str, Node] = attrs.field(factory=dict)
    admit: Callable[[Node], Node | None] = admit_unless_self
    #: Everything ``admit``'s answers depend on besides the node, as a value compared with
    #: ``==``; while it stays equal (and no node changed) the routable set is kept. None: an
    #: admission that says nothing of the kind is asked at every read.
    admit_state: Callable[[], object] | None = None
    # Which nodes are this facade itself (selfcheck.py); asked when a node enters the set
    # and on ``recheck_self``, never per request.
    is_self: Callable[[Node], bool] = never_self
    _observers: list[Callable[[], None]] = attrs.field(factory=list)
    # The routable set, kept between changes when admission is the plain "everything" (it
    # is then a pure function of the tables); asked several times per request
    # (docs/references.md#bare-proxy-cpu).
    _routable: dict[str, Node] | None = attrs.field(default=None, init=False)
    _routable_state: object = attrs.field(default=None, init=False)

    def all(self) -> list[Node]:
        """Every known node, routable or not: what ``nodes/list`` shows."""
        nodes = dict(self.discovered)
        nodes.update(self.manual)
        return [nodes[i] for i in sorted(nodes)]

    def known(self, node_id: str) -> bool:
        return node_id in self.discovered or node_id in self.manual

    def routable(self) -> list[Node]:
        return list(self._routable_now().values())

    def routable_map(self) -> Mapping[str, Node]:
        """The routable nodes by id: the same mapping between changes to the set (a plain
        admission), which is how the rank index knows to start again (rankindex.py)."""
        return self._routable_now()

    def _routable_now(self) -> dict[str, Node]:
        state = None if self.admit_state is None else self.admit_state()
        if self._routable is not None and state == self._routable_state:
            return self._routable
        nodes = {}
        for table in (self.discovered, self.manual):
            for node in table.values():
                admitted = self.admit(node)
                if admitted is not None:
                    nodes[node.id] = admitted
                else:
                    nodes.pop(node.id, None)  # a manual node shadows a discovered one
        ordered = {i: nodes[i] for i in sorted(nodes)}
        if self.admit is admit_unless_self or self.admit_state is not None:
            self._routable, self._routable_state = ordered, state
        return ordered

    def get(self, node_id: str) -> Node | None:
        return self._routable_now().get(node_id)

    def __contains__(self, node_id: str) -> bool:
        return self.get(node_id) is not None

    def replace_discovered(self, nodes: Iterable[Node]) -> Diff:
        new = {n.id: self._stamp(n) for n in nodes}
        change = diff(self.discovered, new)
        self.discovered = new
        self.changed()
        return change

    def put_manual(self, node: Node) -> bool:
        """Add or update a manual node; True when it was added."""
        added = node.id not in self.manual
        self.manual[node.id] = self._stamp(node)
        self.changed()
        return added

    def remove_manual(self, node_id: str) -> Node | None:
        node = self.manual.pop(node_id, None)
        if node is not None:
            self.changed()
        return node

    def set_models(self, node_id: str, engine: Engine, models: Iterable[str]) -> None:
        """Replace a node's inventory (a probe result), wherever the node came from."""
        for table in (self.discovered, self.manual):
            node = table.get(node_id)
            if node is not None:
                advertised = tuple(models)
                table[node_id] = attrs.evolve(
                    node,
                    advertised=advertised,
                    models=frozenset(engine.normalize_model(m) for m in advertised),
                )
                self.changed()

    def _stamp(self, node: Node) -> Node:
        local = bool(self.is_self(node))
        return node if node.local == local else attrs.evolve(node, local=local)

    def recheck_self(self) -> None:
        """The facade's ports changed (``set-port``, aliases): which nodes are self is asked
        again, and the routable set with it."""
        for table in (self.discovered, self.manual):
            for node_id, node in list(table.items()):
                table[node_id] = self._stamp(node)
        self.changed()

    def observe(self, callback: Callable[[], None]) -> None:
        self._observers.append(callback)

    def changed(self) -> None:
        """Tell observers the routable set may differ (a trust or backend change)."""
        self._routable = None
        for callback in list(self._observers):
            callback()


def project(engine: Engine, raw: Mapping) -> Node | None:
    """A DirectoryNode as this engine sees it, or None when it offers no route
    (docs/references.md#directory-node)."""
    if not isinstance(raw, Mapping):
        return None
    node_id = raw.get("hostUuid")
    services = raw.get("services")
    ip = raw.get("ip")
    if not isinstance(node_id, str) or not node_id or not isinstance(services, Mapping):
        return None
    service = services.get(engine.service_key)
    if not isinstance(service, Mapping) or not isinstance(ip, str) or not ip:
        return None
    port = service.get("port")
    if not is_port(port):
        return None
    ips = raw.get("ips")
    addresses = [a for a in ips if isinstance(a, str) and a] if isinstance(ips, list) else []
    if not addresses:
        addresses = [ip]
    if engine.inventory_source == "loaded":
        loaded = raw.get("loadedByEngine")
        models = loaded.get(engine.id, []) if isinstance(loaded, Mapping) else []
    elif isinstance(raw.get("modelsByEngine"), Mapping):
        models = raw["modelsByEngine"].get(engine.id, [])
    else:
        models = raw.get("models") or []
    models = [m for m in models if isinstance(m, str)] if isinstance(models, list) else []
    name = raw.get("name") if isinstance(raw.get("name"), str) else node_id
    cluster = raw.get("clusterUuid") if isinstance(raw.get("clusterUuid"), str) else ""
    return make_node(
        engine,
        id=node_id,
        name=name or node_id,
        port=port,
        addresses=addresses,
        models=models,
        source="discovered",
        cluster_uuid=cluster,
    )
