"""The per-request work of standalone placement at 1,000 nodes, counted, not timed
(docs/decisions.md#rank-index): a request weighs the few nodes something happened to, never
the whole fleet. As the work budget does at three nodes (test_work_budget.py), a change that
ranks or filters every owner per request fails here."""

from __future__ import annotations

import json

from nvpair_proxy.nodes import discovery
from nvpair_proxy.routing import router as router_module

from .world import NDJSON, WorldTestCase

NODES = 1000
REQUESTS = 50
#: The model as the facade normalizes it.
MODEL = "llama3:latest"
#: Node keys computed per request once the index is built: the node the request went to,
#: when its dispatch starts and when it ends (one for each), and slack for an engine report.
KEYS_PER_REQUEST = 4
#: Routable checks per request (a lookup by id each).
LOOKUPS_PER_REQUEST = 4


class PlacementWorkTests(WorldTestCase):
    def fleet(self):
        w = self.world(scheduling=True, queue_depth=100)
        for i in range(NODES):
            w.add(f"n{i:04d}", addresses=(f"10.{i // 250}.{i % 250}.1",))
        return w

    def counting(self):
        """Count the node keys placement computes and the owner checks it makes."""
        counts = {"keys": 0, "owner checks": 0, "routable lookups": 0}
        rank_key, advertises = router_module.rank_key, discovery.Node.advertises
        is_routable = router_module.Router.is_routable

        def counted_lookup(router, node_id):
            counts["routable lookups"] += 1
            return is_routable(router, node_id)

        self.patch(router_module.Router, "is_routable", counted_lookup)

        def counted_key(*args, **kwargs):
            counts["keys"] += 1
            return rank_key(*args, **kwargs)

        def counted_advertises(node, model):
            counts["owner checks"] += 1
            return advertises(node, model)

        self.patch(router_module, "rank_key", counted_key)
        self.patch(discovery.Node, "advertises", counted_advertises)
        return counts

    def chat(self, w, n: int) -> str:
        body = {"model": "llama3", "messages": [{"role": "user", "content": f"question {n}"}]}
        client = w.send("POST", "/api/chat", body)
        request = w.agent.last
        node = request.uri.decode()
        request.respond(200, NDJSON, json.dumps({"done": True}).encode() + b"\n", finish=True)
        self.assertEqual(client.response().status, 200)
        return node

    def test_a_request_at_1000_nodes_weighs_a_few_nodes_not_the_fleet(self):
        w = self.fleet()
        counts = self.counting()
        self.chat(w, 0)  # the first request for the model builds its ranking: every owner
        self.assertLessEqual(counts["keys"], NODES + KEYS_PER_REQUEST)
        counts.update(keys=0, **{"owner checks": 0, "routable lookups": 0})
        for n in range(1, REQUESTS + 1):
            self.chat(w, n)
        self.assertLessEqual(counts["keys"], KEYS_PER_REQUEST * REQUESTS, counts)
        self.assertEqual(counts["owner checks"], 0, "the owners were filtered per request")
        # The dispatch asks whether the node it goes to is still routable, and a watch or a
        # report may ask once more; never each remaining owner.
        self.assertLessEqual(counts["routable lookups"], LOOKUPS_PER_REQUEST * REQUESTS, counts)

    def test_the_ranking_is_the_one_a_sort_gives_as_standings_change(self):
        """Whatever moved, the kept order equals sorting every owner now."""
        w = self.fleet()
        router = w.facade.router
        held = []
        for n in range(30):
            body = {"model": "llama3", "messages": [{"role": "user", "content": f"q{n}"}]}
            held.append(w.send("POST", "/api/chat", body))
        kept = router.candidates(MODEL)
        everyone = router.ranked(list(router.nodes.routable_map().values()), MODEL)
        self.assertEqual([n.id for n in kept], [n.id for n in everyone])
        self.assertEqual(kept[0].id, "n0030", "30 busy nodes went behind the free ones")
        for request in list(w.agent.requests)[:10]:
            request.respond(200, NDJSON, b'{"done":true}\n', finish=True)
        kept = router.candidates(MODEL)
        everyone = router.ranked(list(router.nodes.routable_map().values()), MODEL)
        self.assertEqual([n.id for n in kept], [n.id for n in everyone])
        for request in list(w.agent.requests)[10:]:
            request.respond(200, NDJSON, b'{"done":true}\n', finish=True)
