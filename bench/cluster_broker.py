#!/usr/bin/env python3
"""A scripted broker that keeps listening, for ``bench/overhead --cluster``: one per proxy of
the cluster pair, each reading every line its proxy sends, as a cluster's broker does.

Usage: cluster_broker.py SOCKET CONFIG_JSON

CONFIG_JSON: {"facade_port": P, "backend": [HOST, PORT] or null, "nodes": [DirectoryNode...],
"model": M, "owners": [hostUuid...]}. The setup is ``nvpair_proxy.testing.netns``'s, with its
``ScriptedBroker``: ``facade/enable`` on P, ``ollama:node/set-local-backend`` when a backend is
given, an ``ollama:discovery:nodes`` snapshot of ``nodes``, then ``ollama:node/model-owners``
asked until it names exactly ``owners``; it prints ``broker ready``.

Then it reads the link until the proxy closes it, counting lines and, per target, the
``ollama:proxy/request`` events (and their statuses). A line ``count`` on stdin is answered
with ``counts {json}`` on stdout; the last counts are printed at the end. Unix socket only;
every wait is bounded.
"""

from __future__ import annotations

import json
import os
import selectors
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nvpair_proxy.testing.netns import ScriptedBroker  # noqa: E402


def main() -> int:
    path, config = sys.argv[1], json.loads(sys.argv[2])
    broker = ScriptedBroker(path)
    print("broker listening", flush=True)
    broker.accept(30)
    result = broker.call(
        "facade/enable",
        {"engine": "ollama", "port": config["facade_port"], "ignorePersistedPort": True},
    )
    if result.get("port") != config["facade_port"]:
        raise SystemExit(f"broker: facade/enable answered {result}")
    if config.get("backend"):
        host, port = config["backend"]
        broker.call(
            "ollama:node/set-local-backend",
            {"engine": "ollama", "host": host, "port": port, "healthy": True},
        )
    nodes = [dict(n, lastSeen=int(time.time())) for n in config["nodes"]]
    broker.send("ollama:discovery:nodes", {"nodes": nodes}, request=False)
    want = set(config["owners"])
    deadline = time.monotonic() + 30
    while True:
        got = set(broker.call("ollama:node/model-owners", {"model": config["model"]})["nodes"])
        if got == want:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"broker: owners {sorted(got)}, want {sorted(want)}")
        broker.pump(0.05)
    counts: dict = {"lines": len(broker.messages), "requests": {}, "statuses": {}}
    print("broker ready", flush=True)

    # Drain: raw reads, lines split here, only proxy/request lines parsed.
    fd = broker.conn.fileno()
    pending = broker.reader.buffer
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ, "proxy")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")

    def take(lines: list[bytes]) -> None:
        counts["lines"] += len(lines)
        for line in lines:
            if b'ollama:proxy/request"' in line:
                params = json.loads(line).get("params", {})
                target = str(params.get("target"))
                counts["requests"][target] = counts["requests"].get(target, 0) + 1
                status = str(params.get("status"))
                counts["statuses"][status] = counts["statuses"].get(status, 0) + 1

    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                line = sys.stdin.readline()
                if not line:
                    selector.unregister(sys.stdin.fileno())
                elif line.strip() == "count":
                    print(f"counts {json.dumps(counts)}", flush=True)
                continue
            data = os.read(fd, 1 << 20)
            if not data:
                if pending.strip():
                    take([pending])
                print(f"counts {json.dumps(counts)}", flush=True)
                return 0
            pending += data
            *lines, pending = pending.split(b"\n")
            take(lines)


if __name__ == "__main__":
    sys.exit(main())
