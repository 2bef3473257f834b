"""Real agent CLIs, Claude Code and Codex CLI, through the llama.cpp facade to two real
llama-servers (nodes a and b, one slot each): each CLI holds two sessions of two turns,
interleaved: both turn 1s at once, which the proxy must spread over the two nodes, then session
1's turn 2, then session 2's. Every turn 2 must be served by its turn 1's node, whose engine
must read less than a quarter of the prompt anew (affinity, docs/decisions.md#affinity). Session
2's node is b, though a is free and first by id; with ``--no-affinity`` its turn 2 went to a.

Opt-in, like ``test_llamaserver``: the CLIs are pinned binaries that ``bin/install-agent-clients``
installs into the cache outside the repository (``NVPAIR_CLAUDE`` and ``NVPAIR_CODEX`` name
others), and the engine is the ``llama-server`` that ``bin/install-llama-server`` builds. A
missing piece skips each test and says why, unless ``NVPAIR_REAL_ENGINE=1``, under which it fails.

What makes a random-weight model usable by an agent:

- Context. The tiny model's tokenizer reads about a byte a token, and the CLIs' first request
  (system prompt, tools and environment) is 20-30 thousand tokens; llama.cpp caps a slot at the
  model's trained context, so the engines serve the tiny model written with a context of 65,536.
- An answer that ends. The model never ends a sequence by itself, and Claude Code takes a
  ``max_tokens`` stop for an error (it retries, then exits 1). Each engine runs with the
  server-wide grammar ``root ::= "ok"``: every answer is ``ok`` and then the end of the
  sequence, so a turn is one request with an ``end_turn`` stop. ``-n`` bounds it regardless.

Which node served a turn and what its engine read anew come from the engines themselves: each
llama-server's ``/metrics`` counts the prompt tokens it processed (``prompt_tokens_total``) and
those it took from its cache (``prompt_tokens_cached_total``). Exactly one engine's counters
move during a turn alone; the proxy's ``/status`` names the same node, with status 200. For the
two turn 1s at once, the prompt each CLI reports for its one request (Claude Code's usage; Codex's
``turn.completed`` usage, which adds up the thread's requests, so only on turn 1) tells which
engine read it; session 2's first message is longer, so the two differ.

Every CLI run has a timeout, and no wait asserts a time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request

import attrs
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from nvpair_proxy.test.support import start_standalone
from nvpair_proxy.testing.llamaserver import (
    MODEL,
    cache_dir,
    cached_model,
    llama_server_binary,
    serve,
)
from nvpair_proxy.testing.processes import (
    StartFailed,
    free_port,
    free_ports,
    logged_workloads,
    metrics,
    nodes_toml,
    stop,
)
from nvpair_proxy.testing.tinymodel import TINY

#: The pinned versions bin/install-agent-clients installs (a test fails on another version).
CLAUDE_VERSION = "2.1.337"
CODEX_VERSION = "0.169.0"
#: The tiny model, with room for an agent's system prompt and tools at a byte a token.
AGENT_SHAPE = attrs.evolve(TINY, context=65536)
#: Every answer: "ok", then the end of the sequence (a random-weight model never ends one).
GRAMMAR = 'root ::= "ok"'
#: The engine's own bound on an answer, should the grammar not apply.
PREDICT = 32
#: Seconds one CLI run may take (a first turn reads 20-30 thousand tokens: about 10 s here).
CLI_TIMEOUT = 180
#: At most this share of a turn 2 prompt may be read anew by its engine.
ANEW_AT_MOST = 0.25
NODES = ("a", "b")
#: Session 2's first message is longer, so its prompt differs from session 1's in size.
FIRST_PROMPTS = ("Say ok.", "Answer with ok. " + "The answer is short. " * 20)


# As in test_llamaserver: under bin/test-real-engine a missing piece fails rather than skips.
REQUIRED = os.environ.get("NVPAIR_REAL_ENGINE") == "1"


def unavailable(reason: str, opt_in: str):
    if REQUIRED:
        raise AssertionError(f"NVPAIR_REAL_ENGINE=1 but {reason}")
    raise SkipTest(f"{reason} (opt-in: {opt_in})")


def agent_binary(name: str, variable: str, version: str) -> str:
    """``$variable``, else the cache's link (bin/install-agent-clients); skips, or fails under
    NVPAIR_REAL_ENGINE=1, when there is none. Another version than the pinned one fails."""
    path = os.environ.get(variable) or os.path.join(cache_dir(), "agent-clients", name)
    if not os.access(path, os.X_OK):
        unavailable(
            f"{name} {version} is not installed: no executable {path}",
            "bin/install-agent-clients installs the pinned CLIs into "
            f"{os.path.join(cache_dir(), 'agent-clients')}, bin/test-real-engine runs it; or set "
            f"{variable}",
        )
    said = subprocess.run(
        [path, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    if version not in said.split():
        raise AssertionError(f"{path} --version says {said.strip()!r}: want {name} {version}")
    return path


def status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
        return json.loads(response.read())


@attrs.frozen
class Turn:
    """One CLI run ("s1t2": session 1, turn 2): the node that served it and what its engine
    read."""

    label: str
    node: str
    anew: int  # prompt tokens the serving engine processed
    cached: int  # prompt tokens it took from its cache

    @property
    def prompt(self) -> int:
        return self.anew + self.cached


class AgentFleet:
    """Two llama-servers (nodes a and b, one slot each) on the tiny model with an agent-sized
    context, and the proxy's llama.cpp facade in front of them with its admin listener."""

    def start_fleet(self) -> None:
        opt_in = (
            "bin/test-real-engine builds llama-server and installs gguf; or set NVPAIR_LLAMA_SERVER"
        )
        binary = llama_server_binary()
        if binary is None:
            unavailable("llama-server is not installed", opt_in)
        try:
            model = cached_model(AGENT_SHAPE)
        except ImportError:
            unavailable("the gguf package is not installed: no model to serve", opt_in)
        self.engine_ports = dict(zip(NODES, free_ports(len(NODES))))
        for node, port in self.engine_ports.items():
            log_path = os.path.abspath(self.mktemp() + f"-engine-{node}.log")
            extra = ["--n-predict", str(PREDICT), "--grammar", GRAMMAR, "--metrics"]
            try:
                engine = serve(binary, model, port, log_path, AGENT_SHAPE.context, extra)
            except StartFailed as failed:
                self.fail(f"{node}: {failed}")
            self.addCleanup(stop, engine)
        self.facade_port, self.admin_port = free_port(), free_port()
        nodes = self.mktemp() + ".toml"
        with open(nodes, "w") as handle:
            handle.write(
                nodes_toml(
                    (node, "llamacpp", port, [MODEL]) for node, port in self.engine_ports.items()
                )
            )
        self.log = os.path.abspath(self.mktemp() + ".log")
        start_standalone(
            self,
            ["--engine", f"llamacpp:{self.facade_port}", "--nodes", nodes]
            + ["--admin", f"127.0.0.1:{self.admin_port}"],
            logfile=self.log,
        )
        self.facade = f"http://127.0.0.1:{self.facade_port}"
        # the CLIs' working directory, outside the repository (both read project files and
        # git state from theirs into the prompt)
        self.workdir = tempfile.mkdtemp(prefix="nvp-agent-")
        self.addCleanup(shutil.rmtree, self.workdir, True)

    def engine_counts(self) -> dict[str, tuple[float, float]]:
        """Each engine's (prompt tokens processed, prompt tokens from its cache) so far."""
        counts = {}
        for node, port in self.engine_ports.items():
            values = metrics(port)
            counts[node] = (
                values["llamacpp:prompt_tokens_total"],
                values["llamacpp:prompt_tokens_cached_total"],
            )
        return counts

    def launch(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.addCleanup(stop, proc)
        return proc

    def finish(self, label: str, proc: subprocess.Popen) -> str:
        """The CLI's stdout once it exited 0 (within CLI_TIMEOUT of this call)."""
        try:
            stdout, stderr = proc.communicate(timeout=CLI_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            self.fail(f"{label}: no answer within {CLI_TIMEOUT} s: {stderr[-2000:]!r}")
        self.assertEqual(
            proc.returncode,
            0,
            f"{label}: exit {proc.returncode}: {stdout[-2000:]!r} {stderr[-2000:]!r}",
        )
        return stdout

    def observe(self, run):
        """``run()``'s value, the proxy's /status recent entries it added (oldest first, each
        checked to be an inference answered 200 and completed), and each engine's (prompt
        tokens processed, from its cache) during it, for the engines that read a prompt."""
        before_counts = self.engine_counts()
        before_recent = len(status(self.admin_port)["recent"])
        value = run()
        recent = status(self.admin_port)["recent"]
        added = list(reversed(recent[: len(recent) - before_recent]))
        self.assertEqual(
            [(r["route"], r["status"], r["outcome"]) for r in added],
            [("inference", 200, "completed")] * len(added),
            f"the proxy's requests: {added}",
        )
        after_counts = self.engine_counts()
        moved = {
            node: (int(after_counts[node][0] - before[0]), int(after_counts[node][1] - before[1]))
            for node, before in before_counts.items()
            if after_counts[node] != before
        }
        return value, added, moved

    def first_turns(self, argvs: list[list[str]], env: dict[str, str]) -> list[tuple[str, Turn]]:
        """Both sessions' turn 1 at once, the second started once the proxy has dispatched the
        first (whose prompt takes seconds to read): two new conversations, so the proxy must
        spread them over the two nodes (one slot each). Each run's stdout and Turn; which
        engine served which session is told by the prompt each engine read, which the CLI
        reports for its first request (``prompt_total``)."""

        def run():
            first = self.launch(argvs[0], env)
            # its admission, then its dispatch to a node (a CLI that ends without a request is
            # reported by finish())
            logged_workloads(self.log, 2, "workload:submitted")
            second = self.launch(argvs[1], env)
            return [self.finish("s1t1", first), self.finish("s2t1", second)]

        outputs, added, moved = self.observe(run)
        self.assertEqual(len(added), 2, f"turn 1: the proxy's requests: {added}")
        # distinct conversations spread: each engine read one prompt
        self.assertEqual(
            sorted(r["node"] for r in added), list(NODES), f"turn 1 placement: {added}"
        )
        self.assertEqual(sorted(moved), list(NODES), f"turn 1: engines that read: {moved}")
        turns = []
        for label, stdout in zip(("s1t1", "s2t1"), outputs):
            session, prompt = self.prompt_total(label, stdout)
            nodes = [node for node, (anew, cached) in moved.items() if anew + cached == prompt]
            self.assertEqual(len(nodes), 1, f"{label}: prompt {prompt}, engines read {moved}")
            anew, cached = moved[nodes[0]]
            turns.append((session, Turn(label, nodes[0], anew, cached)))
        return turns

    def next_turn(self, label: str, argv: list[str], env: dict[str, str]) -> tuple[str, Turn]:
        """One CLI turn alone: its stdout and what the engines and the proxy saw. It must be
        one request the proxy answered with 200, read by the engine of the node it names."""
        stdout, added, moved = self.observe(lambda: self.finish(label, self.launch(argv, env)))
        self.assertEqual(len(added), 1, f"{label}: the proxy's requests: {added}")
        node = added[0]["node"]
        self.assertEqual(list(moved), [node], f"{label}: engines that read a prompt: {moved}")
        anew, cached = moved[node]
        return stdout, Turn(label, node, anew, cached)

    def assert_affinity(self, turns: dict[str, Turn]) -> None:
        """Each session's turn 2 on its turn 1's node, reading less than a quarter anew."""
        report = ", ".join(
            f"{t.label}: node {t.node}, prompt {t.prompt}, anew {t.anew}" for t in turns.values()
        )
        shares = {
            node["id"]: [(e["cache"] or {}).get("share") for e in node["engines"]]
            for node in status(self.admin_port)["nodes"]
        }
        # for the record (trial shows stderr); the proxy's own view of reuse beside it
        print(f"{self.id()}: {report}; /status cache share {shares}", file=sys.stderr)
        for session in ("s1", "s2"):
            first, second = turns[f"{session}t1"], turns[f"{session}t2"]
            self.assertEqual(second.node, first.node, f"{session}: {first} then {second}")
            # turn 2 holds turn 1's prompt and more
            self.assertGreater(second.prompt, first.prompt, f"{session}: {second}")
            self.assertLess(
                second.anew, ANEW_AT_MOST * second.prompt, f"{session} turn 2 read anew: {second}"
            )
        # The proxy read the same from each answer (llama.cpp's Responses timings, its
        # Messages message_start usage): a node's turn 1 read all, its turn 2 almost none.
        for node in NODES:
            self.assertGreater(shares[node][0] or 0, 0.4, f"/status cache share {shares}")

    def two_sessions(self) -> None:
        """s1t1 and s2t1 together, then s1t2, then s2t2; the assertions above."""
        (s1, t1), (s2, t2) = self.first_turns(
            [self.argv(FIRST_PROMPTS[0]), self.argv(FIRST_PROMPTS[1])], self.env
        )
        self.assertNotEqual(s1, s2)
        turns = {"s1t1": t1, "s2t1": t2}
        for label, session, prompt in (("s1t2", s1, "Once more."), ("s2t2", s2, "And again.")):
            stdout, turns[label] = self.next_turn(label, self.argv(prompt, session), self.env)
            self.assertEqual(self.session_of(label, stdout), session)
        self.assert_affinity(turns)


def quiet_env(**extra: str) -> dict[str, str]:
    """This environment without any provider setting or credential a CLI would read, plus
    ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_"))
    }
    env.update(extra)
    return env


class ClaudeCodeTests(AgentFleet, SynchronousTestCase):
    """Claude Code in print mode (``-p``): ``POST /v1/messages?beta=true`` as SSE, with the
    session in ``X-Claude-Code-Session-Id``; turn 2 is ``--resume <session id>``."""

    def setUp(self):
        self.claude = agent_binary("claude", "NVPAIR_CLAUDE", CLAUDE_VERSION)
        self.start_fleet()
        config = os.path.abspath(self.mktemp())
        os.makedirs(config)
        self.env = quiet_env(
            ANTHROPIC_BASE_URL=self.facade,
            ANTHROPIC_API_KEY="sk-ant-dummy-key",
            ANTHROPIC_MODEL=MODEL,
            CLAUDE_CONFIG_DIR=config,
            DISABLE_TELEMETRY="1",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_AUTOUPDATER="1",
            DISABLE_ERROR_REPORTING="1",
            CLAUDE_CODE_MAX_OUTPUT_TOKENS="64",
        )

    def argv(self, prompt: str, session: str | None = None) -> list[str]:
        resume = ["--resume", session] if session else []
        return [self.claude, "-p", prompt, "--output-format", "json"] + resume

    def result(self, label: str, stdout: str) -> dict:
        """The run's JSON result: one request, answered "ok", no error."""
        result = json.loads(stdout)
        self.assertEqual(
            (result["is_error"], result["result"], result["num_turns"]),
            (False, "ok", 1),
            f"{label}: {result}",
        )
        return result

    def prompt_total(self, label: str, stdout: str) -> tuple[str, int]:
        # the usage of its one request, the engine's own (Anthropic counts the cached prefix
        # apart)
        result = self.result(label, stdout)
        usage = result["usage"]
        return result["session_id"], usage["input_tokens"] + usage["cache_read_input_tokens"]

    def session_of(self, label: str, stdout: str) -> str:
        return self.result(label, stdout)["session_id"]

    def test_two_sessions_of_two_turns_each_stay_on_their_nodes(self):
        self.two_sessions()


class CodexTests(AgentFleet, SynchronousTestCase):
    """Codex CLI ``exec``: ``POST /v1/responses`` as SSE, with ``session-id`` and
    ``thread-id`` headers and the session as ``prompt_cache_key``; turn 2 is
    ``exec resume <session id>``."""

    def setUp(self):
        self.codex = agent_binary("codex", "NVPAIR_CODEX", CODEX_VERSION)
        self.start_fleet()
        home = os.path.abspath(self.mktemp())
        os.makedirs(home)
        with open(os.path.join(home, "config.toml"), "w") as config:
            config.write(
                f'model = "{MODEL}"\n'
                'model_provider = "nvp"\n'
                "[model_providers.nvp]\n"
                'name = "nvpair-proxy"\n'
                f'base_url = "{self.facade}/v1"\n'
                'env_key = "NVP_API_KEY"\n'
                'wire_api = "responses"\n'
            )
        self.env = quiet_env(CODEX_HOME=home, NVP_API_KEY="unused")

    def argv(self, prompt: str, session: str | None = None) -> list[str]:
        resume = ["resume", session] if session else []
        return [self.codex, "exec", "--skip-git-repo-check", "--json"] + resume + [prompt]

    def codex_events(self, label: str, stdout: str) -> list[dict]:
        """The run's JSON events: a thread, one turn, answered "ok"."""
        events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        types = [event["type"] for event in events]
        self.assertEqual(
            (types[0], types[-1], types.count("turn.completed")),
            ("thread.started", "turn.completed", 1),
            f"{label}: {events}",
        )
        messages = [
            event["item"]["text"]
            for event in events
            if event["type"] == "item.completed" and event["item"]["type"] == "agent_message"
        ]
        self.assertEqual(messages, ["ok"], f"{label}: {events}")
        return events

    def prompt_total(self, label: str, stdout: str) -> tuple[str, int]:
        # turn.completed adds up the thread's requests: on turn 1 that is its one request,
        # input_tokens with the cached ones included
        events = self.codex_events(label, stdout)
        return events[0]["thread_id"], events[-1]["usage"]["input_tokens"]

    def session_of(self, label: str, stdout: str) -> str:
        return self.codex_events(label, stdout)[0]["thread_id"]

    def test_two_sessions_of_two_turns_each_stay_on_their_nodes(self):
        self.two_sessions()
