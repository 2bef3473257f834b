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
CHAT = [{"role": "user", "content": "Say hello"}]


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
    gpu-c has, a model nobody has (502), streams, model lists."""
    sent = [
        ("ollama", "POST", "/api/chat", {"model": "llama3", "messages": CHAT}),
        ("ollama", "POST", "/api/generate", {"model": "llama3", "prompt": "hi", "stream": False}),
        ("ollama", "POST", "/api/chat", {"model": "mistral", "messages": CHAT}),
        ("ollama", "POST", "/api/chat", {"model": "no-such-model", "messages": CHAT}),
        ("ollama", "GET", "/api/tags", None),
        (
            "lmstudio",
            "POST",
            "/v1/chat/completions",
            {"model": "qwen2.5-7b-instruct", "messages": CHAT, "stream": True},
        ),
        ("lmstudio", "POST", "/v1/chat/completions", {"model": "gemma-3-4b", "messages": CHAT}),
        (
            "llamacpp",
            "POST",
            "/v1/chat/completions",
            {"model": "phi-3-mini", "messages": CHAT, "stream": True},
        ),
        (
            "llamacpp",
            "POST",
            "/v1/messages",
            {"model": "phi-3-mini", "max_tokens": 64, "messages": CHAT},
        ),
        (
            "lmstudio",
            "POST",
            "/v1/responses",
            {"model": "qwen2.5-7b-instruct", "input": "Say hello", "stream": True},
        ),
    ]
    # Four rounds 10.5 s apart, so the history (a sample every 10 s) has points to draw.
    for round_ in range(ROUNDS):
        if round_:
            time.sleep(HISTORY_GAP)
        for engine, method, path, body in sent:
            demo.call(facades[engine], method, path, body)
    return ROUNDS * len(sent)


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
        if f'data-engine="{engine}"' not in dom:
            problems.append(f"no counters for {engine}")
    state = re.search(r'id="state"[^>]*>([^<]*)<', dom)
    if state is None or not state.group(1).startswith("updated "):
        problems.append(f"the page did not render /status ({state and state.group(1)!r})")
    charts = dom.count('<figure class="chart"')
    if charts != 5:
        problems.append(f"the last fifteen minutes show {charts} charts, want 5")
    if "Say hello" in dom:
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
        fleet, proc, _, facades, admin = demo.launch(workdir)
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
