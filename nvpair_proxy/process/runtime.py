"""What every facade of the process shares (docs/references.md#one-process), built once from
the command line: the pool and client, the agent per node, the reservation map, the run id, the
random source, the activity throttle, the recorder and the placement ``Policy``; and its place
in the service tree, first in and closed last (docs/references.md#shutdown-order)."""

from __future__ import annotations

import random
from typing import Callable

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IAgent

from ..admin.recorder import Recorder
from ..cluster.admission import peer_dialler
from ..cluster.trust import PeerAgents
from ..core import constants
from ..core.interfaces import IEmitter, IRequestRecorder
from ..core.logs import logger, set_access_log, set_level
from ..facade.facade import Facade, make_facade
from ..fleet.inventory import Prober
from ..fleet.truthpoller import TruthPoller
from ..http.client import Client
from ..http.loopguard import LoopGuard
from ..http.pool import ConnectionPool
from ..nodes.discovery import Node
from ..request.dispatch import Bounds
from ..request.events import ActivityThrottle, new_run_id
from ..routing.reservations import ReservationMap
from ..routing.tickets import Policy
from ..standalone.engineaccess import EngineAgents
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
        spill_keeps=config.affinity_spill == "keep",
        placement_header=config.placement_header,
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
