"""Tests for the simulated engine fleet.

Wire formats are checked over real loopback sockets with treq, because that is what the
proxy will see. Timing and faults are checked in memory: one HTTP channel on a
StringTransport, with the node's time on a MemoryReactorClock, so the tests can assert the
exact bytes on the wire at each moment. The CLI is run as a real subprocess.
"""

from __future__ import annotations

import json
import os
import sys

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionDone, ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.internet.utils import getProcessOutputAndValue
from twisted.protocols.policies import WrappingFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed
from twisted.web.server import Site

from nvpair_proxy.http.client import Client
from nvpair_proxy.http.pool import ConnectionPool
from nvpair_proxy.testing.simfleet import (
    FleetFileError,
    SimNode,
    SimNodeResource,
    load_fleet,
    parse_fleet,
    start_fleet,
    token_text,
)

CHAT = {"messages": [{"role": "user", "content": "why is the sky blue"}]}  # 5 prompt words


def _ndjson(body: bytes) -> list[dict]:
    assert body.endswith(b"\n"), body[-40:]
    return [json.loads(line) for line in body.split(b"\n")[:-1]]


def _sse(body: bytes) -> list[tuple[str | None, str]]:
    """(event, data) per frame; the body must end on a frame boundary."""
    assert body.endswith(b"\n\n"), body[-40:]
    frames = []
    for frame in body.decode("utf-8").split("\n\n")[:-1]:
        event = None
        data = []
        for line in frame.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                event = value
            else:
                assert field == "data", frame
                data.append(value)
        frames.append((event, "\n".join(data)))
    return frames


# -- in memory ---------------------------------------------------------------------------


class _Wire:
    """One client connection to a node, in memory: the raw bytes a proxy would receive."""

    def __init__(self, node: SimNode, clock: MemoryReactorClock):
        # The site's own timers (idle timeout, log clock) run on a separate clock, so the
        # node's clock holds only the node's calls.
        site = Site(SimNodeResource(node, clock), reactor=MemoryReactorClock())
        address = IPv4Address("TCP", "127.0.0.1", 40000)
        self.transport = StringTransport(peerAddress=address)
        self.channel = site.buildProtocol(address)
        self.channel.makeConnection(self.transport)

    def send(
        self, method: str, path: str, body: object = None, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        raw = (
            body
            if isinstance(body, bytes)
            else (b"" if body is None else json.dumps(body).encode())
        )
        lines = [f"{method} {path} HTTP/1.1", "Host: sim.test", f"Content-Length: {len(raw)}"]
        lines += [f"{name}: {value}" for name, value in headers]
        self.channel.dataReceived("\r\n".join(lines).encode() + b"\r\n\r\n" + raw)

    def response(self) -> tuple[int, dict[str, str], list[bytes], bool]:
        """Status, headers, body chunks (or the whole body) and whether the body ended."""
        head, _, rest = self.transport.value().partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in header_lines)
        headers = {name.lower(): value for name, value in headers.items()}
        if headers.get("transfer-encoding") != "chunked":
            length = int(headers["content-length"])
            return int(status_line.split()[1]), headers, [rest], len(rest) == length
        chunks = []
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                assert rest == b"\r\n", rest
                return int(status_line.split()[1]), headers, chunks, True
            chunks.append(rest[:size])
            assert rest[size : size + 2] == b"\r\n"
            rest = rest[size + 2 :]
        return int(status_line.split()[1]), headers, chunks, False

    def client_leaves(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))


class TimingAndFaultTests(SynchronousTestCase):
    """Behaviour over time, read as a timeline on a fake clock."""

    def setUp(self):
        self.clock = MemoryReactorClock()

    def test_token_delay_spaces_streamed_tokens_on_the_clock(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], tokens=3, token_delay=0.5)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        seen = [len(wire.response()[2])]
        for _ in range(6):
            self.clock.advance(0.25)
            seen.append(len(wire.response()[2]))
        # A token at 0, 0.5 and 1.0; the terminal line at 1.5.
        self.assertEqual(seen, [1, 1, 2, 2, 3, 3, 4])
        status, headers, chunks, complete = wire.response()
        self.assertEqual((status, complete), (200, True))
        final = json.loads(chunks[-1])
        self.assertEqual(
            (final["done"], final["eval_count"], final["eval_duration"]), (True, 3, 1_500_000_000)
        )
        self.assertEqual(
            [json.loads(c)["message"]["content"] for c in chunks[:3]],
            [token_text("gpu-a", i) for i in range(3)],
        )
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_non_stream_answer_arrives_only_when_generation_is_done(self):
        node = SimNode("gpu-b", "lmstudio", models=["qwen"], tokens=4, token_delay=0.5)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/v1/chat/completions", {"model": "qwen", **CHAT})
        self.clock.advance(1.75)
        self.assertEqual(wire.transport.value(), b"")
        self.clock.advance(0.25)
        status, headers, (body,), complete = wire.response()
        self.assertEqual(
            (status, complete, headers["content-type"]), (200, True, "application/json")
        )
        answer = json.loads(body)
        self.assertEqual(
            answer["choices"][0]["message"]["content"],
            "".join(token_text("gpu-b", i) for i in range(4)),
        )
        self.assertEqual(
            answer["usage"], {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
        )
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_client_leaving_mid_stream_cancels_pending_tokens(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], tokens=5, token_delay=1.0)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/generate", {"model": "llama3", "prompt": "hi"})
        self.clock.advance(1.0)
        written = wire.transport.value()
        self.assertEqual(len(wire.response()[2]), 2)
        wire.client_leaves()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(10.0)
        self.assertEqual(wire.transport.value(), written)

    def test_die_after_tokens_closes_without_the_chunk_terminator(self):
        node = SimNode(
            "gpu-b", "lmstudio", models=["qwen"], tokens=5, token_delay=0.5, die_after_tokens=2
        )
        wire = _Wire(node, self.clock)
        wire.send("POST", "/v1/chat/completions", {"model": "qwen", "stream": True, **CHAT})
        self.clock.advance(0.5)
        self.assertFalse(wire.transport.disconnecting)
        self.clock.advance(0.5)
        status, headers, chunks, complete = wire.response()
        self.assertEqual((status, headers["x-sim-node"], complete), (200, "gpu-b", False))
        self.assertEqual(
            [json.loads(c[len(b"data: ") :])["choices"][0]["delta"]["content"] for c in chunks],
            [token_text("gpu-b", 0), token_text("gpu-b", 1)],
        )
        self.assertTrue(wire.transport.disconnecting)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        wire.client_leaves()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_die_after_all_tokens_drops_only_the_terminal_frame(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], tokens=2, die_after_tokens=2)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        status, headers, chunks, complete = wire.response()
        self.assertEqual((status, complete), (200, False))
        self.assertEqual([json.loads(c)["done"] for c in chunks], [False, False])
        self.assertTrue(wire.transport.disconnecting)

    def test_die_before_a_non_stream_answer_sends_nothing(self):
        node = SimNode(
            "gpu-c", "llamacpp", models=["m"], tokens=4, token_delay=0.5, die_after_tokens=1
        )
        wire = _Wire(node, self.clock)
        wire.send("POST", "/v1/completions", {"model": "m", "prompt": "hi"})
        self.clock.advance(0.5)
        self.assertEqual((wire.transport.value(), wire.transport.disconnecting), (b"", True))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_llamacpp_closes_right_after_a_stream_though_its_headers_say_keep_alive(self):
        node = SimNode("gpu-c", "llamacpp", models=["m"], tokens=2)
        streamed = _Wire(node, self.clock)
        streamed.send("POST", "/v1/chat/completions", {"model": "m", "stream": True, **CHAT})
        status, headers, chunks, complete = streamed.response()
        self.assertEqual((status, complete, headers.get("connection")), (200, True, None))
        self.assertTrue(streamed.transport.disconnecting, "closed after the terminator")
        whole = _Wire(node, self.clock)
        whole.send("POST", "/v1/chat/completions", {"model": "m", **CHAT})
        self.assertEqual(whole.response()[0], 200)
        self.assertFalse(whole.transport.disconnecting, "a whole answer keeps its connection")
        ollama = _Wire(SimNode("gpu-a", "ollama", models=["llama3"], tokens=2), self.clock)
        ollama.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        self.assertEqual(ollama.response()[3], True)
        self.assertFalse(ollama.transport.disconnecting, "Ollama keeps it after a stream")

    def test_close_after_stream_overrides_the_dialects_habit(self):
        node = SimNode("gpu-c", "llamacpp", models=["m"], tokens=1, close_after_stream=False)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/v1/chat/completions", {"model": "m", "stream": True, **CHAT})
        self.assertEqual(wire.response()[3], True)
        self.assertFalse(wire.transport.disconnecting)

    def test_drop_after_read_closes_without_a_byte_and_counts_the_request(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], drop_after_read=True)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/pull", {"model": "llama3"})
        self.assertEqual((wire.transport.value(), wire.transport.disconnecting), (b"", True))
        self.assertEqual((node.dropped, node.state()["dropped"]), (1, 1))

    def test_hang_after_headers_sends_headers_and_no_body(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], hang_after_headers=True)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        self.clock.advance(3600)
        status, headers, chunks, complete = wire.response()
        self.assertEqual(
            (status, headers["content-type"], headers["x-sim-node"]),
            (200, "application/x-ndjson", "gpu-a"),
        )
        self.assertEqual((chunks, complete), ([], False))
        self.assertTrue(wire.transport.value().endswith(b"\r\n\r\n"))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_hang_before_headers_sends_nothing_but_counts_the_request(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], hang_before_headers=True)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/generate", {"model": "llama3", "prompt": "x"})
        self.clock.advance(3600)
        self.assertEqual(wire.transport.value(), b"")
        self.assertEqual(node.served, [("POST", "/api/generate")])

    def test_headers_delay_answers_only_after_the_delay(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], tokens=1, headers_delay=2.0)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/chat", {"model": "llama3", "stream": False, **CHAT})
        self.clock.advance(1.999)
        self.assertEqual(wire.transport.value(), b"")
        self.clock.advance(0.001)
        status, headers, chunks, complete = wire.response()
        self.assertEqual((status, headers["x-sim-node"], complete), (200, "gpu-a", True))
        self.assertEqual(node.served, [("POST", "/api/chat")])

    def test_headers_delay_keeps_faults_and_forgets_a_client_that_left(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], headers_delay=1.0, status=503)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        self.clock.advance(1.0)
        self.assertEqual(wire.response()[0], 503)
        gone = _Wire(node, self.clock)
        gone.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        gone.channel.connectionLost(Failure(ConnectionDone()))
        self.clock.advance(1.0)
        self.assertEqual(gone.transport.value(), b"")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_paused_client_holds_the_stream_until_it_resumes(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], tokens=3, token_delay=1.0)
        wire = _Wire(node, self.clock)
        wire.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        wire.transport.producer.pauseProducing()  # what a full send buffer does
        self.clock.advance(1.0)
        self.assertEqual(len(wire.response()[2]), 1)
        wire.transport.producer.resumeProducing()  # the token that came due is written now
        self.assertEqual(len(wire.response()[2]), 2)
        self.clock.advance(1.0)
        self.assertEqual(len(wire.response()[2]), 3)
        self.clock.advance(1.0)
        self.assertEqual(wire.response()[3], True)

    def test_headers_of_the_last_request_are_recorded_with_repeats(self):
        node = SimNode("gpu-c", "llamacpp", models=["m"])
        wire = _Wire(node, self.clock)
        wire.send("GET", "/models", headers=(("X-Repeat", "a"), ("X-Repeat", "b")))
        self.assertEqual(node.headers_seen["x-repeat"], ["a", "b"])
        self.assertEqual(node.headers_seen["host"], ["sim.test"])
        self.assertEqual(node.served, [])  # a model list is not inference

    def test_fault_switch_changes_the_next_request_only(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], tokens=2, token_delay=1.0)
        first = _Wire(node, self.clock)
        first.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        admin = _Wire(node, self.clock)
        admin.send("POST", "/_sim/fault", {"status": 503})
        self.assertEqual(admin.response()[0], 200)
        self.clock.advance(2.0)
        self.assertEqual(first.response()[0::3], (200, True))
        second = _Wire(node, self.clock)
        second.send("POST", "/api/chat", {"model": "llama3", **CHAT})
        status, _, (body,), _ = second.response()
        self.assertEqual(
            (status, json.loads(body)), (503, {"error": "simulated fault on gpu-a: HTTP 503"})
        )


class EngineTruthTests(SynchronousTestCase):
    """Slots, warm models and cold loads, and the truth routes that report them, in memory."""

    def setUp(self):
        self.clock = MemoryReactorClock()

    def get(self, node: SimNode, path: str) -> tuple[int, object]:
        wire = _Wire(node, self.clock)
        wire.send("GET", path)
        status, _, (body,), complete = wire.response()
        self.assertTrue(complete)
        return status, json.loads(body)

    def chat(self, node: SimNode, model: str, path: str = "/v1/chat/completions") -> _Wire:
        wire = _Wire(node, self.clock)
        wire.send("POST", path, {"model": model, "stream": True, **CHAT})
        return wire

    def processing(self, node: SimNode, path: str = "/slots") -> list[bool]:
        status, slots = self.get(node, path)
        self.assertEqual(status, 200)
        assert isinstance(slots, list)
        self.assertEqual([slot["id"] for slot in slots], list(range(len(slots))))
        return [slot["is_processing"] for slot in slots]

    def test_llamacpp_slots_report_the_requests_in_progress(self):
        node = SimNode("gpu-c", "llamacpp", models=["m"], slots=2, tokens=2, token_delay=1.0)
        self.assertEqual(self.processing(node), [False, False])
        first = self.chat(node, "m")
        self.assertEqual((self.processing(node), node.busy), ([True, False], 1))
        second = self.chat(node, "m")
        self.assertEqual(self.processing(node), [True, True])
        self.clock.advance(2.0)
        self.assertTrue(first.response()[3] and second.response()[3])
        self.assertEqual((self.processing(node), node.busy), ([False, False], 0))

    def test_without_a_slot_count_slots_is_501_as_with_no_slots(self):
        node = SimNode("gpu-c", "llamacpp", models=["m"])
        self.assertEqual(
            self.get(node, "/slots"),
            (
                501,
                {
                    "error": {
                        "code": 501,
                        "type": "not_supported_error",
                        "message": "This server does not support slots endpoint. "
                        "Start it with `--slots`",
                    }
                },
            ),
        )
        for dialect, path in (
            ("ollama", "/slots"),
            ("lmstudio", "/slots"),
            ("llamacpp", "/api/ps"),
            ("ollama", "/api/v0/models"),
        ):
            wire = _Wire(SimNode("n", dialect, models=["m"]), self.clock)
            wire.send("GET", path)
            self.assertEqual(wire.response()[0], 404)

    def test_a_full_engine_queues_inside_in_arrival_order(self):
        node = SimNode("gpu-c", "llamacpp", models=["m"], slots=1, tokens=1, token_delay=1.0)
        first = self.chat(node, "m")
        second, third, gone = self.chat(node, "m"), self.chat(node, "m"), self.chat(node, "m")
        self.assertEqual((node.busy, node.queued), (1, 3))
        gone.client_leaves()
        self.assertEqual(node.queued, 2)
        self.assertEqual([w.transport.value() for w in (second, third)], [b"", b""])
        self.clock.advance(1.0)  # the first ends; the second starts at once, the third waits
        self.assertTrue(first.response()[3])
        self.assertEqual(len(second.response()[2]), 1)
        self.assertEqual((third.transport.value(), node.busy, node.queued), (b"", 1, 1))
        self.clock.advance(1.0)
        self.assertTrue(second.response()[3])
        self.assertEqual(len(third.response()[2]), 1)
        self.clock.advance(1.0)
        self.assertTrue(third.response()[3])
        self.assertEqual((gone.transport.value(), node.busy, node.queued), (b"", 0, 0))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_more_slots_through_sim_fault_start_waiting_requests(self):
        node = SimNode("gpu-b", "lmstudio", models=["q"], slots=1, tokens=1, token_delay=1.0)
        self.chat(node, "q")
        waiting = self.chat(node, "q")
        admin = _Wire(node, self.clock)
        admin.send("POST", "/_sim/fault", {"slots": 2})
        self.assertEqual(admin.response()[0], 200)
        self.assertEqual(len(waiting.response()[2]), 1)
        self.assertEqual((node.busy, node.queued), (2, 0))

    def test_a_cold_model_loads_on_first_use_then_is_warm(self):
        node = SimNode(
            "gpu-a",
            "ollama",
            models=["llama3", "mistral"],
            loaded=["mistral"],
            tokens=1,
            token_delay=1.0,
            cold_load_delay=5.0,
        )
        self.assertEqual(
            [m["name"] for m in self.get(node, "/api/ps")[1]["models"]], ["mistral:latest"]
        )
        cold = self.chat(node, "llama3", "/api/chat")
        also = self.chat(node, "llama3:latest", "/api/chat")  # waits for the same load
        self.clock.advance(4.999)
        self.assertEqual((cold.transport.value(), also.transport.value(), node.busy), (b"", b"", 2))
        self.assertEqual(
            [m["name"] for m in self.get(node, "/api/ps")[1]["models"]], ["mistral:latest"]
        )
        self.clock.advance(0.001)
        self.assertEqual((len(cold.response()[2]), len(also.response()[2])), (1, 1))
        self.assertEqual(node.loaded, ["mistral", "llama3:latest"])
        ps = self.get(node, "/api/ps")[1]["models"]
        self.assertEqual(
            [(m["name"], m["model"]) for m in ps],
            [("llama3:latest", "llama3:latest"), ("mistral:latest", "mistral:latest")],
        )
        self.clock.advance(1.0)
        warm = self.chat(node, "llama3", "/api/chat")
        self.assertEqual(len(warm.response()[2]), 1)  # its first byte at once
        self.clock.advance(1.0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_cold_load_holds_its_slot(self):
        node = SimNode(
            "gpu-b", "lmstudio", models=["q"], loaded=[], slots=1, tokens=1, cold_load_delay=3.0
        )
        loading = self.chat(node, "q")
        behind = self.chat(node, "q")
        self.assertEqual((node.busy, node.queued), (1, 1))
        self.clock.advance(3.0)
        self.assertTrue(loading.response()[3])
        self.assertTrue(behind.response()[3])
        self.assertEqual((node.busy, node.queued, node.loaded), (0, 0, ["q"]))

    def test_a_client_leaving_a_cold_load_frees_its_slot_and_the_load_goes_on(self):
        node = SimNode("gpu-b", "lmstudio", models=["q"], loaded=[], slots=1, cold_load_delay=3.0)
        gone = self.chat(node, "q")
        gone.client_leaves()
        self.assertEqual(node.busy, 0)
        self.clock.advance(3.0)
        self.assertEqual((gone.transport.value(), node.loaded), (b"", ["q"]))

    def test_lmstudio_v0_models_gives_every_model_a_state(self):
        node = SimNode(
            "gpu-b", "lmstudio", models=["q", "g"], loaded=["g"], cold_load_delay=2.0, tokens=0
        )
        status, listed = self.get(node, "/api/v0/models")
        self.assertEqual(status, 200)
        assert isinstance(listed, dict)
        self.assertEqual(listed["object"], "list")
        self.assertEqual(
            [(m["id"], m["state"], m["type"]) for m in listed["data"]],
            [("q", "not-loaded", "llm"), ("g", "loaded", "llm")],
        )
        self.chat(node, "q")
        self.assertEqual(
            [m["state"] for m in self.get(node, "/api/v0/models")[1]["data"]],
            ["not-loaded", "loaded"],
        )  # loading is not loaded yet
        self.clock.advance(2.0)
        self.assertEqual(
            [m["state"] for m in self.get(node, "/api/v0/models")[1]["data"]], ["loaded", "loaded"]
        )
        # The OpenAI list names every model, loaded or not.
        self.assertEqual([m["id"] for m in self.get(node, "/v1/models")[1]["data"]], ["q", "g"])

    def test_truth_routes_never_load_a_model(self):
        fleet = [
            SimNode("o", "ollama", models=["a"], loaded=[], cold_load_delay=1.0),
            SimNode("l", "lmstudio", models=["a"], loaded=[], cold_load_delay=1.0),
            SimNode(
                "r", "llamacpp", models=["a"], loaded=[], router=True, slots=1, cold_load_delay=1.0
            ),
        ]
        paths = {
            "o": ["/api/ps", "/api/tags", "/v1/models"],
            "l": ["/api/v0/models", "/v1/models"],
            "r": ["/slots", "/slots?model=a", "/models", "/v1/models"],
        }
        for node in fleet:
            for _ in range(3):
                for path in paths[node.node_id]:
                    self.get(node, path)
            self.assertEqual((node.loaded, node.busy, node.served), ([], 0, []))
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual([n.truth_reads for n in fleet], [3, 3, 9])

    def test_llamacpp_router_reports_each_model_and_its_own_slots(self):
        node = SimNode(
            "gpu-c",
            "llamacpp",
            models=["a", "b"],
            loaded=["b"],
            router=True,
            slots=1,
            tokens=1,
            token_delay=1.0,
            cold_load_delay=2.0,
        )

        def statuses() -> list[tuple[str, str]]:
            return [(m["id"], m["status"]["value"]) for m in self.get(node, "/models")[1]["data"]]

        self.assertEqual(statuses(), [("a", "unloaded"), ("b", "loaded")])
        self.assertEqual(self.get(node, "/slots")[0], 400)  # a router needs ?model=
        self.assertEqual(
            self.get(node, "/slots?model=a"),
            (
                400,
                {
                    "error": {
                        "code": 400,
                        "type": "invalid_request_error",
                        "message": 'model "a" is not loaded',
                    }
                },
            ),
        )
        on_b = self.chat(node, "b")
        on_a = self.chat(node, "a")  # each model has its own slot: neither waits for the other
        self.assertEqual(statuses(), [("a", "loading"), ("b", "loaded")])
        self.assertEqual(self.processing(node, "/slots?model=b"), [True])
        self.assertEqual((len(on_b.response()[2]), on_a.transport.value()), (1, b""))
        self.clock.advance(2.0)
        self.assertEqual(statuses(), [("a", "loaded"), ("b", "loaded")])
        self.assertEqual(len(on_a.response()[2]), 1)
        self.assertEqual(self.processing(node, "/slots?model=a"), [True])
        self.assertEqual(self.processing(node, "/slots?model=b"), [False])

    def test_defaults_keep_every_model_warm_and_slots_unlimited(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], tokens=1, token_delay=1.0)
        wires = [self.chat(node, "llama3", "/api/chat") for _ in range(5)]
        self.assertEqual([len(w.response()[2]) for w in wires], [1] * 5)
        self.assertEqual((node.busy, node.queued), (5, 0))
        self.assertEqual(
            [m["name"] for m in self.get(node, "/api/ps")[1]["models"]], ["llama3:latest"]
        )
        state = self.get(node, "/_sim/state")[1]
        assert isinstance(state, dict)
        self.assertEqual(
            (state["busy"], state["queued"], state["truth_reads"], state["slots"]), (5, 0, 1, None)
        )


# A conversation's first turn (3 + 5 prompt words) and its second (3 + 5 + 3 + 3), which
# starts the same way: the same head.
TURN_1 = [
    {"role": "system", "content": "you are terse"},
    {"role": "user", "content": "why is the sky blue"},
]
TURN_2 = TURN_1 + [
    {"role": "assistant", "content": "light scatters most"},
    {"role": "user", "content": "and at sunset"},
]


class PromptCacheTests(SynchronousTestCase):
    """The prompt delay and the prompt cache, on the clock: when the first byte comes, and
    what llama.cpp's timings and /_sim/state say about the cache."""

    def setUp(self):
        self.clock = MemoryReactorClock()

    def stream(self, node: SimNode, body: dict, path: str = "/v1/chat/completions") -> _Wire:
        wire = _Wire(node, self.clock)
        wire.send("POST", path, {"model": "m", "stream": True, **body})
        return wire

    def assertFirstByteAfter(self, wire: _Wire, seconds: float) -> None:
        """Nothing at all (no headers either, as from an engine) until ``seconds`` from now,
        then the headers and the first token together."""
        self.clock.advance(seconds - 0.005)
        self.assertEqual(wire.transport.value(), b"")
        self.clock.advance(0.01)
        self.assertTrue(wire.response()[2])

    def timings(self, wire: _Wire) -> dict:
        """A finished llama.cpp stream's timings, from its final chunk."""
        self.clock.advance(60.0)
        status, _, chunks, complete = wire.response()
        self.assertEqual((status, complete), (200, True))
        frames = _sse(b"".join(chunks))
        self.assertEqual(frames[-1], (None, "[DONE]"))
        return json.loads(frames[-2][1])["timings"]

    def state(self, node: SimNode) -> tuple[int, int, int]:
        wire = _Wire(node, self.clock)
        wire.send("GET", "/_sim/state")
        state = json.loads(wire.response()[2][0])
        return state["cache_hits"], state["cache_misses"], state["cached_heads"]

    def test_prompt_delay_holds_the_first_byte_then_tokens_keep_their_spacing(self):
        node = SimNode(
            "gpu-c", "llamacpp", models=["m"], tokens=2, token_delay=0.5, prompt_delay=1.0
        )
        wire = self.stream(node, {"messages": TURN_1})
        self.clock.advance(0.999)
        self.assertEqual(wire.transport.value(), b"")  # no headers either, as from an engine
        self.clock.advance(0.001)
        self.assertEqual(len(wire.response()[2]), 1)
        self.clock.advance(0.5)
        self.assertEqual(len(wire.response()[2]), 2)
        self.clock.advance(0.5)
        self.assertTrue(wire.response()[3])
        final = json.loads(_sse(b"".join(wire.response()[2]))[-2][1])
        self.assertEqual(
            {k: final["timings"][k] for k in ("cache_n", "prompt_n", "prompt_ms", "predicted_ms")},
            {"cache_n": 0, "prompt_n": 8, "prompt_ms": 1000.0, "predicted_ms": 1000.0},
        )
        # Without a prompt cache every turn reads its whole prompt, and nothing is counted.
        again = self.stream(node, {"messages": TURN_2})
        self.assertFirstByteAfter(again, 1.0)
        self.assertEqual((self.timings(again)["cache_n"], self.state(node)), (0, (0, 0, 0)))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_held_head_gets_its_first_byte_after_cached_prompt_delay(self):
        node = SimNode(
            "gpu-c",
            "llamacpp",
            models=["m"],
            tokens=1,
            prompt_cache=4,
            prompt_delay=1.0,
            cached_prompt_delay=0.25,
        )
        first = self.stream(node, {"messages": TURN_1})
        self.assertFirstByteAfter(first, 1.0)
        self.assertEqual(
            {k: self.timings(first)[k] for k in ("cache_n", "prompt_n", "prompt_ms")},
            {"cache_n": 0, "prompt_n": 8, "prompt_ms": 1000.0},
        )
        self.assertEqual(self.state(node), (0, 1, 1))
        second = self.stream(node, {"messages": TURN_2})
        self.assertFirstByteAfter(second, 0.25)
        # The 8 prompt tokens read last time are reused, the 6 new ones read.
        self.assertEqual(
            {k: self.timings(second)[k] for k in ("cache_n", "prompt_n", "prompt_ms")},
            {"cache_n": 8, "prompt_n": 6, "prompt_ms": 250.0},
        )
        self.assertEqual(self.state(node), (1, 1, 1))
        # The same turn again: everything but one token reused, as llama.cpp does.
        third = self.stream(node, {"messages": TURN_2, "stream_options": {"include_usage": True}})
        self.assertFirstByteAfter(third, 0.25)
        self.clock.advance(60.0)
        final = json.loads(_sse(b"".join(third.response()[2]))[-2][1])
        self.assertEqual(
            (
                final["timings"]["cache_n"],
                final["timings"]["prompt_n"],
                final["usage"]["prompt_tokens"],
            ),
            (13, 1, 14),
        )
        self.assertEqual(self.state(node), (2, 1, 1))

    def test_the_cache_forgets_the_head_used_longest_ago(self):
        node = SimNode("gpu-c", "llamacpp", models=["m"], tokens=0, prompt_cache=2)

        def turn(user: str) -> int:
            wire = self.stream(node, {"messages": [{"role": "user", "content": user}]})
            return self.timings(wire)["cache_n"]

        # a, b, a (a hit: b is now the oldest), c (evicts b), b (a miss, evicts a), c (a hit)
        self.assertEqual(
            [turn(u) for u in ("a x", "b x", "a x", "c x", "b x", "c x")], [0, 0, 1, 0, 0, 1]
        )
        self.assertEqual(self.state(node), (2, 4, 2))

    def test_heads_are_the_model_the_system_prompt_and_the_first_user_message(self):
        node = SimNode("gpu-c", "llamacpp", models=["m", "n"], tokens=0, prompt_cache=16)

        def hit(body: dict, path: str = "/v1/chat/completions") -> bool:
            before = node.cache_hits
            wire = self.stream(node, body, path)
            self.clock.advance(60.0)
            self.assertEqual(wire.response()[0::3], (200, True))
            return node.cache_hits > before

        self.assertFalse(hit({"messages": TURN_1}))
        self.assertTrue(hit({"messages": TURN_2}))
        self.assertFalse(hit({"messages": TURN_2, "model": "n"}))  # another model's cache
        other_system = [{"role": "system", "content": "you are verbose"}] + TURN_2[1:]
        self.assertFalse(hit({"messages": other_system}))
        self.assertFalse(hit({"messages": TURN_2[1:]}))  # no system prompt at all
        # Anthropic's system field, Responses' instructions and input, a bare prompt.
        self.assertFalse(
            hit({"system": "be brief", "max_tokens": 8, "messages": TURN_1[1:]}, "/v1/messages")
        )
        self.assertTrue(
            hit(
                {
                    "system": [{"type": "text", "text": "be brief"}],
                    "max_tokens": 8,
                    "messages": TURN_2[1:],
                },
                "/v1/messages",
            )
        )
        self.assertFalse(hit({"instructions": "be brief", "input": "why"}, "/v1/responses"))
        self.assertTrue(hit({"instructions": "be brief", "input": "why"}, "/v1/responses"))
        self.assertFalse(hit({"prompt": "once upon a time"}, "/v1/completions"))
        self.assertTrue(hit({"prompt": "once upon a time"}, "/v1/completions"))
        self.assertEqual(self.state(node), (4, 7, 7))

    def test_ollama_reports_the_time_spent_reading_the_prompt(self):
        node = SimNode(
            "gpu-a",
            "ollama",
            models=["llama3"],
            tokens=1,
            prompt_cache=1,
            prompt_delay=2.0,
            cached_prompt_delay=0.5,
        )
        for expected in (2.0, 0.5):
            wire = _Wire(node, self.clock)
            wire.send("POST", "/api/chat", {"model": "llama3", "messages": TURN_1})
            self.assertFirstByteAfter(wire, expected)
            self.clock.advance(60.0)
            final = json.loads(wire.response()[2][-1])
            self.assertEqual(
                (final["prompt_eval_count"], final["prompt_eval_duration"]),
                (8, round(expected * 1e9)),
            )
        self.assertEqual((node.cache_hits, node.cache_misses), (1, 1))

    def test_sim_fault_turns_the_cache_on_and_off(self):
        node = SimNode("gpu-c", "llamacpp", models=["m"], tokens=0)
        admin = _Wire(node, self.clock)
        admin.send(
            "POST",
            "/_sim/fault",
            {"prompt_cache": 2, "prompt_delay": 1, "cached_prompt_delay": 0.5},
        )
        self.assertEqual(admin.response()[0], 200)
        self.assertFirstByteAfter(self.stream(node, {"messages": TURN_1}), 1.0)
        self.assertFirstByteAfter(self.stream(node, {"messages": TURN_2}), 0.5)
        node.set_faults({"prompt_cache": 0})  # off: the cache is emptied
        self.assertEqual(self.state(node), (1, 1, 0))
        node.set_faults({"prompt_cache": 2})
        self.assertFirstByteAfter(self.stream(node, {"messages": TURN_2}), 1.0)
        bad = _Wire(node, self.clock)
        bad.send("POST", "/_sim/fault", {"prompt_cache": -1})
        self.assertEqual(bad.response()[0], 400)
        self.assertIn("prompt_cache must be an integer >= 0", bad.response()[2][0].decode())


class SimNodeTests(SynchronousTestCase):
    def test_set_faults_is_all_or_nothing(self):
        node = SimNode("gpu-a", "ollama")
        with self.assertRaises(ValueError) as caught:
            node.set_faults({"status": 503, "tokens": "six"})
        self.assertIn("tokens must be an integer >= 0 (got 'six')", str(caught.exception))
        self.assertEqual((node.status, node.tokens), (None, 6))
        with self.assertRaises(ValueError):
            node.set_faults({"node_id": "other"})
        node.set_faults({"status": 502, "token_delay": 1})
        self.assertEqual((node.status, node.token_delay), (502, 1.0))

    def test_chunk_size_pads_token_text_deterministically(self):
        text = token_text("gpu-a", 3, 100)
        self.assertEqual(len(text), 100)
        self.assertTrue(text.startswith("gpu-a says hello 3 abcdef"))
        self.assertEqual(text, token_text("gpu-a", 3, 100))
        self.assertEqual(token_text("gpu-a", 3, 5), "gpu-a says hello 3 ")


# -- over loopback ------------------------------------------------------------------------


class _Connections(WrappingFactory):
    """Lets cleanup wait until the server saw every connection close (a clean reactor)."""

    def __init__(self, wrapped):
        super().__init__(wrapped)
        self._waiting: list[Deferred] = []

    def unregisterProtocol(self, protocol):
        super().unregisterProtocol(protocol)
        if not self.protocols:
            waiting, self._waiting = self._waiting, []
            for d in waiting:
                d.callback(None)

    def all_closed(self) -> Deferred:
        if not self.protocols:
            return succeed(None)
        d: Deferred = Deferred()
        self._waiting.append(d)
        return d


class _LoopbackCase(TestCase):
    def setUp(self):
        # The proxy's own client: a simulated llama.cpp closes after every stream, as the
        # real one does, and Agent's pool would write the next POST on that dying connection.
        self.pool = ConnectionPool(reactor)
        self.http = HTTPClient(Client(reactor, self.pool))

    def serve(self, node: SimNode) -> str:
        factory = _Connections(Site(SimNodeResource(node, reactor), reactor=reactor))
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.addCleanup(factory.all_closed)
        self.addCleanup(self.pool.closeCachedConnections)
        return f"http://127.0.0.1:{port.getHost().port}"

    async def call(self, method: str, url: str, body: object = None):
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        response = await self.http.request(method, url, data=data)
        return response, await response.content()

    def header(self, response, name: str) -> str:
        return response.headers.getRawHeaders(name)[0]


class OllamaTests(_LoopbackCase):
    async def test_chat_streams_ndjson_ending_with_done_and_eval_counts(self):
        node = SimNode("gpu-a", "ollama", models=["llama3"], tokens=3)
        url = self.serve(node)
        response, body = await self.call("POST", url + "/api/chat", {"model": "llama3", **CHAT})
        self.assertEqual(
            (
                response.code,
                self.header(response, "content-type"),
                self.header(response, "x-sim-node"),
            ),
            (200, "application/x-ndjson", "gpu-a"),
        )
        lines = _ndjson(body)
        self.assertEqual(
            [(line["done"], line["message"]) for line in lines[:3]],
            [(False, {"role": "assistant", "content": token_text("gpu-a", i)}) for i in range(3)],
        )
        final = lines[3]
        self.assertEqual(
            (final["done"], final["done_reason"], final["prompt_eval_count"], final["eval_count"]),
            (True, "stop", 5, 3),
        )
        for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
            self.assertGreater(final[key], 0)
        self.assertIn(b'"done":true', body.split(b"\n")[3])
        self.assertEqual(len(lines), 4)
        self.assertEqual(node.served, [("POST", "/api/chat")])

    async def test_generate_with_stream_false_is_one_json_object(self):
        url = self.serve(SimNode("gpu-a", "ollama", models=["llama3"], tokens=2))
        response, body = await self.call(
            "POST", url + "/api/generate", {"model": "llama3", "prompt": "hi", "stream": False}
        )
        self.assertEqual(self.header(response, "content-type"), "application/json")
        answer = json.loads(body)
        self.assertEqual(
            (answer["response"], answer["done"], answer["eval_count"]),
            (token_text("gpu-a", 0) + token_text("gpu-a", 1), True, 2),
        )

    async def test_model_lists_name_models_with_implied_latest(self):
        url = self.serve(SimNode("gpu-a", "ollama", models=["llama3", "qwen:7b"]))
        _, tags = await self.call("GET", url + "/api/tags")
        self.assertEqual(
            [(m["name"], m["model"]) for m in json.loads(tags)["models"]],
            [("llama3:latest", "llama3:latest"), ("qwen:7b", "qwen:7b")],
        )
        self.assertEqual(
            set(json.loads(tags)["models"][0]),
            {"name", "model", "modified_at", "size", "digest", "details"},
        )
        _, listed = await self.call("GET", url + "/v1/models")
        listed = json.loads(listed)
        self.assertEqual(
            (listed["object"], [m["id"] for m in listed["data"]]),
            ("list", ["llama3:latest", "qwen:7b"]),
        )

    async def test_missing_tag_matches_latest_and_unknown_model_is_404(self):
        url = self.serve(SimNode("gpu-a", "ollama", models=["llama3:latest"]))
        ok, _ = await self.call("POST", url + "/api/chat", {"model": "llama3", **CHAT})
        missing, body = await self.call("POST", url + "/api/chat", {"model": "mistral", **CHAT})
        self.assertEqual((ok.code, missing.code), (200, 404))
        self.assertEqual(json.loads(body), {"error": 'model "mistral" not found on gpu-a'})

    async def test_bad_json_is_400_and_unknown_path_is_404(self):
        url = self.serve(SimNode("gpu-a", "ollama", models=["llama3"]))
        bad, body = await self.call("POST", url + "/api/chat", b"{not json")
        self.assertEqual(bad.code, 400)
        self.assertTrue(json.loads(body)["error"].startswith("invalid JSON body: "))
        lost, body = await self.call("GET", url + "/api/chat")
        self.assertEqual((lost.code, body), (404, b"404 page not found"))

    async def test_embeddings_are_small_deterministic_vectors(self):
        url = self.serve(SimNode("gpu-a", "ollama", models=["nomic"]))
        _, body = await self.call(
            "POST", url + "/api/embed", {"model": "nomic", "input": ["a b", "c", "a b"]}
        )
        answer = json.loads(body)
        vectors = answer["embeddings"]
        self.assertEqual(([len(v) for v in vectors], answer["prompt_eval_count"]), ([4, 4, 4], 5))
        self.assertEqual(vectors[0], vectors[2])
        self.assertNotEqual(vectors[0], vectors[1])
        _, legacy = await self.call(
            "POST", url + "/api/embeddings", {"model": "nomic", "prompt": "a b"}
        )
        self.assertEqual(json.loads(legacy), {"embedding": vectors[0]})


class LMStudioTests(_LoopbackCase):
    async def test_chat_stream_is_sse_with_usage_then_done(self):
        url = self.serve(SimNode("gpu-b", "lmstudio", models=["qwen"], tokens=2))
        response, body = await self.call(
            "POST", url + "/v1/chat/completions", {"model": "qwen", "stream": True, **CHAT}
        )
        self.assertEqual(self.header(response, "content-type"), "text/event-stream")
        self.assertTrue(body.endswith(b"\n\ndata: [DONE]\n\n"))
        frames = _sse(body)
        self.assertEqual([event for event, _ in frames], [None] * 4)
        self.assertEqual(frames[-1][1], "[DONE]")
        chunks = [json.loads(data) for _, data in frames[:-1]]
        self.assertEqual(
            [c["choices"][0]["delta"].get("content") for c in chunks],
            [token_text("gpu-b", 0), token_text("gpu-b", 1), None],
        )
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")
        self.assertEqual(
            chunks[-1]["usage"], {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        )
        self.assertEqual({c["object"] for c in chunks}, {"chat.completion.chunk"})

    async def test_completion_non_stream_carries_usage(self):
        url = self.serve(SimNode("gpu-b", "lmstudio", models=["qwen"], tokens=3))
        _, body = await self.call(
            "POST", url + "/v1/completions", {"model": "qwen", "prompt": "once upon"}
        )
        answer = json.loads(body)
        self.assertEqual(
            (answer["object"], answer["choices"][0]["text"], answer["usage"]),
            (
                "text_completion",
                "".join(token_text("gpu-b", i) for i in range(3)),
                {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
            ),
        )

    async def test_messages_stream_event_sequence_ends_with_message_stop(self):
        url = self.serve(SimNode("gpu-b", "lmstudio", models=["qwen"], tokens=2))
        response, body = await self.call(
            "POST",
            url + "/v1/messages",
            {"model": "qwen", "stream": True, "max_tokens": 64, **CHAT},
        )
        frames = _sse(body)
        self.assertEqual(
            [event for event, _ in frames],
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ],
        )
        data = [json.loads(d) for _, d in frames]
        self.assertEqual([d["type"] for d in data], [event for event, _ in frames])
        self.assertEqual(data[0]["message"]["usage"], {"input_tokens": 5, "output_tokens": 0})
        self.assertEqual(data[2]["delta"], {"type": "text_delta", "text": token_text("gpu-b", 0)})
        self.assertEqual(data[5]["usage"], {"output_tokens": 2})
        self.assertTrue(body.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n'))

    async def test_messages_non_stream_and_errors_are_anthropic_shaped(self):
        url = self.serve(SimNode("gpu-b", "lmstudio", models=["qwen"], tokens=1))
        _, body = await self.call(
            "POST", url + "/v1/messages", {"model": "qwen", "max_tokens": 8, **CHAT}
        )
        answer = json.loads(body)
        self.assertEqual(
            (answer["type"], answer["content"], answer["usage"]),
            (
                "message",
                [{"type": "text", "text": token_text("gpu-b", 0)}],
                {"input_tokens": 5, "output_tokens": 1},
            ),
        )
        missing, body = await self.call(
            "POST", url + "/v1/messages", {"model": "nope", "max_tokens": 8, **CHAT}
        )
        self.assertEqual(
            (missing.code, json.loads(body)),
            (
                404,
                {
                    "type": "error",
                    "error": {
                        "type": "not_found_error",
                        "message": 'model "nope" not found on gpu-b',
                    },
                },
            ),
        )

    async def test_model_list_is_the_openai_envelope(self):
        url = self.serve(SimNode("gpu-b", "lmstudio", models=["qwen", "phi"]))
        _, body = await self.call("GET", url + "/v1/models")
        self.assertEqual(
            json.loads(body),
            {
                "object": "list",
                "data": [
                    {"id": "qwen", "object": "model", "owned_by": "organization_owner"},
                    {"id": "phi", "object": "model", "owned_by": "organization_owner"},
                ],
            },
        )

    async def test_fault_status_hits_inference_but_not_the_model_list(self):
        node = SimNode("gpu-b", "lmstudio", models=["qwen"], status=503)
        url = self.serve(node)
        failed, body = await self.call(
            "POST", url + "/v1/chat/completions", {"model": "qwen", **CHAT}
        )
        self.assertEqual(
            (failed.code, self.header(failed, "x-sim-node"), json.loads(body)),
            (
                503,
                "gpu-b",
                {
                    "error": {
                        "message": "simulated fault on gpu-b: HTTP 503",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                },
            ),
        )
        listed, _ = await self.call("GET", url + "/v1/models")
        self.assertEqual(listed.code, 200)
        self.assertEqual(node.served, [("POST", "/v1/chat/completions")])

    async def test_die_after_tokens_leaves_the_client_a_truncated_body(self):
        url = self.serve(
            SimNode("gpu-b", "lmstudio", models=["qwen"], tokens=5, die_after_tokens=2)
        )
        response = await self.http.post(
            url + "/v1/chat/completions", json={"model": "qwen", "stream": True, **CHAT}
        )
        received: list[bytes] = []
        with self.assertRaises(ResponseFailed):
            await response.collect(received.append)
        frames = _sse(b"".join(received))
        self.assertEqual(
            [json.loads(d)["choices"][0]["delta"]["content"] for _, d in frames],
            [token_text("gpu-b", 0), token_text("gpu-b", 1)],
        )

    async def test_big_chunks_stream_byte_exact(self):
        url = self.serve(
            SimNode("gpu-b", "lmstudio", models=["qwen"], tokens=12, chunk_size=256 * 1024)
        )
        _, body = await self.call(
            "POST", url + "/v1/completions", {"model": "qwen", "prompt": "x", "stream": True}
        )
        self.assertGreater(len(body), 3 * 1024 * 1024)
        frames = _sse(body)
        text = "".join(json.loads(d)["choices"][0]["text"] for _, d in frames[:-1])
        self.assertEqual(text, "".join(token_text("gpu-b", i, 256 * 1024) for i in range(12)))
        self.assertEqual(frames[-1], (None, "[DONE]"))

    async def test_sim_fault_route_changes_behaviour_and_state_reports_it(self):
        node = SimNode("gpu-b", "lmstudio", models=["qwen"])
        url = self.serve(node)
        rejected, body = await self.call("POST", url + "/_sim/fault", {"status": "bad"})
        self.assertEqual((rejected.code, node.status), (400, None))
        self.assertIn("status must be an integer 400-599", json.loads(body)["error"])
        changed, _ = await self.call("POST", url + "/_sim/fault", {"status": 503, "tokens": 1})
        self.assertEqual(changed.code, 200)
        failed, _ = await self.call("POST", url + "/v1/chat/completions", {"model": "qwen"})
        self.assertEqual(failed.code, 503)
        await self.call("POST", url + "/_sim/fault", {"status": None})
        ok, _ = await self.call("POST", url + "/v1/chat/completions", {"model": "qwen"})
        self.assertEqual(ok.code, 200)
        _, state = await self.call("GET", url + "/_sim/state")
        state = json.loads(state)
        self.assertEqual(
            (
                state["node_id"],
                state["status"],
                state["tokens"],
                state["served_count"],
                state["served"],
            ),
            ("gpu-b", None, 1, 2, [["POST", "/v1/chat/completions"]] * 2),
        )


class LlamaCppTests(_LoopbackCase):
    async def test_stream_final_chunk_carries_timings_and_usage_when_asked(self):
        url = self.serve(SimNode("gpu-c", "llamacpp", models=["m"], tokens=2))
        _, plain = await self.call(
            "POST", url + "/v1/chat/completions", {"model": "m", "stream": True, **CHAT}
        )
        _, asked = await self.call(
            "POST",
            url + "/v1/chat/completions",
            {"model": "m", "stream": True, "stream_options": {"include_usage": True}, **CHAT},
        )
        for body, usage in ((plain, False), (asked, True)):
            frames = _sse(body)
            self.assertEqual(frames[-1], (None, "[DONE]"))
            final = json.loads(frames[-2][1])
            self.assertEqual(final["choices"][0]["finish_reason"], "stop")
            self.assertEqual(
                (
                    final["timings"]["cache_n"],
                    final["timings"]["prompt_n"],
                    final["timings"]["predicted_n"],
                ),
                (0, 5, 2),
            )
            self.assertEqual(
                set(final["timings"]),
                {
                    "cache_n",
                    "prompt_n",
                    "prompt_ms",
                    "predicted_n",
                    "predicted_ms",
                    "predicted_per_second",
                },
            )
            self.assertEqual("usage" in final, usage)

    async def test_non_stream_carries_timings_and_usage(self):
        url = self.serve(SimNode("gpu-c", "llamacpp", models=["m"], tokens=4))
        _, body = await self.call("POST", url + "/v1/completions", {"model": "m", "prompt": "a"})
        answer = json.loads(body)
        self.assertEqual(
            (answer["usage"]["completion_tokens"], answer["timings"]["predicted_n"]), (4, 4)
        )
        self.assertGreater(answer["timings"]["predicted_per_second"], 0)

    async def test_lists_only_loaded_models_on_both_routes(self):
        url = self.serve(SimNode("gpu-c", "llamacpp", models=["a", "b", "c"], loaded=["b"]))
        for path in ("/models?limit=5", "/v1/models"):
            response, body = await self.call("GET", url + path)
            listed = json.loads(body)
            self.assertEqual(
                (response.code, listed["object"], [m["id"] for m in listed["data"]]),
                (200, "list", ["b"]),
            )

    async def test_unloaded_model_is_404_in_llamacpp_shape(self):
        url = self.serve(SimNode("gpu-c", "llamacpp", models=["a", "b"], loaded=["b"]))
        response, body = await self.call("POST", url + "/v1/chat/completions", {"model": "a"})
        self.assertEqual(
            (response.code, json.loads(body)),
            (
                404,
                {
                    "error": {
                        "code": 404,
                        "message": 'model "a" not found on gpu-c',
                        "type": "not_found_error",
                    }
                },
            ),
        )
        lost, body = await self.call("GET", url + "/api/tags")
        self.assertEqual((lost.code, json.loads(body)["error"]["message"]), (404, "File Not Found"))

    async def test_openai_embeddings(self):
        url = self.serve(SimNode("gpu-c", "llamacpp", models=["m"]))
        _, body = await self.call("POST", url + "/v1/embeddings", {"model": "m", "input": "a b c"})
        answer = json.loads(body)
        self.assertEqual(
            (
                answer["object"],
                [d["index"] for d in answer["data"]],
                len(answer["data"][0]["embedding"]),
                answer["usage"],
            ),
            ("list", [0], 4, {"prompt_tokens": 3, "total_tokens": 3}),
        )


class ResponsesAndMessagesOnEveryDialectTests(_LoopbackCase):
    """Anthropic Messages and OpenAI Responses are served by all three dialects (design 5)."""

    NODES = {
        "ollama": ("gpu-a", "llama3:latest"),
        "lmstudio": ("gpu-b", "qwen"),
        "llamacpp": ("gpu-c", "phi"),
    }
    RESPONSES_EVENTS = (
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        + ["response.output_text.delta"] * 2
        + [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    )

    def _serve(self, dialect: str, tokens: int = 2) -> tuple[str, str, str]:
        node_id, model = self.NODES[dialect]
        return self.serve(SimNode(node_id, dialect, models=[model], tokens=tokens)), node_id, model

    async def test_responses_stream_is_openais_event_sequence_with_usage_last(self):
        for dialect in self.NODES:
            url, node_id, model = self._serve(dialect)
            response, body = await self.call(
                "POST",
                url + "/v1/responses",
                {
                    "model": model,
                    "stream": True,
                    "instructions": "be brief",
                    "input": [{"role": "user", "content": "why is the sky blue"}],
                },
            )
            self.assertEqual(self.header(response, "content-type"), "text/event-stream")
            frames = _sse(body)
            self.assertEqual([event for event, _ in frames], self.RESPONSES_EVENTS, dialect)
            data = [json.loads(d) for _, d in frames]
            self.assertEqual([d["type"] for d in data], self.RESPONSES_EVENTS)
            self.assertEqual([d["sequence_number"] for d in data], list(range(10)))
            self.assertEqual(data[0]["response"]["status"], "in_progress")
            self.assertIsNone(data[0]["response"]["usage"])
            text = token_text(node_id, 0) + token_text(node_id, 1)
            self.assertEqual(
                [d["delta"] for d in data[4:6]], [token_text(node_id, 0), token_text(node_id, 1)]
            )
            self.assertEqual(data[6]["text"], text)
            done = data[-1]["response"]
            self.assertEqual(
                (done["status"], done["model"], done["output"][0]["content"][0]["text"]),
                ("completed", model, text),
            )
            # 7 prompt words: instructions (2) and input (5)
            self.assertEqual(
                done["usage"],
                {
                    "input_tokens": 7,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": 2,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": 9,
                },
            )
            self.assertEqual("timings" in data[-1], dialect == "llamacpp")
            self.assertTrue(
                body.endswith(b"\n\n") and b"\nevent: response.completed\ndata: " in body
            )

    async def test_responses_non_stream_is_one_response_object(self):
        for dialect in self.NODES:
            url, node_id, model = self._serve(dialect, tokens=3)
            response, body = await self.call(
                "POST", url + "/v1/responses", {"model": model, "input": "hello there"}
            )
            self.assertEqual(self.header(response, "content-type"), "application/json")
            answer = json.loads(body)
            self.assertEqual(
                (
                    answer["object"],
                    answer["status"],
                    answer["output"][0]["content"][0]["text"],
                    answer["usage"]["input_tokens"],
                    answer["usage"]["output_tokens"],
                ),
                ("response", "completed", "".join(token_text(node_id, i) for i in range(3)), 2, 3),
                dialect,
            )

    async def test_messages_stream_and_non_stream_on_llamacpp(self):
        url, node_id, model = self._serve("llamacpp")
        _, body = await self.call(
            "POST", url + "/v1/messages", {"model": model, "stream": True, "max_tokens": 8, **CHAT}
        )
        frames = _sse(body)
        self.assertEqual(
            [event for event, _ in frames],
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ],
        )
        self.assertEqual(json.loads(frames[5][1])["usage"], {"output_tokens": 2})
        _, body = await self.call(
            "POST", url + "/v1/messages", {"model": model, "max_tokens": 8, **CHAT}
        )
        answer = json.loads(body)
        self.assertEqual(
            (answer["type"], answer["content"], answer["usage"]),
            (
                "message",
                [{"type": "text", "text": token_text(node_id, 0) + token_text(node_id, 1)}],
                {"input_tokens": 5, "output_tokens": 2},
            ),
        )

    async def test_errors_keep_each_engines_shape_on_the_new_routes(self):
        expected = {
            ("ollama", "/v1/messages"): {
                "type": "error",
                "error": {"type": "not_found_error", "message": 'model "nope" not found on gpu-a'},
            },
            ("ollama", "/v1/responses"): {
                "error": {
                    "message": 'model "nope" not found on gpu-a',
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            },
            ("llamacpp", "/v1/messages"): {
                "error": {
                    "code": 404,
                    "message": 'model "nope" not found on gpu-c',
                    "type": "not_found_error",
                }
            },
            ("llamacpp", "/v1/responses"): {
                "error": {
                    "code": 404,
                    "message": 'model "nope" not found on gpu-c',
                    "type": "not_found_error",
                }
            },
        }
        for (dialect, path), error in expected.items():
            url, _, _ = self._serve(dialect)
            response, body = await self.call(
                "POST", url + path, {"model": "nope", "max_tokens": 8, "input": "x"}
            )
            self.assertEqual((response.code, json.loads(body)), (404, error), (dialect, path))


class StartFleetTests(_LoopbackCase):
    async def test_each_node_listens_on_its_own_port_and_names_itself(self):
        nodes = [
            SimNode("gpu-a", "ollama", models=["llama3"]),
            SimNode("gpu-b", "lmstudio", models=["qwen"]),
        ]
        listening = start_fleet(reactor, nodes)
        for _, port in listening:
            self.addCleanup(port.stopListening)
        self.addCleanup(self.pool.closeCachedConnections)
        self.assertEqual([node for node, _ in listening], nodes)
        self.assertEqual([n.port for n in nodes], [p.getHost().port for _, p in listening])
        self.assertNotEqual(nodes[0].port, nodes[1].port)
        for node, path in zip(nodes, ("/api/tags", "/v1/models")):
            response, _ = await self.call("GET", f"http://127.0.0.1:{node.port}{path}")
            self.assertEqual(
                (response.code, self.header(response, "x-sim-node")), (200, node.node_id)
            )


# -- fleet files and the CLI --------------------------------------------------------------


class FleetFileTests(SynchronousTestCase):
    def test_a_full_node_table(self):
        (node,) = parse_fleet(
            {
                "node": [
                    {
                        "id": "gpu-c",
                        "dialect": "llamacpp",
                        "port": 18080,
                        "models": ["a", "b"],
                        "loaded": ["b"],
                        "tokens": 3,
                        "token_delay": 1,
                        "status": 503,
                        "die_after_tokens": 2,
                        "hang_after_headers": True,
                    }
                ]
            },
            "fleet.toml",
        )
        self.assertEqual(
            node,
            SimNode(
                "gpu-c",
                "llamacpp",
                models=["a", "b"],
                loaded=["b"],
                port=18080,
                tokens=3,
                token_delay=1.0,
                status=503,
                die_after_tokens=2,
                hang_after_headers=True,
            ),
        )

    def test_engine_truth_keys(self):
        (node,) = parse_fleet(
            {
                "node": [
                    {
                        "id": "gpu-c",
                        "dialect": "llamacpp",
                        "models": ["a"],
                        "loaded": [],
                        "slots": 2,
                        "cold_load_delay": 5,
                        "router": True,
                    }
                ]
            },
            "fleet.toml",
        )
        self.assertEqual((node.slots, node.cold_load_delay, node.router), (2, 5.0, True))
        for table, message in (
            ({"slots": 0}, "slots must be an integer >= 1 (got 0)"),
            ({"cold_load_delay": -1}, "cold_load_delay must be a number of seconds >= 0"),
            ({"router": True}, "router is for llamacpp nodes only"),
        ):
            with self.assertRaises(FleetFileError) as caught:
                parse_fleet({"node": [{"id": "a", "dialect": "ollama", **table}]}, "f.toml")
            self.assertIn(message, str(caught.exception))

    def test_prompt_cache_keys(self):
        (node,) = parse_fleet(
            {
                "node": [
                    {
                        "id": "gpu-c",
                        "dialect": "llamacpp",
                        "models": ["a"],
                        "prompt_cache": 8,
                        "prompt_delay": 1,
                        "cached_prompt_delay": 0.05,
                    }
                ]
            },
            "fleet.toml",
        )
        self.assertEqual(
            (node.prompt_cache, node.prompt_delay, node.cached_prompt_delay), (8, 1.0, 0.05)
        )
        for table, message in (
            ({"prompt_cache": 1.5}, "prompt_cache must be an integer >= 0 (got 1.5)"),
            ({"prompt_delay": -1}, "prompt_delay must be a number of seconds >= 0"),
            ({"cached_prompt_delay": "0"}, "cached_prompt_delay must be a number of seconds"),
        ):
            with self.assertRaises(FleetFileError) as caught:
                parse_fleet({"node": [{"id": "a", "dialect": "ollama", **table}]}, "f.toml")
            self.assertIn(message, str(caught.exception))

    def test_errors_name_the_file_node_and_field(self):
        cases = [
            ({}, "f.toml: needs at least one [[node]] table"),
            ({"nodes": []}, "f.toml: unknown top-level key(s): nodes"),
            ({"node": [{"id": "a"}]}, "f.toml: node[0] (a): missing key 'dialect'"),
            (
                {"node": [{"id": "a", "dialect": "vllm"}]},
                "f.toml: node[0] (a): dialect must be one of ollama, lmstudio, llamacpp "
                "(got 'vllm')",
            ),
            (
                {"node": [{"id": "a", "dialect": "ollama", "tokens": "6"}]},
                "f.toml: node[0] (a): tokens must be an integer >= 0 (got '6')",
            ),
            (
                {"node": [{"id": "a", "dialect": "ollama", "port": 70000}]},
                "f.toml: node[0] (a): port must be an integer 0-65535 (got 70000)",
            ),
            (
                {"node": [{"id": "a", "dialect": "ollama"}, {"id": "a", "dialect": "ollama"}]},
                "f.toml: node[1] (a): id 'a' is used twice",
            ),
        ]
        for data, message in cases:
            with self.assertRaises(FleetFileError) as caught:
                parse_fleet(data, "f.toml")
            self.assertEqual(str(caught.exception), message)
        with self.assertRaises(FleetFileError) as caught:
            parse_fleet({"node": [{"id": "a", "dialect": "ollama", "stauts": 503}]}, "f.toml")
        self.assertTrue(
            str(caught.exception).startswith("f.toml: node[0] (a): unknown key(s): stauts;")
        )

    def test_unreadable_and_invalid_files(self):
        path = self.mktemp()
        with self.assertRaises(FleetFileError) as caught:
            load_fleet(path)
        self.assertEqual(str(caught.exception), f"{path}: cannot read: No such file or directory")
        with open(path, "w") as handle:
            handle.write("[[node]\n")
        with self.assertRaises(FleetFileError) as caught:
            load_fleet(path)
        self.assertTrue(str(caught.exception).startswith(f"{path}: not valid TOML: "))


class _ReadyLine(ProcessProtocol):
    def __init__(self):
        self.ready: Deferred = Deferred()
        self.ended: Deferred = Deferred()
        self.out = b""
        self.err = b""

    def outReceived(self, data: bytes) -> None:
        self.out += data
        if b"\n" in self.out and not self.ready.called:
            self.ready.callback(self.out.split(b"\n")[0].decode())

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def processEnded(self, reason: Failure) -> None:
        if not self.ready.called:
            self.ready.errback(reason)
        self.ended.callback(reason.value)


class CLITests(TestCase):
    def write(self, text: str) -> str:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(text)
        return path

    async def run_cli(self, *args: str):
        return await getProcessOutputAndValue(
            sys.executable, ["-m", "nvpair_proxy.testing.simfleet", *args], env=dict(os.environ)
        )

    async def test_bad_file_exits_2_with_one_line_on_stderr(self):
        path = self.write('[[node]]\nid = "gpu-a"\ndialect = "vllm"\n')
        out, err, code = await self.run_cli(path)
        self.assertEqual((out, code), (b"", 2))
        self.assertEqual(
            err.decode(),
            f"simfleet: {path}: node[0] (gpu-a): dialect must be one "
            "of ollama, lmstudio, llamacpp (got 'vllm')\n",
        )

    async def test_invalid_toml_exits_2(self):
        path = self.write("[[node]\n")
        out, err, code = await self.run_cli(path)
        self.assertEqual((out, code, err.count(b"\n")), (b"", 2, 1))
        self.assertTrue(err.startswith(f"simfleet: {path}: not valid TOML: ".encode()))

    async def test_serves_until_sigterm_after_printing_the_ready_line(self):
        path = self.write(
            '[[node]]\nid = "gpu-a"\ndialect = "ollama"\nmodels = ["llama3"]\n'
            '[[node]]\nid = "gpu-c"\ndialect = "llamacpp"\nmodels = ["m"]\n'
        )
        protocol = _ReadyLine()
        process = reactor.spawnProcess(
            protocol,
            sys.executable,
            [sys.executable, "-m", "nvpair_proxy.testing.simfleet", path],
            env=dict(os.environ),
        )
        self.addCleanup(lambda: process.pid and process.signalProcess("KILL"))
        line = await protocol.ready
        self.assertRegex(line, r"^simfleet ready: gpu-a=\d+ gpu-c=\d+$")
        ports = dict(pair.split("=") for pair in line.split(": ")[1].split())
        pool = HTTPConnectionPool(reactor, persistent=False)
        response = await HTTPClient(Agent(reactor, pool=pool)).get(
            f"http://127.0.0.1:{ports['gpu-c']}/models"
        )
        self.assertEqual([m["id"] for m in (await response.json())["data"]], ["m"])
        process.signalProcess("TERM")
        reason = await protocol.ended
        self.assertIsInstance(reason, ProcessDone)
        self.assertEqual(protocol.err, b"")
