"""The check behind bin/status-screenshot: the status page in a real headless Chromium.

bin/demo's fleet and proxy (with ``--admin``) are started, traffic is sent through every
facade, then Chromium loads the page twice: once to dump the DOM after its scripts ran
(``--dump-dom`` with a virtual-time budget, so the first polls of /status have landed) and
once to save a screenshot. The DOM must show the three nodes and the recent requests.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402  (bin/demo.py: the fleet, the proxy, HTTP calls)

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
#: A system prompt long enough (150 words) for the engines' prompt caches to matter: each
#: round's chat is the last one's conversation and one more turn, so from the second round
#: on the nodes' caches hold its head and the page shows what they reused.
SYSTEM = "You answer briefly and check each step of your reasoning twice. " * 15


def conversation(turns: int) -> list[dict]:
    """A chat of ``turns`` user turns, the system prompt first."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello"}]
    for turn in range(1, turns):
        messages.append({"role": "assistant", "content": "Hello."})
        messages.append({"role": "user", "content": f"Say hello again, turn {turn + 1}"})
    return messages


def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("status-screenshot: no Chromium found; on Debian: apt-get install -y chromium")


def chromium(binary: str, url: str, *extra: str) -> str:
    with tempfile.TemporaryDirectory(prefix="nvpair-chromium-") as profile:
        result = subprocess.run(
            [
                binary,
                *FLAGS,
                f"--user-data-dir={profile}",
                "--virtual-time-budget=6000",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if result.returncode != 0:
        raise SystemExit(
            f"status-screenshot: chromium failed ({result.returncode}): "
            f"{result.stderr.strip()[-500:]}"
        )
    return result.stdout


#: Rounds of traffic, and the seconds between two: the history samples every 10 s.
ROUNDS = 4
HISTORY_GAP = 10.5


def traffic(facades: dict[str, int]) -> int:
    """Requests through every facade: failovers (gpu-a's Ollama answers 503), a model only
    gpu-c has, a model nobody has (502), streams, model lists; each round's chats one turn
    longer."""
    sent = 0
    # Four rounds 10.5 s apart, so the history (a sample every 10 s) has points to draw.
    for round_ in range(ROUNDS):
        if round_:
            time.sleep(HISTORY_GAP)
        for engine, method, path, body in requests(conversation(round_ + 1)):
            demo.call(facades[engine], method, path, body)
            sent += 1
    return sent


def requests(chat: list[dict]) -> list[tuple[str, str, str, dict | None]]:
    """One round: (facade, method, path, body)."""
    return [
        ("ollama", "POST", "/api/chat", {"model": "llama3", "messages": chat}),
        ("ollama", "POST", "/api/generate", {"model": "llama3", "prompt": "hi", "stream": False}),
        ("ollama", "POST", "/api/chat", {"model": "mistral", "messages": chat}),
        ("ollama", "POST", "/api/chat", {"model": "no-such-model", "messages": chat}),
        ("ollama", "GET", "/api/tags", None),
        (
            "lmstudio",
            "POST",
            "/v1/chat/completions",
            {"model": "qwen2.5-7b-instruct", "messages": chat, "stream": True},
        ),
        ("lmstudio", "POST", "/v1/chat/completions", {"model": "gemma-3-4b", "messages": chat}),
        (
            "llamacpp",
            "POST",
            "/v1/chat/completions",
            {"model": "phi-3-mini", "messages": chat, "stream": True},
        ),
        (
            "llamacpp",
            "POST",
            "/v1/messages",
            {"model": "phi-3-mini", "max_tokens": 64, "system": SYSTEM, "messages": chat[1:]},
        ),
        (
            "lmstudio",
            "POST",
            "/v1/responses",
            {"model": "qwen2.5-7b-instruct", "input": "Say hello", "stream": True},
        ),
    ]


def check(dom: str, requests: int) -> list[str]:
    problems = []
    for node in ("gpu-a", "gpu-b", "gpu-c"):
        if f'data-node="{node}"' not in dom:
            problems.append(f"fleet table has no row for {node}")
    rows = re.findall(r'<tr data-outcome="(\w+)"', dom)
    if len(rows) != requests:
        problems.append(f"recent requests show {len(rows)} rows, want {requests}")
    for outcome in ("completed", "failed"):
        if outcome not in rows:
            problems.append(f"no {outcome} request shown")
    for engine in ("ollama", "lmstudio", "llamacpp"):
        if f'class="card" data-engine="{engine}"' not in dom:
            problems.append(f"no counters for {engine}")
    # One fleet row per node and engine, and the cache truth of the nodes that answered:
    # llama.cpp's exact, Ollama's estimated.
    fleet_rows = re.findall(r'<tr data-node="[^"]+" data-engine="(\w+)"', dom)
    if sorted(set(fleet_rows)) != ["llamacpp", "lmstudio", "ollama"]:
        problems.append(f"fleet rows name engines {sorted(set(fleet_rows))}")
    for source in ("exact", "estimated"):
        if not re.search(r'<td class="num" title="%s; ' % source, dom):
            problems.append(f"no node shows an {source} share of prompt tokens reused")
    state = re.search(r'id="state"[^>]*>([^<]*)<', dom)
    if state is None or not state.group(1).startswith("updated "):
        problems.append(f"the page did not render /status ({state and state.group(1)!r})")
    charts = dom.count('<figure class="chart"')
    if charts != 5:
        problems.append(f"the last fifteen minutes show {charts} charts, want 5")
    if "Say hello" in dom or "reasoning twice" in dom:
        problems.append("a prompt reached the page")
    return problems


def parse(argv: list[str]):
    """bin/status-screenshot's flags; ``--help`` prints the usage and exits 0, an unknown flag
    is one line on stderr and exit 2, both before the fleet or a browser starts."""
    parser = demo.Parser(
        "bin/status-screenshot",
        description=(
            "Start bin/demo's fleet and the proxy with its admin listener, send traffic, check the "
            "status page in headless Chromium and save a PNG of it. Needs chromium."
        ),
    )
    parser.add_argument(
        "--out",
        default=os.path.join(demo.ROOT, "docs", "status-page.png"),
        help="where to save the PNG (default: docs/status-page.png)",
    )
    return parser.parse_args(argv)


def main() -> int:
    args = parse(sys.argv[1:])
    binary = browser()
    workdir = tempfile.mkdtemp(prefix="nvpair-screenshot-")
    fleet = proc = None
    try:
        fleet, proc, fleet_ports, facades, admin = demo.launch(workdir)
        # Every engine keeps a prompt cache, as bin/demo's affinity part sets one up.
        cache = {"prompt_cache": 8, "prompt_delay": 0.3, "cached_prompt_delay": 0.02}
        for sim_id in fleet_ports:
            demo.sim(fleet_ports, sim_id, "/_sim/fault", cache)
        requests = traffic(facades)
        url = f"http://127.0.0.1:{admin}/"
        problems = check(chromium(binary, url, "--dump-dom"), requests)
        if problems:
            for problem in problems:
                print(f"status-screenshot: {problem}")
            return 1
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        chromium(
            binary, url, f"--screenshot={os.path.abspath(args.out)}", "--window-size=1440,1900"
        )
        print(
            f"status page {url}: 3 nodes and {requests} recent requests shown; "
            f"screenshot saved to {args.out}"
        )
        return 0
    finally:
        demo.stop(proc, fleet)
        # The fleet file, the nodes file and the proxy's state: nothing is kept.
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
