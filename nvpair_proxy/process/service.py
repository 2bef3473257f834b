"""Wiring: the service tree for either mode, and the only module that touches the global
reactor (``build_service`` imports it; everything else takes the reactor it is given, so the
tests drive it with a fake clock). What the facades share is ``runtime.py``'s, the broker link
``link.py``'s.

The process is a tree of Twisted services, built here for either mode; the tree's order is
the shutdown order (docs/references.md#shutdown-order): children stop in reverse order of
addition, each after the one before it has finished:

    process (ProcessService: READY, signals, STOPPING)
    ├── runtime          the shared pool and agent; added first, so it closes last
    ├── admin            --admin: /metrics, /status, /healthz, the page (stops after facades)
    ├── link             broker mode: the JSON-RPC link (stdio or --ipc)
    │   or standalone    standalone mode: opens the --engine facades, feeds them the fleet
    │      └── nodes-file watch (TimerService, 2 s) when --nodes is given
    ├── trust watch      broker mode with --cluster-dir (TimerService, 2 s)
    ├── facades          one FacadeService per facade, stopped together
    │   └── <engine>     its ports, its facade and router; stop accepting, cancel, grace
    │       └── prober   (TimerService, 5 s)
    └── watchdog         (TimerService, WATCHDOG_USEC / 2) added once READY=1 is sent
"""

from __future__ import annotations

import gc
import signal
from functools import partial
from typing import Callable

import attrs
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.error import CannotListenError
from twisted.python.failure import Failure
from zope.interface import implementer

from ..admin.recorder import Recorder
from ..cluster.trust import ClusterDirectory, PeerAgents, trust_watch
from ..core import constants, sdnotify
from ..core.acceptguard import listen_tcp, raise_descriptor_limit
from ..core.interfaces import IStatusSource
from ..core.logs import logger
from ..core.validate import is_loopback
from ..core.views import ProcessSnapshot
from ..core.warnonce import WarnOnce
from ..facade.facadeservice import Facades, listen_on
from ..lan.apikeys import KeyStore, LanGate
from ..nodes.discovery import Node, make_node
from ..nodes.selfcheck import self_reason
from ..request.events import LogEmitter
from ..standalone.engineaccess import EngineAgents
from ..standalone.nodesfile import ConfiguredNodes, NodesFileError, NodesFileWatcher, tls_configs
from .handoff import Handoff, take_over_notify
from .link import LinkService, stop_on_signals, stop_once
from .options import Config
from .runtime import Runtime, RuntimeService
from .sockets import Inherited, adopting, inherited_sockets

log = logger()


#: Called once the process is up, before READY=1 (docs/decisions.md#frozen-heap): what exists
#: by then (modules, classes, the service tree) lives as long as the process, so the cyclic
#: garbage collector stops walking it at every full collection.
freeze_heap = gc.freeze


@implementer(IStatusSource)
class ProcessService(MultiService):
    """The root: systemd's view of the process, and children stopped one after another.

    A plain MultiService calls every child's ``stopService`` at once and only then waits;
    the shutdown order (docs/references.md#shutdown-order) needs each step finished before the
    next starts (the pool must not close while the facades' grace runs), so here each child stops
    after the one added after it.
    """

    name = "process"  # type: ignore[assignment]  # Twisted leaves Service.name untyped (None)

    runtime: "Runtime | None" = None
    facades: "Facades | None" = None
    #: Seconds a SIGTERM lets admitted requests finish (``--drain-timeout``); 0 stops at once.
    drain_timeout: float = 0.0
    draining = False
    #: Standalone mode: SIGHUP hands the listening sockets to a successor (handoff.py).
    handoff: Handoff | None = None
    # Set by makeService: offered to twistd's application as its log observer (logformat.py).
    offer_log_observer = None

    def __init__(self, reactor) -> None:
        super().__init__()
        self.reactor = reactor

    def setServiceParent(self, parent) -> None:
        if self.offer_log_observer is not None:
            self.offer_log_observer(parent)
        super().setServiceParent(parent)

    def startService(self) -> None:
        super().startService()
        self.reactor.callWhenRunning(self._ready)

    def _ready(self) -> None:
        """READY=1 once the reactor runs: twistd starts services before ``reactor.run``,
        and a SIGTERM that arrived between READY and the reactor's own signal handlers
        would kill the process by signal. The watchdog starts with READY, as systemd
        expects pings only from a service that is up."""
        if not self.running:
            return
        stop_on_signals(self.reactor, self.drain)
        handoff = self.handoff
        if handoff is not None:
            signal.signal(
                signal.SIGHUP, lambda number, frame: self.reactor.callFromThread(handoff.start)
            )
        freeze_heap()
        sdnotify.notify("READY=1")
        take_over_notify()
        pinging = sdnotify.watchdog(self.reactor)
        if pinging is not None:
            pinging.setServiceParent(self)

    def listening_sockets(self) -> list[tuple[str, int]]:
        """What a successor inherits (handoff.py): each facade's listening socket by its
        engine id, and the admin listener's as ``admin``."""
        named = [(service.name, service.listening.fileno()) for service in self.facades or ()]
        admin = self._admin()
        if admin is not None and admin.listening is not None:
            named.append(("admin", admin.listening.fileno()))
        return named

    def _admin(self):
        try:
            return self.getServiceNamed("admin")
        except KeyError:
            return None

    def handed_over(self) -> None:
        """The successor is ready and serves the same sockets: this process stops accepting
        on all of them, the admin listener's too, and drains (at once without a drain
        timeout) without telling systemd it stops: the service goes on in the successor."""
        admin = self._admin()
        if admin is not None:
            admin.hand_over()
        if not self.drain(handoff=True):
            for service in self.facades or ():
                service.drain(handed_over=True)
            stop_once(self.reactor)

    def drain(self, handoff: bool = False) -> bool:
        """Begin a graceful stop (docs/operations.md#restarts): every facade stops accepting
        and closes its idle connections, ``/healthz`` answers 503, and admitted requests
        (queued ones included) go on until none is left or ``drain_timeout`` has passed; then
        the reactor stops, which cancels what remains, each with its one terminal event.
        False, starting nothing, when there is no drain to do (a zero timeout, a drain
        already under way, a process not serving): the caller stops at once."""
        if self.draining or not self.running or self.drain_timeout <= 0 or self.facades is None:
            return False
        self.draining = True
        if not handoff:
            if self.handoff is not None:
                self.handoff.stop()
            sdnotify.notify("STOPPING=1")
        services = list(self.facades)
        for service in services:
            service.drain(handed_over=handoff)
        reactor = self.reactor
        began = reactor.seconds()
        deadline = began + self.drain_timeout

        def check() -> None:
            if all(service.drained() for service in services):
                log.info("drained in {seconds:.1f}s", seconds=reactor.seconds() - began)
            elif reactor.seconds() >= deadline:
                log.warn(
                    "drain timeout ({timeout:g}s): cancelling {left} requests",
                    timeout=self.drain_timeout,
                    left=sum(len(service.facade.in_flight) for service in services),
                )
            else:
                reactor.callLater(
                    min(constants.DRAIN_CHECK_INTERVAL, deadline - reactor.seconds()), check
                )
                return
            stop_once(reactor)

        check()
        return True

    def stopService(self) -> Deferred:
        Service.stopService(self)
        if self.handoff is not None:
            self.handoff.stop()
        if not self.draining and (self.handoff is None or not self.handoff.handed_over):
            sdnotify.notify("STOPPING=1")
        stopped = succeed(None)
        for child in reversed(list(self)):
            stopped.addBoth(self._stop_next, child)
        return stopped.addBoth(self._stop_next, None)

    def snapshot(self) -> ProcessSnapshot:
        """The process as the admin listener shows it, read now (IStatusSource)."""
        runtime, facades = self.runtime, self.facades
        reservations: dict[str, int] = {}
        streamed: dict[str, float] = {}
        if runtime is not None:
            reservations = dict(runtime.reservations.reservations)
            if runtime.activity is not None:
                streamed = runtime.activity.last_seen()
        try:
            link = self.getServiceNamed("link")
        except KeyError:
            link = None
        return ProcessSnapshot(
            running=bool(self.running),
            facades=facades.views() if facades is not None else (),
            reservations=reservations,
            streamed=streamed,
            link_up=link.is_up() if isinstance(link, LinkService) else None,
            cluster_pins=facades.cluster_pins() if facades is not None else None,
            draining=self.draining,
        )

    @staticmethod
    def _stop_next(result, child):
        """A step that failed is logged and the next one still runs: the pool must close."""
        if isinstance(result, Failure):
            log.failure("stopping the process", result)
        return None if child is None else maybeDeferred(child.stopService)


def local_fleet(config: Config) -> ConfiguredNodes:
    """Without --nodes, this machine's engine is the fleet (docs/references.md#standalone-fleet).

    The engine is looked for on its own client-facing port, or on its relocated port when the
    facade itself sits on the client-facing one.
    """
    nodes, probed = {}, set()
    for engine_id, port in config.facades:
        engine = config.engines[engine_id]
        engine_port = engine.ports.relocated if port == engine.ports.own else engine.ports.own
        nodes[engine_id] = (
            make_node(
                engine,
                id="local",
                name="local",
                port=engine_port,
                addresses=["127.0.0.1"],
                source="standalone",
            ),
        )
        probed.add((engine_id, "local"))
    return ConfiguredNodes(nodes, frozenset(probed))


class Standalone(MultiService):
    """Standalone mode: the ``--engine`` facades and the fleet they route to
    (docs/references.md#standalone-fleet, #nodes-file).

    Facades are bound and the nodes file read before the reactor runs, so a taken port or a
    bad file stops start-up with one clear line; the nodes-file watch is a child.
    """

    name = "standalone"  # type: ignore[assignment]  # Twisted leaves Service.name untyped (None)

    def __init__(
        self,
        config: Config,
        reactor,
        facades: Facades,
        engine_agents: EngineAgents | None = None,
        inherited: Inherited | None = None,
    ) -> None:
        super().__init__()
        self.config, self.facades, self.engine_agents = config, facades, engine_agents
        self.reactor = reactor
        #: Listening sockets handed over (socket activation, a hot handoff), by role.
        self.inherited = inherited or Inherited()
        self.probed: frozenset = frozenset()
        # The nodes last warned about as this proxy, per (engine, node): one warning per
        # change, not one per reload of an unchanged file.
        self.warned_self: WarnOnce[tuple[str, str]] = WarnOnce()
        self.watcher: NodesFileWatcher | None = None
        if config.nodes:
            self.watcher = NodesFileWatcher(config.nodes, config.engines, reactor, self.apply)
            self.watcher.setName("nodes-file watch")
            self.watcher.setServiceParent(self)

    def privilegedStartService(self) -> None:
        config = self.config
        for engine_id, port in config.facades:
            try:
                service = self.facades.open(
                    config.engines[engine_id],
                    port,
                    should_probe=self._probes(engine_id),
                    listen=adopting(self.reactor, self.inherited, engine_id, self.facades.listen),
                )
            except CannotListenError as exc:
                raise SystemExit(
                    f"nvpair-proxy: {engine_id}: cannot listen on port {port}: {exc.socketError}"
                ) from None
            self.facades.add(service)
            log.info(
                "{engine} facade listening on port {port}",
                engine=engine_id,
                port=service.listening.getHost().port,
            )
        for role in self.inherited.unused():
            raise SystemExit(
                f"nvpair-proxy: an inherited socket is named {role!r}, which no --engine "
                f"or --admin of this command line serves"
            )
        if self.watcher is not None:
            try:
                self.watcher.load()
            except NodesFileError as exc:
                raise SystemExit(f"nvpair-proxy: --nodes: {exc}") from None
        else:
            self.apply(local_fleet(config))
        super().privilegedStartService()

    def _probes(self, engine_id: str) -> Callable[[Node], bool]:
        """Whether the fleet last applied has this engine's node probed for its models."""
        return lambda node: (engine_id, node.id) in self.probed

    def apply(self, fleet: ConfiguredNodes) -> None:
        self.probed = fleet.probed
        for service in self.facades:
            engine_id, facade = service.name, service.facade
            known = {n.id: n for n in facade.router.routable()}
            nodes = []
            for node in fleet.nodes.get(engine_id, ()):
                old = known.get(node.id)
                if (engine_id, node.id) in fleet.probed and old is not None:
                    node = attrs.evolve(node, models=old.models, advertised=old.advertised)
                nodes.append(node)
            facade.router.replace_discovered(nodes)
        self.warn_self()
        if self.engine_agents is not None:
            self.engine_agents.retain(tls_configs(fleet))

    def warn_self(self) -> None:
        """Name every node that is this proxy's own facade, once per change
        (docs/references.md#self-by-address)."""
        found = frozenset(
            (service.name, node.id, node.port)
            for service in self.facades
            for node in service.facade.router.nodes.all()
            if node.local
        )
        for engine_id, node_id, port in sorted(found):
            why = self_reason(engine_id, port)
            if self.warned_self.new((engine_id, node_id), why):
                log.warn(
                    "node {node} is left out of the {engine} fleet: {why}",
                    node=node_id,
                    engine=engine_id,
                    why=why,
                )
        self.warned_self.retain({(e, n) for e, n, _ in found}.__contains__)


def lan_gate(config: Config, reactor):
    """The opt-in LAN keys every facade's listener asks (docs/references.md#lan-keys), the same in
    both modes."""
    return LanGate(
        KeyStore(reactor, env=config.api_keys, path=config.api_keys_file),
        allowed=list(config.allowed_cidrs),
    )


def add_admin(
    root: ProcessService,
    runtime: Runtime,
    config: Config,
    reactor,
    mode: str,
    inherited: Inherited | None = None,
) -> None:
    """The admin listener (docs/references.md#admin-listener), when ``--admin`` asks for it: it
    reads the tree's snapshots and the runtime's recorder (made whenever ``--admin`` is given),
    on the socket inherited for ``admin`` when there is one."""
    if config.admin is not None:
        recorder = runtime.recorder
        assert isinstance(recorder, Recorder)
        # Imported here: the admin listener's metrics library stays out of a process that
        # serves no --admin (0.9 MiB resident, measured at import).
        from ..admin.admin import AdminService

        listen = None
        if inherited is not None:
            bind = partial(listen_tcp, reactor, name="admin")
            listen = adopting(reactor, inherited, "admin", bind, not_loopback)
        AdminService(root, recorder, config.admin, reactor, mode, listen).setServiceParent(root)


def standalone_tree(config: Config, reactor) -> ProcessService:
    """Facades from ``--engine``, fleet from ``--nodes``; events to the log."""
    root = ProcessService(reactor)
    root.drain_timeout = config.drain_timeout
    inherited = handed_over()
    runtime = Runtime.build(config, reactor, LogEmitter())
    RuntimeService(runtime).setServiceParent(root)
    add_admin(root, runtime, config, reactor, "standalone", inherited)
    facades = Facades(
        make_facade=runtime.facade,
        listen=listen_on(reactor),
        make_prober=runtime.prober,
        clock=reactor,
        lan=lan_gate(config, reactor),
        make_poller=runtime.poller,
    )
    Standalone(config, reactor, facades, runtime.engine_agents, inherited).setServiceParent(root)
    root.handoff = Handoff(reactor, root.listening_sockets, root.handed_over)
    facades.setServiceParent(root)
    root.runtime, root.facades = runtime, facades
    return root


def broker_tree(config: Config, reactor) -> ProcessService:
    """Broker mode: no facade until ``facade/enable``; the link is stdio or ``--ipc``."""
    # Imported here: a standalone process never loads the broker's methods (0.4 MiB).
    from ..broker.broker import Broker

    if handed_over():
        raise SystemExit(
            "nvpair-proxy: inherited listening sockets (LISTEN_FDS) are for standalone mode "
            "(--engine); the broker opens facades itself"
        )
    root = ProcessService(reactor)
    root.drain_timeout = config.drain_timeout
    broker: Broker  # made last, from the link and the facades; the link calls it later
    link = LinkService(reactor, config.ipc, lambda method, params: broker.dispatch(method, params))
    directory = peer_agents = None
    if config.cluster_dir:
        directory = ClusterDirectory(config.cluster_dir)
        peer_agents = PeerAgents(
            reactor,
            directory,
            constants.DIAL_TIMEOUT,
            constants.POOL_IDLE_TIMEOUT,
            keepalive=config.upstream_keepalive,
        )
    runtime = Runtime.build(config, reactor, link.link, peer_agents)
    RuntimeService(runtime).setServiceParent(root)
    add_admin(root, runtime, config, reactor, "broker")
    link.setServiceParent(root)
    if directory is not None:
        trust_watch(directory, reactor).setServiceParent(root)
    facades = Facades(
        make_facade=runtime.facade,
        listen=listen_on(reactor),
        make_prober=runtime.prober,
        clock=reactor,
        admission=True,
        directory=directory,
        lan=lan_gate(config, reactor),
    )
    facades.setServiceParent(root)
    broker = Broker(
        engines=config.engines,
        emitter=link.link,
        reservations=runtime.reservations,
        state_dir=config.state_dir,
        facades=facades,
        on_shutdown=lambda: reactor.callLater(0, stop_once, reactor),
        after_answer=link.link.after_answer.append,
    )
    root.runtime, root.facades = runtime, facades
    return root


def handed_over() -> Inherited:
    """The listening sockets systemd or a predecessor handed this process; a set that cannot
    be used stops start-up with one line."""
    try:
        return inherited_sockets()
    except ValueError as exc:
        raise SystemExit(f"nvpair-proxy: {exc}") from None


def not_loopback(port) -> str | None:
    """Why an inherited admin socket is refused: it must be on a loopback address, as
    ``--admin`` must."""
    if is_loopback(port.getHost().host):
        return None
    return (
        "the inherited admin socket is not on a loopback address; "
        "the admin listener serves this machine only"
    )


def build_service(config: Config):
    from twisted.internet import reactor

    before, after = raise_descriptor_limit()
    log.info(
        "descriptors: at most {limit} open (soft RLIMIT_NOFILE{raised})",
        limit=after,
        raised=f", raised from {before}" if after != before else "",
    )

    if config.standalone:
        return standalone_tree(config, reactor)
    return broker_tree(config, reactor)
