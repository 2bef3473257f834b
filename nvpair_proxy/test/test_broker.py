"""The broker link end to end, in memory (protocol 1-4, design 8, behaviours).

Every test drives the real RpcLink framer over a StringTransport, wired to a real Broker the
way ``broker_tree`` wires it (the Facades node of the service tree, running): facades on a
MemoryReactorClock with a FakeAgent, a listen seam
that can be told which ports are taken, and a temporary state directory. Assertions are on the
lines the broker would read, parsed as JSON and compared whole, in order: the notifications a
method causes and then its one answer.
"""

from __future__ import annotations

import json
import os

from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy import __version__
from nvpair_proxy.core import constants, logs
from nvpair_proxy.test.brokerlink import ENGINES, Listening, Proxy
from nvpair_proxy.test.world import connect, request_bytes

MiB = 1024 * 1024

UNREACHABLE_TEXT = 'Upstream node "{}" is no longer reachable (dropped from discovery)'
ALIAS_ALERT = "ollama-proxy:ollama-host-alias-blocked"
NO_FACADE_TEXT = 'no facade is enabled for engine "{}" on this proxy'
UNKNOWN_ENGINE_TEXT = 'unknown engine "{}"; want one of ollama, lmstudio, llamacpp'
GENERATION_TEXT = "generation is required and must be greater than 0"
MANUAL_TEXT = "id, port, and at least one address are required"


# The wire, as the broker reads it.


def ok(message_id, result) -> dict:
    return {"jsonrpc": "2.0", "id": message_id, "result": result}


def err(message_id, code: int, message: str) -> dict:
    return {"jsonrpc": "2.0", "id": message_id, "error": {"code": code, "message": message}}


def note(method: str, params: dict) -> dict:
    return {"jsonrpc": "2.0", "method": method, "params": params}


def ready(engine: str, port: int) -> dict:
    return note(f"{engine}:ready", {"version": __version__, "port": port})


def subscribe(engine: str) -> dict:
    return note(f"{engine}:discovery:subscribe", {"services": [ENGINES[engine].service_key]})


def manual_node(
    node_id: str,
    address: str = "10.0.0.1",
    port: int = 11434,
    models=("llama3:latest",),
    host: str | None = None,
    txt=None,
) -> dict:
    """The Node shape of nodes/list and the diffs for a manual node."""
    node = {
        "id": node_id,
        "host": host or node_id,
        "port": port,
        "addresses": [address],
        "txt": txt,
        "ip": address,
    }
    if models is not None:
        node["models"] = list(models)
    return node


def directory(
    uuid: str, ip: str = "192.168.1.10", port: int = 11434, name: str | None = None, **extra
) -> dict:
    """A DirectoryNode offering the Ollama service; ``extra`` overrides or adds fields."""
    node = {
        "hostUuid": uuid,
        "name": name or f"host-{uuid}",
        "ip": ip,
        "clusterUuid": uuid,
        "trusted": True,
        "services": {"ol": {"port": port}},
        "modelsByEngine": {"ollama": ["llama3:latest"]},
        "lastSeen": 1716998400,
    }
    node.update(extra)
    return node


def seen(
    uuid: str,
    ip: str = "192.168.1.10",
    port: int = 11434,
    name: str | None = None,
    models=("llama3:latest",),
    addresses=None,
) -> dict:
    """The Node a projected DirectoryNode shows as."""
    addresses = list(addresses or [ip])
    return {
        "id": uuid,
        "host": name or f"host-{uuid}",
        "port": port,
        "addresses": addresses,
        "txt": None,
        "models": list(models),
        "ip": addresses[0],
    }


def identity(listening: Listening) -> str | None:
    """Which facade a listener serves: the engine its identity probe (409) names."""
    client = connect(listening.factory)
    client.protocol.dataReceived(
        request_bytes("GET", "/", headers={"X-NVPAIR-Engine-Identity-Probe": "1"})
    )
    response = client.response()
    client.protocol.connectionLost(Failure(ConnectionDone()))  # its idle timer goes with it
    if response.status != 409:
        return None
    engine = response.json()["error"].rpartition(" ")[2]
    # The probe is itself a finished request: reported on the link, and taken off it here.
    link = listening.factory.site.resource.facade.reporter.emitter.framer.transport
    report = json.loads(link.value())
    assert report["method"] == f"{engine}:proxy/request", report
    assert report["params"]["status"] == 409, report
    link.clear()
    return engine


def level_guard(test: SynchronousTestCase) -> None:
    test.addCleanup(logs.set_level, logs.level_name())


# protocol 1: the link.


class LinkTests(SynchronousTestCase):
    def setUp(self) -> None:
        level_guard(self)
        self.proxy = Proxy(self)

    def test_request_answered_once_with_exact_bytes(self) -> None:
        out = self.proxy.raw(
            b'{"jsonrpc":"2.0","id":7,"method":"log/set-level","params":{"level":"warn"}}\n'
        )
        self.assertEqual(out, b'{"jsonrpc":"2.0","id":7,"result":{"level":"warn"}}\n')
        self.assertEqual(logs.level_name(), "warn")

    def test_notification_never_answered(self) -> None:
        out = self.proxy.raw(
            b'{"jsonrpc":"2.0","method":"log/set-level","params":{"level":"error"}}\n'
        )
        self.assertEqual(out, b"")
        self.assertEqual(logs.level_name(), "error")
        # A failing notification is not answered either.
        self.assertEqual(self.proxy.tell("log/set-level", {"level": "loud"}), [])
        self.assertEqual(self.proxy.tell("no/such-method"), [])
        self.assertEqual(self.proxy.tell("nodes/list"), [])

    def test_id_echoed_whatever_its_type(self) -> None:
        for message_id in (0, "abc", None, 1.5, [1], {"a": 1}):
            self.assertEqual(
                self.proxy.call("node/set-priority", {"generation": 1}, message_id),
                [ok(message_id, {"count": 0})],
            )

    def test_crlf_line_end(self) -> None:
        out = self.proxy.raw(
            b'{"jsonrpc":"2.0","id":1,"method":"log/set-level","params":{"level":"info"}}\r\n'
        )
        self.assertEqual(out, b'{"jsonrpc":"2.0","id":1,"result":{"level":"info"}}\n')

    def test_lines_split_and_batched_in_any_chunks(self) -> None:
        stream = b"".join(
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": i,
                    "method": "node/set-priority",
                    "params": {"generation": i + 1, "nodes": ["n"] * i},
                }
            ).encode()
            + b"\n"
            for i in range(5)
        )
        for size in (1, 3, 17, len(stream)):
            proxy = Proxy(self)
            out = b""
            for start in range(0, len(stream), size):
                out += proxy.raw(stream[start : start + size])
            self.assertEqual(
                out,
                b"".join(
                    b'{"jsonrpc":"2.0","id":%d,"result":{"count":%d}}\n' % (i, i) for i in range(5)
                ),
            )

    def test_every_inbound_method_accepted_as_notification(self) -> None:
        proxy = self.proxy
        self.assertEqual(
            proxy.tell("facade/enable", {"engine": "ollama", "port": 11434}),
            [ready("ollama", 11434), subscribe("ollama")],
        )
        self.assertEqual(
            proxy.tell("node/set-priority", {"generation": 1, "nodes": ["a", "b"]}), []
        )
        self.assertEqual(proxy.result("node/set-priority", {"generation": 1}), {"count": 2})
        self.assertEqual(
            proxy.tell("ollama:node/set-priority", {"generation": 2, "nodes": ["a"]}), []
        )
        self.assertEqual(proxy.result("node/set-priority", {"generation": 2}), {"count": 1})
        self.assertEqual(proxy.tell("log/set-level", {"level": "debug"}), [])
        self.assertEqual(logs.level_name(), "debug")
        self.assertEqual(proxy.tell("ollama:set-port", {"port": 12000}), [ready("ollama", 12000)])
        self.assertEqual(
            proxy.tell(
                "ollama:node/add-manual",
                {
                    "id": "m",
                    "host": "m",
                    "port": 11434,
                    "addresses": ["10.0.0.1"],
                    "models": ["llama3:latest"],
                },
            ),
            [note("ollama:node/discovered", manual_node("m"))],
        )
        self.assertEqual(
            proxy.tell("ollama:node/select", {"id": "m"}),
            [note("ollama:node/selection-changed", {"id": "m"})],
        )
        self.assertEqual(proxy.tell("ollama:node/selected"), [])
        self.assertEqual(proxy.tell("ollama:nodes/list"), [])
        self.assertEqual(proxy.tell("ollama:node/model-owners", {"model": "llama3"}), [])
        self.assertEqual(
            proxy.tell(
                "ollama:node/set-local-backend",
                {"engine": "ollama", "host": "", "port": 11434, "healthy": True},
            ),
            [],
        )
        self.assertEqual(
            proxy.tell("ollama:discovery:nodes", {"nodes": [directory("d")]}),
            [note("ollama:node/discovered", seen("d"))],
        )
        self.assertEqual(
            proxy.tell("ollama:node/remove-manual", {"id": "m"}),
            [
                note("ollama:node/removed", manual_node("m")),
                note("ollama:node/selection-changed", {"id": ""}),
            ],
        )
        self.assertEqual(proxy.listed(), [seen("d")])
        self.assertEqual(proxy.shutdowns, [])
        self.assertEqual(proxy.tell("shutdown"), [])
        self.assertEqual(len(proxy.shutdowns), 1)

    def test_every_inbound_method_answered_as_request(self) -> None:
        proxy = self.proxy
        requests = [
            (
                "facade/enable",
                {"engine": "ollama", "port": 11434},
                {"engine": "ollama", "port": 11434},
            ),
            ("node/set-priority", {"generation": 1, "nodes": ["a"]}, {"count": 1}),
            ("ollama:node/set-priority", {"generation": 2}, {"count": 0}),
            ("log/set-level", {"level": "info"}, {"level": "info"}),
            ("ollama:set-port", {"port": 12000}, {"version": __version__, "port": 12000}),
            (
                "ollama:node/add-manual",
                {"id": "m", "port": 11434, "addresses": ["10.0.0.1"], "models": []},
                {"added": True},
            ),
            ("ollama:node/select", {"id": "m"}, {"id": "m"}),
            ("ollama:node/selected", None, {"id": "m"}),
            ("ollama:nodes/list", {}, {"nodes": [manual_node("m", models=())]}),
            ("ollama:node/model-owners", {"model": "llama3"}, {"nodes": []}),
            ("ollama:node/set-local-backend", {"engine": "ollama", "port": 0}, {"ok": True}),
            ("ollama:node/remove-manual", {"id": "m"}, {"removed": True}),
            ("shutdown", None, None),
        ]
        for index, (method, params, result) in enumerate(requests):
            lines = proxy.call(method, params, message_id=index)
            answers = [line for line in lines if "id" in line]
            self.assertEqual(answers, [ok(index, result)], method)
            self.assertEqual(lines[-1], answers[0], method)
        self.assertEqual(len(proxy.shutdowns), 1)

    def test_discovery_nodes_never_answered(self) -> None:
        proxy = self.proxy
        # Unaddressed, and addressed to an engine with no facade: ignored, even with an id.
        self.assertEqual(proxy.call("discovery:nodes", {"nodes": [directory("a")]}), [])
        self.assertEqual(proxy.call("ollama:discovery:nodes", {"nodes": [directory("a")]}), [])
        proxy.enable(port=11434)
        self.assertEqual(
            proxy.call("ollama:discovery:nodes", {"nodes": [directory("a")]}),
            [note("ollama:node/discovered", seen("a"))],
        )
        for params in ([1, 2], "nodes", 5, {"nodes": "a"}, {"nodes": None}, {}):
            self.assertEqual(proxy.call("ollama:discovery:nodes", params, message_id=9), [], params)
        self.assertEqual(proxy.listed(), [seen("a")])

    def test_discovery_nodes_failure_is_logged_not_answered(self) -> None:
        def broken(address):
            raise RuntimeError("interfaces unreadable")

        proxy = Proxy(self, is_local=broken)
        proxy.enable(port=11434)
        self.assertEqual(proxy.call("ollama:discovery:nodes", {"nodes": [directory("a")]}), [])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(proxy.call("ollama:nodes/list", message_id=2), [ok(2, {"nodes": []})])

    def test_malformed_lines_skipped_and_link_keeps_answering(self) -> None:
        request = b'{"jsonrpc":"2.0","id":%d,"method":"log/set-level","params":{"level":"info"}}'
        bad = [
            b"not json",
            b"{",
            b'{"jsonrpc":"2.0","id":1,"method":"log/set-level"',
            b"42",
            b'"a string"',
            b"null",
            b"true",
            b"[]",
            b"[" + request % 1 + b"]",
            b'{"id":1,"method":"log/set-level","params":{"level":"debug"}}',
            b'{"jsonrpc":"1.0","id":1,"method":"log/set-level","params":{"level":"debug"}}',
            b'{"jsonrpc":2.0,"id":1,"method":"log/set-level","params":{"level":"debug"}}',
            b'{"jsonrpc":null,"id":1,"method":"log/set-level","params":{"level":"debug"}}',
            b'{"jsonrpc":"2.0","id":1,"result":{"level":"debug"}}',
            b'{"jsonrpc":"2.0","id":1,"error":{"code":-32601,"message":"x"}}',
            b'{"jsonrpc":"2.0","id":1}',
            b'{"jsonrpc":"2.0","id":1,"method":5}',
            b'{"jsonrpc":"2.0","id":1,"method":null}',
            b"",
            b"   ",
            b"\r",
            b'{"jsonrpc":"2.0","id":1,"method":"log/set-level","params":{"level":"\xff\xfe"}}',
            b"\xc3\x28\xa0\xa1",
            (request % 1).decode().encode("utf-16"),
            b'{"jsonrpc":"2.0","id":1,"method":"node/set-priority","params":{"generation":NaN}}',
            b'{"jsonrpc":"2.0","id":1,"method":"node/set-priority",'
            b'"params":{"generation":Infinity}}',
            b"[" * 200000 + b"]" * 200000,
        ]
        for index, line in enumerate(bad):
            self.assertEqual(self.proxy.raw(line + b"\n"), b"", line)
            answer_id = 100 + index
            self.assertEqual(
                self.proxy.call("log/set-level", {"level": "info"}, answer_id),
                [ok(answer_id, {"level": "info"})],
                line,
            )
        # All at once, in one chunk.
        stream = b"".join(line + b"\n" for line in bad) + request % 500 + b"\n"
        self.assertEqual(
            self.proxy.raw(stream), b'{"jsonrpc":"2.0","id":500,"result":{"level":"info"}}\n'
        )
        self.assertEqual(logs.level_name(), "info")
        self.assertEqual(self.proxy.result("node/set-priority", {"generation": 1}), {"count": 0})

    def padded(self, message_id: int, size: int) -> bytes:
        """A valid request of exactly ``size`` bytes (without its newline)."""
        head = (
            b'{"jsonrpc":"2.0","id":%d,"method":"log/set-level","params":{"level":"info"}'
            % message_id
        )
        return head + b" " * (size - len(head) - 1) + b"}"

    def test_line_of_exactly_the_limit_is_answered(self) -> None:
        line = self.padded(3, constants.MAX_RPC_LINE)
        self.assertEqual(len(line), MiB)
        self.assertEqual(self.proxy.feed(line + b"\n"), [ok(3, {"level": "info"})])

    def test_overlong_line_discarded_in_one_chunk(self) -> None:
        line = self.padded(3, constants.MAX_RPC_LINE + 1)
        out = self.proxy.raw(line + b"\n" + self.padded(4, 200) + b"\n")
        self.assertEqual(out, b'{"jsonrpc":"2.0","id":4,"result":{"level":"info"}}\n')

    def test_overlong_line_discarded_across_many_chunks(self) -> None:
        # A valid request, 3 MiB long: were any part of it kept, its tail would parse.
        line = self.padded(3, 3 * MiB)
        follow = self.padded(4, 100) + b"\n"
        for chunk in (4096, 65536, 1000003):
            proxy = Proxy(self)
            stream = line + b"\n" + follow
            out = b""
            for start in range(0, len(stream), chunk):
                out += proxy.raw(stream[start : start + chunk])
            self.assertEqual(out, b'{"jsonrpc":"2.0","id":4,"result":{"level":"info"}}\n', chunk)
            self.assertLessEqual(len(proxy.link.framer._buffer), constants.MAX_RPC_LINE)

    def test_overlong_line_newline_on_chunk_boundary(self) -> None:
        body = b"x" * (constants.MAX_RPC_LINE + 10)
        self.assertEqual(self.proxy.raw(body), b"")
        self.assertEqual(self.proxy.raw(b"yyy"), b"")
        # The newline alone ends the discarded line; the next line is whole again.
        self.assertEqual(self.proxy.raw(b"\n"), b"")
        self.assertEqual(self.proxy.feed(self.padded(5, 100) + b"\n"), [ok(5, {"level": "info"})])
        # An over-long line whose tail arrives together with a whole request.
        self.assertEqual(self.proxy.raw(body), b"")
        self.assertEqual(
            self.proxy.feed(b"tail\n" + self.padded(6, 80) + b"\n"), [ok(6, {"level": "info"})]
        )

    def test_method_not_found_names_the_method_as_received(self) -> None:
        for method in (
            "bogus",
            "ollama:log/set-level",
            "ollama:bogus",
            "lmstudio:shutdown",
            "errors:report",
            "workload:started",
            "ollama:facade/enable",
            "nobody:nodes/list",
            "Ollama:nodes/list",
            "ollama:",
            "",
        ):
            self.assertEqual(
                self.proxy.call(method, {}, message_id=4),
                [err(4, -32601, f"method not found: {method}")],
                method,
            )
        self.proxy.enable(port=11434)
        self.assertEqual(
            self.proxy.call("ollama:log/set-level", {"level": "info"}, 5),
            [err(5, -32601, "method not found: ollama:log/set-level")],
        )

    def test_handler_exception_is_internal_error_and_logged(self) -> None:
        def broken(engine):
            raise RuntimeError("boom")

        proxy = Proxy(self, make_facade=broken)
        self.assertEqual(
            proxy.call("facade/enable", {"engine": "ollama"}, 8),
            [err(8, -32603, "internal error handling facade/enable")],
        )
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        # A notification is logged but not answered; the link keeps going.
        self.assertEqual(proxy.tell("facade/enable", {"engine": "ollama"}), [])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(
            proxy.call("log/set-level", {"level": "info"}, 9), [ok(9, {"level": "info"})]
        )

    def test_addressed_handler_exception_names_the_addressed_method(self) -> None:
        self.proxy.enable(port=11434)

        def broken(running, params):
            raise KeyError("boom")

        self.proxy.broker._facade["nodes/list"] = broken
        self.assertEqual(
            self.proxy.call("ollama:nodes/list", None, 2),
            [err(2, -32603, "internal error handling ollama:nodes/list")],
        )
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)

    def test_unserializable_result_is_still_answered_once(self) -> None:
        self.proxy.enable(port=11434)
        self.proxy.broker._facade["node/selected"] = lambda running, params: {"id": object()}
        self.assertEqual(
            self.proxy.call("ollama:node/selected", None, 3),
            [err(3, -32603, "internal error handling ollama:node/selected")],
        )
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)
        self.assertEqual(self.proxy.call("ollama:nodes/list", None, 4), [ok(4, {"nodes": []})])

    def test_failing_after_answer_callback_does_not_drop_the_link(self) -> None:
        def broken():
            raise RuntimeError("stop failed")

        proxy = Proxy(self, on_shutdown=broken)
        self.assertEqual(proxy.call("shutdown", None, 1), [ok(1, None)])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(
            proxy.call("log/set-level", {"level": "info"}, 2), [ok(2, {"level": "info"})]
        )

    def test_params_must_be_an_object(self) -> None:
        for params in ([1], "x", 3):
            lines = self.proxy.call("log/set-level", params, 1)
            self.assertEqual([(line["id"], line["error"]["code"]) for line in lines], [(1, -32602)])
        # Absent or null params read as {}.
        self.assertEqual(
            self.proxy.call("node/set-priority", None, 2), [err(2, -32602, GENERATION_TEXT)]
        )
        self.assertEqual(
            self.proxy.feed(
                b'{"jsonrpc":"2.0","id":3,"method":"node/set-priority","params":null}\n'
            ),
            [err(3, -32602, GENERATION_TEXT)],
        )


# protocol 2: addressing.


class AddressingTests(SynchronousTestCase):
    def setUp(self) -> None:
        level_guard(self)
        self.proxy = Proxy(self)

    def test_only_a_known_engine_id_is_an_address(self) -> None:
        self.proxy.enable(port=11434)
        for method in ("errors:report", "workload:started", "discovery:node-activity"):
            self.assertEqual(
                self.proxy.call(method, {"id": "x"}, 1),
                [err(1, -32601, f"method not found: {method}")],
            )

    def test_unaddressed_facade_scoped_request_has_no_facade(self) -> None:
        self.proxy.enable(port=11434)
        for method in (
            "set-port",
            "node/select",
            "node/selected",
            "nodes/list",
            "node/add-manual",
            "node/remove-manual",
            "node/set-local-backend",
            "node/model-owners",
        ):
            self.assertEqual(
                self.proxy.call(method, {}, 1), [err(1, -32002, NO_FACADE_TEXT.format(""))], method
            )

    def test_engine_without_facade(self) -> None:
        self.proxy.enable(port=11434)
        for method in ("lmstudio:nodes/list", "lmstudio:set-port", "llamacpp:node/select"):
            engine = method.partition(":")[0]
            self.assertEqual(
                self.proxy.call(method, {"port": 2000, "id": ""}, 1),
                [err(1, -32002, NO_FACADE_TEXT.format(engine))],
                method,
            )

    def test_set_priority_with_or_without_prefix(self) -> None:
        self.assertEqual(
            self.proxy.call("node/set-priority", {"generation": 1, "nodes": ["a", "b"]}, 1),
            [ok(1, {"count": 2})],
        )
        # Prefixed, and to an engine with no facade: the prefix is ignored.
        self.assertEqual(
            self.proxy.call(
                "lmstudio:node/set-priority", {"generation": 2, "nodes": ["a", "b", "c"]}, 2
            ),
            [ok(2, {"count": 3})],
        )
        self.proxy.enable(port=11434)
        self.assertEqual(
            self.proxy.call("ollama:node/set-priority", {"generation": 3, "nodes": ["c"]}, 3),
            [ok(3, {"count": 1})],
        )

    def test_log_set_level_only_unaddressed(self) -> None:
        self.proxy.enable(port=11434)
        self.assertEqual(
            self.proxy.call("log/set-level", {"level": "warn"}, 1), [ok(1, {"level": "warn"})]
        )
        self.assertEqual(
            self.proxy.call("ollama:log/set-level", {"level": "debug"}, 2),
            [err(2, -32601, "method not found: ollama:log/set-level")],
        )
        self.assertEqual(logs.level_name(), "warn")

    def test_facades_are_addressed_separately(self) -> None:
        self.proxy.enable(port=11434)
        self.proxy.enable("lmstudio", port=1234)
        self.proxy.add("o")
        self.assertEqual([n["id"] for n in self.proxy.listed("ollama")], ["o"])
        self.assertEqual(self.proxy.listed("lmstudio"), [])


# protocol 3: facade/enable.


class EnableTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.proxy = Proxy(self)

    def test_success_order_and_bytes(self) -> None:
        out = self.proxy.raw(
            b'{"jsonrpc":"2.0","id":1,"method":"facade/enable",'
            b'"params":{"engine":"ollama","port":11434}}\n'
        )
        self.assertEqual(
            out,
            (
                b'{"jsonrpc":"2.0","method":"ollama:ready","params":{"version":"%s","port":11434}}\n'
                b'{"jsonrpc":"2.0","method":"ollama:discovery:subscribe","params":{"services":["ol"]}}\n'
                b'{"jsonrpc":"2.0","id":1,"result":{"engine":"ollama","port":11434}}\n'
            )
            % __version__.encode(),
        )
        self.assertEqual(self.proxy.listen.calls, [(11434, "::")])
        self.assertEqual(identity(self.proxy.listen.on(11434)), "ollama")

    def test_success_for_each_engine(self) -> None:
        for engine, port, key in (
            ("ollama", 11434, "ol"),
            ("lmstudio", 1234, "lm"),
            ("llamacpp", 8080, "lc"),
        ):
            self.assertEqual(
                self.proxy.call("facade/enable", {"engine": engine, "port": port}, 1),
                [
                    ready(engine, port),
                    note(f"{engine}:discovery:subscribe", {"services": [key]}),
                    ok(1, {"engine": engine, "port": port}),
                ],
            )
            self.assertEqual(identity(self.proxy.listen.on(port)), engine)

    def test_alias_clear_goes_first(self) -> None:
        self.assertEqual(
            self.proxy.call(
                "facade/enable",
                {"engine": "ollama", "port": 11435, "aliasAddresses": ["127.0.0.1:11434"]},
                1,
            ),
            [
                note("ollama:errors:clear", {"id": ALIAS_ALERT}),
                ready("ollama", 11435),
                subscribe("ollama"),
                ok(1, {"engine": "ollama", "port": 11435}),
            ],
        )

    def test_idempotent(self) -> None:
        self.proxy.enable(port=11434)
        listening = self.proxy.listen.on(11434)
        for params in (
            {"port": 11434},
            {"port": 2000},
            {},
            {"port": 2000, "aliasAddresses": ["127.0.0.1:3000"]},
        ):
            self.assertEqual(
                self.proxy.call("facade/enable", {"engine": "ollama", **params}, 2),
                [ok(2, {"engine": "ollama", "port": 11434})],
            )
        self.assertEqual(self.proxy.listen.calls, [(11434, "::")])
        self.assertFalse(listening.stopped)
        self.assertEqual(identity(listening), "ollama")

    def test_idempotent_after_set_port(self) -> None:
        self.proxy.enable(port=11434)
        self.proxy.result("ollama:set-port", {"port": 12000})
        self.assertEqual(
            self.proxy.call("facade/enable", {"engine": "ollama", "port": 11434}, 2),
            [ok(2, {"engine": "ollama", "port": 12000})],
        )

    def test_port_zero_or_omitted_is_the_standalone_default(self) -> None:
        for engine, port in (("ollama", 11435), ("lmstudio", 1234), ("llamacpp", 8080)):
            for params in ({}, {"port": 0}):
                proxy = Proxy(self)
                self.assertEqual(
                    proxy.call("facade/enable", {"engine": engine, **params}, 1),
                    [
                        ready(engine, port),
                        subscribe(engine),
                        ok(1, {"engine": engine, "port": port}),
                    ],
                )
                self.assertEqual(proxy.listen.calls, [(port, "::")])

    def test_port_out_of_range(self) -> None:
        for port in (65536, 70000, -1, -11434):
            self.assertEqual(
                self.proxy.call("facade/enable", {"engine": "ollama", "port": port}, 1),
                [err(1, -32000, f"port must be between 1 and 65535 (got {port})")],
            )
        self.assertEqual(self.proxy.listen.calls, [])
        self.assertEqual(
            self.proxy.call("ollama:nodes/list", {}, 2),
            [err(2, -32002, NO_FACADE_TEXT.format("ollama"))],
        )

    def test_unknown_engine(self) -> None:
        for engine in ("x", "Ollama", "ollama-proxy", ""):
            self.assertEqual(
                self.proxy.call("facade/enable", {"engine": engine}, 1),
                [err(1, -32000, UNKNOWN_ENGINE_TEXT.format(engine))],
            )
        # Missing altogether decodes as "".
        self.assertEqual(
            self.proxy.call("facade/enable", {"port": 11434}, 2),
            [err(2, -32000, UNKNOWN_ENGINE_TEXT.format(""))],
        )
        self.assertEqual(self.proxy.listen.calls, [])

    def test_params_that_do_not_decode(self) -> None:
        for params in (
            {"engine": "ollama", "port": "11434"},
            {"engine": "ollama", "port": 1.5},
            {"engine": "ollama", "port": True},
            {"engine": "ollama", "port": [1]},
            {"engine": "ollama", "ignorePersistedPort": "yes"},
            {"engine": "ollama", "aliasAddresses": "127.0.0.1:11434"},
            {"engine": 5},
            {"engine": ["ollama"]},
        ):
            lines = self.proxy.call("facade/enable", params, 1)
            self.assertEqual(len(lines), 1, params)
            self.assertEqual(lines[0]["error"]["code"], -32602, params)
        lines = self.proxy.feed(
            b'{"jsonrpc":"2.0","id":1,"method":"facade/enable","params":["ollama",11434]}\n'
        )
        self.assertEqual([line["error"]["code"] for line in lines], [-32602])
        self.assertEqual(self.proxy.listen.calls, [])

    def test_bind_failure(self) -> None:
        self.proxy.listen.occupy(11434)
        self.assertEqual(
            self.proxy.call("facade/enable", {"engine": "ollama", "port": 11434}, 1),
            [
                note(
                    "ollama:error",
                    {
                        "code": "bind-failed",
                        "port": 11434,
                        "message": "failed to bind port 11434: Address already in use",
                    },
                ),
                err(1, -32010, "facade bind failed: port 11434: Address already in use"),
            ],
        )
        self.assertEqual(
            self.proxy.call("ollama:nodes/list", {}, 2),
            [err(2, -32002, NO_FACADE_TEXT.format("ollama"))],
        )
        # The broker retries elsewhere.
        self.assertEqual(
            self.proxy.call("facade/enable", {"engine": "ollama", "port": 11436}, 3),
            [
                ready("ollama", 11436),
                subscribe("ollama"),
                ok(3, {"engine": "ollama", "port": 11436}),
            ],
        )

    def test_lost_bind_race_leaves_the_other_facade_serving(self) -> None:
        self.proxy.enable("ollama", port=1234)
        self.proxy.add("o")
        self.assertEqual(
            self.proxy.call("facade/enable", {"engine": "lmstudio", "port": 1234}, 1),
            [
                note(
                    "lmstudio:error",
                    {
                        "code": "bind-failed",
                        "port": 1234,
                        "message": "failed to bind port 1234: Address already in use",
                    },
                ),
                err(1, -32010, "facade bind failed: port 1234: Address already in use"),
            ],
        )
        listening = self.proxy.listen.on(1234)
        self.assertFalse(listening.stopped)
        self.assertEqual(identity(listening), "ollama")
        self.assertEqual([n["id"] for n in self.proxy.listed("ollama")], ["o"])
        self.assertEqual(
            self.proxy.call("lmstudio:nodes/list", {}, 2),
            [err(2, -32002, NO_FACADE_TEXT.format("lmstudio"))],
        )
        self.assertEqual(self.proxy.enable("lmstudio", port=1236), 1236)
        self.assertEqual(identity(self.proxy.listen.on(1236)), "lmstudio")
        self.assertEqual(identity(self.proxy.listen.on(1234)), "ollama")

    def test_persisted_port_wins(self) -> None:
        self.proxy.persist('{"port":12000}')
        self.assertEqual(
            self.proxy.call("facade/enable", {"engine": "ollama", "port": 11434}, 1),
            [
                ready("ollama", 12000),
                subscribe("ollama"),
                ok(1, {"engine": "ollama", "port": 12000}),
            ],
        )
        self.assertEqual(self.proxy.listen.calls, [(12000, "::")])

    def test_persisted_port_wins_over_the_default_too(self) -> None:
        self.proxy.persist('{"port": 1300}', name="lmstudio-proxy-port.json")
        self.assertEqual(self.proxy.enable("lmstudio"), 1300)

    def test_ignore_persisted_port(self) -> None:
        self.proxy.persist('{"port":12000}')
        self.assertEqual(self.proxy.enable(port=11434, ignorePersistedPort=True), 11434)
        self.assertEqual(self.proxy.listen.calls, [(11434, "::")])
        # The file stays for the next start.
        self.assertEqual(self.proxy.persisted(), b'{"port":12000}')

    def test_reserved_persisted_port_never_restored(self) -> None:
        self.proxy.persist('{"port":1235}', name="lmstudio-proxy-port.json")
        self.proxy.persist('{"port":8081}', name="llamacpp-proxy-port.json")
        self.assertEqual(self.proxy.enable("lmstudio", port=1234), 1234)
        self.assertEqual(self.proxy.enable("llamacpp"), 8080)

    def test_unusable_persisted_file_counts_as_none(self) -> None:
        for content in (
            b"",
            b"{",
            b"null",
            b"[12000]",
            b'{"port":"12000"}',
            b'{"port":0}',
            b'{"port":-5}',
            b'{"port":65536}',
            b'{"port":12000.5}',
            b'{"port":true}',
            b'{"other":12000}',
            b"\xff\xfe\x00",
        ):
            proxy = Proxy(self)
            proxy.persist(content)
            self.assertEqual(proxy.enable(port=11434), 11434, content)
        self.flushLoggedErrors()

    def test_persisted_port_that_will_not_bind(self) -> None:
        self.proxy.persist('{"port":12000}')
        self.proxy.listen.occupy(12000)
        self.assertEqual(
            self.proxy.call("facade/enable", {"engine": "ollama", "port": 11434}, 1),
            [
                note(
                    "ollama:error",
                    {
                        "code": "bind-failed",
                        "port": 12000,
                        "message": "failed to bind port 12000: Address already in use",
                    },
                ),
                err(1, -32010, "facade bind failed: port 12000: Address already in use"),
            ],
        )
        self.assertEqual(self.proxy.enable(port=11434, ignorePersistedPort=True), 11434)

    def test_persisted_port_survives_a_restart(self) -> None:
        self.proxy.enable(port=11434)
        self.proxy.result("ollama:set-port", {"port": 12345})
        restarted = Proxy(self, state_dir=self.proxy.state_dir)
        self.assertEqual(restarted.enable(port=11434), 12345)


class AliasTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.proxy = Proxy(self)

    def enable(self, aliases, port=11435, proxy=None) -> list[dict]:
        proxy = proxy or self.proxy
        return proxy.call(
            "facade/enable", {"engine": "ollama", "port": port, "aliasAddresses": aliases}, 1
        )

    def test_ollama_only(self) -> None:
        for engine in ("lmstudio", "llamacpp"):
            lines = self.proxy.call(
                "facade/enable", {"engine": engine, "aliasAddresses": ["127.0.0.1:3000"]}, 1
            )
            self.assertEqual([line["error"]["code"] for line in lines], [-32000])
        self.assertEqual(self.proxy.listen.calls, [])
        # An empty list asks for nothing and is fine anywhere.
        self.assertEqual(self.proxy.enable("lmstudio", aliasAddresses=[]), 1234)

    def test_accepted(self) -> None:
        table = [
            (["127.0.0.1:11434"], [(11434, "127.0.0.1")]),
            (["[::1]:11434"], [(11434, "::1")]),
            (["localhost:11434"], [(11434, "127.0.0.1"), (11434, "::1")]),
            (["127.0.0.1:11434", "[::1]:11434"], [(11434, "127.0.0.1"), (11434, "::1")]),
            (["[::1]:2000", "127.0.0.1:2000"], [(2000, "::1"), (2000, "127.0.0.1")]),
            (["127.0.0.5:11434"], [(11434, "127.0.0.5")]),
            (["[0:0:0:0:0:0:0:1]:11434"], [(11434, "::1")]),
            # A mapped loopback is the IPv4 address inside it (validate), and bound so.
            (["[::ffff:127.0.0.1]:11434", "[::1]:11434"], [(11434, "127.0.0.1"), (11434, "::1")]),
        ]
        for aliases, binds in table:
            proxy = Proxy(self)
            lines = self.enable(aliases, proxy=proxy)
            self.assertEqual(
                lines,
                [
                    note("ollama:errors:clear", {"id": ALIAS_ALERT}),
                    ready("ollama", 11435),
                    subscribe("ollama"),
                    ok(1, {"engine": "ollama", "port": 11435}),
                ],
                aliases,
            )
            self.assertEqual(proxy.listen.calls, [(11435, "::")] + binds, aliases)
            primary = proxy.listen.on(11435)
            for port, host in binds:
                alias = proxy.listen.on(port, host)
                self.assertIs(alias.factory, primary.factory)
                self.assertEqual(identity(alias), "ollama")

    def test_refused(self) -> None:
        for aliases in (
            ["0.0.0.0:11434"],
            ["[::]:11434"],
            ["192.168.1.5:11434"],
            ["10.0.0.1:11434"],
            ["[fe80::1]:11434"],
            ["[::ffff:192.168.1.5]:11434"],
            ["127.0.0.1:11435"],
            ["localhost:11435"],
            ["127.0.0.1:0"],
            ["127.0.0.1:65536"],
            ["127.0.0.1:-1"],
            ["127.0.0.1"],
            ["localhost"],
            ["garbage"],
            [""],
            [":11434"],
            ["127.0.0.1:"],
            ["127.0.0.1:port"],
            ["127.0.0.1: 11434"],
            ["127.0.0.1:+11434"],
            ["127.0.0.1:\u0661\u0662"],
            ["127.0.0.1:\u00b2"],
            ["::1:11434"],
            ["[127.0.0.1]:11434"],
            ["[::1%lo]:11434"],
            ["example.com:11434"],
            ["LOCALHOST:11434"],
            ["http://127.0.0.1:11434"],
            [11434],
            [None],
            ["127.0.0.1:11434", "127.0.0.2:11434"],
            ["127.0.0.1:11434", "[::1]:11436"],
            ["localhost:11434", "127.0.0.1:11434"],
            ["localhost:11434", "[::1]:11434"],
            ["127.0.0.1:11434", "127.0.0.1:11434"],
            ["127.0.0.1:11434", "[::ffff:127.0.0.1]:11434"],
            ["[::ffff:127.0.0.1%lo]:11434"],
            ["127.0.0.1:11434", "[::1]:11434", "localhost:11434"],
        ):
            lines = self.enable(aliases)
            self.assertEqual(
                [line.get("error", {}).get("code") for line in lines], [-32000], aliases
            )
        self.assertEqual(self.proxy.listen.calls, [])

    def test_never_the_primary_port_even_when_persisted(self) -> None:
        self.proxy.persist('{"port":11434}')
        lines = self.enable(["127.0.0.1:11434"])
        self.assertEqual([line["error"]["code"] for line in lines], [-32000])
        self.assertEqual(self.proxy.listen.calls, [])

    def test_occupied_alias_is_a_warning_and_primary_stays(self) -> None:
        self.proxy.listen.occupy(11434, "127.0.0.1")
        lines = self.enable(["127.0.0.1:11434"])
        self.assertEqual(
            [line.get("method") for line in lines],
            ["ollama:errors:report", "ollama:ready", "ollama:discovery:subscribe", None],
        )
        report = lines[0]["params"]
        self.assertEqual(report.pop("id"), ALIAS_ALERT)
        self.assertEqual(report.pop("severity"), "warning")
        self.assertEqual(report.pop("action"), "none")
        self.assertIsInstance(report.pop("message"), str)
        self.assertEqual(report, {})
        self.assertEqual(
            lines[1:],
            [
                ready("ollama", 11435),
                subscribe("ollama"),
                ok(1, {"engine": "ollama", "port": 11435}),
            ],
        )
        self.assertEqual(identity(self.proxy.listen.on(11435)), "ollama")
        self.assertIsNone(self.proxy.listen.on(11434, "127.0.0.1"))

    def test_both_families_or_neither(self) -> None:
        self.proxy.listen.occupy(11434, "::1")
        lines = self.enable(["localhost:11434"])
        self.assertEqual(
            [line.get("method") for line in lines],
            ["ollama:errors:report", "ollama:ready", "ollama:discovery:subscribe", None],
        )
        self.assertEqual(
            self.proxy.listen.calls, [(11435, "::"), (11434, "127.0.0.1"), (11434, "::1")]
        )
        # The IPv4 half that did bind was let go again.
        self.assertEqual(
            [(one.port, one.interface) for one in self.proxy.listen.active], [(11435, "::")]
        )
        self.assertEqual(self.proxy.facades["ollama"].aliases, [])

    def test_alias_is_a_self_address_only_when_bound(self) -> None:
        proxy = Proxy(self, is_local=lambda address: address == "192.168.1.50")
        self.enable(["127.0.0.1:11434"], proxy=proxy)
        proxy.result("ollama:node/set-local-backend", {"engine": "ollama", "port": 11433})
        proxy.snapshot([directory("me", ip="192.168.1.50", port=11434)])
        self.assertEqual(proxy.owners(), ["me"])

        blocked = Proxy(self, is_local=lambda address: address == "192.168.1.50")
        blocked.listen.occupy(11434, "127.0.0.1")
        self.enable(["127.0.0.1:11434"], proxy=blocked)
        blocked.result("ollama:node/set-local-backend", {"engine": "ollama", "port": 11433})
        blocked.snapshot([directory("me", ip="192.168.1.50", port=11434)])
        self.assertEqual(blocked.owners(), [])


# protocol 3: set-port.


class SetPortTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.proxy = Proxy(self)
        self.proxy.enable(port=11434)
        self.old = self.proxy.listen.on(11434)

    def assert_old_serving(self) -> None:
        self.assertFalse(self.old.stopped)
        self.assertIs(self.proxy.listen.on(11434), self.old)
        self.assertEqual(identity(self.old), "ollama")
        self.assertEqual(
            self.proxy.call("facade/enable", {"engine": "ollama"}, "e"),
            [ok("e", {"engine": "ollama", "port": 11434})],
        )

    def test_out_of_range(self) -> None:
        for port in (0, -1, 65536, 100000):
            self.assertEqual(
                self.proxy.call("ollama:set-port", {"port": port}, 1),
                [err(1, -32602, f"port must be between 1 and 65535 (got {port})")],
            )
        for params in ({}, {"port": "12000"}, {"port": 1.5}, {"port": None}, {"port": False}):
            lines = self.proxy.call("ollama:set-port", params, 1)
            self.assertEqual([line["error"]["code"] for line in lines], [-32602], params)
        self.assertEqual(self.proxy.listen.calls, [(11434, "::")])
        self.assertFalse(os.path.exists(os.path.join(self.proxy.state_dir, "proxy-port.json")))
        self.assert_old_serving()

    def test_success(self) -> None:
        self.assertEqual(
            self.proxy.call("ollama:set-port", {"port": 12000}, 1),
            [ready("ollama", 12000), ok(1, {"version": __version__, "port": 12000})],
        )
        self.assertEqual(self.proxy.persisted(), b'{"port":12000}')
        self.assertEqual(os.listdir(self.proxy.state_dir), ["proxy-port.json"])
        self.assertTrue(self.old.stopped)
        self.assertEqual(self.proxy.listen.calls, [(11434, "::"), (12000, "::")])
        self.assertEqual(identity(self.proxy.listen.on(12000)), "ollama")
        self.assertEqual(
            self.proxy.call("facade/enable", {"engine": "ollama"}, 2),
            [ok(2, {"engine": "ollama", "port": 12000})],
        )

    def test_success_bytes(self) -> None:
        out = self.proxy.raw(
            b'{"jsonrpc":"2.0","id":"s","method":"ollama:set-port","params":{"port":12001}}\n'
        )
        version = __version__.encode()
        self.assertEqual(
            out,
            (
                b'{"jsonrpc":"2.0","method":"ollama:ready","params":{"version":"%s","port":12001}}\n'
                b'{"jsonrpc":"2.0","id":"s","result":{"version":"%s","port":12001}}\n'
            )
            % (version, version),
        )

    def test_overwrites_the_persisted_port(self) -> None:
        self.proxy.result("ollama:set-port", {"port": 12000})
        self.proxy.result("ollama:set-port", {"port": 12001})
        self.assertEqual(self.proxy.persisted(), b'{"port":12001}')

    def test_creates_the_state_dir(self) -> None:
        proxy = Proxy(self, state_dir=os.path.join(self.mktemp(), "a", "b"))
        proxy.enable(port=11434)
        proxy.result("ollama:set-port", {"port": 12000})
        self.assertEqual(proxy.persisted(), b'{"port":12000}')

    def test_bind_failure_keeps_the_old_listener(self) -> None:
        self.proxy.listen.occupy(12000)
        self.assertEqual(
            self.proxy.call("ollama:set-port", {"port": 12000}, 1),
            [err(1, -32000, "failed to bind port 12000: Address already in use")],
        )
        self.assertFalse(os.path.exists(os.path.join(self.proxy.state_dir, "proxy-port.json")))
        self.assert_old_serving()

    def test_port_of_another_facade(self) -> None:
        self.proxy.enable("lmstudio", port=1234)
        lines = self.proxy.call("ollama:set-port", {"port": 1234}, 1)
        self.assertEqual(
            lines, [err(1, -32000, "failed to bind port 1234: Address already in use")]
        )
        self.assert_old_serving()
        self.assertEqual(identity(self.proxy.listen.on(1234)), "lmstudio")

    def check_persist_failure(self, proxy: Proxy, old: Listening) -> None:
        lines = proxy.call("ollama:set-port", {"port": 12000}, 1)
        self.assertEqual(len(lines), 1)
        self.assertEqual(lines[0]["error"]["code"], -32000)
        self.assertTrue(lines[0]["error"]["message"].startswith("failed to persist port 12000"))
        # The new port was bound, then released; the old one never stopped.
        self.assertEqual(proxy.listen.calls[-1], (12000, "::"))
        self.assertIsNone(proxy.listen.on(12000))
        self.assertFalse(old.stopped)
        self.assertEqual(identity(old), "ollama")
        self.assertEqual(
            proxy.call("facade/enable", {"engine": "ollama"}, 2),
            [ok(2, {"engine": "ollama", "port": 11434})],
        )

    def test_persist_failure_state_dir_is_a_file(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write("not a directory")
        proxy = Proxy(self, state_dir=path)
        proxy.enable(port=11434)
        self.check_persist_failure(proxy, proxy.listen.on(11434))

    def test_persist_failure_state_dir_under_a_file(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write("not a directory")
        proxy = Proxy(self, state_dir=os.path.join(path, "state"))
        proxy.enable(port=11434)
        self.check_persist_failure(proxy, proxy.listen.on(11434))

    def test_persist_failure_target_unwritable(self) -> None:
        # The port file's own path is taken by a directory: the rename cannot land.
        os.mkdir(os.path.join(self.proxy.state_dir, "proxy-port.json"))
        self.check_persist_failure(self.proxy, self.old)
        self.assertEqual(os.listdir(self.proxy.state_dir), ["proxy-port.json"])

    def test_persist_failure_read_only_dir(self) -> None:
        if os.getuid() == 0:
            raise self.skipTest("root writes through directory permissions")
        os.chmod(self.proxy.state_dir, 0o500)
        self.addCleanup(os.chmod, self.proxy.state_dir, 0o700)
        self.check_persist_failure(self.proxy, self.old)

    def test_same_port_only_persists(self) -> None:
        self.assertEqual(
            self.proxy.call("ollama:set-port", {"port": 11434}, 1),
            [ok(1, {"version": __version__, "port": 11434})],
        )
        self.assertEqual(self.proxy.persisted(), b'{"port":11434}')
        self.assertEqual(self.proxy.listen.calls, [(11434, "::")])
        self.assert_old_serving()

    def test_same_port_persist_failure(self) -> None:
        os.mkdir(os.path.join(self.proxy.state_dir, "proxy-port.json"))
        lines = self.proxy.call("ollama:set-port", {"port": 11434}, 1)
        self.assertEqual([line["error"]["code"] for line in lines], [-32000])
        self.assert_old_serving()

    def test_aliases_survive(self) -> None:
        proxy = Proxy(self)
        proxy.call(
            "facade/enable",
            {"engine": "ollama", "port": 11435, "aliasAddresses": ["localhost:11434"]},
            1,
        )
        aliases = [proxy.listen.on(11434, "127.0.0.1"), proxy.listen.on(11434, "::1")]
        self.assertEqual(
            proxy.call("ollama:set-port", {"port": 12000}, 2),
            [ready("ollama", 12000), ok(2, {"version": __version__, "port": 12000})],
        )
        for alias in aliases:
            self.assertFalse(alias.stopped)
            self.assertEqual(identity(alias), "ollama")
        self.assertEqual(
            sorted((one.port, one.interface) for one in proxy.listen.active),
            [(11434, "127.0.0.1"), (11434, "::1"), (12000, "::")],
        )

    def test_not_onto_the_alias_port(self) -> None:
        proxy = Proxy(self)
        proxy.call(
            "facade/enable",
            {"engine": "ollama", "port": 11435, "aliasAddresses": ["127.0.0.1:11434"]},
            1,
        )
        lines = proxy.call("ollama:set-port", {"port": 11434}, 2)
        self.assertEqual([line["error"]["code"] for line in lines], [-32000])
        self.assertEqual(identity(proxy.listen.on(11435)), "ollama")
        self.assertFalse(os.path.exists(os.path.join(proxy.state_dir, "proxy-port.json")))

    def test_only_that_engine(self) -> None:
        self.proxy.enable("lmstudio", port=1234)
        self.proxy.result("lmstudio:set-port", {"port": 1300})
        self.assertEqual(self.proxy.persisted("lmstudio-proxy-port.json"), b'{"port":1300}')
        self.assertFalse(os.path.exists(os.path.join(self.proxy.state_dir, "proxy-port.json")))
        self.assert_old_serving()


# protocol 3: discovery:nodes.


class DiscoveryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.proxy = Proxy(self)
        self.proxy.enable(port=11435)

    def test_projection(self) -> None:
        nodes = [
            directory(
                "multi",
                ip="192.168.1.10",
                ips=["192.168.1.10", "10.0.0.5"],
                services={"ol": {"port": 11434}, "lm": {"port": 1234}},
            ),
            directory("no-ip", ip=""),
            {k: v for k, v in directory("ip-missing").items() if k != "ip"},
            directory("lm-only", services={"lm": {"port": 1234}}),
            directory("no-services", services={}),
            directory(
                "per-engine", modelsByEngine={"ollama": ["a"], "lmstudio": ["b"]}, models=["flat"]
            ),
            directory("flat-only", models=["flat"], modelsByEngine=None),
            directory("other-engine-only", modelsByEngine={"lmstudio": ["b"]}, models=["flat"]),
            directory("named", name="gpu-a", ip="192.168.1.11", port=11500),
            "not an object",
            {"name": "no-uuid", "ip": "192.168.1.12", "services": {"ol": {"port": 11434}}},
        ]
        flat = nodes[6]
        del flat["modelsByEngine"]
        self.assertEqual(
            self.proxy.snapshot(nodes),
            [
                note("ollama:node/discovered", node)
                for node in (
                    seen("flat-only", models=["flat"]),
                    seen("multi", addresses=["192.168.1.10", "10.0.0.5"]),
                    seen("named", name="gpu-a", ip="192.168.1.11", port=11500),
                    seen("other-engine-only", models=[]),
                    seen("per-engine", models=["a"]),
                )
            ],
        )
        self.assertEqual(
            [n["id"] for n in self.proxy.listed()],
            ["flat-only", "multi", "named", "other-engine-only", "per-engine"],
        )

    def test_llamacpp_reads_loaded_models_only(self) -> None:
        self.proxy.enable("llamacpp", port=8080)
        nodes = [
            directory(
                "loaded",
                services={"lc": {"port": 8080}},
                modelsByEngine={"llamacpp": ["a.gguf", "b.gguf"]},
                models=["a.gguf"],
                loadedByEngine={"llamacpp": ["b.gguf"], "ollama": ["c"]},
            ),
            directory(
                "catalog-only",
                services={"lc": {"port": 8080}},
                modelsByEngine={"llamacpp": ["a.gguf"]},
                models=["a.gguf"],
            ),
            directory(
                "other-loaded",
                services={"lc": {"port": 8080}},
                loadedByEngine={"ollama": ["a.gguf"]},
            ),
        ]
        self.assertEqual(
            self.proxy.snapshot(nodes, engine="llamacpp"),
            [
                note("llamacpp:node/discovered", seen("catalog-only", port=8080, models=[])),
                note("llamacpp:node/discovered", seen("loaded", port=8080, models=["b.gguf"])),
                note("llamacpp:node/discovered", seen("other-loaded", port=8080, models=[])),
            ],
        )
        # The Ollama facade sees none of them: they do not offer its service.
        self.assertEqual(self.proxy.listed("ollama"), [])

    def test_llamacpp_routes_by_the_cluster_key_lc_not_ll(self) -> None:
        """protocol 7: the cluster's node record names llama.cpp ``lc``; ``ll`` is nobody's."""
        proxy = Proxy(self, is_local=lambda address: True)
        lines = proxy.call("facade/enable", {"engine": "llamacpp", "port": 8080})
        self.assertIn(note("llamacpp:discovery:subscribe", {"services": ["lc"]}), lines)
        proxy.result(
            "llamacpp:node/set-local-backend",
            {"engine": "llamacpp", "host": "127.0.0.1", "port": 8081, "healthy": True},
        )
        loaded = {"llamacpp": ["m.gguf"]}
        proxy.snapshot(
            [directory("self", services={"lc": {"port": 8080}}, loadedByEngine=loaded)],
            engine="llamacpp",
        )
        self.assertEqual(proxy.owners("m.gguf", engine="llamacpp"), ["self"])
        proxy.snapshot(
            [directory("self", services={"ll": {"port": 8080}}, loadedByEngine=loaded)],
            engine="llamacpp",
        )
        self.assertEqual(proxy.owners("m.gguf", engine="llamacpp"), [])
        self.assertEqual(proxy.listed("llamacpp"), [])

    def test_snapshot_replaces_discovered_wholesale_manual_survive(self) -> None:
        self.proxy.add("manual-1", address="10.0.0.9")
        self.proxy.snapshot([directory("a"), directory("b")])
        self.assertEqual([n["id"] for n in self.proxy.listed()], ["a", "b", "manual-1"])
        lines = self.proxy.snapshot([directory("c")])
        self.assertEqual(
            [line["method"] for line in lines],
            [
                "ollama:node/discovered",
                "ollama:node/removed",
                "ollama:node/removed",
                "ollama:errors:report",
                "ollama:errors:report",
            ],
        )
        self.assertEqual([n["id"] for n in self.proxy.listed()], ["c", "manual-1"])
        self.assertEqual(
            self.proxy.snapshot([]),
            [
                note("ollama:node/removed", seen("c")),
                note(
                    "ollama:errors:report",
                    {
                        "id": "ollama-proxy:upstream-unreachable:c",
                        "severity": "warning",
                        "action": "none",
                        "message": UNREACHABLE_TEXT.format("host-c"),
                    },
                ),
            ],
        )
        self.assertEqual(self.proxy.listed(), [manual_node("manual-1", address="10.0.0.9")])
        self.assertEqual(self.proxy.owners(), ["manual-1"])

    def test_unchanged_snapshot_is_silent(self) -> None:
        nodes = [directory("a"), directory("b")]
        self.proxy.snapshot(nodes)
        self.assertEqual(self.proxy.snapshot(list(reversed(nodes))), [])
        # A changed name or lastSeen is not an update.
        self.assertEqual(self.proxy.snapshot([directory("a", lastSeen=5), directory("b")]), [])

    def test_diff_order(self) -> None:
        self.proxy.snapshot(
            [
                directory("c", ip="192.168.1.3"),
                directory("a", ip="192.168.1.1"),
                directory("b", ip="192.168.1.2"),
                directory("f", ip="192.168.1.6"),
            ]
        )
        self.assertEqual(
            self.proxy.call("ollama:node/select", {"id": "f"}, 1),
            [note("ollama:node/selection-changed", {"id": "f"}), ok(1, {"id": "f"})],
        )
        lines = self.proxy.snapshot(
            [
                directory("e", ip="192.168.1.5"),
                directory("b", ip="192.168.1.2", ips=["192.168.1.2", "10.0.0.2"]),
                directory("d", ip="192.168.1.4"),
                directory("a", ip="192.168.1.1", modelsByEngine={"ollama": ["mistral"]}),
            ]
        )

        def unreachable(node_id):
            return note(
                "ollama:errors:report",
                {
                    "id": f"ollama-proxy:upstream-unreachable:{node_id}",
                    "severity": "warning",
                    "action": "none",
                    "message": UNREACHABLE_TEXT.format(f"host-{node_id}"),
                },
            )

        self.assertEqual(
            lines,
            [
                note("ollama:node/discovered", seen("d", ip="192.168.1.4")),
                note("ollama:node/discovered", seen("e", ip="192.168.1.5")),
                note("ollama:node/updated", seen("a", ip="192.168.1.1", models=["mistral"])),
                note("ollama:node/updated", seen("b", addresses=["192.168.1.2", "10.0.0.2"])),
                note("ollama:node/removed", seen("c", ip="192.168.1.3")),
                note("ollama:node/removed", seen("f", ip="192.168.1.6")),
                unreachable("c"),
                unreachable("f"),
                note("ollama:node/selection-changed", {"id": ""}),
            ],
        )
        self.assertEqual(self.proxy.result("ollama:node/selected"), {"id": ""})
        # c comes back while e leaves: the report for e, then c's clear.
        lines = self.proxy.snapshot(
            [
                directory("a", ip="192.168.1.1", modelsByEngine={"ollama": ["mistral"]}),
                directory("b", ip="192.168.1.2", ips=["192.168.1.2", "10.0.0.2"]),
                directory("c", ip="192.168.1.3"),
                directory("d", ip="192.168.1.4"),
            ]
        )
        self.assertEqual(
            lines,
            [
                note("ollama:node/discovered", seen("c", ip="192.168.1.3")),
                note("ollama:node/removed", seen("e", ip="192.168.1.5")),
                unreachable("e"),
                note("ollama:errors:clear", {"id": "ollama-proxy:upstream-unreachable:c"}),
            ],
        )
        # A port change is an update.
        lines = self.proxy.snapshot(
            [
                directory("a", ip="192.168.1.1", modelsByEngine={"ollama": ["mistral"]}),
                directory("b", ip="192.168.1.2", ips=["192.168.1.2", "10.0.0.2"]),
                directory("c", ip="192.168.1.3"),
                directory("d", ip="192.168.1.4", port=11500),
            ]
        )
        self.assertEqual(
            lines, [note("ollama:node/updated", seen("d", ip="192.168.1.4", port=11500))]
        )

    def test_clear_only_once_and_only_after_a_report(self) -> None:
        self.proxy.snapshot([directory("a")])
        self.proxy.snapshot([])
        self.assertEqual(
            self.proxy.snapshot([directory("a")]),
            [
                note("ollama:node/discovered", seen("a")),
                note("ollama:errors:clear", {"id": "ollama-proxy:upstream-unreachable:a"}),
            ],
        )
        self.proxy.snapshot([])
        self.proxy.snapshot([directory("a")])
        self.assertEqual(
            self.proxy.snapshot([directory("a"), directory("b")]),
            [note("ollama:node/discovered", seen("b"))],
        )

    def test_pin_kept_while_its_node_stays(self) -> None:
        self.proxy.add("m")
        self.proxy.snapshot([directory("a"), directory("b")])
        self.proxy.result("ollama:node/select", {"id": "a"})
        self.assertEqual(
            self.proxy.snapshot([directory("a")]),
            [
                note("ollama:node/removed", seen("b")),
                note(
                    "ollama:errors:report",
                    {
                        "id": "ollama-proxy:upstream-unreachable:b",
                        "severity": "warning",
                        "action": "none",
                        "message": UNREACHABLE_TEXT.format("host-b"),
                    },
                ),
            ],
        )
        self.assertEqual(self.proxy.result("ollama:node/selected"), {"id": "a"})
        # A pinned manual node survives any snapshot.
        self.proxy.result("ollama:node/select", {"id": "m"})
        self.assertEqual(
            [line["method"] for line in self.proxy.snapshot([])],
            ["ollama:node/removed", "ollama:errors:report"],
        )
        self.assertEqual(self.proxy.result("ollama:node/selected"), {"id": "m"})

    def test_facades_have_separate_discovered_sets(self) -> None:
        self.proxy.enable("lmstudio", port=1234)
        both = directory(
            "both",
            services={"ol": {"port": 11434}, "lm": {"port": 1234}},
            modelsByEngine={"ollama": ["a"], "lmstudio": ["b"]},
        )
        self.assertEqual(
            self.proxy.snapshot([both], engine="lmstudio"),
            [note("lmstudio:node/discovered", seen("both", port=1234, models=["b"]))],
        )
        self.assertEqual(self.proxy.listed("ollama"), [])
        self.assertEqual(
            self.proxy.snapshot([both]),
            [note("ollama:node/discovered", seen("both", models=["a"]))],
        )
        self.assertEqual(
            self.proxy.snapshot([], engine="lmstudio")[0]["method"], "lmstudio:node/removed"
        )
        self.assertEqual([n["id"] for n in self.proxy.listed("ollama")], ["both"])

    def test_discovered_peers_are_listed_but_not_candidates(self) -> None:
        self.proxy.add("manual-1")
        self.proxy.snapshot([directory("peer", ip="192.168.1.60")])
        self.assertEqual([n["id"] for n in self.proxy.listed()], ["manual-1", "peer"])
        self.assertEqual(self.proxy.owners(), ["manual-1"])
        # A pin on the peer is allowed, but cannot make it a candidate.
        self.proxy.result("ollama:node/select", {"id": "peer"})
        self.assertEqual(self.proxy.owners(), ["manual-1"])

    def test_self_goes_through_the_local_backend(self) -> None:
        proxy = Proxy(self, is_local=lambda address: address in ("192.168.1.50", "10.1.1.1"))
        proxy.enable(port=11435)
        proxy.snapshot(
            [
                directory("me", ip="192.168.1.60", ips=["192.168.1.60", "10.1.1.1"], port=11435),
                # A local address but another port: that is not our facade.
                directory("engine", ip="192.168.1.50", port=11434),
                directory("peer", ip="192.168.1.70", port=11435),
            ]
        )
        self.assertEqual([n["id"] for n in proxy.listed()], ["engine", "me", "peer"])
        self.assertEqual(proxy.owners(), [])
        self.assertEqual(
            proxy.call(
                "ollama:node/set-local-backend",
                {"engine": "ollama", "host": "", "port": 11434, "healthy": True},
                1,
            ),
            [ok(1, {"ok": True})],
        )
        self.assertEqual(proxy.owners(), ["me"])
        proxy.chat(11435)
        self.assertEqual(
            [r.uri for r in proxy.agent.requests], [b"http://127.0.0.1:11434/api/chat"]
        )
        proxy.result(
            "ollama:node/set-local-backend", {"engine": "ollama", "port": 11434, "healthy": False}
        )
        self.assertEqual(proxy.owners(), [])
        proxy.result("ollama:node/set-local-backend", {"engine": "ollama", "port": 11434})
        self.assertEqual(proxy.owners(), ["me"])
        proxy.result(
            "ollama:node/set-local-backend", {"engine": "ollama", "port": 0, "healthy": True}
        )
        self.assertEqual(proxy.owners(), [])
        proxy.end_chats()


# protocol 3: node/set-local-backend's slots.


class LocalBackendSlotsTests(SynchronousTestCase):
    """A newer broker relays the engine's parallel slots; nodes/list shows them on self."""

    def setUp(self) -> None:
        self.proxy = Proxy(self, is_local=lambda address: address == "192.168.1.50")
        self.proxy.enable(port=11435)
        self.proxy.snapshot(
            [
                directory("me", ip="192.168.1.50", port=11435),
                directory("peer", ip="192.168.1.70", port=11435),
            ]
        )
        self.proxy.add("m", address="10.0.0.9")

    def backend(self, slots=None, port: int = 11434, message_id=1, **extra) -> list[dict]:
        params = {"engine": "ollama", "host": "127.0.0.1", "port": port, "healthy": True, **extra}
        if slots is not None:
            params["slots"] = slots
        return self.proxy.call("ollama:node/set-local-backend", params, message_id)

    def shown(self) -> dict[str, dict | None]:
        """Each listed node's slots field (None when it has none)."""
        return {node["id"]: node.get("slots") for node in self.proxy.listed()}

    def test_accepted_normalized_and_shown_on_the_self_node_only(self) -> None:
        self.assertEqual(
            self.backend({"default": 4, "models": {"llama3": 2, "mistral:7b": 3}}),
            [ok(1, {"ok": True})],
        )
        self.assertEqual(
            self.proxy.listed(),
            [
                manual_node("m", address="10.0.0.9"),
                {
                    **seen("me", ip="192.168.1.50", port=11435),
                    "slots": {"default": 4, "models": {"llama3:latest": 2, "mistral:7b": 3}},
                },
                seen("peer", ip="192.168.1.70", port=11435),
            ],
        )
        self.assertEqual(self.proxy.owners(), ["m", "me"])

    def test_where_two_names_normalize_alike_the_smaller_count_wins(self) -> None:
        for models in (
            {"llama3": 3, "llama3:latest": 2, " llama3 ": 5},
            {"llama3:latest": 2, "llama3": 3},
        ):
            self.assertEqual(self.backend({"models": models}), [ok(1, {"ok": True})])
            self.assertEqual(
                self.shown()["me"], {"default": None, "models": {"llama3:latest": 2}}, models
            )

    def test_counts_below_one_are_dropped(self) -> None:
        self.backend(
            {"default": 0, "models": {"a": 0, "b": -1, "c": 1, "llama3": 0, "llama3:latest": 4}}
        )
        self.assertEqual(
            self.shown()["me"], {"default": None, "models": {"c:latest": 1, "llama3:latest": 4}}
        )
        self.backend({"default": -2, "models": {"c": 1}})
        self.assertEqual(self.shown()["me"], {"default": None, "models": {"c:latest": 1}})
        # Nothing left is no slots at all.
        self.assertEqual(self.backend({"default": 0, "models": {"a": 0}}), [ok(1, {"ok": True})])
        self.assertEqual(self.shown()["me"], None)
        self.assertEqual(self.proxy.owners(), ["m", "me"])

    def test_malformed_slots_are_refused_and_change_nothing(self) -> None:
        self.backend({"default": 2, "models": {"llama3": 1}})
        self.proxy.result("ollama:node/select", {"id": "me"})
        before = self.proxy.listed()
        self.assertEqual(before[1]["slots"], {"default": 2, "models": {"llama3:latest": 1}})
        for slots, text in (
            ([], "slots must be an object"),
            ("4", "slots must be an object"),
            (4, "slots must be an object"),
            (True, "slots must be an object"),
            ({"default": "2"}, "slots.default must be an integer"),
            ({"default": 2.0}, "slots.default must be an integer"),
            ({"default": True}, "slots.default must be an integer"),
            ({"models": []}, "slots.models must be an object"),
            ({"models": "llama3"}, "slots.models must be an object"),
            (
                {"default": 1, "models": {"a": 1, "llama3": "2"}},
                "slots.models counts must be integers",
            ),
            ({"models": {"llama3": 2.5}}, "slots.models counts must be integers"),
            ({"models": {"llama3": False}}, "slots.models counts must be integers"),
            ({"models": {"llama3": None}}, "slots.models counts must be integers"),
        ):
            # A new port and a clearing call alike: neither takes effect.
            for port in (9999, 0):
                self.assertEqual(self.backend(slots, port=port), [err(1, -32602, text)], slots)
                self.assertEqual(self.proxy.listed(), before, slots)
                self.proxy.chat(11435)
                self.assertEqual(self.proxy.agent.last.uri, b"http://127.0.0.1:11434/api/chat")
        self.proxy.end_chats()

    def test_a_backend_sent_without_slots_clears_them(self) -> None:
        slots = {"default": 2}
        for clearing in (
            {},
            {"slots": None},
            {"port": 0, "slots": slots},
            {"healthy": False, "slots": slots},
        ):
            self.backend(slots)
            self.assertEqual(self.shown()["me"], {"default": 2, "models": {}})
            self.assertEqual(self.backend(**clearing), [ok(1, {"ok": True})], clearing)
            self.assertEqual(self.shown(), {"m": None, "me": None, "peer": None}, clearing)
        self.assertEqual(self.proxy.owners(), ["m"])


# protocol 3: node/set-priority.


class PriorityTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.proxy = Proxy(self)
        self.proxy.enable(port=11435)
        for node_id, address in (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")):
            self.proxy.add(node_id, address=address)

    def priority(self, generation, nodes=(), ranks=None, message_id=1) -> list[dict]:
        params = {"generation": generation, "nodes": list(nodes)}
        if ranks is not None:
            params["ranks"] = ranks
        return self.proxy.call("node/set-priority", params, message_id)

    def test_count_and_order(self) -> None:
        self.assertEqual(self.proxy.owners(), ["a", "b", "c"])
        self.assertEqual(self.priority(1, ["c", "a", "zzz"]), [ok(1, {"count": 3})])
        self.assertEqual(self.proxy.owners(), ["c", "a", "b"])
        self.assertEqual(self.priority(2, []), [ok(1, {"count": 0})])
        self.assertEqual(self.proxy.owners(), ["a", "b", "c"])

    def test_generation_required_and_positive(self) -> None:
        self.priority(5, ["c"])
        for params in (
            {},
            {"generation": 0},
            {"generation": -1},
            {"generation": None},
            {"nodes": ["b"]},
            {"generation": 0, "nodes": ["b"]},
            {"generation": -7, "nodes": ["b", "a"]},
        ):
            self.assertEqual(
                self.proxy.call("node/set-priority", params, 2),
                [err(2, -32602, GENERATION_TEXT)],
                params,
            )
        for params in (
            {"generation": "9", "nodes": ["b"]},
            {"generation": 9.5, "nodes": ["b"]},
            {"generation": True, "nodes": ["b"]},
        ):
            lines = self.proxy.call("node/set-priority", params, 3)
            self.assertEqual([line["error"]["code"] for line in lines], [-32602], params)
        self.assertEqual(self.proxy.owners(), ["c", "a", "b"])
        self.assertEqual(self.priority(5, ["b", "a"]), [ok(1, {"count": 1})])

    def test_stale_or_repeated_generation_changes_nothing(self) -> None:
        self.assertEqual(self.priority(3, ["c", "b"]), [ok(1, {"count": 2})])
        self.assertEqual(self.priority(3, ["a"]), [ok(1, {"count": 2})])
        self.assertEqual(self.priority(2, ["b", "a", "c"]), [ok(1, {"count": 2})])
        self.assertEqual(self.proxy.owners(), ["c", "b", "a"])
        self.assertEqual(self.priority(4, ["a"]), [ok(1, {"count": 1})])
        self.assertEqual(self.proxy.owners(), ["a", "b", "c"])

    def test_repeated_generation_keeps_reservations_newer_clears(self) -> None:
        self.priority(1, ["b", "a"])
        self.assertEqual(self.proxy.owners(), ["b", "a", "c"])
        self.proxy.reservations.reserve("b")
        self.assertEqual(self.proxy.owners(), ["a", "b", "c"])
        self.priority(1, ["b", "a"])
        self.assertEqual(self.proxy.owners(), ["a", "b", "c"])
        self.priority(2, ["b", "a"])
        self.assertEqual(self.proxy.owners(), ["b", "a", "c"])

    def test_negative_pending_reads_as_zero(self) -> None:
        self.priority(
            1,
            ["b", "a"],
            [
                {"id": "a", "pending": -5, "gpuPressure": 0, "rank": 2},
                {"id": "b", "pending": 0, "gpuPressure": 0, "rank": 1},
            ],
        )
        self.assertEqual(self.proxy.owners(), ["b", "a", "c"])

    def test_pressure_clamped_high(self) -> None:
        self.priority(
            1,
            ["b", "a"],
            [
                {"id": "a", "pending": 0, "gpuPressure": 10},
                {"id": "b", "pending": 3.5, "gpuPressure": 0},
            ],
        )
        self.assertEqual(self.proxy.owners(), ["a", "b", "c"])

    def test_pressure_clamped_low(self) -> None:
        self.priority(
            1,
            ["a", "b"],
            [
                {"id": "a", "pending": 1, "gpuPressure": -2},
                {"id": "b", "pending": 0.5, "gpuPressure": 0},
            ],
        )
        self.assertEqual(self.proxy.owners(), ["b", "a", "c"])

    def test_least_loaded_listed_goes_first(self) -> None:
        self.priority(
            1,
            ["a", "b"],
            [{"id": "a", "pending": 2}, {"id": "b", "pending": 1}, {"id": "c", "pending": 0}],
        )
        # c is unlisted: it keeps its place after the listed ones, whatever its load.
        self.assertEqual(self.proxy.owners(), ["b", "a", "c"])

    def test_odd_ranks_do_not_break_it(self) -> None:
        # 1e400 is valid JSON that reads as an infinite float.
        lines = self.proxy.feed(
            b'{"jsonrpc":"2.0","id":1,"method":"node/set-priority","params":{"generation":1,'
            b'"nodes":["a",5,null,"b"],"ranks":[{"id":"a","pending":"x","gpuPressure":null,'
            b'"rank":1e300},{"id":"b","pending":1e400,"rank":-1e400},"junk",{"pending":1},'
            b"null]}}\n"
        )
        self.assertEqual(lines, [ok(1, {"count": 2})])
        self.assertEqual(self.proxy.owners(), ["a", "b", "c"])
        for params in ({"generation": 2, "nodes": "a"}, {"generation": 2, "ranks": {"a": 1}}):
            lines = self.proxy.call("node/set-priority", params, 2)
            self.assertEqual([line["error"]["code"] for line in lines], [-32602])
        self.assertEqual(self.priority(2, ["b"]), [ok(1, {"count": 1})])


# protocol 3: the node methods.


class NodeMethodTests(SynchronousTestCase):
    def setUp(self) -> None:
        level_guard(self)
        self.proxy = Proxy(self)
        self.proxy.enable(port=11435)

    def test_select_and_selected(self) -> None:
        self.assertEqual(self.proxy.call("ollama:node/selected", None, 1), [ok(1, {"id": ""})])
        self.assertEqual(
            self.proxy.call("ollama:node/select", {"id": "x"}, 2),
            [err(2, -32602, 'node "x" not found')],
        )
        self.proxy.add("m")
        self.proxy.snapshot([directory("d")])
        for node_id in ("m", "d", ""):
            self.assertEqual(
                self.proxy.call("ollama:node/select", {"id": node_id}, 3),
                [note("ollama:node/selection-changed", {"id": node_id}), ok(3, {"id": node_id})],
            )
            self.assertEqual(
                self.proxy.call("ollama:node/selected", {}, 4), [ok(4, {"id": node_id})]
            )
        # Omitted id clears too.
        self.proxy.result("ollama:node/select", {"id": "m"})
        self.assertEqual(
            self.proxy.call("ollama:node/select", {}, 5),
            [note("ollama:node/selection-changed", {"id": ""}), ok(5, {"id": ""})],
        )
        lines = self.proxy.call("ollama:node/select", {"id": 5}, 6)
        self.assertEqual([line["error"]["code"] for line in lines], [-32602])

    def test_select_is_per_facade(self) -> None:
        self.proxy.enable("lmstudio", port=1234)
        self.proxy.add("m")
        self.assertEqual(
            self.proxy.call("lmstudio:node/select", {"id": "m"}, 1),
            [err(1, -32602, 'node "m" not found')],
        )

    def test_pin_orders_owners_first(self) -> None:
        self.proxy.add("a", address="10.0.0.1")
        self.proxy.add("b", address="10.0.0.2")
        self.proxy.add("c", address="10.0.0.3", models=["mistral"])
        self.proxy.result("node/set-priority", {"generation": 1, "nodes": ["a", "b"]})
        self.proxy.result("ollama:node/select", {"id": "b"})
        self.assertEqual(self.proxy.owners(), ["b", "a"])
        # An ineligible pin does not widen the owners.
        self.proxy.result("ollama:node/select", {"id": "c"})
        self.assertEqual(self.proxy.owners(), ["a", "b"])

    def test_nodes_list_shape(self) -> None:
        self.assertEqual(self.proxy.call("ollama:nodes/list", None, 1), [ok(1, {"nodes": []})])
        self.proxy.result(
            "ollama:node/add-manual",
            {
                "id": "m",
                "host": "box",
                "port": 11434,
                "addresses": ["10.0.0.9", "fd00::9"],
                "txt": ["k=v"],
                "models": ["llama3", "mistral:7b"],
            },
        )
        self.proxy.result(
            "ollama:node/add-manual", {"id": "p", "port": 11434, "addresses": ["10.0.0.8"]}
        )
        self.proxy.snapshot([directory("d", ip="192.168.1.4")])
        self.assertEqual(
            self.proxy.call("ollama:nodes/list", None, 2),
            [
                ok(
                    2,
                    {
                        "nodes": [
                            seen("d", ip="192.168.1.4"),
                            {
                                "id": "m",
                                "host": "box",
                                "port": 11434,
                                "addresses": ["10.0.0.9", "fd00::9"],
                                "txt": ["k=v"],
                                "models": ["llama3", "mistral:7b"],
                                "ip": "10.0.0.9",
                            },
                            {
                                "id": "p",
                                "host": "p",
                                "port": 11434,
                                "addresses": ["10.0.0.8"],
                                "txt": None,
                                "ip": "10.0.0.8",
                            },
                        ]
                    },
                )
            ],
        )
        # p came without models, so it is being probed; the probe gets its answer.
        self.proxy.agent.last.respond(200, body=b'{"models":[]}', finish=True)

    def test_add_manual(self) -> None:
        params = {
            "id": "m",
            "host": "box",
            "port": 11434,
            "addresses": ["10.0.0.9"],
            "models": ["llama3"],
        }
        node = manual_node("m", address="10.0.0.9", host="box", models=["llama3"])
        self.assertEqual(
            self.proxy.call("ollama:node/add-manual", params, 1),
            [note("ollama:node/discovered", node), ok(1, {"added": True})],
        )
        params.update(port=11500, models=["mistral"])
        node.update(port=11500, models=["mistral"])
        self.assertEqual(
            self.proxy.call("ollama:node/add-manual", params, 2),
            [note("ollama:node/updated", node), ok(2, {"added": False})],
        )
        self.assertEqual(self.proxy.listed(), [node])
        self.assertEqual(self.proxy.owners("mistral"), ["m"])
        self.assertEqual(self.proxy.owners("llama3"), [])

    def test_add_manual_txt_is_kept_as_the_list_given(self) -> None:
        params = {
            "id": "m",
            "port": 11434,
            "addresses": ["10.0.0.9"],
            "models": ["llama3"],
            "txt": ["role=gpu", "a=1", "role=gpu"],
        }
        node = manual_node(
            "m", address="10.0.0.9", models=["llama3"], txt=["role=gpu", "a=1", "role=gpu"]
        )
        self.assertEqual(
            self.proxy.call("ollama:node/add-manual", params, 1),
            [note("ollama:node/discovered", node), ok(1, {"added": True})],
        )
        self.assertEqual(self.proxy.listed(), [node])
        # Absent, null and an empty list: none given is null, an empty list stays a list.
        for txt, shown in ((None, None), ([], [])):
            params = {"id": "m", "port": 11434, "addresses": ["10.0.0.9"], "models": ["llama3"]}
            if txt is not None:
                params["txt"] = txt
            self.proxy.result("ollama:node/add-manual", params)
            self.assertEqual(self.proxy.listed()[0]["txt"], shown, txt)
        self.proxy.result(
            "ollama:node/add-manual",
            {"id": "m", "port": 11434, "txt": None, "addresses": ["10.0.0.9"]},
        )
        self.assertIsNone(self.proxy.listed()[0]["txt"])
        # Sent without models this time, so it is being probed; the probe gets its answer.
        self.proxy.agent.last.respond(200, body=b'{"models":[]}', finish=True)

    def test_add_manual_txt_that_is_not_a_list_of_strings_is_refused(self) -> None:
        text = 'txt must be a list of "key=value" strings'
        for txt in ({"k": "v"}, "k=v", ["k=v", 5], [None], [["k=v"]]):
            params = {"id": "m", "port": 11434, "addresses": ["10.0.0.9"], "txt": txt}
            self.assertEqual(
                self.proxy.call("ollama:node/add-manual", params, 1), [err(1, -32602, text)], txt
            )
        self.assertEqual(self.proxy.listed(), [])
        self.assertEqual(self.proxy.agent.requests, [])

    def test_add_manual_required_fields(self) -> None:
        good = {"id": "m", "port": 11434, "addresses": ["10.0.0.9"]}
        for change in (
            {"id": None},
            {"id": ""},
            {"id": 5},
            {"port": None},
            {"port": 0},
            {"port": "11434"},
            {"port": 70000},
            {"port": True},
            {"addresses": None},
            {"addresses": []},
            {"addresses": [""]},
            {"addresses": "10.0.0.9"},
            {"addresses": [5]},
        ):
            params = {**good, **change}
            params = {k: v for k, v in params.items() if v is not None}
            self.assertEqual(
                self.proxy.call("ollama:node/add-manual", params, 1),
                [err(1, -32602, MANUAL_TEXT)],
                change,
            )
        self.assertEqual(self.proxy.listed(), [])

    def test_manual_node_survives_snapshots(self) -> None:
        self.proxy.add("m")
        self.proxy.snapshot([directory("d")])
        self.assertEqual(
            self.proxy.snapshot([]),
            [
                note("ollama:node/removed", seen("d")),
                note(
                    "ollama:errors:report",
                    {
                        "id": "ollama-proxy:upstream-unreachable:d",
                        "severity": "warning",
                        "action": "none",
                        "message": UNREACHABLE_TEXT.format("host-d"),
                    },
                ),
            ],
        )
        self.assertEqual(self.proxy.listed(), [manual_node("m")])
        self.assertEqual(self.proxy.owners(), ["m"])

    def test_manual_node_without_models_is_probed(self) -> None:
        self.proxy.result(
            "ollama:node/add-manual", {"id": "p", "port": 11434, "addresses": ["10.0.0.8"]}
        )
        self.assertEqual(self.proxy.owners(), [])
        probe = self.proxy.agent.last
        self.assertEqual((probe.method, probe.uri), (b"GET", b"http://10.0.0.8:11434/api/tags"))
        probe.respond(200, body=b'{"models":[{"name":"llama3:latest"}]}', finish=True)
        self.assertEqual(self.proxy.owners(), ["p"])
        # An explicit empty list advertises nothing and is not probed.
        before = len(self.proxy.agent.requests)
        self.proxy.result(
            "ollama:node/add-manual",
            {"id": "q", "port": 11434, "addresses": ["10.0.0.7"], "models": []},
        )
        self.assertEqual(len(self.proxy.agent.requests), before)
        self.proxy.reactor.advance(constants.INVENTORY_PROBE_INTERVAL)
        self.assertEqual(
            [r.uri for r in self.proxy.agent.requests[before:]], [b"http://10.0.0.8:11434/api/tags"]
        )
        self.proxy.agent.last.respond(200, body=b'{"models":[]}', finish=True)

    def test_remove_manual(self) -> None:
        self.assertEqual(
            self.proxy.call("ollama:node/remove-manual", {"id": "m"}, 1),
            [ok(1, {"removed": False})],
        )
        self.proxy.add("m")
        self.proxy.add("n", address="10.0.0.2")
        self.assertEqual(
            self.proxy.call("ollama:node/remove-manual", {"id": "n"}, 2),
            [
                note("ollama:node/removed", manual_node("n", address="10.0.0.2")),
                ok(2, {"removed": True}),
            ],
        )
        self.proxy.result("ollama:node/select", {"id": "m"})
        self.assertEqual(
            self.proxy.call("ollama:node/remove-manual", {"id": "m"}, 3),
            [
                note("ollama:node/removed", manual_node("m")),
                note("ollama:node/selection-changed", {"id": ""}),
                ok(3, {"removed": True}),
            ],
        )
        self.assertEqual(self.proxy.result("ollama:node/selected"), {"id": ""})
        self.assertEqual(self.proxy.listed(), [])
        lines = self.proxy.call("ollama:node/remove-manual", {}, 4)
        self.assertEqual([line["error"]["code"] for line in lines], [-32602])

    def test_remove_manual_never_removes_a_discovered_node(self) -> None:
        self.proxy.snapshot([directory("d")])
        self.assertEqual(
            self.proxy.call("ollama:node/remove-manual", {"id": "d"}, 1),
            [ok(1, {"removed": False})],
        )
        self.assertEqual(self.proxy.listed(), [seen("d")])

    def test_set_local_backend_validation(self) -> None:
        for params in (
            {"engine": "ollama", "host": "192.168.1.5", "port": 11434},
            {"engine": "ollama", "host": "::ffff:192.168.1.5", "port": 11434},
            {"engine": "ollama", "host": "[::ffff:192.168.1.5]", "port": 11434},
            {"engine": "ollama", "host": "0.0.0.0", "port": 11434},
            {"engine": "ollama", "host": "::", "port": 11434},
            {"engine": "ollama", "host": "example.com", "port": 11434},
            {"engine": "ollama", "host": 5, "port": 11434},
            {"engine": "lmstudio", "host": "127.0.0.1", "port": 11434},
            {"engine": "", "host": "127.0.0.1", "port": 11434},
            {"engine": "ollama", "port": -1},
            {"engine": "ollama", "port": 70000},
            {"engine": "ollama", "port": "11434"},
            {"engine": "ollama", "port": 11434, "healthy": "false"},
        ):
            lines = self.proxy.call("ollama:node/set-local-backend", params, 1)
            self.assertEqual(
                [line.get("error", {}).get("code") for line in lines], [-32602], params
            )

    def test_set_local_backend_hosts(self) -> None:
        proxy = Proxy(self, is_local=lambda address: address == "192.168.1.50")
        proxy.enable(port=11435)
        proxy.snapshot([directory("me", ip="192.168.1.50", port=11435)])
        for host, uri in (
            ("", b"http://127.0.0.1:11434/api/chat"),
            ("127.0.0.1", b"http://127.0.0.1:11434/api/chat"),
            ("::1", b"http://[::1]:11434/api/chat"),
            ("[::1]", b"http://[::1]:11434/api/chat"),
            ("::ffff:127.0.0.1", b"http://[::ffff:127.0.0.1]:11434/api/chat"),
            ("127.0.0.2", b"http://127.0.0.2:11434/api/chat"),
        ):
            self.assertEqual(
                proxy.call(
                    "ollama:node/set-local-backend",
                    {"engine": "ollama", "host": host, "port": 11434, "healthy": True},
                    1,
                ),
                [ok(1, {"ok": True})],
                host,
            )
            proxy.chat(11435)
            self.assertEqual(proxy.agent.last.uri, uri, host)
        # A refused host leaves the backend as it was.
        proxy.call(
            "ollama:node/set-local-backend", {"engine": "ollama", "host": "192.168.1.50", "port": 9}
        )
        self.assertEqual(proxy.owners(), ["me"])
        proxy.end_chats()

    def test_model_owners(self) -> None:
        self.assertEqual(
            self.proxy.call("ollama:node/model-owners", {"model": "llama3"}, 1),
            [ok(1, {"nodes": []})],
        )
        self.proxy.add("b", address="10.0.0.2", models=["llama3:latest", "mistral"])
        self.proxy.add("a", address="10.0.0.1", models=["llama3"])
        self.proxy.add("c", address="10.0.0.3", models=["mistral"])
        self.assertEqual(self.proxy.owners("llama3"), ["a", "b"])
        self.assertEqual(self.proxy.owners("llama3:latest"), ["a", "b"])
        self.assertEqual(self.proxy.owners("mistral"), ["b", "c"])
        self.assertEqual(self.proxy.owners("phi"), [])
        for params in ({}, {"model": ""}, {"model": "  "}, {"model": 5}, {"model": None}):
            lines = self.proxy.call("ollama:node/model-owners", params, 2)
            self.assertEqual(
                [line.get("error", {}).get("code") for line in lines], [-32602], params
            )

    def test_model_owners_is_what_a_request_tries_first(self) -> None:
        for node_id, address in (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")):
            self.proxy.add(node_id, address=address)
        self.proxy.result(
            "node/set-priority",
            {
                "generation": 1,
                "nodes": ["a", "b", "c"],
                "ranks": [
                    {"id": "a", "pending": 2},
                    {"id": "b", "pending": 0},
                    {"id": "c", "pending": 0.5},
                ],
            },
        )
        owners = self.proxy.owners()
        self.assertEqual(owners, ["b", "a", "c"])
        # Read-only: asking again reserves nothing and answers the same.
        self.assertEqual(self.proxy.owners(), owners)
        self.assertEqual(self.proxy.reservations.reservations, {})
        self.proxy.chat(11435)
        self.assertEqual(self.proxy.agent.last.uri, b"http://10.0.0.2:11434/api/chat")
        # The dispatch holds a reservation now, so the next request would go elsewhere.
        self.assertEqual(self.proxy.owners(), ["c", "a", "b"])
        # Refused on b, the request fails over to the next candidate the answer named.
        self.proxy.agent.last.respond(503, body=b"busy", finish=True)
        self.assertEqual(self.proxy.agent.last.uri, b"http://10.0.0.3:11434/api/chat")
        self.proxy.end_chats()

    def test_log_set_level(self) -> None:
        for level in ("debug", "info", "warn", "error"):
            self.assertEqual(
                self.proxy.call("log/set-level", {"level": level}, 1), [ok(1, {"level": level})]
            )
            self.assertEqual(logs.level_name(), level)
        for level in ("warning", "INFO", "trace", "", None, 5, [], {}, ["info"]):
            lines = self.proxy.call("log/set-level", {"level": level}, 2)
            self.assertEqual([line.get("error", {}).get("code") for line in lines], [-32602], level)
        lines = self.proxy.call("log/set-level", {}, 3)
        self.assertEqual([line["error"]["code"] for line in lines], [-32602])
        self.assertEqual(logs.level_name(), "error")

    def test_shutdown_answers_first_then_runs(self) -> None:
        # Earlier answered requests must not get in the way of the shutdown callback.
        self.proxy.result("ollama:nodes/list")
        self.proxy.call("bogus", {}, 1)
        self.proxy.call("ollama:discovery:nodes", {"nodes": []}, 2)
        self.proxy.result("log/set-level", {"level": "info"})
        self.assertEqual(self.proxy.shutdowns, [])
        self.assertEqual(self.proxy.call("shutdown", None, 9), [ok(9, None)])
        self.assertEqual(self.proxy.shutdowns, [b'{"jsonrpc":"2.0","id":9,"result":null}\n'])
        # Nothing queued twice: a later request does not run it again.
        self.proxy.result("log/set-level", {"level": "info"})
        self.assertEqual(len(self.proxy.shutdowns), 1)

    def test_shutdown_as_notification(self) -> None:
        self.proxy.result("ollama:nodes/list")
        self.assertEqual(self.proxy.tell("shutdown"), [])
        self.assertEqual(self.proxy.shutdowns, [b""])


class FacadeStopTests(SynchronousTestCase):
    """Stopping the facades node (protocol 1): every port stops, aliases included, each
    request in flight is reported cancelled on the link, and probing stops."""

    def test_stop_closes_every_port_and_reports_in_flight_requests_cancelled(self) -> None:
        proxy = Proxy(self)
        port = proxy.enable(aliasAddresses=["127.0.0.1:11434"])
        proxy.add("gpu-a")
        proxy.chat(port)
        self.assertEqual(len(proxy.agent.requests), 1)
        ports = list(proxy.listen.active)
        self.assertEqual(
            [(p.port, p.interface) for p in ports], [(port, "::"), (11434, "127.0.0.1")]
        )
        self.successResultOf(proxy.facades.stopService())
        self.assertEqual(proxy.listen.active, [])
        self.assertTrue(all(p.stopped for p in ports))
        self.assertTrue(proxy.agent.requests[0].cancelled)
        terminal = [
            line["params"]["workloadInfo"]
            for line in proxy.feed(b"")
            if line.get("method") == "workload:errored"
        ]
        self.assertEqual(
            [(t["state"], t["error"]) for t in terminal],
            [("cancelled", "request cancelled before completion")],
        )
        self.assertFalse(proxy.facades["ollama"].prober.running)
        self.assertEqual(proxy.reactor.getDelayedCalls(), [])


class ManualSelfTests(SynchronousTestCase):
    """Protocol 3, self by address for every candidate: a manual node at this facade's own
    port is this proxy. It is served through the local backend (keeping its id, so
    ``scheduledOn`` names it), or dropped; a backend at the facade itself is no backend."""

    def setUp(self) -> None:
        level_guard(self)
        self.proxy = Proxy(self, is_local=lambda address: address == "192.168.1.50")
        self.port = self.proxy.enable(port=11500)

    def backend(self, port: int) -> None:
        self.proxy.result(
            "ollama:node/set-local-backend",
            {"engine": "ollama", "host": "127.0.0.1", "port": port, "healthy": True},
        )

    def test_without_a_local_backend_it_is_no_candidate(self) -> None:
        self.proxy.add("me", address="127.0.0.1", port=self.port)
        self.proxy.add("me-lan", address="192.168.1.50", port=self.port)
        self.proxy.add("other", address="10.0.0.1", port=self.port)
        self.assertEqual(self.proxy.owners(), ["other"])
        self.assertEqual([n["id"] for n in self.proxy.listed()], ["me", "me-lan", "other"])

    def test_with_a_local_backend_it_is_served_there_under_its_own_id(self) -> None:
        self.proxy.add("me", address="127.0.0.1", port=self.port)
        self.backend(11434)
        self.assertEqual(self.proxy.owners(), ["me"])
        events = self.proxy.chat(self.port)
        self.assertEqual(self.proxy.agent.last.uri, b"http://127.0.0.1:11434/api/chat")
        submitted = [
            e["params"]["workloadInfo"] for e in events if e.get("method") == "workload:submitted"
        ]
        self.assertEqual(submitted[-1]["scheduledOn"], "me")
        self.proxy.end_chats()
        self.proxy.feed(b"")

    def test_a_local_backend_at_the_facade_itself_is_dropped(self) -> None:
        self.proxy.add("me", address="127.0.0.1", port=self.port)
        self.backend(self.port)
        self.assertEqual(self.proxy.owners(), [])
        self.proxy.chat(self.port)
        self.assertEqual(self.proxy.agent.requests, [])
        self.proxy.end_chats()
        self.proxy.feed(b"")

    def test_set_port_rechecks_who_is_self(self) -> None:
        self.proxy.add("was-me", address="127.0.0.1", port=self.port)
        self.proxy.add("will-be-me", address="127.0.0.1", port=11600)
        self.assertEqual(self.proxy.owners(), ["will-be-me"])
        self.proxy.result("ollama:set-port", {"port": 11600})
        self.assertEqual(self.proxy.owners(), ["was-me"])

    def test_a_discovered_self_follows_set_port_too(self) -> None:
        self.backend(11434)
        self.proxy.snapshot(
            [directory("self", ip="192.168.1.50", services={"ol": {"port": 11600}})]
        )
        self.proxy.add("m", address="10.0.0.9", port=11434)
        self.proxy.result(
            "ollama:node/set-local-backend", {"engine": "ollama", "port": 0, "healthy": False}
        )
        self.assertEqual(self.proxy.owners(), ["m"])  # a peer without a pin is no candidate
        self.proxy.result("ollama:set-port", {"port": 11600})
        self.assertEqual(self.proxy.owners(), ["m"])  # self now, and no backend: dropped
        self.backend(11434)
        self.assertEqual(self.proxy.owners(), ["m", "self"])
