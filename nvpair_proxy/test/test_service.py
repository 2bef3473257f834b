"""The wiring: the implicit local fleet, the shared pool, and the service tree (protocol 1)."""

from __future__ import annotations

import os

from twisted.application.internet import TimerService
from twisted.application.service import Service
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core import constants, logs
from nvpair_proxy.facade.facadeservice import Facades, FacadeService
from nvpair_proxy.fleet.inventory import Prober
from nvpair_proxy.nodes.discovery import make_node
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.process.options import Config, Options
from nvpair_proxy.process.runtime import Runtime, RuntimeService, make_pool
from nvpair_proxy.process.service import (
    ProcessService,
    broker_tree,
    local_fleet,
    standalone_tree,
)
from nvpair_proxy.routing.router import Router
from nvpair_proxy.test.support import Wire
from nvpair_proxy.test.world import Client, connect, request_bytes
from nvpair_proxy.testing import lan, loopback

ENGINES = load_engines()


def parsed(*args: str) -> Config:
    options = Options()
    options.parseOptions(list(args))
    return options.config


class LocalFleetTests(SynchronousTestCase):
    def test_without_nodes_the_engine_on_its_own_port_is_the_fleet(self):
        fleet = local_fleet(parsed("--engine", "ollama", "--engine", "lmstudio:1300"))
        (ollama,), (lmstudio,) = fleet.nodes["ollama"], fleet.nodes["lmstudio"]
        self.assertEqual(
            (ollama.id, ollama.addresses, ollama.port), ("local", ("127.0.0.1",), 11434)
        )
        self.assertEqual(lmstudio.port, 1234)
        self.assertEqual(fleet.probed, {("ollama", "local"), ("lmstudio", "local")})
        self.assertIsNone(ollama.models)

    def test_a_facade_on_the_engines_own_port_looks_for_it_on_the_relocated_port(self):
        fleet = local_fleet(
            parsed("--engine", "lmstudio", "--engine", "llamacpp", "--engine", "ollama:11434")
        )
        self.assertEqual(
            [fleet.nodes[e][0].port for e in ("lmstudio", "llamacpp", "ollama")],
            [1235, 8081, 11435],
        )


class PoolTests(SynchronousTestCase):
    def test_pool_keeps_idle_connections_as_long_as_the_servers_do(self):
        pool = make_pool(MemoryReactorClock())
        self.assertEqual(pool.idle_timeout, constants.POOL_IDLE_TIMEOUT)
        self.assertEqual(constants.POOL_IDLE_TIMEOUT, constants.SERVER_IDLE_TIMEOUT)
        self.assertGreaterEqual(pool.max_idle_per_host, 256)


class Steps:
    """The fakes of one process tree, writing what they did into one list, in order."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def port(self, closes: Deferred | None = None):
        steps = self

        class Port:
            def stopListening(self):
                steps.done.append("stop listening")
                return closes

        return Port()

    def facade(self, engine_id: str = "ollama"):
        steps = self

        class FakeFacade:
            engine = ENGINES[engine_id]
            router = Router(engine=ENGINES[engine_id], clock=Clock())

            def shutdown(self):
                steps.done.append("cancel in flight")

        return FakeFacade()

    def runtime(self):
        steps = self

        class Pool:
            def closeCachedConnections(self):
                steps.done.append("pool closed")
                return succeed(None)

        return Runtime(reactor=None, emitter=None, bounds=None, pool=Pool(), agent=None)


class OwnPortsTests(SynchronousTestCase):
    """The ports a facade is reached on are asked for with every request in broker mode;
    the bound port is read from its listening port once, and again only after a move."""

    def test_the_bound_port_is_read_once_per_listening_port(self):
        asked: list[int] = []

        class Port:
            def __init__(self, number: int) -> None:
                self.number = number

            def getHost(self):
                asked.append(self.number)
                return IPv4Address("TCP", "0.0.0.0", self.number)

            def stopListening(self):
                return None

        numbers = iter([41000, 42000])
        clock = MemoryReactorClock()
        prober = TimerService(5, lambda: None)
        service = FacadeService(
            Steps().facade(),
            None,
            lambda port, factory, interface: Port(next(numbers)),
            prober,
            clock,
            0,
        )
        self.assertEqual([service.own_ports() for _ in range(3)], [frozenset({41000})] * 3)
        self.assertEqual(asked, [41000])
        service.move(0, lambda: None)
        service.alias_port = 11434
        self.assertEqual([service.own_ports() for _ in range(2)], [frozenset({42000, 11434})] * 2)
        self.assertEqual(asked, [41000, 42000])


class StartingHandoff:
    """A hot handoff whose successor is still starting: records that it was stopped."""

    handed_over = False

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops

    def stop(self) -> None:
        self.stops.append("successor stopped")


class StopOrderTests(SynchronousTestCase):
    """Protocol 1: stop accepting, cancel in-flight requests, the grace, the pool last; the
    order is the tree's (children stop in reverse order of addition, one after another)."""

    def tree(self, closes: Deferred | None = None):
        self.clock, self.steps = MemoryReactorClock(), Steps()
        root = ProcessService(self.clock)
        RuntimeService(self.steps.runtime()).setServiceParent(root)
        facades = Facades(make_facade=None, listen=None, make_prober=None, clock=self.clock)
        facades.setServiceParent(root)
        prober = TimerService(5, lambda: None)
        prober.clock = self.clock
        facades.add(
            FacadeService(
                self.steps.facade(),
                None,
                lambda port, factory, interface: self.steps.port(closes),
                prober,
                self.clock,
                11435,
            )
        )
        root.startService()
        return root

    def test_stop_listening_then_cancel_in_flight_then_grace_then_pool(self):
        root = self.tree(closes=Deferred())
        stopped = root.stopService()
        self.assertEqual(self.steps.done, ["stop listening", "cancel in flight"])
        self.clock.advance(constants.FACADE_SHUTDOWN_GRACE - 0.1)
        self.assertNoResult(stopped)
        self.assertEqual(self.steps.done, ["stop listening", "cancel in flight"])
        self.clock.advance(0.1)
        self.assertEqual(self.steps.done, ["stop listening", "cancel in flight", "pool closed"])
        self.successResultOf(stopped)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_stop_during_a_hot_handoff_stops_the_starting_successor(self):
        root = self.tree(closes=None)
        stops: list[str] = []
        root.handoff = StartingHandoff(stops)  # type: ignore[assignment]
        self.successResultOf(root.stopService())
        self.assertEqual(stops, ["successor stopped"])

    def test_a_sigterms_drain_stops_a_starting_successor_before_it_can_take_over(self):
        """Its READY=1 must not name it the main process of a service that is stopping."""
        root = self.tree(closes=None)
        stops: list[str] = []
        root.handoff = StartingHandoff(stops)  # type: ignore[assignment]
        root.drain_timeout = 30.0
        root.facades = []  # nothing admitted: the drain ends at once
        self.assertTrue(root.drain())
        self.assertEqual(stops, ["successor stopped"])

    def test_ports_that_close_at_once_do_not_wait_for_the_grace(self):
        root = self.tree(closes=None)
        self.successResultOf(root.stopService())
        self.assertEqual(self.steps.done, ["stop listening", "cancel in flight", "pool closed"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_facades_stop_together_under_one_grace(self):
        self.clock, self.steps = MemoryReactorClock(), Steps()
        root = ProcessService(self.clock)
        RuntimeService(self.steps.runtime()).setServiceParent(root)
        facades = Facades(make_facade=None, listen=None, make_prober=None, clock=self.clock)
        facades.setServiceParent(root)
        for engine_id in ("ollama", "lmstudio"):
            prober = TimerService(5, lambda: None)
            prober.clock = self.clock
            facades.add(
                FacadeService(
                    self.steps.facade(engine_id),
                    None,
                    lambda port, factory, interface: self.steps.port(Deferred()),
                    prober,
                    self.clock,
                    1,
                )
            )
        root.startService()
        stopped = root.stopService()
        self.assertEqual(self.steps.done, ["stop listening", "cancel in flight"] * 2)
        self.clock.advance(constants.FACADE_SHUTDOWN_GRACE)
        self.assertEqual(self.steps.done[-1], "pool closed")
        self.successResultOf(stopped)

    def test_a_step_that_fails_is_logged_and_the_pool_still_closes(self):
        root = self.tree()

        class Broken(Service):
            def stopService(self):
                raise RuntimeError("broken step")

        Broken().setServiceParent(root)
        self.successResultOf(root.stopService())
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(self.steps.done[-1], "pool closed")


class PeriodicTaskTests(SynchronousTestCase):
    """Every periodic task is a TimerService of the tree: it runs at once and then at its
    interval on the injected clock, and stopping its service leaves no timer behind."""

    def assertRunsEvery(self, service, interval: float, calls: list) -> None:
        clock = service.clock
        service.startService()
        self.assertEqual(len(calls), 1)
        clock.advance(interval - 0.01)
        self.assertEqual(len(calls), 1)
        clock.advance(0.01)
        self.assertEqual(len(calls), 2)
        self.successResultOf(service.stopService())
        clock.advance(interval * 10)
        self.assertEqual(len(calls), 2)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_watchdog_every_half_watchdog_usec(self):
        from nvpair_proxy.core import sdnotify

        calls = []
        self.patch(sdnotify, "notify", lambda state, environ: calls.append(state))
        service = sdnotify.watchdog(Clock(), {"WATCHDOG_USEC": "3000000"})
        self.assertRunsEvery(service, 1.5, calls)
        self.assertEqual(set(calls), {"WATCHDOG=1"})

    def test_trust_watch_every_two_seconds(self):
        from nvpair_proxy.cluster.trust import ClusterDirectory, trust_watch

        calls = []
        self.patch(ClusterDirectory, "refresh", lambda self: calls.append(self.path))
        self.assertRunsEvery(trust_watch(ClusterDirectory("/nonexistent"), Clock()), 2.0, calls)

    def test_nodes_file_watch_every_two_seconds(self):
        from nvpair_proxy.standalone.nodesfile import NodesFileWatcher

        calls = []
        self.patch(NodesFileWatcher, "check", lambda self: calls.append(self.path))
        service = NodesFileWatcher("nodes.toml", ENGINES, Clock(), lambda fleet: None)
        self.assertRunsEvery(service, constants.NODES_FILE_CHECK_INTERVAL, calls)
        self.assertEqual(constants.NODES_FILE_CHECK_INTERVAL, 2.0)

    def test_inventory_probing_every_five_seconds(self):
        from nvpair_proxy.nodes.discovery import NodeSet

        calls = []
        self.patch(Prober, "probe_all", lambda self: calls.append(self.engine.id))
        service = Prober(ENGINES["ollama"], NodeSet(), None, Clock(), lambda node: True)
        self.assertRunsEvery(service, constants.INVENTORY_PROBE_INTERVAL, calls)
        self.assertEqual(constants.INVENTORY_PROBE_INTERVAL, 5.0)

    def test_a_probe_in_flight_is_cancelled_when_probing_stops(self):
        from nvpair_proxy.nodes.discovery import NodeSet, make_node
        from nvpair_proxy.testing import FakeAgent

        nodes, agent, clock = NodeSet(), FakeAgent(), Clock()
        nodes.put_manual(
            make_node(ENGINES["ollama"], id="silent", port=11434, addresses=["10.0.0.1"])
        )
        prober = Prober(ENGINES["ollama"], nodes, agent, clock, lambda node: True)
        prober.startService()
        self.assertEqual(len(agent.requests), 1)
        self.successResultOf(prober.stopService())
        self.assertTrue(agent.requests[0].cancelled)
        self.assertEqual(clock.getDelayedCalls(), [])


class TreeTests(SynchronousTestCase):
    """The trees the plugin builds, on a MemoryReactorClock."""

    def setUp(self):
        from nvpair_proxy.core import sdnotify
        from nvpair_proxy.process import service

        self.notified: list[str] = []
        self.signals: list[object] = []
        self.patch(sdnotify, "notify", lambda state, environ=None: self.notified.append(state))
        self.patch(
            service, "stop_on_signals", lambda reactor, drain=None: self.signals.append(reactor)
        )
        self.patch(service, "freeze_heap", lambda: self.notified.append("heap frozen"))
        self.addCleanup(logs.set_level, logs.level_name())

    def test_standalone_tree(self):
        reactor = MemoryReactorClock()
        root = standalone_tree(
            parsed("--engine", "ollama:1300", "--engine", "lmstudio:1301"), reactor
        )
        self.assertEqual([s.name for s in root], ["runtime", "standalone", "facades"])
        root.privilegedStartService()
        facades = root.getServiceNamed("facades")
        self.assertEqual(
            [(s.name, s.port) for s in facades], [("ollama", 1300), ("lmstudio", 1301)]
        )
        self.assertEqual([(t[0], t[3]) for t in reactor.tcpServers], [(1300, "::"), (1301, "::")])
        self.assertEqual([list(s) for s in facades], [[s.prober, s.poller] for s in facades])
        self.assertEqual([type(s.poller).__name__ for s in facades], ["TruthPoller"] * 2)
        self.assertEqual(
            [(s.facade.router.scheduling, s.facade.router.queue.depth) for s in facades],
            [(True, 1000), (True, 1000)],
        )

    def test_no_late_binding_leaves_the_queue_out_and_queue_depth_sets_it(self):
        reactor = MemoryReactorClock()
        off = standalone_tree(parsed("--engine", "ollama:1300", "--no-late-binding"), reactor)
        deep = standalone_tree(parsed("--engine", "ollama:1301", "--queue-depth", "7"), reactor)

        def router_of(root):
            root.privilegedStartService()
            return root.getServiceNamed("facades")["ollama"].facade.router

        router = router_of(off)
        self.assertEqual((router.scheduling, router.queue), (True, None))
        self.assertEqual(router_of(deep).queue.depth, 7)

    def test_the_keepalive_flag_reaches_every_upstream_client(self):
        reactor = MemoryReactorClock()
        root = standalone_tree(
            parsed("--engine", "ollama:1300", "--upstream-keepalive", "7"), reactor
        )
        self.assertEqual(
            (root.runtime.agent.keepalive, root.runtime.engine_agents.keepalive), (7.0, 7.0)
        )

    def test_a_fleet_applied_tells_the_engine_clients_which_tls_configurations_remain(self):
        reactor = MemoryReactorClock()
        root = standalone_tree(parsed("--engine", "ollama:1300"), reactor)
        kept = []
        self.patch(root.runtime.engine_agents, "retain", kept.append)
        root.privilegedStartService()
        self.assertEqual(kept, [set()], "the local engine over plain http: no TLS configuration")

    def test_ready_once_the_reactor_runs_then_the_watchdog(self):
        previous = os.environ.get("WATCHDOG_USEC")
        os.environ["WATCHDOG_USEC"] = "4000000"
        self.addCleanup(
            lambda: (
                os.environ.pop("WATCHDOG_USEC")
                if previous is None
                else os.environ.update(WATCHDOG_USEC=previous)
            )
        )
        reactor = MemoryReactorClock()
        root = standalone_tree(parsed("--engine", "ollama:1300"), reactor)
        root.privilegedStartService()
        root.startService()
        self.assertEqual((self.notified, self.signals), ([], []))
        reactor.run()
        self.assertEqual(self.notified, ["heap frozen", "READY=1", "WATCHDOG=1"])
        self.assertEqual(self.signals, [reactor])
        self.assertEqual([s.name for s in root][-1], "watchdog")
        self.successResultOf(root.stopService())
        self.assertEqual(self.notified, ["heap frozen", "READY=1", "WATCHDOG=1", "STOPPING=1"])
        self.assertFalse(root.getServiceNamed("watchdog").running)

    def test_broker_tree(self):
        from nvpair_proxy.process import link

        self.patch(link, "claim_stdout", lambda: 99)
        cluster = self.mktemp()
        os.makedirs(cluster)
        root = broker_tree(parsed("--cluster-dir", cluster), MemoryReactorClock())
        self.assertEqual([s.name for s in root], ["runtime", "link", "trust watch", "facades"])
        self.assertEqual(list(root.getServiceNamed("facades")), [])

    def test_a_broker_facade_dials_pinned_peers_on_their_pool_and_the_rest_on_the_shared(self):
        from nvpair_proxy.process import link

        self.patch(link, "claim_stdout", lambda: 99)
        cluster = self.mktemp()
        os.makedirs(cluster)
        root = broker_tree(parsed("--cluster-dir", cluster), MemoryReactorClock())
        facade = root.runtime.facade(ENGINES["ollama"])
        peer = make_node(
            ENGINES["ollama"],
            id="node-b",
            port=11434,
            addresses=["10.0.0.2"],
            scheme="https",
            cluster_uuid="node-b",
        )
        plain = make_node(ENGINES["ollama"], id="m1", port=11434, addresses=["10.0.0.3"])
        self.assertIs(facade.upstreams.agent_for(plain), root.runtime.agent)
        self.assertIs(facade.upstreams.agent_for(peer), root.runtime.peer_agents.for_node(peer))
        self.assertIsNot(facade.upstreams.agent_for(peer), root.runtime.agent)


ENV_KEY = "env-key-" + "Q" * 32
ENGINE_KEY = "engine-secret-0123456789abcdefXYZ"
IDENTITY_PROBE = {"X-Nvpair-Engine-Identity-Probe": "1"}


class WiredTreeTests(SynchronousTestCase):
    """The trees as the plugin builds them, options from the command line and the environment:
    every facade asks the LAN keys the environment configures, and in standalone mode its
    requests and its prober reach an engine through the runtime's engine clients (issue 11);
    the stream-idle bound reaches the request path (issue 13). On a MemoryReactorClock:
    requests enter the facade's own listener factory over a StringTransport, and an upstream
    connection is the one the facade asked the reactor for."""

    def setUp(self):
        self.addCleanup(logs.set_level, logs.level_name())
        environ = {k: v for k, v in os.environ.items() if not k.startswith("NVPAIR_")}
        environ["NVPAIR_PROXY_API_KEYS"] = ENV_KEY
        self.patch(os, "environ", environ)
        self.folder = os.path.abspath(self.mktemp())
        os.makedirs(self.folder)

    def standalone(self, *args: str):
        nodes = os.path.join(self.folder, "nodes.toml")
        with open(nodes, "w") as handle:
            handle.write(
                '[[node]]\nid = "a"\naddress = "127.0.0.1"\n'
                '[node.engines.ollama]\nport = 11434\nmodels = ["llama3:latest"]\n'
                f'api_key = "{ENGINE_KEY}"\n'
            )
        self.reactor = MemoryReactorClock()
        root = standalone_tree(
            parsed(
                "--engine",
                "ollama:1300",
                "--engine",
                "lmstudio:1301",
                "--nodes",
                nodes,
                "--state-dir",
                self.folder,
                *args,
            ),
            self.reactor,
        )
        root.privilegedStartService()
        return root

    def send(self, service: FacadeService, peer, data: bytes) -> Client:
        client = connect(service.factory, peer)
        client.protocol.dataReceived(data)
        return client

    def assertAsksTheEnvironmentsKeys(self, service: FacadeService) -> None:
        refused = self.send(service, lan(), request_bytes("GET", "/api/tags")).response()
        self.assertEqual(
            (refused.status, refused.json()["code"]), (401, "unauthorized"), service.name
        )
        served = self.send(
            service,
            lan(),
            request_bytes("GET", "/", headers={"X-Api-Key": ENV_KEY, **IDENTITY_PROBE}),
        ).response()
        self.assertEqual(
            (served.status, served.json()["code"]), (409, "proxy-facade"), service.name
        )

    def test_standalone_facades_ask_the_lan_keys_of_the_environment(self):
        facades = self.standalone().facades
        self.assertEqual([s.name for s in facades], ["ollama", "lmstudio"])
        for service in facades:
            self.assertAsksTheEnvironmentsKeys(service)

    def test_broker_facades_ask_the_lan_keys_of_the_environment(self):
        from nvpair_proxy.process import link

        self.patch(link, "claim_stdout", lambda: 99)
        root = broker_tree(parsed("--state-dir", self.folder), MemoryReactorClock())
        for engine_id, port in (("ollama", 1300), ("llamacpp", 1301)):
            opened = root.facades.open(ENGINES[engine_id], port, should_probe=lambda node: False)
            self.assertAsksTheEnvironmentsKeys(opened)

    def test_standalone_requests_and_probes_carry_a_keyed_engines_key(self):
        ollama = self.standalone().facades["ollama"]
        self.send(
            ollama,
            loopback(),
            request_bytes(
                "POST", "/api/chat", {"model": "llama3"}, {"Authorization": "Bearer caller-key"}
            ),
        )
        head = Wire(self.reactor).sent().split(b"\r\n\r\n")[0].split(b"\r\n")
        self.assertEqual(head[0], b"POST /api/chat HTTP/1.1")
        self.assertEqual(
            [line for line in head if line.lower().startswith(b"authorization")],
            [b"Authorization: Bearer " + ENGINE_KEY.encode()],
        )
        [node] = ollama.facade.router.routable()
        ollama.prober.probe(node)
        via = ollama.facade.upstreams.loop_guard.hop
        self.assertEqual(
            Wire(self.reactor).sent(),
            b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1:11434\r\n"
            b"Via: " + via + b"\r\n"
            b"Authorization: Bearer " + ENGINE_KEY.encode() + b"\r\n\r\n",
        )

    def test_the_stream_idle_timeout_reaches_the_request_path(self):
        ollama = self.standalone("--stream-idle-timeout", "7").facades["ollama"]
        client = self.send(
            ollama,
            loopback(),
            request_bytes("POST", "/api/chat", {"model": "llama3", "stream": True}),
        )
        engine = Wire(self.reactor)
        engine.protocol.dataReceived(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
            b'Transfer-Encoding: chunked\r\n\r\nf\r\n{"done":false}\n\r\n'
        )
        self.assertEqual(client.response().body, b'{"done":false}\n')
        self.reactor.advance(6.9)
        self.assertFalse(engine.transport.disconnecting)
        self.reactor.advance(0.1)
        self.assertTrue(engine.transport.disconnecting)
        self.assertTrue(client.transport.disconnecting)
        self.assertFalse(client.response().complete)


class StopOnceTests(SynchronousTestCase):
    def test_a_second_stop_is_quiet(self):
        from twisted.internet.error import ReactorNotRunning

        from nvpair_proxy.process.link import stop_once

        class Reactor:
            stops = 0

            def stop(self):
                self.stops += 1
                if self.stops > 1:
                    raise ReactorNotRunning("Can't stop reactor that isn't running.")

        reactor = Reactor()
        stop_once(reactor)
        stop_once(reactor)  # shutdown, then SIGTERM: no traceback
        self.assertEqual(reactor.stops, 2)
