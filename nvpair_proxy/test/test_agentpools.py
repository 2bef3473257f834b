"""One pooled client per configuration (agentpools.py): made once, retired when gone."""

from __future__ import annotations

from twisted.internet.defer import succeed
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.http.agentpools import AgentPools


class Idle:
    """An idle connection as the pool keeps it; records being closed."""

    key, idle_until = (b"https", b"10.0.0.1", 443), 0.0

    def __init__(self, closed: list) -> None:
        self.closed = closed

    def close_idle(self):
        self.closed.append(self)
        return succeed(None)


class AgentPoolsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.policies: list[str] = []
        self.pools: AgentPools[str] = AgentPools(MemoryReactorClock(), 5.0, 90.0, 16, keepalive=7.0)

    def get(self, key: str):
        return self.pools.get(key, lambda: self.policies.append(key) or f"policy {key}")

    def test_one_client_per_key_made_once_with_its_own_pool_and_policy(self):
        a, b = self.get("a"), self.get("b")
        self.assertIs(self.get("a"), a)
        self.assertIsNot(a.pool, b.pool)
        self.assertEqual((self.policies, a.tls, b.tls), (["a", "b"], "policy a", "policy b"))
        self.assertEqual(
            (a.connect_timeout, a.keepalive, a.pool.idle_timeout, a.pool.max_idle_per_host),
            (5.0, 7.0, 90.0, 16),
        )

    def test_a_retired_key_closes_its_idle_connections_and_gets_a_fresh_client(self):
        closed: list = []
        a = self.get("a")
        idle = Idle(closed)
        a.pool.give(idle)
        self.pools.retire("a")
        self.pools.retire("never-asked")  # nothing to retire
        self.assertEqual((closed, a.pool.idle_count()), ([idle], 0))
        self.assertIsNot(self.get("a"), a)

    def test_retain_retires_only_the_keys_refused(self):
        closed: list = []
        a, b = self.get("a"), self.get("b")
        on_a = Idle(closed)
        a.pool.give(on_a)
        b.pool.give(Idle(closed))
        self.pools.retain(lambda key: key == "b")
        self.assertEqual((closed, b.pool.idle_count()), ([on_a], 1))
        self.assertIs(self.get("b"), b)

    def test_close_closes_every_clients_idle_connections(self):
        closed: list = []
        for key in ("a", "b"):
            self.get(key).pool.give(Idle(closed))
        self.successResultOf(self.pools.close())
        self.assertEqual(len(closed), 2)
