"""Wiring: the only module that touches the global reactor (imported inside functions).

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
import random
from typing import Callable

import attrs
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.iweb import IAgent
from zope.interface import implementer

from ..cluster.admission import peer_dialler
from ..cluster.trust import PeerAgents
from ..core import constants
from ..core.interfaces import IEmitter, IRequestRecorder, IStatusSource
from ..core.logs import logger, set_access_log, set_level
from ..core.views import ProcessSnapshot
from ..core.warnonce import WarnOnce
from ..facade.facade import Facade, make_facade
from ..facade.facadeservice import Facades, listen_on
from ..fleet.inventory import Prober
from ..fleet.truthpoller import TruthPoller
from ..http.client import Client
from ..http.loopguard import LoopGuard
from ..http.pool import ConnectionPool
from ..nodes.discovery import Node, make_node
from ..nodes.selfcheck import self_reason
from ..request.dispatch import Bounds
from ..request.events import ActivityThrottle, LogEmitter, new_run_id
from ..routing.reservations import ReservationMap
from ..routing.tickets import Policy
from ..standalone.engineaccess import EngineAgents
from ..standalone.nodesfile import ConfiguredNodes, NodesFileError, NodesFileWatcher, tls_configs
from .options import Config

log = logger()


def make_pool(reactor) -> ConnectionPool:
    """One process-wide pool; idle connections kept as long as the engines keep them."""
    return ConnectionPool(reactor, max_idle_per_host=256, idle_timeout=constants.POOL_IDLE_TIMEOUT)


def policy_of(config: Config) -> Policy:
    """How the facades place requests, read once from the command line: standalone mode ranks
    by what engines report and, unless ``--no-late-binding``, lets requests wait in the
    facade's queue; affinity is on by default there and opt-in under the broker."""
    late = config.standalone and config.late_binding
    return Policy(
        ranking=config.standalone,
        queue_depth=config.queue_depth if late else None,
        affinity=config.affinity,
    )


@attrs.define(eq=False)
class Runtime:
    """What every facade of the process shares (docs/references.md#one-process): one pool and agent,
    one reservation map, one run id, one random source, one activity throttle."""

    reactor: IReactorTime
    emitter: IEmitter
    bounds: Bounds
    pool: ConnectionPool
    agent: Client
    reservations: ReservationMap = attrs.Factory(ReservationMap)
    run_id: str = attrs.Factory(new_run_id)
    loop_guard: LoopGuard = attrs.Factory(LoopGuard)
    rng: random.Random = attrs.Factory(random.Random)
    activity: ActivityThrottle | None = None
    engine_agents: EngineAgents | None = None
    recorder: IRequestRecorder | None = None
    # Broker mode with --cluster-dir: one pinned pool per peer, closed with the shared one.
    peer_agents: PeerAgents | None = None
    # The agent per node, given to every facade when it is made (None: all share ``agent``).
    agent_for_node: Callable[[Node], IAgent] | None = None
    # How every facade places requests (standalone: ranked, late binding, affinity).
    policy: Policy = Policy()

    @classmethod
    def build(
        cls,
        config: Config,
        reactor: IReactorTime,
        emitter: IEmitter,
        peer_agents: PeerAgents | None = None,
    ) -> "Runtime":
        set_level(config.log_level)
        set_access_log(config.access_log)
        pool = make_pool(reactor)
        agent = Client(
            reactor,
            pool,
            connect_timeout=constants.DIAL_TIMEOUT,
            keepalive=config.upstream_keepalive,
        )
        recorder: IRequestRecorder | None = None
        if config.admin is not None:
            from ..admin.recorder import Recorder

            recorder = Recorder()
        # Only a nodes file names engine TLS or keys: standalone mode only.
        engine_agents: EngineAgents | None = None
        agent_for_node: Callable[[Node], IAgent] | None = None
        if config.standalone:
            engine_agents = EngineAgents(
                reactor,
                agent,
                constants.DIAL_TIMEOUT,
                constants.POOL_IDLE_TIMEOUT,
                keepalive=config.upstream_keepalive,
            )
            agent_for_node = engine_agents.for_node
        elif peer_agents is not None:
            agent_for_node = peer_dialler(peer_agents, agent)
        return cls(
            reactor=reactor,
            emitter=emitter,
            recorder=recorder,
            bounds=Bounds(response_timeout=config.response_timeout, stream_idle=config.stream_idle),
            pool=pool,
            agent=agent,
            activity=ActivityThrottle(emitter, reactor.seconds),
            engine_agents=engine_agents,
            peer_agents=peer_agents,
            agent_for_node=agent_for_node,
            policy=policy_of(config),
        )

    def facade(self, engine) -> Facade:
        return make_facade(
            engine,
            clock=self.reactor,
            agent=self.agent,
            emitter=self.emitter,
            run_id=self.run_id,
            random=self.rng.random,
            bounds=self.bounds,
            reservations=self.reservations,
            activity=self.activity,
            recorder=self.recorder,
            agent_for_node=self.agent_for_node,
            loop_guard=self.loop_guard,
            policy=self.policy,
        )

    def poller(self, facade: Facade) -> TruthPoller:
        """Standalone mode: what each node's engine reports, for placement."""
        return TruthPoller(
            facade.engine,
            facade.router,
            facade.upstreams.agent_for,
            self.reactor,
            self.rng.random,
            loop_guard=facade.upstreams.loop_guard,
        )

    def prober(self, facade: Facade, should_probe) -> Prober:
        return Prober(
            facade.engine,
            facade.router,
            self.agent,
            self.reactor,
            should_probe,
            agent_for=facade.upstreams.agent_for,
            loop_guard=facade.upstreams.loop_guard,
        )


class RuntimeService(Service):
    """The runtime's place in the tree: first in, so its pool closes last
    (docs/references.md#shutdown-order): requests in flight hold pooled connections until the
    facades have cancelled them."""

    name = "runtime"  # type: ignore[assignment]  # Twisted leaves Service.name untyped (None)

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def stopService(self) -> Deferred:
        super().stopService()
        closing = [maybeDeferred(self.runtime.pool.closeCachedConnections)]
        if self.runtime.engine_agents is not None:
            closing.append(maybeDeferred(self.runtime.engine_agents.close))
        if self.runtime.peer_agents is not None:
            closing.append(maybeDeferred(self.runtime.peer_agents.close))
        return DeferredList(closing, consumeErrors=True).addCallback(lambda _: None)


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
        from ..core.sdnotify import notify, watchdog

        if not self.running:
            return
        stop_on_signals(self.reactor)
        freeze_heap()
        notify("READY=1")
        pinging = watchdog(self.reactor)
        if pinging is not None:
            pinging.setServiceParent(self)

    def stopService(self) -> Deferred:
        from ..core.sdnotify import notify

        Service.stopService(self)
        notify("STOPPING=1")
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
        self, config: Config, reactor, facades: Facades, engine_agents: EngineAgents | None = None
    ) -> None:
        super().__init__()
        self.config, self.facades, self.engine_agents = config, facades, engine_agents
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
                    config.engines[engine_id], port, should_probe=self._probes(engine_id)
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


def stop_once(reactor) -> None:
    """Stop the reactor unless it is already stopping: a broker's ``shutdown`` followed by
    SIGTERM, or Ctrl-C twice, must not log a ReactorNotRunning traceback."""
    from twisted.internet.error import ReactorNotRunning

    try:
        reactor.stop()
    except ReactorNotRunning:
        pass


def stop_on_signals(reactor) -> None:
    """SIGTERM and SIGINT are orderly stops here (docs/references.md#shutdown-order: exit 0).

    The reactor's own handlers remember the signal, and twistd re-raises it once shutdown
    has finished, so the process would die by signal (status 143) after a clean shutdown.
    Ours, installed once the reactor's are (it is running), only stop the reactor.
    """
    import signal

    def stop(number: int, frame) -> None:
        log.info("received {signal}, shutting down", signal=signal.Signals(number).name)
        reactor.callFromThread(stop_once, reactor)

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stop)


def claim_stdout() -> int:
    """Give the link the real stdout and point fd 1 at stderr (docs/references.md#stdout-for-link).

    After this, a stray print or a library writing to stdout lands in the log, never in the
    middle of a JSON-RPC line.
    """
    import os
    import sys

    sys.stdout.flush()
    link_fd = os.dup(1)
    os.dup2(2, 1)
    return link_fd


def connect_ipc(path: str):
    """Connect to the broker's socket at start-up; failure is one clear line
    (docs/references.md#ready-and-ipc)."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"nvpair-proxy: --ipc: cannot connect to {path}: {exc.strerror or exc}"
        ) from None
    return sock


class LinkService(Service):
    """The broker link: stdio (the claimed fd 1) or the ``--ipc`` socket
    (docs/references.md#rpc-transport)."""

    name = "link"  # type: ignore[assignment]  # Twisted leaves Service.name untyped (None)

    def __init__(self, reactor, ipc: str | None, dispatch) -> None:
        from ..broker.rpc import RpcLink

        self.reactor, self.ipc = reactor, ipc
        self.sock = None
        # Before twistd starts its log observer on stdout (makeService runs first).
        self.link_fd = None if ipc else claim_stdout()
        self.link = RpcLink(dispatch, on_closed=self._closed)

    def privilegedStartService(self) -> None:
        if self.ipc:
            self.sock = connect_ipc(self.ipc)

    def startService(self) -> None:
        super().startService()
        import socket

        from twisted.internet.protocol import Factory
        from twisted.internet.stdio import StandardIO

        if self.sock is not None:
            factory = Factory.forProtocol(lambda: self.link.framer)
            self.reactor.adoptStreamConnection(self.sock.fileno(), socket.AF_UNIX, factory)
            self.sock.close()
        else:
            # POSIX's StandardIO; mypy reads stdio's Windows branch, which takes no fds.
            StandardIO(
                self.link.framer,
                stdin=0,
                stdout=self.link_fd,  # type: ignore[call-arg]
                reactor=self.reactor,
            )
        log.info("nvpair-proxy broker link up ({channel})", channel=self.ipc or "stdio")

    def is_up(self) -> bool:
        """Running, and the link to the broker open: what ``/healthz`` and the
        ``broker_link_up`` gauge report."""
        return bool(self.running and self.link.is_open())

    def _closed(self) -> None:
        """EOF ends the process (docs/references.md#shutdown-order), unless it is already ending."""
        if self.running and self.parent is not None and self.parent.running:
            log.info("broker link closed; shutting down")
            stop_once(self.reactor)

    def stopService(self) -> Deferred:
        """Flush what the link still holds (the shutdown answer, the cancelled events)
        before the reactor tears connections down; at most the grace."""
        super().stopService()
        transport = self.link.framer.transport
        if transport is None or getattr(transport, "disconnected", False):
            return succeed(None)
        flushed: Deferred[None] = Deferred()

        def closed(reason: Failure) -> None:
            if not flushed.called:
                flushed.callback(None)

        self.link.framer.on_closed = closed
        transport.loseConnection()
        flushed.addTimeout(constants.FACADE_SHUTDOWN_GRACE, self.reactor)
        return flushed.addErrback(lambda _: None)


def lan_gate(config: Config, reactor):
    """The opt-in LAN keys every facade's listener asks (docs/references.md#lan-keys), the same in
    both modes."""
    from ..lan.apikeys import KeyStore, LanGate

    return LanGate(
        KeyStore(reactor, env=config.api_keys, path=config.api_keys_file),
        allowed=list(config.allowed_cidrs),
    )


def add_admin(root: ProcessService, runtime: Runtime, config: Config, reactor, mode: str) -> None:
    """The admin listener (docs/references.md#admin-listener), when ``--admin`` asks for it: it
    reads the tree's snapshots and the runtime's recorder (made whenever ``--admin`` is given)."""
    if config.admin is not None:
        from ..admin.admin import AdminService
        from ..admin.recorder import Recorder

        recorder = runtime.recorder
        assert isinstance(recorder, Recorder)
        AdminService(root, recorder, config.admin, reactor, mode).setServiceParent(root)


def standalone_tree(config: Config, reactor) -> ProcessService:
    """Facades from ``--engine``, fleet from ``--nodes``; events to the log."""
    root = ProcessService(reactor)
    runtime = Runtime.build(config, reactor, LogEmitter())
    RuntimeService(runtime).setServiceParent(root)
    add_admin(root, runtime, config, reactor, "standalone")
    facades = Facades(
        make_facade=runtime.facade,
        listen=listen_on(reactor),
        make_prober=runtime.prober,
        clock=reactor,
        lan=lan_gate(config, reactor),
        make_poller=runtime.poller,
    )
    Standalone(config, reactor, facades, runtime.engine_agents).setServiceParent(root)
    facades.setServiceParent(root)
    root.runtime, root.facades = runtime, facades
    return root


def broker_tree(config: Config, reactor) -> ProcessService:
    """Broker mode: no facade until ``facade/enable``; the link is stdio or ``--ipc``."""
    from ..broker.broker import Broker

    root = ProcessService(reactor)
    broker: Broker  # made last, from the link and the facades; the link calls it later
    link = LinkService(reactor, config.ipc, lambda method, params: broker.dispatch(method, params))
    directory = peer_agents = None
    if config.cluster_dir:
        from ..cluster.trust import ClusterDirectory

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
        from ..cluster.trust import trust_watch

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


def build_service(config: Config):
    from twisted.internet import reactor

    if config.standalone:
        return standalone_tree(config, reactor)
    return broker_tree(config, reactor)
