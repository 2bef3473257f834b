"""The proxy as a process: twistd, its stdio link, and the real client packages.

The `ollama`, `openai` and `anthropic` packages are blocking, so they run here against a proxy
in a subprocess (twisted-notes), never against a reactor this test would have to spin.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.test.support import broker_channel, start_fleet, start_standalone
from nvpair_proxy.testing.processes import (
    TWISTD,
    BrokerChannel,
    free_port,
    free_ports,
    logged_workloads,
    nodes_toml,
)


class RealClientTests(SynchronousTestCase):
    def _write(self, text: str) -> str:
        path = self.mktemp() + ".toml"
        with open(path, "w") as handle:
            handle.write(text)
        return path

    def test_the_ollama_client_streams_a_chat_through_twistd_nvpair_proxy(self):
        import ollama

        fleet = start_fleet(
            self,
            '[[node]]\nid = "gpu-a"\ndialect = "ollama"\nmodels = ["llama3:latest"]\ntokens = 4\n',
        )
        port = free_port()
        nodes = self._write(nodes_toml([("gpu-a", "ollama", fleet["gpu-a"], ["llama3:latest"])]))
        start_standalone(self, ["--engine", f"ollama:{port}", "--nodes", nodes])
        client = ollama.Client(host=f"http://127.0.0.1:{port}")
        chunks = list(
            client.chat(
                model="llama3", stream=True, messages=[{"role": "user", "content": "hello there"}]
            )
        )
        text = "".join(chunk.message.content for chunk in chunks)
        self.assertEqual(text, "".join(f"gpu-a says hello {i} " for i in range(4)))
        self.assertTrue(chunks[-1].done)
        self.assertEqual(chunks[-1].eval_count, 4)

    def test_the_openai_client_streams_through_the_lmstudio_facade(self):
        import openai

        fleet = start_fleet(
            self, '[[node]]\nid = "gpu-b"\ndialect = "lmstudio"\nmodels = ["qwen"]\ntokens = 3\n'
        )
        port = free_port()
        nodes = self._write(nodes_toml([("gpu-b", "lmstudio", fleet["gpu-b"], ["qwen"])]))
        start_standalone(self, ["--engine", f"lmstudio:{port}", "--nodes", nodes])
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        stream = client.chat.completions.create(
            model="qwen", stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        self.assertEqual(text, "".join(f"gpu-b says hello {i} " for i in range(3)))


class NewerRoutesRealClientTests(SynchronousTestCase):
    """The `anthropic` and `openai` packages on /v1/messages and /v1/responses (design 5),
    through the facades in a twistd subprocess, in front of a simulated node per engine."""

    MODELS = {"ollama": "llama3:latest", "lmstudio": "qwen", "llamacpp": "phi"}
    TOKENS = 3

    def setUp(self):
        fleet = start_fleet(
            self,
            "".join(
                f'[[node]]\nid = "sim-{engine}"\ndialect = "{engine}"\n'
                f'models = ["{model}"]\ntokens = {self.TOKENS}\n\n'
                for engine, model in self.MODELS.items()
            ),
        )
        self.ports = dict(zip(self.MODELS, free_ports(len(self.MODELS))))
        path = self.mktemp() + ".toml"
        with open(path, "w") as handle:
            handle.write(
                nodes_toml(
                    [
                        (f"sim-{engine}", engine, fleet[f"sim-{engine}"], [model])
                        for engine, model in self.MODELS.items()
                    ]
                )
            )
        args = ["--nodes", path]
        for engine, port in self.ports.items():
            args += ["--engine", f"{engine}:{port}"]
        self.log = os.path.abspath(self.mktemp() + ".log")
        start_standalone(self, args, logfile=self.log)

    def assert_reported(self, expected: list[tuple[str, str, int, int]]) -> None:
        """Each request was one completed workload whose stats are the engine's usage."""
        reported = [
            (
                info["engine"],
                info["model"],
                info["stats"].get("promptTokens"),
                info["stats"]["completionTokens"],
                info["stats"].get("estimated", False),
            )
            for info in logged_workloads(self.log, len(expected))
        ]
        self.assertEqual(reported, [(*e, False) for e in expected])

    def text(self, engine: str) -> str:
        return "".join(f"sim-{engine} says hello {i} " for i in range(self.TOKENS))

    def test_the_anthropic_client_creates_messages_through_ollama_and_llamacpp(self):
        import anthropic

        for engine, model in (("ollama", "llama3"), ("llamacpp", "phi")):
            client = anthropic.Anthropic(
                base_url=f"http://127.0.0.1:{self.ports[engine]}", api_key="unused", max_retries=0
            )
            question = [{"role": "user", "content": "why is the sky blue"}]  # 5 words
            message = client.messages.create(model=model, max_tokens=64, messages=question)
            self.assertEqual(
                (
                    message.content[0].text,
                    message.usage.input_tokens,
                    message.usage.output_tokens,
                    message.stop_reason,
                ),
                (self.text(engine), 5, self.TOKENS, "end_turn"),
                engine,
            )
            events = list(
                client.messages.create(model=model, max_tokens=64, messages=question, stream=True)
            )
            text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
            start = next(e for e in events if e.type == "message_start")
            delta = next(e for e in events if e.type == "message_delta")
            self.assertEqual(
                (
                    text,
                    start.message.usage.input_tokens,
                    delta.usage.output_tokens,
                    events[-1].type,
                ),
                (self.text(engine), 5, self.TOKENS, "message_stop"),
                engine,
            )
        self.assert_reported(
            [
                (engine, model, 5, self.TOKENS)
                for engine, model in (("ollama", "llama3"), ("llamacpp", "phi"))
                for _ in ("not streaming", "streaming")
            ]
        )

    def test_the_openai_client_creates_responses_through_every_facade(self):
        import openai

        for engine, model in self.MODELS.items():
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{self.ports[engine]}/v1",
                api_key="unused",
                max_retries=0,
            )
            response = client.responses.create(model=model, input="hello there")
            self.assertEqual(
                (
                    response.status,
                    response.output_text,
                    response.usage.input_tokens,
                    response.usage.output_tokens,
                ),
                ("completed", self.text(engine), 2, self.TOKENS),
                engine,
            )
            events = list(
                client.responses.create(
                    model=model, input="hello there", instructions="be brief", stream=True
                )
            )
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            completed = events[-1]
            self.assertEqual(
                (
                    completed.type,
                    text,
                    completed.response.output_text,
                    completed.response.usage.input_tokens,
                    completed.response.usage.output_tokens,
                ),
                ("response.completed", self.text(engine), self.text(engine), 4, self.TOKENS),
                engine,
            )
            self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        self.assert_reported(
            [
                (engine, model, prompt, self.TOKENS)
                for engine, model in self.MODELS.items()
                for prompt in (2, 4)
            ]
        )


class StartupTests(SynchronousTestCase):
    def test_a_bad_flag_stops_start_up_with_one_clear_line(self):
        result = subprocess.run(
            TWISTD
            + [
                "-n",
                "--pidfile=",
                "nvpair-proxy",
                "--engine",
                "ollama",
                "--response-header-timeout",
                "soon",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertNotEqual(result.returncode, 0)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(
            lines,
            [
                "nvpair-proxy: --response-header-timeout: not a duration: "
                "'soon' (use seconds or e.g. 90s, 30m, 1h30m)"
            ],
        )

    def test_a_stray_print_cannot_reach_the_link(self):
        code = (
            "import os\nfrom nvpair_proxy.process.link import claim_stdout\n"
            "fd = claim_stdout()\nprint('stray output', flush=True)\n"
            "os.write(1, b'raw fd 1 write\\n')\nos.write(fd, b'{\"jsonrpc\":\"2.0\"}\\n')\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
        self.assertEqual(result.stdout, b'{"jsonrpc":"2.0"}\n')
        self.assertIn(b"stray output", result.stderr)
        self.assertIn(b"raw fd 1 write", result.stderr)


def one_chat_through(
    test: SynchronousTestCase, link: BrokerChannel, node: str, behaviour: str, chat: dict
) -> socket.socket:
    """Over ``link``, the broker enables the Ollama facade and adds one simulated node
    (``behaviour``: its simfleet settings); then one chat is sent to the facade: its socket."""
    fleet = start_fleet(
        test,
        f'[[node]]\nid = "{node}"\ndialect = "ollama"\nmodels = ["llama3:latest"]\n{behaviour}',
    )
    port = free_port()
    enabled = link.call(
        "facade/enable", {"engine": "ollama", "port": port, "ignorePersistedPort": True}
    )
    test.assertIn("result", enabled)
    link.call(
        "ollama:node/add-manual",
        {"id": node, "port": fleet[node], "addresses": ["127.0.0.1"], "models": ["llama3"]},
    )
    body = json.dumps(chat).encode()
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    test.addCleanup(client.close)
    client.sendall(
        b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return client


class BrokerProcessTests(SynchronousTestCase):
    def test_driven_over_stdio_enable_discover_fail_over_and_shut_down(self):
        fleet = start_fleet(
            self,
            '[[node]]\nid = "bad"\ndialect = "ollama"\n'
            'models = ["llama3:latest"]\nstatus = 503\n\n'
            '[[node]]\nid = "good"\ndialect = "ollama"\n'
            'models = ["llama3:latest"]\ntokens = 2\n',
        )
        link = broker_channel(self)
        for _ in range(5):
            port = free_port()
            answer = link.call(
                "facade/enable", {"engine": "ollama", "port": port, "ignorePersistedPort": True}
            )
            if "result" in answer:
                break
            self.assertEqual(answer["error"]["code"], -32010)
        self.assertEqual(answer["result"], {"engine": "ollama", "port": port})
        self.assertEqual(
            [m.get("method") for m in link.lines[-3:]],
            ["ollama:ready", "ollama:discovery:subscribe", None],
        )
        link.send(
            "ollama:discovery:nodes",
            {
                "nodes": [
                    {
                        "hostUuid": "peer-1",
                        "name": "gpu-peer",
                        "ip": "192.0.2.7",
                        "services": {"ol": {"port": 11434}},
                        "modelsByEngine": {"ollama": ["llama3"]},
                    }
                ]
            },
            request=False,
        )
        listed = link.call("ollama:nodes/list")["result"]["nodes"]
        self.assertEqual([n["id"] for n in listed], ["peer-1"])
        self.assertEqual(listed[0]["models"], ["llama3"])
        for node_id in ("bad", "good"):
            added = link.call(
                "ollama:node/add-manual",
                {
                    "id": f"m-{node_id}",
                    "host": node_id,
                    "port": fleet[node_id],
                    "addresses": ["127.0.0.1"],
                    "models": ["llama3:latest"],
                },
            )
            self.assertEqual(added["result"], {"added": True})
        self.assertEqual(
            link.call("ollama:node/select", {"id": "m-bad"})["result"], {"id": "m-bad"}
        )
        self.assertEqual(
            link.lines[-2],
            {
                "jsonrpc": "2.0",
                "method": "ollama:node/selection-changed",
                "params": {"id": "m-bad"},
            },
        )
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/chat",
            method="POST",
            data=json.dumps({"model": "llama3", "messages": []}).encode(),
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            self.assertEqual(response.status, 200)
            self.assertEqual(response.headers["X-Sim-Node"], "good")
            body = response.read()
        self.assertTrue(json.loads(body.splitlines()[-1])["done"])
        link.wait(lambda m: m.get("method") == "workload:completed")
        workload = [
            (
                m["method"],
                m["params"]["workloadInfo"].get("scheduledOn"),
                m["params"]["workloadInfo"]["seq"],
            )
            for m in link.lines
            if m.get("method", "").startswith("workload:")
        ]
        self.assertEqual(
            workload,
            [
                ("workload:submitted", None, 1),
                ("workload:submitted", "m-bad", 2),
                ("workload:submitted", "m-good", 3),
                ("workload:started", "m-good", 4),
                ("workload:completed", "m-good", 5),
            ],
        )
        link.wait(lambda m: m.get("method") == "ollama:proxy/request")
        self.assertEqual(
            link.call("shutdown"), {"jsonrpc": "2.0", "id": link.next_id - 1, "result": None}
        )
        self.assertEqual(link.proc.wait(timeout=30), 0)

    def _broker_with_a_request_in_flight(self) -> BrokerChannel:
        """A proxy whose one request waits on a node that sent headers and nothing else."""
        link = broker_channel(self)
        one_chat_through(self, link, "slow", "hang_after_headers = true\n", {"model": "llama3"})
        link.wait(
            lambda m: (
                m.get("method") == "workload:submitted"
                and m["params"]["workloadInfo"].get("scheduledOn") == "slow"
            )
        )
        return link

    def test_shutdown_cancels_in_flight_requests_and_exits_zero(self):
        link = self._broker_with_a_request_in_flight()
        answer_id = link.send("shutdown")
        link.wait(lambda m: m.get("id") == answer_id)
        terminal = link.wait(lambda m: m.get("method") == "workload:errored")
        info = terminal["params"]["workloadInfo"]
        self.assertEqual(
            (info["state"], info["error"]), ("cancelled", "request cancelled before completion")
        )
        self.assertEqual(link.proc.wait(timeout=30), 0)
        ids = [m.get("id") for m in link.lines]
        self.assertLess(ids.index(answer_id), link.lines.index(terminal))

    def test_sigterm_cancels_in_flight_requests_and_exits_zero(self):
        import signal

        link = self._broker_with_a_request_in_flight()
        link.proc.send_signal(signal.SIGTERM)
        terminal = link.wait(lambda m: m.get("method") == "workload:errored")
        self.assertEqual(
            terminal["params"]["workloadInfo"]["error"], "request cancelled before completion"
        )
        self.assertEqual(link.proc.wait(timeout=30), 0)


class BrokerDrainTests(SynchronousTestCase):
    """Broker mode keeps protocol 1 (a SIGTERM cancels at once) unless ``--drain-timeout`` is
    given: then a SIGTERM lets admitted requests finish, and the broker's ``shutdown`` still
    cancels at once (docs/operations.md#restarts)."""

    def streaming(self) -> tuple[BrokerChannel, socket.socket]:
        """A proxy with a drain timeout whose one stream has begun and runs for 2 s more."""
        link = broker_channel(self, ["--drain-timeout", "30s"])
        chat = {"model": "llama3", "messages": []}
        client = one_chat_through(self, link, "gpu", "tokens = 20\ntoken_delay = 0.1\n", chat)
        link.wait(lambda m: m.get("method") == "workload:started")
        return link, client

    def test_sigterm_lets_the_stream_finish_then_exits_zero(self):
        link, client = self.streaming()
        link.proc.send_signal(signal.SIGTERM)
        received = b""
        while chunk := client.recv(65536):
            received += chunk
            if received.endswith(b"0\r\n\r\n"):
                break
        self.assertIn(b'"done":true', received, "the whole stream, to its last line")
        link.wait(lambda m: m.get("method") == "workload:completed")
        self.assertEqual(link.proc.wait(timeout=30), 0)
        terminal = [m["method"] for m in link.lines if m.get("method") in TERMINAL]
        self.assertEqual(terminal, ["workload:completed"])

    def test_shutdown_still_cancels_at_once(self):
        link, _ = self.streaming()
        link.send("shutdown")
        terminal = link.wait(lambda m: m.get("method") == "workload:errored")
        self.assertEqual(
            terminal["params"]["workloadInfo"]["error"], "request cancelled before completion"
        )
        self.assertEqual(link.proc.wait(timeout=30), 0)


TERMINAL = ("workload:completed", "workload:errored")


class StandaloneSignalTests(SynchronousTestCase):
    def test_sigterm_and_sigint_exit_zero(self):
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            proc = start_standalone(self, ["--engine", f"ollama:{free_port()}"])
            proc.send_signal(sig)
            self.assertEqual(proc.wait(timeout=30), 0, sig)
