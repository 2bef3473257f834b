#!/usr/bin/env python3
"""A broker that listens, for ``bench/overhead --broker``: our proxy in broker mode, so every
workload and request event is built, encoded and sent, as in a cluster.

Usage: listening_broker.py SOCKET FACADE_PORT ENGINE_PORT MODEL

It listens on SOCKET (the proxy's ``--ipc``), enables the ollama facade on FACADE_PORT, points
the local backend at the engine, names this node in a discovery snapshot as MODEL's owner,
waits until the proxy does too,
prints ``broker ready``, then reads (and counts) every line the proxy sends until it closes.
Loopback and a Unix socket only; every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def main() -> int:
    path, facade_port, engine_port, model = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(30)
    print("broker listening", flush=True)
    conn, _ = listener.accept()
    lines = conn.makefile("rb")
    seen = {"lines": 0}
    next_id = [0]

    def call(method: str, params: dict) -> dict:
        next_id[0] += 1
        conn.sendall(
            json.dumps(
                {"jsonrpc": "2.0", "id": next_id[0], "method": method, "params": params}
            ).encode()
            + b"\n"
        )
        conn.settimeout(30)
        while True:
            line = lines.readline()
            if not line:
                raise SystemExit(f"broker: the proxy closed the link during {method}")
            seen["lines"] += 1
            message = json.loads(line)
            if message.get("id") == next_id[0]:
                if "error" in message:
                    raise SystemExit(f"broker: {method}: {message['error']}")
                return message["result"]

    call("facade/enable", {"engine": "ollama", "port": facade_port, "ignorePersistedPort": True})
    call(
        "ollama:node/set-local-backend",
        {"engine": "ollama", "host": "127.0.0.1", "port": engine_port, "healthy": True},
    )
    # This node as discovery names it (a local address with the facade's port is self,
    # reached through the local backend), advertising the model.
    conn.sendall(
        json.dumps(
            {
                "jsonrpc": "2.0",
                "method": "ollama:discovery:nodes",
                "params": {
                    "nodes": [
                        {
                            "hostUuid": "bench-node",
                            "name": "bench",
                            "ip": "127.0.0.1",
                            "ips": ["127.0.0.1"],
                            "services": {"ol": {"port": facade_port}},
                            "models": [model],
                            "modelsByEngine": {"ollama": [model]},
                            "lastSeen": int(time.time()),
                        }
                    ]
                },
            }
        ).encode()
        + b"\n"
    )
    deadline = time.monotonic() + 30
    while not call("ollama:node/model-owners", {"model": model})["nodes"]:
        if time.monotonic() > deadline:
            raise SystemExit("broker: the engine never became the model's owner")
        time.sleep(0.1)
    print("broker ready", flush=True)
    conn.settimeout(None)
    while lines.readline():
        seen["lines"] += 1
    print(f"broker: {seen['lines']} lines read", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
