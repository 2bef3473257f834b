"""The demo behind bin/demo: a real fleet of simulated engines, the real proxy, real HTTP.

Three simulated GPU nodes each run Ollama, LM Studio and llama.cpp; gpu-a's Ollama answers
503 to every inference request and `mistral` lives on gpu-c only. The proxy runs standalone
with all three facades, the nodes file below and the admin listener (its status page URL is
printed); every request goes through it. ``--hold`` keeps everything running afterwards.

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
import time
import urllib.error
import urllib.request
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLEET = {
    "gpu-a": {"ollama": {"models": ["llama3:latest"], "status": 503},
              "lmstudio": {"models": ["qwen2.5-7b-instruct"]},
              "llamacpp": {"models": ["phi-3-mini"], "loaded": ["phi-3-mini"]}},
    "gpu-b": {"ollama": {"models": ["llama3:latest"]},
              "lmstudio": {"models": ["qwen2.5-7b-instruct"]},
              "llamacpp": {"models": ["phi-3-mini"], "loaded": []}},
    "gpu-c": {"ollama": {"models": ["llama3:latest", "mistral:latest"]},
              "lmstudio": {"models": ["gemma-3-4b"]},
              "llamacpp": {"models": ["phi-3-mini"], "loaded": ["phi-3-mini"]}},
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
    parser = Parser("bin/demo", description=(
        "Start a simulated 3-node fleet and the proxy in front of it (standalone, with its "
        "admin listener), send real requests through every facade and print which node served "
        "each one. Exits 0 when every request behaved as expected."))
    parser.add_argument("--hold", action="store_true",
                        help="keep the fleet and the proxy running afterwards (Ctrl-C stops)")
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
            lines = ['[[node]]', f'id = "{sim_id}"', f'dialect = "{engine}"', "port = 0",
                     f"models = {toml_list(spec['models'])}", "tokens = 5", "token_delay = 0.02"]
            if "loaded" in spec:
                lines.append(f"loaded = {toml_list(spec['loaded'])}")
            if "status" in spec:
                lines.append(f"status = {spec['status']}")
            fleet.append("\n".join(lines) + "\n")
    fleet_path = os.path.join(workdir, "fleet.toml")
    with open(fleet_path, "w") as handle:
        handle.write("\n".join(fleet))
    return fleet_path


def write_nodes(workdir: str, ports: dict[str, int]) -> str:
    """The proxy's nodes file: each node's three engines on their simulated ports. Ollama and
    LM Studio list their models when probed; for llama.cpp the file names the loaded ones."""
    entries = [(node_id, engine, ports[f"{node_id}-{engine}"],
                spec["loaded"] if engine == "llamacpp" else None)
               for node_id, engines in FLEET.items() for engine, spec in engines.items()]
    path = os.path.join(workdir, "nodes.toml")
    with open(path, "w") as handle:
        handle.write(processes().nodes_toml(entries))
    return path


def start_proxy(workdir: str, nodes_path: str, facades: dict[str, int],
                admin: int | None = None) -> subprocess.Popen:
    """The proxy standalone with a facade per engine, logging at debug to proxy.log."""
    args = ["--nodes", nodes_path, "--log-level", "debug"]
    for engine, port in facades.items():
        args += ["--engine", f"{engine}:{port}"]
    if admin is not None:
        args += ["--admin", f"127.0.0.1:{admin}"]
    return processes().spawn_proxy(workdir, args, os.path.join(workdir, "proxy.log"),
                                   stdout=None, stderr=None, cwd=workdir)


def call(port: int, method: str, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers.get("X-Sim-Node", ""), response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("X-Sim-Node", ""), error.read()


def served(fleet_ports: dict[str, int], sim_id: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet_ports[sim_id]}/_sim/state") as response:
        return len(json.load(response)["served"])


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
        print(f"simulated fleet: {len(fleet_ports)} engine servers on 3 nodes (gpu-a, gpu-b, gpu-c)")
        print("proxy facades: " + ", ".join(f"{e} on :{p}" for e, p in facades.items()))
        print(f"status page: http://127.0.0.1:{admin}/  (metrics: /metrics, JSON: /status)")
        chat = [{"role": "user", "content": "Say hello"}]
        cases = [
            ("ollama", "POST", "/api/chat", {"model": "llama3", "messages": chat}, True,
             200, "gpu-b", "gpu-a answers 503: fails over to gpu-b"),
            ("ollama", "POST", "/api/generate", {"model": "llama3", "prompt": "hi", "stream": False},
             False, 200, None, "non-streaming"),
            ("ollama", "POST", "/api/chat", {"model": "mistral", "messages": chat}, True,
             200, "gpu-c", "a model only gpu-c has"),
            ("ollama", "POST", "/api/chat", {"model": "no-such-model", "messages": chat}, False,
             502, "", "nobody advertises it: local 502, no engine contacted"),
            ("ollama", "GET", "/api/tags", None, False, 200, "", "fleet-wide model list"),
            ("lmstudio", "POST", "/v1/chat/completions",
             {"model": "qwen2.5-7b-instruct", "messages": chat, "stream": True}, True, 200, None,
             "OpenAI SSE"),
            ("lmstudio", "POST", "/v1/chat/completions",
             {"model": "gemma-3-4b", "messages": chat}, False, 200, "gpu-c", "non-streaming"),
            ("llamacpp", "POST", "/v1/chat/completions",
             {"model": "phi-3-mini", "messages": chat, "stream": True}, True, 200, None,
             "only nodes with the model loaded"),
            ("llamacpp", "GET", "/v1/models", None, False, 200, "", "fleet-wide, loaded models"),
            ("ollama", "POST", "/v1/messages",
             {"model": "llama3", "max_tokens": 64, "messages": chat, "stream": True}, True, 200,
             "gpu-b", "Anthropic SSE, ends at message_stop"),
            ("llamacpp", "POST", "/v1/messages",
             {"model": "phi-3-mini", "max_tokens": 64, "messages": chat}, False, 200, None,
             "Anthropic, non-streaming"),
            ("lmstudio", "POST", "/v1/responses",
             {"model": "qwen2.5-7b-instruct", "input": "Say hello", "stream": True}, True, 200,
             None, "OpenAI Responses SSE, ends at response.completed"),
            ("ollama", "POST", "/v1/responses", {"model": "mistral", "input": "Say hello"},
             False, 200, "gpu-c", "OpenAI Responses, non-streaming"),
            ("llamacpp", "POST", "/v1/responses",
             {"model": "phi-3-mini", "input": "Say hello", "stream": True}, True, 200, None,
             "OpenAI Responses SSE"),
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
            print(f"{engine:9} {method + ' ' + path:28} {model:20} {status:<6} "
                  f"{(node.rsplit('-', 1)[0] if node else 'proxy'):16} "
                  f"{outcome(status, content, stream)}{extra}  [{note}]{'' if ok else '  <- UNEXPECTED'}")
        print()
        print("all requests behaved as expected" if not failures else f"{failures} unexpected results")
        if hold:
            print(f"holding: the fleet and the proxy keep running; status page "
                  f"http://127.0.0.1:{admin}/ ; Ctrl-C to stop", flush=True)
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
