"""Hostile input on the broker link (protocol 1), as properties over arbitrary lines.

Whatever a line holds (bytes that are not UTF-8, nesting deeper than the parser goes,
numbers beyond float range, NaN, batches, ids of every JSON type, every method with params
of the wrong type, missing or extra, lines just under and over 1 MiB), it either gets the
documented answer or is logged and skipped; every line the proxy writes is strict JSON; no
traceback is logged; the link stays open and the next valid call is answered.

Each example drives the real framer and Broker in memory (brokerlink's ``Proxy``). The
number of examples comes from the Hypothesis profile (``ci`` by default,
``HYPOTHESIS_PROFILE=fuzz`` for many).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core import constants, logs
from nvpair_proxy.test.brokerlink import Proxy

# protocol 1 and 3: every error code a request can be answered with, short of a handler
# crashing (-32603, which none of these inputs may cause).
DOCUMENTED = {-32601, -32602, -32000, -32002, -32010}
PROBE = b'{"jsonrpc":"2.0","id":"probe","method":"node/set-priority","params":{"generation":1}}\n'
PROBE_ANSWER = b'{"jsonrpc":"2.0","id":"probe","result":{"count":%d}}\n'
FUZZ = settings.default.max_examples
# What the link logs for a line it skips (rpc.py): fixed text, at most a size; never the line.
LINK_WARNINGS = {
    "skipped a JSON-RPC line that is not JSON",
    "skipped a JSON-RPC line that is not a 2.0 object",
    "skipped a JSON-RPC message without a method",
    "skipped a JSON-RPC request whose id cannot be echoed",
    "discarding an over-long JSON-RPC line (over {limit} bytes)",
    "discarded an over-long JSON-RPC line ({size} bytes)",
    "refused a JSON-RPC notification (error {code})",
}
# What twisted.logger's bridge to the legacy log adds to every event.
LEGACY_KEYS = {"format", "isError", "message", "system", "time"}


def _strict(constant: str):
    raise ValueError(f"{constant} written on the link")


def written(out: bytes) -> list[dict]:
    """The lines the proxy wrote, each of which must be one strict JSON-RPC 2.0 object."""
    if not out:
        return []
    assert out.endswith(b"\n"), out[-200:]
    lines = []
    for line in out[:-1].split(b"\n"):
        message = json.loads(line.decode("utf-8"), parse_constant=_strict)
        assert isinstance(message, dict) and message.get("jsonrpc") == "2.0", line[:200]
        assert ("id" in message) != ("method" in message), line[:200]
        lines.append(message)
    return lines


# Strategies.

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(
        [
            2**63,
            -(2**63) - 1,
            10**308,
            10**309,
            -(10**400),
            1e308,
            -0.0,
            0,
            "",
            "ollama",
            "127.0.0.1",
            "::1",
            "10.0.0.1",
        ]
    )
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

ENGINES = ("ollama", "lmstudio", "llamacpp")
# The valid shape of every inbound method's params (protocol 3), to be broken field by field.
VALID = {
    "facade/enable": {
        "engine": "ollama",
        "port": 11434,
        "aliasAddresses": ["127.0.0.1:11500"],
        "ignorePersistedPort": True,
    },
    "node/set-priority": {
        "generation": 3,
        "nodes": ["a", "b"],
        "ranks": [{"id": "a", "pending": 1, "gpuPressure": 0.5, "rank": 1}],
    },
    "log/set-level": {"level": "info"},
    "shutdown": {},
    "set-port": {"port": 12001},
    "discovery:nodes": {
        "nodes": [
            {
                "hostUuid": "d",
                "name": "d",
                "ip": "192.168.1.10",
                "ips": ["192.168.1.10"],
                "clusterUuid": "d",
                "services": {"ol": {"port": 11434}},
                "modelsByEngine": {"ollama": ["llama3:latest"]},
            }
        ]
    },
    "node/select": {"id": "m"},
    "node/selected": {},
    "nodes/list": {},
    "node/add-manual": {
        "id": "m",
        "host": "m",
        "port": 11434,
        "addresses": ["10.0.0.1"],
        "txt": ["a=b"],
        "models": ["llama3:latest"],
    },
    "node/remove-manual": {"id": "m"},
    "node/set-local-backend": {
        "engine": "ollama",
        "host": "127.0.0.1",
        "port": 11434,
        "healthy": True,
        "slots": {"default": 2, "models": {"x": 1}},
    },
    "node/model-owners": {"model": "llama3"},
}
FACADE_SCOPED = {
    "set-port",
    "discovery:nodes",
    "node/select",
    "node/selected",
    "nodes/list",
    "node/add-manual",
    "node/remove-manual",
    "node/set-local-backend",
    "node/model-owners",
    "node/set-priority",
}


@st.composite
def broken_params(draw, method: str):
    """The method's valid params with each field kept, dropped or replaced, plus extras;
    now and then not an object at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    params = {}
    for key, value in VALID[method].items():
        choice = draw(st.sampled_from(["keep", "drop", "replace"]))
        if choice == "keep":
            params[key] = value
        elif choice == "replace":
            params[key] = draw(json_values)
    params.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=3)))
    return params


@st.composite
def calls(draw):
    """A message for any inbound method, addressed any way, with or without an id."""
    bare = draw(st.sampled_from(sorted(VALID)))
    if bare in FACADE_SCOPED:
        prefix = draw(st.sampled_from(["ollama:", "lmstudio:", "llamacpp:", "", "nobody:"]))
    else:
        prefix = draw(st.sampled_from(["", "", "", "ollama:"]))
    message = {"jsonrpc": "2.0", "method": prefix + bare}
    if draw(st.booleans()):
        message["params"] = draw(broken_params(bare))
    if draw(st.integers(0, 3)):
        message["id"] = draw(json_values)
    return message


def nested(depth: int, kind: str) -> bytes:
    opening, closing = {"list": (b"[", b"]"), "object": (b'{"a":', b"}")}[kind]
    return opening * depth + b"1" + closing * depth


class LinkUnderHostileInput(SynchronousTestCase):
    """One fresh proxy (ollama facade enabled) per example: state never leaks between them."""

    def setUp(self) -> None:
        self.addCleanup(logs.set_level, logs.level_name())
        self.examples = 0

    def tearDown(self) -> None:
        """With ``HYPOTHESIS_EXAMPLES_LOG=FILE``, record how many examples each property ran."""
        if os.environ.get("HYPOTHESIS_EXAMPLES_LOG"):
            with open(os.environ["HYPOTHESIS_EXAMPLES_LOG"], "a") as handle:
                handle.write(f"{self._testMethodName} {self.examples}\n")

    def fresh(self) -> Proxy:
        self.examples += 1
        proxy = Proxy(self)
        proxy.enable(port=11434)
        return proxy

    @contextmanager
    def logged(self, level: str = "info"):
        """The log events made inside the block, at ``level`` (an example before may have set
        another through log/set-level); info again after it."""
        events: list[dict] = []
        logs.set_level(level)
        globalLogPublisher.addObserver(events.append)
        try:
            yield events
        finally:
            globalLogPublisher.removeObserver(events.append)
            logs.set_level("info")

    def assertLinkWarnings(self, events: list[dict], count: int) -> None:
        """``count`` warnings from the link, one per skipped line, each of them one of its
        fixed texts with at most a size: nothing of a line reaches the log."""
        warnings = [e for e in events if e.get("log_level") == LogLevel.warn]
        self.assertEqual(len(warnings), count, [e.get("log_format") for e in events])
        for event in warnings:
            self.assertIn(event["log_format"], LINK_WARNINGS)
            fields = {
                k: v for k, v in event.items() if not k.startswith("log_") and k not in LEGACY_KEYS
            }
            self.assertLessEqual(set(fields), {"limit", "size", "code"}, sorted(fields))
            self.assertTrue(all(type(value) is int for value in fields.values()), fields)

    def assertSkipped(self, events: list[dict], lines: int = 1) -> None:
        """``lines`` lines skipped: their warnings are all that was logged."""
        self.assertLinkWarnings(events, lines)
        self.assertEqual(len(events), lines, [e.get("log_format") for e in events])

    def survives(self, proxy: Proxy, count: int = 0) -> None:
        """The link is open, nothing crashed, and the next valid call is answered."""
        self.assertFalse(proxy.transport.disconnecting)
        self.assertEqual(self.flushLoggedErrors(), [])
        self.assertEqual(proxy.raw(PROBE), PROBE_ANSWER % count)
        # A valid add-manual without models starts an inventory probe (design 15): the
        # engine answers it, so the example ends with nothing pending upstream.
        for record in proxy.agent.requests:
            if record.pending:
                record.respond(200, body=b'{"models":[]}', finish=True)

    @settings(suppress_health_check=[HealthCheck.too_slow])
    @given(st.binary(max_size=2000), st.integers(1, 64))
    def test_arbitrary_bytes(self, data: bytes, chunk: int) -> None:
        proxy = self.fresh()
        stream = data + b"\n"
        out = b""
        with self.logged() as events:
            for start in range(0, len(stream), chunk):
                out += proxy.raw(stream[start : start + chunk])
        written(out)
        if not out:  # every line that is not blank was skipped
            self.assertSkipped(events, sum(1 for line in stream.split(b"\n") if line.strip()))
        self.survives(proxy, proxy.reservations.count)

    @given(
        st.binary(min_size=1, max_size=8).filter(lambda b: not _utf8(b) and b"\n" not in b),
        st.integers(0, 40),
    )
    def test_invalid_utf8_anywhere_is_skipped(self, junk: bytes, where: int) -> None:
        proxy = self.fresh()
        line = b'{"jsonrpc":"2.0","id":1,"method":"log/set-level","params":{"level":"info"}}'
        where = min(where, len(line) - 2)
        bad = line[:where] + junk + line[where:]
        with self.logged() as events:
            self.assertEqual(proxy.raw(bad + b"\n"), b"")
        self.assertSkipped(events)
        self.survives(proxy)

    @given(json_values | st.lists(calls(), max_size=3))
    def test_anything_that_is_not_a_request_object_is_skipped(self, value) -> None:
        assume(not isinstance(value, dict))
        proxy = self.fresh()
        with self.logged() as events:
            self.assertEqual(proxy.raw(json.dumps(value).encode() + b"\n"), b"")
        self.assertSkipped(events)
        self.survives(proxy)

    @given(
        st.dictionaries(st.text(max_size=8), json_values, max_size=4),
        st.booleans(),
        json_values.filter(lambda value: not isinstance(value, str)),
    )
    def test_a_2_0_object_without_a_method_name_is_skipped(
        self, extra: dict, named: bool, method
    ) -> None:
        message = {k: v for k, v in extra.items() if k not in ("method", "result", "error")}
        message["jsonrpc"] = "2.0"
        if named:
            message["method"] = method
        proxy = self.fresh()
        with self.logged() as events:
            self.assertEqual(proxy.raw(json.dumps(message).encode() + b"\n"), b"")
        self.assertSkipped(events)
        self.survives(proxy)

    def test_a_refused_notification_is_logged_with_its_code_only(self) -> None:
        proxy = self.fresh()
        line = b'{"jsonrpc":"2.0","method":"log/set-level","params":{"level":7}}\n'
        with self.logged() as events:
            self.assertEqual(proxy.raw(line), b"")
        self.assertSkipped(events)
        self.assertEqual(events[0]["code"], -32602)
        self.survives(proxy)

    def test_unknown_notifications_and_responses_are_skipped_at_debug(self) -> None:
        proxy = self.fresh()
        lines = (
            b'{"jsonrpc":"2.0","method":"ollama:something/new","params":{"x":1}}\n',
            b'{"jsonrpc":"2.0","id":3,"result":{"ok":true}}\n',
            b'{"jsonrpc":"2.0","id":4,"error":{"code":-1,"message":"no"}}\n',
        )
        with self.logged("debug") as events:
            for line in lines:
                self.assertEqual(proxy.raw(line), b"")
        self.assertEqual(
            [(e["log_level"], e["log_format"]) for e in events],
            [
                (
                    LogLevel.debug,
                    "skipped a JSON-RPC notification of a method this version does not know",
                ),
                (LogLevel.debug, "skipped a JSON-RPC response: this link sends no requests"),
                (LogLevel.debug, "skipped a JSON-RPC response: this link sends no requests"),
            ],
        )
        self.survives(proxy)

    @given(calls())
    def test_every_method_with_broken_params(self, message: dict) -> None:
        proxy = self.fresh()
        with self.logged() as events:
            out = written(proxy.raw(json.dumps(message).encode() + b"\n"))
        answers = [line for line in out if "id" in line]
        # Only addressed to a known engine (or bare) is it discovery:nodes (protocol 2);
        # "nobody:discovery:nodes" is just an unknown method.
        never_answered = message["method"] in (
            "discovery:nodes",
            *(f"{engine}:discovery:nodes" for engine in ENGINES),
        )
        if _has_non_finite(message):
            # Infinity or NaN written out is not JSON: the whole line is skipped.
            self.assertEqual(out, [])
            self.assertSkipped(events)
        elif "id" not in message or never_answered or not _echoable(message["id"]):
            self.assertEqual(answers, [])
        else:
            self.assertEqual(len(answers), 1, out)
            self.assertEqual(out[-1], answers[0], "notifications come before the answer")
            (answer,) = answers
            self.assertEqual(answer["id"], message["id"])
            if "error" in answer:
                self.assertIn(answer["error"]["code"], DOCUMENTED, answer)
                self.assertIsInstance(answer["error"]["message"], str)
            else:
                self.assertIn("result", answer)
        self.survives(proxy, proxy.reservations.count)

    @given(
        st.sampled_from(["id", "params", "top"]),
        st.sampled_from(["list", "object"]),
        st.integers(1, 3000) | st.integers(900, 1100) | st.just(200000),
    )
    def test_deep_nesting(self, where: str, kind: str, depth: int) -> None:
        proxy = self.fresh()
        value = nested(depth, kind)
        line = {
            "id": b'{"jsonrpc":"2.0","id":%s,"method":"log/set-level",'
            b'"params":{"level":"info"}}' % value,
            "params": b'{"jsonrpc":"2.0","id":7,"method":"log/set-level",'
            b'"params":{"level":%s}}' % value,
            "top": value,
        }[where]
        with self.logged() as events:
            out = written(proxy.raw(line + b"\n"))
        if not out:
            self.assertSkipped(events)
        if where == "params":
            # Parsed: a level that is not a string; too deep to parse: skipped.
            self.assertIn(
                out,
                (
                    [],
                    [
                        {
                            "jsonrpc": "2.0",
                            "id": 7,
                            "error": {
                                "code": -32602,
                                "message": "level must be one of debug, info, warn, error",
                            },
                        }
                    ],
                ),
            )
        elif where == "id":
            # Echoed exactly, or (too deep to parse or to echo) skipped before it ran.
            if out:
                self.assertEqual(
                    out, [{"jsonrpc": "2.0", "id": json.loads(value), "result": {"level": "info"}}]
                )
        else:
            self.assertEqual(out, [])
        self.survives(proxy)

    @given(
        st.sampled_from(["id", "generation", "pending", "port", "rank"]),
        st.sampled_from(
            [
                b"NaN",
                b"-Infinity",
                b"Infinity",
                b"1e400",
                b"-1e400",
                b"1" + b"0" * 400,
                b"-1" + b"0" * 400,
                b"1" + b"0" * 5000,
                b"1e-400",
                b"123456789012345678901234567890",
                b"1.5",
                b"-0",
            ]
        ),
    )
    def test_huge_numbers_and_non_numbers(self, where: str, number: bytes) -> None:
        proxy = self.fresh()
        line = {
            "id": b'{"jsonrpc":"2.0","id":%s,"method":"nodes/list"}',
            "generation": b'{"jsonrpc":"2.0","id":1,"method":"node/set-priority",'
            b'"params":{"generation":%s}}',
            "pending": b'{"jsonrpc":"2.0","id":1,"method":"node/set-priority","params":'
            b'{"generation":5,"ranks":[{"id":"a","pending":%s}]}}',
            "rank": b'{"jsonrpc":"2.0","id":1,"method":"node/set-priority","params":'
            b'{"generation":5,"ranks":[{"id":"a","rank":%s}]}}',
            "port": b'{"jsonrpc":"2.0","id":1,"method":"ollama:set-port","params":{"port":%s}}',
        }[where] % number
        with self.logged() as events:
            out = written(proxy.raw(line + b"\n"))
        if not out:
            self.assertSkipped(events)
        if number in (b"NaN", b"-Infinity", b"Infinity", b"1" + b"0" * 5000):
            self.assertEqual(out, [], "not JSON (or past the parser's digit limit): skipped")
        elif where == "id":
            # Beyond float range an id reads as infinite, which cannot be echoed as JSON.
            value = json.loads(number)
            if abs(value) > 1.7976931348623157e308:
                self.assertEqual(out, [])
            else:
                self.assertEqual([line.get("id") for line in out], [value])
        else:
            (answer,) = out
            self.assertTrue("result" in answer or answer["error"]["code"] == -32602, answer)
        self.survives(proxy, proxy.reservations.count)

    def test_null_port_reads_as_omitted(self) -> None:
        # Found by test_every_method_with_broken_params: a null port crashed facade/enable
        # (-32603, a traceback) instead of meaning "the standalone default".
        proxy = Proxy(self)
        self.assertEqual(
            written(
                proxy.raw(
                    b'{"jsonrpc":"2.0","id":1,"method":"facade/enable",'
                    b'"params":{"engine":"lmstudio","port":null,"ignorePersistedPort":true}}\n'
                )
            )[-1],
            {"jsonrpc": "2.0", "id": 1, "result": {"engine": "lmstudio", "port": 1234}},
        )
        self.survives(proxy)

    @settings(
        max_examples=max(10, FUZZ // 10),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        st.integers(-40, 40),
        st.booleans(),
        st.lists(
            st.integers(0, constants.MAX_RPC_LINE + 200)
            | st.integers(constants.MAX_RPC_LINE - 3, constants.MAX_RPC_LINE + 3),
            max_size=4,
        ),
    )
    def test_lines_just_under_and_over_one_mib(
        self, offset: int, crlf: bool, splits: list[int]
    ) -> None:
        proxy = self.fresh()
        size = constants.MAX_RPC_LINE + offset
        head = b'{"jsonrpc":"2.0","id":3,"method":"log/set-level","params":{"level":"info"}'
        end = b"}\r" if crlf else b"}"
        line = head + b" " * (size - len(head) - len(end)) + end
        self.assertEqual(len(line), size)
        stream = line + b"\n" + PROBE
        cuts = sorted({0, len(stream), *(min(cut, len(stream)) for cut in splits)})
        with self.logged() as events:
            out = b"".join(proxy.raw(stream[a:b]) for a, b in zip(cuts, cuts[1:]))
        self.assertLinkWarnings(events, 0 if size <= constants.MAX_RPC_LINE else 1)
        want = PROBE_ANSWER % 0
        if size <= constants.MAX_RPC_LINE:
            want = b'{"jsonrpc":"2.0","id":3,"result":{"level":"info"}}\n' + want
        self.assertEqual(out, want)
        self.assertLessEqual(len(proxy.link.framer._buffer), constants.MAX_RPC_LINE)
        self.survives(proxy)


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _echoable(value) -> bool:
    """Can the proxy echo this id? Not when it holds a number beyond float range (read as
    infinite) or nests too deep to encode."""

    def fits(item) -> bool:
        if isinstance(item, float) or (isinstance(item, int) and not isinstance(item, bool)):
            return abs(item) <= 1.7976931348623157e308
        if isinstance(item, list):
            return all(fits(i) for i in item)
        if isinstance(item, dict):
            return all(fits(i) for i in item.values())
        return True

    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, RecursionError):
        return False
    return fits(value)


def _has_non_finite(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return True
    return False


class RealLinkTests(SynchronousTestCase):
    """Once over the real stdio link of a running proxy: the process, not just the framer."""

    def test_hostile_lines_leave_the_process_answering(self) -> None:
        from nvpair_proxy.test.support import broker_channel

        link = broker_channel(self)
        hostile = [
            b"\xff\xfe\xc3\x28 not UTF-8",
            b"[" * 200000 + b"]" * 200000,
            b'{"jsonrpc":"2.0","id":1e400,"method":"nodes/list"}',
            b'{"jsonrpc":"2.0","id":NaN,"method":"nodes/list"}',
            b'[{"jsonrpc":"2.0","id":2,"method":"log/set-level","params":{"level":"info"}}]',
            b'{"jsonrpc":"2.0","id":3,"method":"' + b"x" * (constants.MAX_RPC_LINE + 10) + b'"}',
            b'{"jsonrpc":"2.0","id":4,"method":"facade/enable","params":{"engine":5}}',
        ]
        link.proc.stdin.write(b"\n".join(hostile) + b"\n")
        link.proc.stdin.flush()
        self.assertEqual(link.wait(lambda m: m.get("id") == 4)["error"]["code"], -32602)
        self.assertEqual(link.call("log/set-level", {"level": "info"})["result"], {"level": "info"})
        self.assertIsNone(link.proc.poll())
        self.assertEqual([m.get("id") for m in link.lines], [4, link.next_id - 1])
