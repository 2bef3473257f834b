"""The demo behind bin/demo: a real fleet of simulated engines, the real proxy, real HTTP.

Three simulated GPU nodes each run Ollama, LM Studio and llama.cpp; gpu-a's Ollama answers
503 to every inference request and `mistral` lives on gpu-c only. The proxy runs standalone
with all three facades, the nodes file below and the admin listener (its status page URL is
printed); every request goes through it. ``--hold`` keeps everything running afterwards.

Then two scheduling demonstrations, on what the simulated engines report (their truth
routes): a warm owner chosen over a cold one (``llama-3.2-3b-instruct`` is advertised by the
LM Studio of gpu-a and gpu-b and loaded only on gpu-b; gpu-a would load it first), and late
binding (gpu-a's and gpu-c's llama.cpp run one request at a time; while both stream, a third
request waits in the proxy, not inside an engine, and goes to the node that frees first).
A third demonstration is affinity (docs/decisions.md#affinity): gpu-a's and gpu-c's llama.cpp
keep a prompt cache (the simulated fleet's ``prompt_cache``: a turn whose conversation the
node has read before gets its first byte sooner), a conversation's turns stay on the node that
served its first, and when that node answers 503 the next turn spills to the other and stays.

The fleet and the proxy are started and stopped by ``nvpair_proxy.testing.processes``, as the
process tests start them. It is imported only once something starts, so that ``--help`` (and
bin/status_screenshot.py's) needs nothing but the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from types import ModuleType
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model of the warm-versus-cold demonstration: nothing else asks for it.
WARM_MODEL = "llama-3.2-3b-instruct"
COLD_LOAD = 3.0

FLEET: dict[str, dict[str, dict[str, Any]]] = {
    "gpu-a": {
        "ollama": {"models": ["llama3:latest"], "status": 503},
        "lmstudio": {
            "models": ["qwen2.5-7b-instruct", WARM_MODEL],
            "loaded": ["qwen2.5-7b-instruct"],
            "cold_load_delay": COLD_LOAD,
        },
        "llamacpp": {"models": ["phi-3-mini"], "loaded": ["phi-3-mini"], "slots": 1},
    },
    "gpu-b": {
        "ollama": {"models": ["llama3:latest"]},
        "lmstudio": {"models": ["qwen2.5-7b-instruct", WARM_MODEL], "cold_load_delay": COLD_LOAD},
        "llamacpp": {"models": ["phi-3-mini"], "loaded": []},
    },
    "gpu-c": {
        "ollama": {"models": ["llama3:latest", "mistral:latest"]},
        "lmstudio": {"models": ["gemma-3-4b"]},
        "llamacpp": {"models": ["phi-3-mini"], "loaded": ["phi-3-mini"], "slots": 1},
    },
}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors on stderr (exit 2) and no prefix abbreviations: an
    unknown flag is named (``bin/demo: unknown flag --bogus (see bin/demo --help)``).
    bin/status_screenshot.py parses its flags with it too."""

    def __init__(self, prog: str, **kwargs) -> None:
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        for arg in extra:
            if arg.startswith("-"):
                self.error(f"unknown flag {arg.split('=', 1)[0]}")
            self.error(f"unexpected argument {arg!r}")
        return parsed

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parse(argv: list[str]) -> argparse.Namespace:
    """bin/demo's flags; ``--help`` prints the usage and exits 0 before anything starts."""
    parser = Parser(
        "bin/demo",
        description=(
            "Start a simulated 3-node fleet and the proxy in front of it (standalone, with its "
            "admin listener), send real requests through every facade and print which node served "
            "each one. Exits 0 when every request behaved as expected."
        ),
    )
    parser.add_argument(
        "--hold",
        action="store_true",
        help="keep the fleet and the proxy running afterwards (Ctrl-C stops)",
    )
    return parser.parse_args(argv)


def processes() -> ModuleType:
    """``nvpair_proxy.testing.processes`` of this checkout."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from nvpair_proxy.testing import processes as module

    return module


def stop(*children: subprocess.Popen | None) -> None:
    """SIGTERM each child still running; kill one that has not exited 10 s later."""
    processes().stop(*children)


def toml_list(values) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def write_files(workdir: str) -> str:
    """The simulated fleet's file; its path."""
    fleet = []
    for node_id, engines in FLEET.items():
        for engine, spec in engines.items():
            sim_id = f"{node_id}-{engine}"
            lines = [
                "[[node]]",
                f'id = "{sim_id}"',
                f'dialect = "{engine}"',
                "port = 0",
                f"models = {toml_list(spec['models'])}",
                "tokens = 5",
                "token_delay = 0.02",
            ]
            if "loaded" in spec:
                lines.append(f"loaded = {toml_list(spec['loaded'])}")
            for key in ("status", "slots", "cold_load_delay"):
                if key in spec:
                    lines.append(f"{key} = {spec[key]}")
            fleet.append("\n".join(lines) + "\n")
    fleet_path = os.path.join(workdir, "fleet.toml")
    with open(fleet_path, "w") as handle:
        handle.write("\n".join(fleet))
    return fleet_path


def write_nodes(workdir: str, ports: dict[str, int]) -> str:
    """The proxy's nodes file: each node's three engines on their simulated ports. Ollama and
    LM Studio list their models when probed; for llama.cpp the file names the loaded ones,
    and the slots each runs (which its ``/slots`` also reports, once read)."""
    entries = [
        (
            node_id,
            engine,
            ports[f"{node_id}-{engine}"],
            spec["loaded"] if engine == "llamacpp" else None,
        )
        for node_id, engines in FLEET.items()
        for engine, spec in engines.items()
    ]
    slots = {
        (node_id, engine): spec["slots"]
        for node_id, engines in FLEET.items()
        for engine, spec in engines.items()
        if "slots" in spec
    }
    path = os.path.join(workdir, "nodes.toml")
    with open(path, "w") as handle:
        handle.write(processes().nodes_toml(entries, slots))
    return path


def start_proxy(
    workdir: str, nodes_path: str, facades: dict[str, int], admin: int | None = None
) -> subprocess.Popen:
    """The proxy standalone with a facade per engine, logging at debug to proxy.log."""
    args = ["--nodes", nodes_path, "--log-level", "debug"]
    for engine, port in facades.items():
        args += ["--engine", f"{engine}:{port}"]
    if admin is not None:
        args += ["--admin", f"127.0.0.1:{admin}"]
    return processes().spawn_proxy(
        workdir, args, os.path.join(workdir, "proxy.log"), stdout=None, stderr=None, cwd=workdir
    )


def call(port: int, method: str, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers.get("X-Sim-Node", ""), response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("X-Sim-Node", ""), error.read()


def sim(
    fleet_ports: dict[str, int], sim_id: str, path: str = "/_sim/state", change: dict | None = None
):
    """A simulated engine's answer to ``path`` (its admin or truth routes), decoded."""
    data = json.dumps(change).encode() if change is not None else None
    with urllib.request.urlopen(
        f"http://127.0.0.1:{fleet_ports[sim_id]}{path}", data=data, timeout=10
    ) as response:
        return json.load(response)


def served(fleet_ports: dict[str, int], sim_id: str) -> int:
    return len(sim(fleet_ports, sim_id)["served"])


def wait_for(ready, timeout: float) -> bool:
    """Poll ``ready()`` every 50 ms until it is true or ``timeout`` passes."""
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def node_of(response) -> str:
    return (response.headers.get("X-Sim-Node") or "proxy").rsplit("-", 1)[0]


def open_stream(port: int, model: str):
    """A streaming chat through the llama.cpp facade, open once its headers arrived."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(request, timeout=30)


def queued_in(status: object) -> list[int]:
    """Every ``queued`` count in the proxy's /status JSON (none while it does not show one)."""
    if isinstance(status, dict):
        found = [v for k, v in status.items() if k == "queued" and isinstance(v, int)]
        return found + [n for v in status.values() for n in queued_in(v)]
    if isinstance(status, list):
        return [n for v in status for n in queued_in(v)]
    return []


def demo_warm_over_cold(fleet_ports: dict[str, int], facades: dict[str, int]) -> bool:
    """Two owners advertise WARM_MODEL, only gpu-b has it loaded: the proxy picks gpu-b,
    though gpu-a comes first by node id, and gpu-a never loads it."""
    print()
    print(f"warm before cold: {WARM_MODEL} is advertised by gpu-a and gpu-b (LM Studio)")
    owners = ("gpu-a-lmstudio", "gpu-b-lmstudio")
    # The proxy reads each engine's /api/v0/models about a second after start-up.
    read = wait_for(lambda: all(sim(fleet_ports, o)["truth_reads"] for o in owners), 15.0)
    time.sleep(0.3)  # the read's answer reaches the router
    for owner in owners:
        states = {m["id"]: m["state"] for m in sim(fleet_ports, owner, "/api/v0/models")["data"]}
        print(
            f"  {owner[:5]} reports {WARM_MODEL}: {states[WARM_MODEL]}"
            + (
                f" (a request there would wait {COLD_LOAD:.0f} s for it to load)"
                if states[WARM_MODEL] != "loaded"
                else ""
            )
        )
    started = time.monotonic()
    status, node, body = call(
        facades["lmstudio"],
        "POST",
        "/v1/chat/completions",
        {"model": WARM_MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    took = time.monotonic() - started
    still_cold = all(
        m["state"] == "not-loaded"
        for m in sim(fleet_ports, "gpu-a-lmstudio", "/api/v0/models")["data"]
        if m["id"] == WARM_MODEL
    )
    ok = read and status == 200 and node.startswith("gpu-b") and still_cold
    print(
        f"  one request: {status}, served by {node.rsplit('-', 1)[0] or 'proxy'} in "
        f"{took:.2f} s; gpu-a still has it {'not loaded' if still_cold else 'LOADED'}"
        f"{'' if ok else '  <- UNEXPECTED'}"
    )
    return ok


def demo_late_binding(fleet_ports: dict[str, int], facades: dict[str, int], admin: int) -> bool:
    """gpu-a and gpu-c run one llama.cpp request at a time; both stream (gpu-a for 2 s,
    gpu-c for 0.8 s); a third request waits in the proxy and goes to gpu-c, which frees
    first, although gpu-a comes first by node id."""
    long, short = ("gpu-a-llamacpp", 40), ("gpu-c-llamacpp", 16)
    for sim_id, tokens in (long, short):
        sim(fleet_ports, sim_id, "/_sim/fault", {"tokens": tokens, "token_delay": 0.05})
    port = facades["llamacpp"]
    print()
    print(
        "late binding: gpu-a and gpu-c run one llama.cpp request at a time "
        "(slots = 1, their /slots says so too)"
    )
    results: dict[str, object] = {}
    readers = []
    try:
        t0 = time.monotonic()
        for name in ("first", "second"):
            response = open_stream(port, "phi-3-mini")
            results[name] = node_of(response)
            reader = threading.Thread(target=response.read, daemon=True)
            reader.start()
            readers.append(reader)
        print(
            f"  stream 1 on {results['first']} (40 tokens, 2.0 s), stream 2 on "
            f"{results['second']} (16 tokens, 0.8 s): every owner is full"
        )

        def third() -> None:
            sent = time.monotonic()
            with open_stream(port, "phi-3-mini") as response:
                results["third"] = node_of(response)
                results["waited"] = time.monotonic() - sent
                response.read()

        waiter = threading.Thread(target=third, daemon=True)
        waiter.start()
        time.sleep(0.3)
        inside = {sim_id[:5]: sim(fleet_ports, sim_id)["queued"] for sim_id, _ in (long, short)}
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/status", timeout=10) as response:
            queued = queued_in(json.load(response))
        shown = (
            f"proxy /status queued = {max(queued)}"
            if queued
            else "waiting in the proxy (its /status does not show the queue yet)"
        )
        print(
            f"  request 3 at {time.monotonic() - t0:.1f} s: {shown}; inside the engines: "
            + ", ".join(f"{node} {count}" for node, count in inside.items())
        )
        waiter.join(30)
        for reader in readers:
            reader.join(30)
    finally:
        for sim_id, _ in (long, short):
            sim(fleet_ports, sim_id, "/_sim/fault", {"tokens": 5, "token_delay": 0.02})
    ok = (results.get("first"), results.get("second"), results.get("third")) == (
        "gpu-a",
        "gpu-c",
        "gpu-c",
    ) and not any(inside.values())
    print(
        f"  request 3 served by {results.get('third')} when its stream ended, after waiting "
        f"{results.get('waited', 0.0):.2f} s (gpu-a stayed busy until 2.0 s)"
        f"{'' if ok else '  <- UNEXPECTED'}"
    )
    return ok


# The affinity demonstration: a prompt read from scratch, and one whose head the node holds.
PROMPT_DELAY = 0.6
CACHED_DELAY = 0.05


def chat_turn(port: int, messages: list[dict]) -> dict[str, Any]:
    """One streamed turn of a conversation through the llama.cpp facade: its status, node,
    first-byte time, answer text and llama.cpp's final timings."""
    body = {"model": "phi-3-mini", "stream": True, "messages": messages}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    sent = time.monotonic()
    turn: dict[str, Any] = {
        "status": 0,
        "node": "proxy",
        "first_byte": None,
        "text": "",
        "timings": {},
    }
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            turn["status"], turn["node"] = response.status, node_of(response)
            for line in response:
                if turn["first_byte"] is None and line.strip():
                    turn["first_byte"] = time.monotonic() - sent
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[len(b"data: ") :])
                for choice in chunk.get("choices", []):
                    turn["text"] += choice.get("delta", {}).get("content", "")
                turn["timings"] = chunk.get("timings", turn["timings"])
    except urllib.error.HTTPError as error:
        turn["status"] = error.code
    return turn


def affinity_counts(admin: int) -> dict[str, float]:
    """The proxy's ``nvpair_proxy_affinity_total`` of the llama.cpp facade, by result."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("nvpair_proxy_affinity_total{") and 'engine="llamacpp"' in line:
            result = line.split('result="', 1)[1].split('"', 1)[0]
            counts[result] = float(line.rsplit(" ", 1)[1])
    return counts


def affinity_placed(admin: int, before: dict[str, float]) -> str:
    """How the proxy's affinity placed the llama.cpp request that ended after ``before`` was
    read (it counts a request once it ended, which its client may see first): hit, spill,
    miss or none; empty if it counted nothing within 5 s."""
    now: dict[str, float] = {}

    def counted() -> bool:
        now.update(affinity_counts(admin))
        return sum(now.values()) > sum(before.values())

    wait_for(counted, 5.0)
    return ",".join(result for result in sorted(now) if now[result] > before.get(result, 0))


def demo_affinity(fleet_ports: dict[str, int], facades: dict[str, int], admin: int) -> bool:
    """Five turns of one conversation through the llama.cpp facade (phi-3-mini: gpu-a and
    gpu-c). Turns 1-3 stay on the node of turn 1 (a prompt cache miss, then hits); then that
    node answers 503, so turn 4 spills to the other (a miss there); the node answers again,
    but turn 5 goes where turn 4 was committed (a hit): the conversation lives there now."""
    owners = ("gpu-a-llamacpp", "gpu-c-llamacpp")
    print()
    print(
        f"affinity: one conversation through the llama.cpp facade; gpu-a and gpu-c keep a "
        f"prompt cache (first byte after {PROMPT_DELAY} s reading a prompt from scratch, "
        f"after {CACHED_DELAY} s when the engine holds the conversation)"
    )
    for sim_id in owners:
        sim(
            fleet_ports,
            sim_id,
            "/_sim/fault",
            {"prompt_cache": 8, "prompt_delay": PROMPT_DELAY, "cached_prompt_delay": CACHED_DELAY},
        )
    messages: list[dict] = [{"role": "system", "content": "You answer in one short line."}]
    questions = (
        "Why is the sky blue?",
        "And at sunset?",
        "Is it the same on Mars?",
        "What about the Moon?",
        "Thanks, one last thing: and at night?",
    )
    turns: list[dict[str, Any]] = []
    faulted, home, other, refused = "", "", "", False
    print(
        f"  {'turn':6}{'status':8}{'served by':11}{'first byte':12}"
        f"{'engine prompt cache':26}proxy affinity"
    )

    def run(number: int, note: str = "") -> None:
        messages.append({"role": "user", "content": questions[number - 1]})
        counts = affinity_counts(admin)
        turn = chat_turn(facades["llamacpp"], messages)
        turn["affinity"] = affinity_placed(admin, counts)
        messages.append({"role": "assistant", "content": turn["text"]})
        turns.append(turn)
        cached = turn["timings"].get("cache_n", 0)
        read = turn["timings"].get("prompt_n", "-")
        first = turn["first_byte"]
        cache = f"hit: {cached} reused, {read} read" if cached else f"miss: {read} read"
        print(
            f"  {number:<6}{turn['status']:<8}{turn['node']:11}"
            f"{(f'{first:.2f} s' if first is not None else 'none'):12}{cache:26}"
            f"{turn['affinity'] or '-':8}{note}".rstrip()
        )

    try:
        run(1, "a new conversation, placed like any new request")
        home = turns[0]["node"]
        other = next((o[:5] for o in owners if o[:5] != home), "")
        run(2, f"the conversation's node, {home}, goes first")
        run(3)
        if f"{home}-llamacpp" in owners:
            faulted = f"{home}-llamacpp"
            before = served(fleet_ports, faulted)
            sim(fleet_ports, faulted, "/_sim/fault", {"status": 503})
            print(f"  ({home} now answers 503 to every inference request)")
            run(4, f"{home} answered 503 (the proxy holds it 1 s): the turn spilled")
            refused = served(fleet_ports, faulted) > before
            sim(fleet_ports, faulted, "/_sim/fault", {"status": None})
            faulted = ""
            time.sleep(1.2)  # the proxy's hold on it passes
            print(f"  ({home} answers again, and the proxy no longer holds it)")
            run(5, f"the conversation now lives on {turns[3]['node']}")
    finally:
        if faulted:
            sim(fleet_ports, faulted, "/_sim/fault", {"status": None})
        for sim_id in owners:
            sim(
                fleet_ports,
                sim_id,
                "/_sim/fault",
                {"prompt_cache": 0, "prompt_delay": 0, "cached_prompt_delay": 0},
            )
    hit = [bool(t["timings"].get("cache_n")) for t in turns]
    hits = [t["first_byte"] for t, h in zip(turns, hit) if h and t["first_byte"] is not None]
    misses = [t["first_byte"] for t, h in zip(turns, hit) if not h and t["first_byte"] is not None]
    ok = (
        refused
        and all(t["status"] == 200 for t in turns)
        and [t["node"] for t in turns] == [home] * 3 + [other] * 2
        and hit == [False, True, True, False, True]
        and [t["affinity"] for t in turns] == ["miss", "hit", "hit", "spill", "hit"]
        and len(hits) == 3
        and len(misses) == 2
        and max(hits) < min(misses)
    )
    if ok:
        print(
            f"  {home} served turns 1-3 from its cache; {other} took the conversation over at "
            f"turn 4 and kept it, a hit again from turn 5"
        )
    else:
        print("  the conversation did not go as described above  <- UNEXPECTED")
    return ok


def outcome(status: int, body: bytes, stream: bool) -> str:
    if status != 200:
        try:
            return f"error: {json.loads(body)['error']}"
        except (ValueError, KeyError, TypeError):
            return f"error body of {len(body)} bytes"
    if stream:
        frames = [line for line in body.splitlines() if line.strip()]
        return f"streamed {len(frames)} frames, {len(body)} bytes"
    return f"{len(body)} bytes"


def launch(workdir: str):
    """The simulated fleet and the proxy in front of it (with the admin listener), files in
    ``workdir``: (fleet, proxy, fleet ports, facade ports, admin port). bin/demo and
    bin/status-screenshot both start here; the fleet is stopped again if the proxy fails."""
    spawned = processes()
    try:
        fleet, fleet_ports = spawned.spawn_fleet(write_files(workdir), stderr=None)
    except spawned.StartFailed as failed:
        raise SystemExit(f"demo: {failed}")
    try:
        free_port = spawned.free_port
        facades = {"ollama": free_port(), "lmstudio": free_port(), "llamacpp": free_port()}
        admin = free_port()
        proxy = start_proxy(workdir, write_nodes(workdir, fleet_ports), facades, admin)
    except spawned.StartFailed as failed:
        stop(fleet)
        raise SystemExit(f"demo: {failed}")
    except BaseException:
        stop(fleet)
        raise
    time.sleep(0.5)  # let the first inventory probe of the llama.cpp facade land
    return fleet, proxy, fleet_ports, facades, admin


def main(argv: list[str]) -> int:
    hold = parse(argv).hold
    workdir = tempfile.mkdtemp(prefix="nvpair-demo-")
    fleet, proc = None, None
    failures = 0
    try:
        fleet, proc, fleet_ports, facades, admin = launch(workdir)
        print(
            f"simulated fleet: {len(fleet_ports)} engine servers on 3 nodes (gpu-a, gpu-b, gpu-c)"
        )
        print("proxy facades: " + ", ".join(f"{e} on :{p}" for e, p in facades.items()))
        print(f"status page: http://127.0.0.1:{admin}/  (metrics: /metrics, JSON: /status)")
        chat = [{"role": "user", "content": "Say hello"}]
        cases: list[tuple[Any, ...]] = [
            (
                "ollama",
                "POST",
                "/api/chat",
                {"model": "llama3", "messages": chat},
                True,
                200,
                "gpu-b",
                "gpu-a answers 503: fails over to gpu-b",
            ),
            (
                "ollama",
                "POST",
                "/api/generate",
                {"model": "llama3", "prompt": "hi", "stream": False},
                False,
                200,
                None,
                "non-streaming",
            ),
            (
                "ollama",
                "POST",
                "/api/chat",
                {"model": "mistral", "messages": chat},
                True,
                200,
                "gpu-c",
                "a model only gpu-c has",
            ),
            (
                "ollama",
                "POST",
                "/api/chat",
                {"model": "no-such-model", "messages": chat},
                False,
                502,
                "",
                "nobody advertises it: local 502, no engine contacted",
            ),
            ("ollama", "GET", "/api/tags", None, False, 200, "", "fleet-wide model list"),
            (
                "lmstudio",
                "POST",
                "/v1/chat/completions",
                {"model": "qwen2.5-7b-instruct", "messages": chat, "stream": True},
                True,
                200,
                None,
                "OpenAI SSE",
            ),
            (
                "lmstudio",
                "POST",
                "/v1/chat/completions",
                {"model": "gemma-3-4b", "messages": chat},
                False,
                200,
                "gpu-c",
                "non-streaming",
            ),
            (
                "llamacpp",
                "POST",
                "/v1/chat/completions",
                {"model": "phi-3-mini", "messages": chat, "stream": True},
                True,
                200,
                None,
                "only nodes with the model loaded",
            ),
            ("llamacpp", "GET", "/v1/models", None, False, 200, "", "fleet-wide, loaded models"),
            (
                "ollama",
                "POST",
                "/v1/messages",
                {"model": "llama3", "max_tokens": 64, "messages": chat, "stream": True},
                True,
                200,
                "gpu-b",
                "Anthropic SSE, ends at message_stop",
            ),
            (
                "llamacpp",
                "POST",
                "/v1/messages",
                {"model": "phi-3-mini", "max_tokens": 64, "messages": chat},
                False,
                200,
                None,
                "Anthropic, non-streaming",
            ),
            (
                "lmstudio",
                "POST",
                "/v1/responses",
                {"model": "qwen2.5-7b-instruct", "input": "Say hello", "stream": True},
                True,
                200,
                None,
                "OpenAI Responses SSE, ends at response.completed",
            ),
            (
                "ollama",
                "POST",
                "/v1/responses",
                {"model": "mistral", "input": "Say hello"},
                False,
                200,
                "gpu-c",
                "OpenAI Responses, non-streaming",
            ),
            (
                "llamacpp",
                "POST",
                "/v1/responses",
                {"model": "phi-3-mini", "input": "Say hello", "stream": True},
                True,
                200,
                None,
                "OpenAI Responses SSE",
            ),
        ]
        print()
        print(f"{'facade':9} {'request':28} {'model':20} {'status':6} {'served by':16} outcome")
        for engine, method, path, body, stream, want_status, want_node, note in cases:
            before = served(fleet_ports, "gpu-a-ollama")
            status, node, content = call(facades[engine], method, path, body)
            model = (body or {}).get("model", "-")
            ok = status == want_status and (want_node is None or node.startswith(want_node))
            if engine == "llamacpp" and method == "POST":
                ok = ok and not node.startswith("gpu-b")
            failures += not ok
            extra = ""
            if engine == "ollama" and served(fleet_ports, "gpu-a-ollama") > before:
                extra = " (after gpu-a answered 503)"
            print(
                f"{engine:9} {method + ' ' + path:28} {model:20} {status:<6} "
                f"{(node.rsplit('-', 1)[0] if node else 'proxy'):16} "
                f"{outcome(status, content, stream)}{extra}  [{note}]"
                f"{'' if ok else '  <- UNEXPECTED'}"
            )
        failures += not demo_warm_over_cold(fleet_ports, facades)
        failures += not demo_late_binding(fleet_ports, facades, admin)
        failures += not demo_affinity(fleet_ports, facades, admin)
        print()
        print(
            "all requests behaved as expected" if not failures else f"{failures} unexpected results"
        )
        if hold:
            print(
                f"holding: the fleet and the proxy keep running; status page "
                f"http://127.0.0.1:{admin}/ ; Ctrl-C to stop",
                flush=True,
            )
            signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(0))
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 1 if failures else 0
    finally:
        stop(proc, fleet)
        if failures or sys.exc_info()[0] not in (None, SystemExit):
            print(f"the proxy's log is kept in {workdir}/proxy.log")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
