"""Standalone wiring: the implicit local fleet and the shared connection pool."""

from __future__ import annotations

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy import constants
from nvpair_proxy.options import Options
from nvpair_proxy.service import local_fleet, make_pool


def parsed(*args: str) -> Options:
    options = Options()
    options.parseOptions(list(args))
    return options


class LocalFleetTests(SynchronousTestCase):
    def test_without_nodes_the_engine_on_its_own_port_is_the_fleet(self):
        fleet = local_fleet(parsed("--engine", "ollama", "--engine", "lmstudio:1300"))
        (ollama,), (lmstudio,) = fleet.nodes["ollama"], fleet.nodes["lmstudio"]
        self.assertEqual((ollama.id, ollama.addresses, ollama.port), ("local", ("127.0.0.1",), 11434))
        self.assertEqual(lmstudio.port, 1234)
        self.assertEqual(fleet.probed, {("ollama", "local"), ("lmstudio", "local")})
        self.assertIsNone(ollama.models)

    def test_a_facade_on_the_engines_own_port_looks_for_it_on_the_relocated_port(self):
        fleet = local_fleet(parsed("--engine", "lmstudio", "--engine", "llamacpp",
                                   "--engine", "ollama:11434"))
        self.assertEqual([fleet.nodes[e][0].port for e in ("lmstudio", "llamacpp", "ollama")],
                         [1235, 8081, 11435])


class PoolTests(SynchronousTestCase):
    def test_pool_keeps_idle_connections_as_long_as_the_servers_do(self):
        pool = make_pool(MemoryReactorClock())
        self.assertTrue(pool.persistent)
        self.assertEqual(pool.cachedConnectionTimeout, constants.SERVER_IDLE_TIMEOUT)
        self.assertGreaterEqual(pool.maxPersistentPerHost, 16)
        self.assertFalse(pool.retryAutomatically)


class CloseTests(SynchronousTestCase):
    def _runtime(self, clock):
        from nvpair_proxy.service import Runtime
        options = parsed("--engine", "ollama")
        runtime = Runtime.build(options, clock, None)
        closed = []
        self.patch(runtime.pool, "closeCachedConnections", lambda: closed.append(True))
        return runtime, closed

    def test_the_pool_closes_only_after_the_listeners_have_stopped(self):
        from twisted.internet.defer import Deferred

        class Port:
            def __init__(self):
                self.stopped = Deferred()

            def stopListening(self):
                return self.stopped

        clock = MemoryReactorClock()
        runtime, closed = self._runtime(clock)
        port = Port()
        runtime.close([port])
        self.assertEqual(closed, [])
        port.stopped.callback(None)
        self.assertEqual(closed, [True])

    def test_the_grace_bounds_the_wait_for_listeners(self):
        from twisted.internet.defer import Deferred

        class Stuck:
            def stopListening(self):
                return Deferred()

        clock = MemoryReactorClock()
        runtime, closed = self._runtime(clock)
        runtime.close([Stuck()])
        clock.advance(constants.FACADE_SHUTDOWN_GRACE - 0.1)
        self.assertEqual(closed, [])
        clock.advance(0.1)
        self.assertEqual(closed, [True])


class ReadyTests(SynchronousTestCase):
    def test_ready_is_announced_only_once_the_reactor_runs(self):
        """Before reactor.run twistd has no SIGTERM handler yet: READY=1 must wait for it."""
        import os
        import shutil
        import socket
        import tempfile
        from nvpair_proxy.service import Supervised
        workdir = tempfile.mkdtemp(prefix="nvp-")  # AF_UNIX paths are short
        self.addCleanup(shutil.rmtree, workdir, True)
        path = os.path.join(workdir, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(sock.close)
        sock.bind(path)
        sock.setblocking(False)
        previous = os.environ.get("NOTIFY_SOCKET")
        os.environ["NOTIFY_SOCKET"] = path  # sdnotify reads the process environment
        self.addCleanup(lambda: os.environ.pop("NOTIFY_SOCKET") if previous is None
                        else os.environ.__setitem__("NOTIFY_SOCKET", previous))
        reactor = MemoryReactorClock()
        service = Supervised()
        service.reactor = reactor
        service.announce_ready()
        self.assertRaises(BlockingIOError, sock.recv, 64)
        reactor.run()
        self.assertEqual(sock.recv(64), b"READY=1")
