"""Wiring: the only module that touches the global reactor (imported inside functions).

Standalone mode builds its facades from the command line and its fleet from ``--nodes`` (or
this machine's engine). Broker mode is driven by the JSON-RPC link.
"""

from __future__ import annotations

import random

import attrs

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.web.client import Agent, HTTPConnectionPool

from . import constants
from .discovery import make_node
from .dispatch import Bounds
from .events import ActivityThrottle, LogEmitter, new_run_id
from .facade import Facade, facade_site
from .inventory import Prober
from .listener import DemuxFactory, listen_everywhere
from .logs import logger, set_level
from .nodesfile import Fleet, NodesFileError, NodesFileWatcher
from .options import Options
from .reservations import ReservationMap

log = logger()


def make_pool(reactor) -> HTTPConnectionPool:
    """One process-wide pool; idle connections kept as long as the engines keep them."""
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = 64
    pool.cachedConnectionTimeout = constants.POOL_IDLE_TIMEOUT
    pool.retryAutomatically = False
    return pool


@attrs.define(eq=False)
class Runtime:
    """What every facade of the process shares (spec 3.1): one pool and agent, one
    reservation map, one run id, one random source, one activity throttle."""

    reactor: object
    emitter: object
    bounds: Bounds
    pool: HTTPConnectionPool
    agent: Agent
    reservations: ReservationMap = attrs.Factory(ReservationMap)
    run_id: str = attrs.Factory(new_run_id)
    rng: random.Random = attrs.Factory(random.Random)
    activity: ActivityThrottle | None = None

    @classmethod
    def build(cls, options: Options, reactor, emitter) -> "Runtime":
        set_level(options["log-level"])
        pool = make_pool(reactor)
        return cls(reactor=reactor, emitter=emitter,
                   bounds=Bounds(response_timeout=options["response-timeout"]), pool=pool,
                   agent=Agent(reactor, pool=pool, connectTimeout=constants.DIAL_TIMEOUT),
                   activity=ActivityThrottle(emitter, reactor.seconds))

    def facade(self, engine) -> Facade:
        return Facade(engine=engine, clock=self.reactor, agent=self.agent, emitter=self.emitter,
                      run_id=self.run_id, random=self.rng.random, bounds=self.bounds,
                      reservations=self.reservations, activity=self.activity)

    def prober(self, facade: Facade, should_probe) -> Prober:
        return Prober(facade.engine, facade.nodes, self.agent, self.reactor, should_probe)

    def close(self, listening) -> Deferred:
        """Stop listening, give the facades their grace, close the pool last (protocol 1)."""
        stopped = DeferredList([maybeDeferred(port.stopListening) for port in listening],
                               consumeErrors=True)
        stopped.addTimeout(constants.FACADE_SHUTDOWN_GRACE, self.reactor)
        stopped.addBoth(lambda _: self.pool.closeCachedConnections())
        return stopped


class Supervised(Service):
    """systemd's view of the process: READY once serving, a watchdog, STOPPING at the end."""

    watchdog = None

    def announce_ready(self) -> None:
        """READY=1 once the reactor runs, not when the service starts.

        twistd starts services before ``reactor.run`` installs the SIGTERM/SIGINT handlers; a
        stop signal sent right after an early READY=1 killed the process by signal (status
        143) instead of the orderly exit 0 of protocol 1.
        """
        exit_zero_after_signal(self.reactor)
        self.reactor.callWhenRunning(self._ready)

    def _ready(self) -> None:
        from .sdnotify import notify, start_watchdog
        notify("READY=1")
        self.watchdog = start_watchdog(self.reactor)

    def announce_stopping(self) -> None:
        from .sdnotify import notify
        notify("STOPPING=1")
        if self.watchdog is not None and self.watchdog.running:
            self.watchdog.stop()


def local_fleet(options: Options) -> Fleet:
    """Without --nodes, this machine's engine is the fleet (design 3).

    The engine is looked for on its own client-facing port, or on its relocated port when the
    facade itself sits on the client-facing one.
    """
    nodes, probed = {}, set()
    for engine_id, port in options["facades"]:
        engine = options.engines[engine_id]
        engine_port = engine.ports.relocated if port == engine.ports.own else engine.ports.own
        nodes[engine_id] = (make_node(engine, id="local", name="local", port=engine_port,
                                      addresses=["127.0.0.1"], source="standalone"),)
        probed.add((engine_id, "local"))
    return Fleet(nodes, frozenset(probed))


class StandaloneService(Supervised):
    """Facades from ``--engine``, fleet from ``--nodes``; events to the log."""

    def __init__(self, options: Options, reactor) -> None:
        self.options, self.reactor = options, reactor
        self.facades: dict[str, Facade] = {}
        self.ports = []
        self.probers: list[Prober] = []
        self.watcher: NodesFileWatcher | None = None
        self.probed: frozenset = frozenset()

    def privilegedStartService(self) -> None:
        """Bind and load before the reactor runs, so a bad port or file stops start-up."""
        options, reactor = self.options, self.reactor
        self.runtime = Runtime.build(options, reactor, LogEmitter())
        for engine_id, port in options["facades"]:
            facade = self.runtime.facade(options.engines[engine_id])
            try:
                listening = listen_everywhere(reactor, port, DemuxFactory(facade_site(facade, reactor)))
            except CannotListenError as exc:
                raise SystemExit(f"nvpair-proxy: {engine_id}: cannot listen on port {port}: "
                                 f"{exc.socketError}") from None
            self.facades[engine_id] = facade
            self.ports.append(listening)
            log.info("{engine} facade listening on port {port}", engine=engine_id,
                     port=listening.getHost().port)
        if options["nodes"]:
            self.watcher = NodesFileWatcher(options["nodes"], options.engines, reactor, self.apply)
            try:
                self.watcher.load()
            except NodesFileError as exc:
                raise SystemExit(f"nvpair-proxy: --nodes: {exc}") from None
        else:
            self.apply(local_fleet(options))
        for engine_id, facade in self.facades.items():
            self.probers.append(self.runtime.prober(
                facade, lambda node, e=engine_id: (e, node.id) in self.probed))

    def apply(self, fleet: Fleet) -> None:
        self.probed = fleet.probed
        for engine_id, facade in self.facades.items():
            known = {n.id: n for n in facade.nodes.routable()}
            nodes = []
            for node in fleet.nodes.get(engine_id, ()):
                old = known.get(node.id)
                if (engine_id, node.id) in fleet.probed and old is not None:
                    node = attrs.evolve(node, models=old.models, advertised=old.advertised)
                nodes.append(node)
            facade.nodes.replace_discovered(nodes)

    def startService(self) -> None:
        super().startService()
        if self.watcher is not None:
            self.watcher.start()
        for prober in self.probers:
            prober.start()
        self.announce_ready()

    def stopService(self) -> Deferred:
        super().stopService()
        self.announce_stopping()
        if self.watcher is not None:
            self.watcher.stop()
        for prober in self.probers:
            prober.stop()
        for facade in self.facades.values():
            facade.shutdown()
        return self.runtime.close(self.ports)


def exit_zero_after_signal(reactor) -> None:
    """SIGTERM and SIGINT are orderly stops here (protocol 1: exit 0).

    twistd re-raises the signal that stopped the reactor once shutdown has finished, so the
    process would die by signal (status 143) after a clean shutdown; forget it instead.
    """
    def forget() -> None:
        if getattr(reactor, "_exitSignal", None) is not None:
            reactor._exitSignal = None
    reactor.addSystemEventTrigger("after", "shutdown", forget)


def claim_stdout() -> int:
    """Give the link the real stdout and point fd 1 at stderr (design 3).

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
    """Connect to the broker's socket at start-up; failure is one clear line (decision 18)."""
    import socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"nvpair-proxy: --ipc: cannot connect to {path}: "
                         f"{exc.strerror or exc}") from None
    return sock


class BrokerService(Supervised):
    """Broker mode: no facade until ``facade/enable``; the link is stdio or ``--ipc``."""

    def __init__(self, options: Options, reactor) -> None:
        self.options, self.reactor = options, reactor
        self.sock = None
        # Before twistd starts its log observer on stdout (makeService runs first).
        self.link_fd = None if options["ipc"] else claim_stdout()
        self.stopping = False

    def privilegedStartService(self) -> None:
        from .broker import Broker
        from .rpc import RpcLink
        options, reactor = self.options, self.reactor
        if options["ipc"]:
            self.sock = connect_ipc(options["ipc"])
        self.link = RpcLink(lambda method, params: self.broker.dispatch(method, params),
                            on_closed=self._link_closed)
        self.runtime = Runtime.build(options, reactor, self.link)
        self.directory = self.peer_agents = None
        if options["cluster-dir"]:
            from .trust import ClusterDirectory, PeerAgents
            self.directory = ClusterDirectory(options["cluster-dir"])
            self.directory.refresh()
            self.peer_agents = PeerAgents(reactor, self.directory, constants.DIAL_TIMEOUT,
                                          constants.POOL_IDLE_TIMEOUT)
        self.broker = Broker(
            directory=self.directory, peer_agents=self.peer_agents,
            engines=options.engines, emitter=self.link,
            reservations=self.runtime.reservations, state_dir=options["state-dir"],
            make_facade=self.runtime.facade,
            listen=lambda port, factory, interface: (
                listen_everywhere(reactor, port, factory) if interface == "::"
                else reactor.listenTCP(port, factory, interface=interface)),
            make_prober=self.runtime.prober, on_shutdown=self._shutdown_requested,
            after_answer=self.link.after_answer.append)

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
            StandardIO(self.link.framer, stdin=0, stdout=self.link_fd, reactor=self.reactor)
        if self.directory is not None:
            self.directory.start(self.reactor)
        self.announce_ready()
        log.info("nvpair-proxy broker link up ({channel})",
                 channel=self.options["ipc"] or "stdio")

    def _link_closed(self) -> None:
        if self.running and not self.stopping:
            log.info("broker link closed; shutting down")
            self.reactor.stop()

    def _shutdown_requested(self) -> None:
        self.reactor.callLater(0, self.reactor.stop)

    def stopService(self) -> Deferred:
        super().stopService()
        self.announce_stopping()
        if self.directory is not None:
            self.directory.stop()
        stopped = self.runtime.close(self.broker.stop_all())
        if self.peer_agents is not None:
            stopped.addBoth(lambda _: self.peer_agents.close())
        stopped.addBoth(self._close_link)
        return stopped

    def _close_link(self, result):
        """Flush what the link still holds (the shutdown answer, the cancelled events)
        before the reactor tears connections down."""
        from twisted.internet.defer import Deferred
        self.stopping = True
        transport = self.link.framer.transport
        if transport is None or getattr(transport, "disconnected", False):
            return result
        flushed = Deferred()
        self.link.framer.on_closed = lambda reason: flushed.called or flushed.callback(None)
        transport.loseConnection()
        flushed.addTimeout(constants.FACADE_SHUTDOWN_GRACE, self.reactor)
        flushed.addErrback(lambda _: None)
        return flushed.addCallback(lambda _: result)


def build_service(options: Options):
    from twisted.internet import reactor
    if options.standalone:
        return StandaloneService(options, reactor)
    return BrokerService(options, reactor)
