"""Tests for owners and ordering (spec 5 steps 1-2), the node model and the discovery diff.

Behaviours "Discovery, selection, priority"; design decisions 4, 7 and 8.
"""

from __future__ import annotations

import attrs
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.nodes.discovery import (
    Diff,
    Node,
    NodeSet,
    diff,
    host_port,
    is_loopback,
    make_node,
)
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.nodes.selection import order, owners
from nvpair_proxy.nodes.selfcheck import SelfCheck
from nvpair_proxy.request.exchange import requested_model
from nvpair_proxy.routing.router import Router

ENGINES = load_engines()
OLLAMA = ENGINES["ollama"]
LMSTUDIO = ENGINES["lmstudio"]


def node(
    node_id: str, *models: str, engine=OLLAMA, addresses=("10.0.0.1",), port=11434, **extra
) -> Node:
    return make_node(engine, id=node_id, port=port, addresses=addresses, models=models, **extra)


def ids(nodes) -> list[str]:
    return [n.id for n in nodes]


class OwnersTests(SynchronousTestCase):
    """Only nodes advertising the normalized model right now are owners."""

    def test_owners_match_normalized_ids(self) -> None:
        nodes = [node("a", "llama3"), node("b", "llama3:8b"), node("c", "llama3:latest", "phi3")]
        self.assertEqual(ids(owners(nodes, OLLAMA.normalize_model("llama3"))), ["a", "c"])
        self.assertEqual(ids(owners(nodes, "llama3:8b")), ["b"])

    def test_owners_do_not_normalize_the_request_themselves(self) -> None:
        nodes = [node("a", "llama3")]
        self.assertEqual(owners(nodes, "llama3"), [])

    def test_exact_engines_match_case_sensitively(self) -> None:
        nodes = [node("a", "Qwen", engine=LMSTUDIO), node("b", "qwen", engine=LMSTUDIO)]
        self.assertEqual(ids(owners(nodes, "Qwen")), ["a"])
        self.assertEqual(ids(owners(nodes, "qwen")), ["b"])

    def test_a_node_whose_models_are_unknown_advertises_nothing(self) -> None:
        unknown = make_node(OLLAMA, id="a", port=11434, addresses=["10.0.0.1"], models=None)
        self.assertIsNone(unknown.models)
        self.assertEqual(ids(owners([unknown, node("b", "llama3")], "llama3:latest")), ["b"])

    def test_a_node_with_no_models_advertises_nothing(self) -> None:
        self.assertEqual(owners([node("a")], "llama3:latest"), [])

    def test_owners_keep_the_given_order(self) -> None:
        nodes = [node("c", "m"), node("a", "m"), node("b", "m")]
        self.assertEqual(ids(owners(nodes, "m:latest")), ["c", "a", "b"])


class OrderTests(SynchronousTestCase):
    """Pin first, then the priority list, then unlisted nodes by id."""

    NODES = [node("d"), node("b"), node("a"), node("c")]

    def test_empty_priority_is_id_order(self) -> None:
        self.assertEqual(ids(order(self.NODES)), ["a", "b", "c", "d"])
        self.assertEqual(ids(order(self.NODES, priority=[])), ["a", "b", "c", "d"])

    def test_priority_list_order_then_unlisted_by_id(self) -> None:
        self.assertEqual(ids(order(self.NODES, priority=["c", "a"])), ["c", "a", "b", "d"])

    def test_unknown_priority_ids_are_ignored(self) -> None:
        self.assertEqual(
            ids(order(self.NODES, priority=["x", "d", "y", "b"])), ["d", "b", "a", "c"]
        )

    def test_pin_comes_first_then_priority(self) -> None:
        self.assertEqual(
            ids(order(self.NODES, pin="b", priority=["c", "b", "a"])), ["b", "c", "a", "d"]
        )

    def test_pin_without_priority_then_id_order(self) -> None:
        self.assertEqual(ids(order(self.NODES, pin="c")), ["c", "a", "b", "d"])

    def test_ineligible_pin_does_not_add_the_node(self) -> None:
        eligible = owners([node("a", "m"), node("b"), node("c", "m")], "m:latest")
        self.assertEqual(ids(order(eligible, pin="b", priority=["c"])), ["c", "a"])

    def test_unknown_pin_changes_nothing(self) -> None:
        self.assertEqual(ids(order(self.NODES, pin="zz", priority=["c"])), ["c", "a", "b", "d"])

    def test_model_filter_runs_before_pin_and_priority(self) -> None:
        nodes = [node("a", "m"), node("b", "other"), node("c", "m")]
        self.assertEqual(
            ids(order(owners(nodes, "m:latest"), pin="b", priority=["b", "c"])), ["c", "a"]
        )

    def test_order_returns_nodes_not_ids(self) -> None:
        a = node("a", "m")
        self.assertEqual(order([a]), [a])


class AddressTests(SynchronousTestCase):
    """Dial order, URL authority and the loopback table (design 4, behaviours)."""

    def test_dial_order_is_loopback_first_then_published_order_deduplicated(self) -> None:
        n = node(
            "a",
            addresses=(
                "192.168.1.5",
                "10.0.0.2",
                "127.0.0.1",
                "192.168.1.5",
                "fd00::5",
                "::1",
                "10.0.0.2",
            ),
        )
        self.assertEqual(n.dial_order(), ["127.0.0.1", "::1", "192.168.1.5", "10.0.0.2", "fd00::5"])

    def test_dial_order_keeps_published_order_without_loopback(self) -> None:
        n = node("a", addresses=("10.0.0.9", "10.0.0.1", "fd00::1"))
        self.assertEqual(n.dial_order(), ["10.0.0.9", "10.0.0.1", "fd00::1"])

    def test_dial_order_skips_empty_addresses(self) -> None:
        self.assertEqual(node("a", addresses=("", "10.0.0.1", "")).dial_order(), ["10.0.0.1"])

    def test_host_port_brackets_ipv6(self) -> None:
        self.assertEqual(host_port("10.0.0.1", 11434), "10.0.0.1:11434")
        self.assertEqual(host_port("::1", 11434), "[::1]:11434")
        self.assertEqual(host_port("fd00::5", 8080), "[fd00::5]:8080")
        self.assertEqual(host_port("gpu-a.local", 1234), "gpu-a.local:1234")

    LOOPBACK = [
        ("127.0.0.1", True),
        ("127.5.6.7", True),
        ("127.255.255.254", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("::1%lo", True),
        ("fe80::1%eth0", False),
        ("192.168.1.2", False),
        ("::ffff:192.168.1.2", False),
        ("0.0.0.0", False),
        ("::", False),
        ("128.0.0.1", False),
        ("localhost", False),
        ("garbage", False),
        ("", False),
    ]

    def test_is_loopback_table(self) -> None:
        self.assertEqual([(host, is_loopback(host)) for host, _ in self.LOOPBACK], self.LOOPBACK)


class DiffTests(SynchronousTestCase):
    """A discovery diff: discovered, updated (models or address changed), removed, in id order."""

    def test_discovered_updated_removed_each_in_id_order(self) -> None:
        old = {
            n.id: n
            for n in [
                node("a", "m"),
                node("b", "m"),
                node("c", "m"),
                node("e", "m"),
                node("g", "m"),
            ]
        }
        new = {
            n.id: n
            for n in [
                node("g", "m", "n"),  # models changed
                node("c", "m", addresses=("10.0.0.2",)),  # address changed
                node("a", "m"),  # unchanged
                node("f", "m"),
                node("d", "m"),  # discovered
            ]
        }
        change = diff(old, new)
        self.assertEqual(
            (ids(change.discovered), ids(change.updated), ids(change.removed)),
            (["d", "f"], ["c", "g"], ["b", "e"]),
        )
        self.assertEqual(change.updated, (new["c"], new["g"]))
        self.assertEqual(change.removed, (old["b"], old["e"]))

    def test_models_compare_normalized(self) -> None:
        old = {"a": node("a", "llama3")}
        new = {"a": node("a", "llama3:latest")}
        self.assertEqual(diff(old, new), Diff())

    def test_advertised_order_is_not_an_update(self) -> None:
        self.assertEqual(diff({"a": node("a", "x", "y")}, {"a": node("a", "y", "x")}), Diff())

    def test_added_address_is_an_update(self) -> None:
        change = diff(
            {"a": node("a", "m")}, {"a": node("a", "m", addresses=("10.0.0.1", "10.0.0.2"))}
        )
        self.assertEqual(ids(change.updated), ["a"])

    def test_no_change_is_an_empty_falsy_diff(self) -> None:
        same = {"a": node("a", "m")}
        change = diff(same, dict(same))
        self.assertEqual(change, Diff())
        self.assertFalse(change)
        self.assertTrue(diff({}, same))


class NodeSetTests(SynchronousTestCase):
    """A snapshot replaces the discovered set wholesale; manual nodes survive."""

    def test_snapshot_replaces_discovered_and_keeps_manual(self) -> None:
        nodes = NodeSet()
        nodes.put_manual(node("m1", "x"))
        nodes.replace_discovered([node("a", "x"), node("b", "x")])
        change = nodes.replace_discovered([node("c", "x"), node("b", "y")])
        self.assertEqual(
            (ids(change.discovered), ids(change.updated), ids(change.removed)),
            (["c"], ["b"], ["a"]),
        )
        self.assertEqual(ids(nodes.routable()), ["b", "c", "m1"])
        nodes.replace_discovered([])
        self.assertEqual(ids(nodes.routable()), ["m1"])
        self.assertIn("m1", nodes)
        self.assertNotIn("a", nodes)

    def test_snapshot_diff_does_not_mention_manual_nodes(self) -> None:
        nodes = NodeSet()
        nodes.put_manual(node("m1", "x"))
        self.assertEqual(nodes.replace_discovered([]), Diff())

    def test_routable_is_in_id_order(self) -> None:
        nodes = NodeSet()
        nodes.replace_discovered([node("z"), node("b")])
        nodes.put_manual(node("k"))
        self.assertEqual(ids(nodes.routable()), ["b", "k", "z"])

    def test_admit_decides_at_read_time_which_nodes_are_routable_manual_ones_too(self) -> None:
        """A manual node can be this proxy as well as a discovered one (protocol 3), so
        admission is asked of both."""
        allowed = {"a"}
        nodes = NodeSet(admit=lambda n: n if n.id in allowed else None)
        nodes.replace_discovered([node("a"), node("b")])
        nodes.put_manual(node("m1"))
        self.assertEqual(ids(nodes.routable()), ["a"])
        allowed.update({"b", "m1"})
        self.assertEqual(ids(nodes.routable()), ["a", "b", "m1"])

    def test_admit_decides_how_a_node_is_reached(self) -> None:
        nodes = NodeSet(
            admit=lambda n: attrs.evolve(n, scheme="https") if n.source == "discovered" else n
        )
        nodes.replace_discovered([node("a", source="discovered")])
        nodes.put_manual(node("m1"))
        self.assertEqual(
            [(n.id, n.scheme) for n in nodes.routable()], [("a", "https"), ("m1", "http")]
        )

    def test_a_node_that_is_this_facade_is_left_out_until_the_facade_moves(self) -> None:
        """Self by address (protocol 3): loopback, or an address of this host, on one of
        the facade's ports; asked again when the ports change, not per read."""
        ports = {11435}
        asked: list[str] = []

        def is_local(address: str) -> bool:
            asked.append(address)
            return address == "192.168.1.50"

        nodes = NodeSet(is_self=SelfCheck(lambda: ports, is_local))
        nodes.replace_discovered(
            [
                make_node(OLLAMA, id="loop", port=11435, addresses=["127.0.0.1"]),
                make_node(
                    OLLAMA, id="lan-self", port=11435, addresses=["10.9.9.9", "192.168.1.50"]
                ),
                make_node(OLLAMA, id="engine", port=11434, addresses=["127.0.0.1"]),
                make_node(OLLAMA, id="peer", port=11435, addresses=["10.9.9.9"]),
            ]
        )
        nodes.put_manual(make_node(OLLAMA, id="manual-self", port=11435, addresses=["localhost"]))
        self.assertEqual(ids(nodes.routable()), ["engine", "peer"])
        self.assertEqual(
            sorted(n.id for n in nodes.all() if n.local), ["lan-self", "loop", "manual-self"]
        )
        self.assertEqual(sorted(asked), ["10.9.9.9", "10.9.9.9"] + ["192.168.1.50"])
        nodes.routable()
        self.assertEqual(len(asked), 3)  # reads ask nothing
        ports.clear()
        ports.add(11434)
        nodes.recheck_self()
        self.assertEqual(ids(nodes.routable()), ["lan-self", "loop", "manual-self", "peer"])

    def test_put_manual_reports_added_then_updated(self) -> None:
        nodes = NodeSet()
        self.assertTrue(nodes.put_manual(node("m1", "x")))
        self.assertFalse(nodes.put_manual(node("m1", "y")))
        self.assertEqual(nodes.get("m1").models, frozenset({"y:latest"}))

    def test_set_models_normalizes_a_probe_result(self) -> None:
        nodes = NodeSet()
        nodes.put_manual(make_node(OLLAMA, id="m1", port=11434, addresses=["10.0.0.1"]))
        nodes.set_models("m1", OLLAMA, ["llama3", "phi3:mini"])
        probed = nodes.get("m1")
        self.assertEqual(
            (probed.models, probed.advertised),
            (frozenset({"llama3:latest", "phi3:mini"}), ("llama3", "phi3:mini")),
        )

    def test_observers_hear_every_change(self) -> None:
        nodes = NodeSet()
        calls = []
        nodes.observe(lambda: calls.append(len(nodes.routable())))
        nodes.replace_discovered([node("a")])
        nodes.put_manual(node("m1"))
        nodes.remove_manual("m1")
        nodes.remove_manual("absent")
        self.assertEqual(calls, [1, 2, 1])


class RouterNodeChangeTests(SynchronousTestCase):
    """Probes and the local backend change routing through the router's methods (issue 9)."""

    def test_a_probe_result_changes_the_owners_a_request_gets(self) -> None:
        router = Router(engine=OLLAMA, clock=Clock())
        router.put_manual(make_node(OLLAMA, id="m1", port=11434, addresses=["10.0.0.1"]))
        self.assertEqual(ids(router.candidates("llama3:latest")), [])
        router.set_models("m1", ["llama3"])
        self.assertEqual(ids(router.candidates("llama3:latest")), ["m1"])
        router.set_models("m1", [])
        self.assertEqual(ids(router.candidates("llama3:latest")), [])

    def test_an_admission_change_is_announced_with_the_new_routable_set(self) -> None:
        backend: list = []
        router = Router(engine=OLLAMA, clock=Clock())
        router.set_admission(lambda n: n if backend else None)
        router.replace_discovered([node("self", "llama3")])
        heard = []
        router.nodes.observe(lambda: heard.append(ids(router.routable())))
        backend.append(("127.0.0.1", 11434))
        router.admission_changed()
        self.assertEqual(heard, [["self"]])


class RequestedModelTests(SynchronousTestCase):
    """Design decision 7: when an inference body names no model."""

    def test_a_named_model_is_returned(self) -> None:
        self.assertEqual(requested_model(b'{"model":"llama3","stream":true}'), "llama3")

    def test_a_padded_name_is_kept_for_normalization(self) -> None:
        model = requested_model(b'{"model":"  llama3 "}')
        self.assertIsNotNone(model)
        self.assertEqual(OLLAMA.normalize_model(model), "llama3:latest")

    def test_any_json_encoding_json_reads_names_the_model(self) -> None:
        """The UTF-8 fast path (issue 10) answers as ``json.loads(bytes)`` does: a BOM,
        UTF-16 and UTF-32 (with or without a BOM) and lone surrogates in UTF-8 included."""
        document = '{"model":"llama3","note":"\u00e9\U0001f600"}'
        bodies = [
            document.encode(),
            b"\xef\xbb\xbf" + document.encode(),
            *(
                document.encode(codec)
                for codec in (
                    "utf-16",
                    "utf-16-le",
                    "utf-16-be",
                    "utf-32",
                    "utf-32-le",
                    "utf-32-be",
                )
            ),
        ]
        for body in bodies:
            self.assertEqual(requested_model(body), "llama3", body[:8])
        self.assertEqual(requested_model(b'{"model":"m\xed\xa0\x80"}'), "m\ud800")

    def test_bodies_that_name_no_model(self) -> None:
        for body in [
            b"",
            b"not json",
            b"\xff\xfe",
            b'{"model":',
            b"[1, 2]",
            b'["model", "llama3"]',
            b'"llama3"',
            b"null",
            b"42",
            b"{}",
            b'{"messages":[]}',
            b'{"model":null}',
            b'{"model":3}',
            b'{"model":["llama3"]}',
            b'{"model":{"name":"llama3"}}',
            b'{"model":""}',
            b'{"model":"   "}',
            b'{"model":"\\t\\n"}',
        ]:
            self.assertIsNone(requested_model(body), body)
