"""Tests for nvpair_proxy.standalone.nodesfile: the standalone fleet file and its watcher (design
4, 8.15)."""

from __future__ import annotations

import os

from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core import logs
from nvpair_proxy.nodes.discovery import Node
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.standalone.nodesfile import (
    ConfiguredNodes,
    NodesFileError,
    NodesFileWatcher,
    load_nodes_file,
    parse_nodes,
)
from nvpair_proxy.test.support import ONE_NODE, TWO_NODES, LogCapture

ENGINES = load_engines()
SOURCE = "nodes.toml"


def standalone(**fields) -> Node:
    return Node(source="standalone", **fields)


class ParseTests(SynchronousTestCase):
    """The file format of design 4: [[node]] with per-engine tables."""

    def test_nodes_are_listed_per_engine_with_normalised_models(self) -> None:
        fleet = parse_nodes(TWO_NODES, ENGINES, SOURCE)
        self.assertEqual(
            fleet.nodes,
            {
                "ollama": (
                    standalone(
                        id="gpu-a",
                        name="GPU A",
                        port=11434,
                        addresses=("127.0.0.1",),
                        models=frozenset({"llama3:latest", "qwen2:7b"}),
                        advertised=("llama3", "qwen2:7b"),
                    ),
                    standalone(
                        id="gpu-b", name="gpu-b", port=11500, addresses=("192.168.1.20", "fd00::20")
                    ),
                ),
                "lmstudio": (
                    standalone(
                        id="gpu-a",
                        name="GPU A",
                        port=1234,
                        addresses=("127.0.0.1",),
                        models=frozenset({"Qwen", "phi-3"}),
                        advertised=("Qwen", " phi-3 "),
                    ),
                ),
                "llamacpp": (),
            },
        )

    def test_nodes_without_models_are_probed(self) -> None:
        fleet = parse_nodes(TWO_NODES, ENGINES, SOURCE)
        self.assertEqual(fleet.probed, frozenset({("ollama", "gpu-b")}))

    def test_an_empty_models_list_advertises_nothing_and_is_not_probed(self) -> None:
        fleet = parse_nodes(ONE_NODE.replace('["llama3"]', "[]"), ENGINES, SOURCE)
        (node,) = fleet.nodes["ollama"]
        self.assertEqual(node.models, frozenset())
        self.assertFalse(node.advertises("llama3:latest"))
        self.assertEqual(fleet.probed, frozenset())

    def test_ollama_llama3_advertises_llama3_latest(self) -> None:
        (node,) = parse_nodes(ONE_NODE, ENGINES, SOURCE).nodes["ollama"]
        self.assertTrue(node.advertises("llama3:latest"))
        self.assertFalse(node.advertises("llama3"))

    def test_exact_engines_keep_case(self) -> None:
        (node,) = parse_nodes(TWO_NODES, ENGINES, SOURCE).nodes["lmstudio"]
        self.assertTrue(node.advertises("Qwen"))
        self.assertFalse(node.advertises("qwen"))

    def test_port_defaults_to_the_engines_own_port(self) -> None:
        text = ONE_NODE + '[node.engines.llamacpp]\nmodels = ["m"]\n'
        fleet = parse_nodes(text, ENGINES, SOURCE)
        self.assertEqual([n.port for n in fleet.nodes["ollama"]], [11434])
        self.assertEqual([n.port for n in fleet.nodes["llamacpp"]], [8080])

    def test_an_empty_file_is_an_empty_fleet(self) -> None:
        self.assertEqual(
            parse_nodes("", ENGINES, SOURCE),
            ConfiguredNodes({"ollama": (), "lmstudio": (), "llamacpp": ()}, frozenset()),
        )


class ParseErrorTests(SynchronousTestCase):
    """Every error names the file and the field, on one line."""

    def error(self, text: str) -> str:
        with self.assertRaises(NodesFileError) as caught:
            parse_nodes(text, ENGINES, SOURCE)
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        return message

    def test_bad_toml(self) -> None:
        self.assertTrue(self.error("[[node]\n").startswith("nodes.toml: not valid TOML: "))

    def test_unknown_top_level_table(self) -> None:
        self.assertEqual(
            self.error('[[nodes]]\nid = "a"\n'),
            "nodes.toml: unknown table 'nodes' (expected [[node]])",
        )

    def test_node_must_be_an_array_of_tables(self) -> None:
        self.assertEqual(
            self.error('node = "gpu-a"\n'),
            "nodes.toml: 'node' must be an array of tables ([[node]])",
        )

    def test_unknown_node_field(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace('id = "gpu-a"', 'id = "gpu-a"\nport = 1')),
            "nodes.toml: node[0]: unknown field 'port'",
        )

    def test_missing_id(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace('id = "gpu-a"\n', "")),
            "nodes.toml: node[0]: field 'id' must be a non-empty string",
        )

    def test_empty_id(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace('"gpu-a"', '""')),
            "nodes.toml: node[0]: field 'id' must be a non-empty string",
        )

    def test_duplicate_id(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE + "\n" + ONE_NODE),
            "nodes.toml: node[1]: node id 'gpu-a' appears twice",
        )

    def test_missing_address(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace('address = "127.0.0.1"\n', "")),
            "nodes.toml: node 'gpu-a': needs 'address' (a string) or 'addresses' (a list)",
        )

    def test_address_that_is_not_a_string(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace('"127.0.0.1"', "127")),
            "nodes.toml: node 'gpu-a': needs 'address' (a string) or 'addresses' (a list)",
        )

    def test_empty_addresses(self) -> None:
        text = ONE_NODE.replace('address = "127.0.0.1"', "addresses = []")
        self.assertEqual(
            self.error(text),
            "nodes.toml: node 'gpu-a': needs 'address' (a string) or 'addresses' (a list)",
        )

    def test_name_that_is_not_a_string(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace('id = "gpu-a"', 'id = "gpu-a"\nname = 3')),
            "nodes.toml: node 'gpu-a': field 'name' must be a string",
        )

    def test_node_without_engines(self) -> None:
        self.assertEqual(
            self.error('[[node]]\nid = "gpu-a"\naddress = "127.0.0.1"\n'),
            "nodes.toml: node 'gpu-a': needs at least one [node.engines.<engine>] table",
        )

    def test_unknown_engine(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace("engines.ollama", "engines.vllm")),
            "nodes.toml: node 'gpu-a': unknown engine 'vllm'; want one of "
            "llamacpp, lmstudio, ollama",
        )

    def test_engine_entry_that_is_not_a_table(self) -> None:
        text = '[[node]]\nid = "gpu-a"\naddress = "127.0.0.1"\nengines = { ollama = 1 }\n'
        self.assertEqual(
            self.error(text), "nodes.toml: node 'gpu-a': engines.ollama: must be a table"
        )

    def test_unknown_engine_field(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE + "loaded = []\n"),
            "nodes.toml: node 'gpu-a': engines.ollama: unknown field 'loaded'",
        )

    def test_port_out_of_range(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE + "port = 70000\n"),
            "nodes.toml: node 'gpu-a': engines.ollama: field 'port' must be 1-65535 (got 70000)",
        )

    def test_port_that_is_not_an_integer(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE + 'port = "11434"\n'),
            "nodes.toml: node 'gpu-a': engines.ollama: field 'port' must be 1-65535 (got '11434')",
        )

    def test_boolean_port(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE + "port = true\n"),
            "nodes.toml: node 'gpu-a': engines.ollama: field 'port' must be 1-65535 (got True)",
        )

    def test_models_that_are_not_strings(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace('["llama3"]', '["llama3", 3]')),
            "nodes.toml: node 'gpu-a': engines.ollama: field 'models' must be a list of strings",
        )

    def test_models_that_are_not_a_list(self) -> None:
        self.assertEqual(
            self.error(ONE_NODE.replace('["llama3"]', '"llama3"')),
            "nodes.toml: node 'gpu-a': engines.ollama: field 'models' must be a list of strings",
        )


def write(path: str, text: str | bytes, stamp: int) -> None:
    """Write ``text`` with an explicit mtime, so every write is a distinct change."""
    with open(path, "wb") as handle:
        handle.write(text.encode() if isinstance(text, str) else text)
    os.utime(path, ns=(stamp, stamp))


class LoadFileTests(SynchronousTestCase):
    def test_file_is_read_and_parsed(self) -> None:
        path = self.mktemp()
        write(path, ONE_NODE, 10**18)
        fleet = load_nodes_file(path, ENGINES)
        self.assertEqual([n.id for n in fleet.nodes["ollama"]], ["gpu-a"])

    def test_errors_name_the_file(self) -> None:
        path = self.mktemp()
        write(path, ONE_NODE.replace("engines.ollama", "engines.vllm"), 10**18)
        with self.assertRaises(NodesFileError) as caught:
            load_nodes_file(path, ENGINES)
        self.assertEqual(
            str(caught.exception),
            f"{path}: node 'gpu-a': unknown engine 'vllm'; want one of llamacpp, lmstudio, ollama",
        )

    def test_missing_file(self) -> None:
        path = self.mktemp()
        with self.assertRaises(NodesFileError) as caught:
            load_nodes_file(path, ENGINES)
        self.assertEqual(str(caught.exception), f"{path}: cannot read: No such file or directory")

    def test_file_that_is_not_utf8(self) -> None:
        path = self.mktemp()
        write(path, b'[[node]]\nid = "\xff"\n', 10**18)
        with self.assertRaises(NodesFileError) as caught:
            load_nodes_file(path, ENGINES)
        self.assertEqual(str(caught.exception), f"{path}: not UTF-8 text")


class WatcherTests(SynchronousTestCase):
    """Checked every 2 s; a changed valid file is applied, a bad one keeps the last good one."""

    def setUp(self) -> None:
        self.path = self.mktemp()
        self.stamp = 10**18
        write(self.path, ONE_NODE, self.stamp)
        self.clock = Clock()
        self.applied: list[ConfiguredNodes] = []
        self.watcher = NodesFileWatcher(self.path, ENGINES, self.clock, self.applied.append)
        self.events = LogCapture(self, level="info").events
        self.addCleanup(lambda: self.watcher.running and self.watcher.stopService())

    def rewrite(self, text: str | bytes) -> None:
        self.stamp += 10**9
        write(self.path, text, self.stamp)

    def ollama_ids(self, fleet: ConfiguredNodes) -> list[str]:
        return [n.id for n in fleet.nodes["ollama"]]

    def messages(self, level: LogLevel) -> list[str]:
        return [
            formatEvent(e)
            for e in self.events
            if e.get("log_namespace") == logs.COMPONENT and e.get("log_level") == level
        ]

    def test_load_applies_the_file_and_returns_it(self) -> None:
        fleet = self.watcher.load()
        self.assertEqual(self.applied, [fleet])
        self.assertEqual(self.ollama_ids(fleet), ["gpu-a"])

    def test_load_raises_on_a_bad_file_and_applies_nothing(self) -> None:
        self.rewrite("[[node]\n")
        with self.assertRaises(NodesFileError) as caught:
            self.watcher.load()
        self.assertTrue(str(caught.exception).startswith(f"{self.path}: not valid TOML: "))
        self.assertEqual(self.applied, [])

    def test_load_raises_on_a_missing_file(self) -> None:
        os.remove(self.path)
        self.assertRaises(NodesFileError, self.watcher.load)
        self.assertEqual(self.applied, [])

    def test_changed_valid_file_is_applied_on_the_next_two_second_check(self) -> None:
        self.watcher.load()
        self.watcher.startService()
        self.rewrite(TWO_NODES)
        self.clock.advance(1)
        self.assertEqual(len(self.applied), 1)
        self.clock.advance(1)
        self.assertEqual(len(self.applied), 2)
        self.assertEqual(self.ollama_ids(self.applied[1]), ["gpu-a", "gpu-b"])
        self.assertEqual(self.applied[1].probed, frozenset({("ollama", "gpu-b")}))
        self.assertEqual(self.messages(LogLevel.info), [f"nodes file reloaded: {self.path}"])

    def test_a_rotated_ca_file_reloads_the_fleet_with_the_new_material(self) -> None:
        from nvpair_proxy.testing.certs import TestCA

        ca_path = os.path.join(os.path.dirname(self.path), "engines-ca.pem")
        write(ca_path, TestCA("old").pem, self.stamp)
        self.rewrite(
            '[[node]]\nid = "gpu-a"\naddress = "10.0.0.1"\n'
            '[node.engines.ollama]\nscheme = "https"\nca_file = "engines-ca.pem"\n'
            'models = ["llama3:latest"]\n'
        )
        first = self.watcher.load().nodes["ollama"][0].access.tls
        self.watcher.startService()
        self.clock.advance(2)
        self.assertEqual(len(self.applied), 1, "nothing changed, nothing reloaded")
        write(ca_path, TestCA("new").pem, self.stamp + 10**9)  # the nodes file untouched
        self.clock.advance(2)
        self.assertEqual(len(self.applied), 2)
        second = self.applied[1].nodes["ollama"][0].access.tls
        self.assertEqual(second.ca_file, ca_path)
        self.assertNotEqual(second, first, "a new TLS configuration: a fresh pool")
        self.clock.advance(2)
        self.assertEqual(len(self.applied), 2)

    def test_a_ca_file_named_before_it_exists_is_loaded_when_it_arrives(self) -> None:
        from nvpair_proxy.testing.certs import TestCA

        self.watcher.load()
        self.watcher.startService()
        ca_path = os.path.join(os.path.dirname(self.path), "later-ca.pem")
        self.rewrite(
            '[[node]]\nid = "gpu-a"\naddress = "10.0.0.1"\n'
            '[node.engines.ollama]\nscheme = "https"\nca_file = "later-ca.pem"\n'
            'models = ["llama3:latest"]\n'
        )
        self.clock.advance(2)
        self.assertEqual(len(self.applied), 1, "the CA file is not there yet")
        self.assertEqual(len(self.messages(LogLevel.warn)), 1)
        write(ca_path, TestCA().pem, self.stamp)  # the nodes file untouched
        self.clock.advance(2)
        self.assertEqual(len(self.applied), 2)
        self.assertEqual(self.applied[1].nodes["ollama"][0].access.tls.ca_file, ca_path)

    def test_an_edit_saved_while_the_file_is_read_is_seen_by_the_next_check(self) -> None:
        from nvpair_proxy.standalone import nodesfile

        original = nodesfile.load_nodes_file

        def load_then_edit(path, engines):
            fleet = original(path, engines)
            if not self.applied:  # the first load: an edit lands right after the read
                self.rewrite(TWO_NODES)
            return fleet

        self.patch(nodesfile, "load_nodes_file", load_then_edit)
        self.watcher.load()
        self.watcher.startService()
        self.clock.advance(2)
        self.assertEqual(
            [self.ollama_ids(f) for f in self.applied], [["gpu-a"], ["gpu-a", "gpu-b"]]
        )

    def test_unchanged_file_is_not_reapplied(self) -> None:
        self.watcher.load()
        self.watcher.startService()
        for _ in range(5):
            self.clock.advance(2)
        self.assertEqual(len(self.applied), 1)
        self.assertEqual(self.messages(LogLevel.info), [])

    def test_bad_reload_keeps_the_last_good_snapshot_and_logs_a_warning(self) -> None:
        self.watcher.load()
        self.watcher.startService()
        self.rewrite(ONE_NODE + "port = 70000\n")
        self.clock.advance(2)
        self.assertEqual(len(self.applied), 1)
        self.assertEqual(
            self.messages(LogLevel.warn),
            [
                "nodes file not reloaded, keeping the last good one: "
                f"{self.path}: node 'gpu-a': engines.ollama: "
                "field 'port' must be 1-65535 (got 70000)"
            ],
        )
        # The bad file is not re-read (nor re-reported) every check while it stays the same.
        self.clock.advance(4)
        self.assertEqual(len(self.applied), 1)
        self.assertEqual(len(self.messages(LogLevel.warn)), 1)

    def test_a_fixed_file_after_a_bad_reload_is_applied(self) -> None:
        self.watcher.load()
        self.watcher.startService()
        self.rewrite("[[node]\n")
        self.clock.advance(2)
        self.rewrite(TWO_NODES)
        self.clock.advance(2)
        self.assertEqual(
            [self.ollama_ids(f) for f in self.applied], [["gpu-a"], ["gpu-a", "gpu-b"]]
        )

    def test_a_deleted_file_keeps_the_last_good_snapshot(self) -> None:
        self.watcher.load()
        self.watcher.startService()
        os.remove(self.path)
        self.clock.advance(2)
        self.assertEqual(len(self.applied), 1)
        self.assertEqual(
            self.messages(LogLevel.warn),
            [
                "nodes file not reloaded, keeping the last good one: "
                f"{self.path}: cannot read: No such file or directory"
            ],
        )

    def test_stopped_watcher_applies_nothing(self) -> None:
        self.watcher.load()
        self.watcher.startService()
        self.watcher.stopService()
        self.rewrite(TWO_NODES)
        self.clock.advance(10)
        self.assertEqual(len(self.applied), 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])
