#!/usr/bin/env python3
"""A minimal round-robin proxy: bench/fleet's baseline, what a user would otherwise pick.

Each request, whatever its path, goes to the next node in turn (a counter under a lock, nothing
else: no queue, no health check, no retry), its body passed through, and the node's answer is
streamed back as it comes (status, content type, then each chunk the node sends, the connection
closed at the end). Standard library only, one thread per connection.

Usage: python bench/round_robin.py --port N --node HOST:PORT [--node HOST:PORT ...]
Prints ``round-robin ready on PORT`` once listening. Loopback only: it listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Request headers not passed on (hop-by-hop, or ours to set).
DROPPED = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "proxy-connection",
    "te",
    "upgrade",
}
TIMEOUT = 600.0


def node(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]") or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a loopback HOST:PORT")
    return host.strip("[]"), int(port)


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.0 answers: no length needed, the end of the stream is the end of the connection.
    protocol_version = "HTTP/1.0"
    nodes: itertools.cycle
    lock = threading.Lock()

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def forward(self) -> None:
        with self.lock:
            host, port = next(self.nodes)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in DROPPED}
        upstream = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
        try:
            upstream.request(self.command, self.path, body, headers)
            response = upstream.getresponse()
            self.send_response(response.status)
            for key in ("Content-Type", "Cache-Control"):
                if response.getheader(key):
                    self.send_header(key, response.getheader(key))
            self.end_headers()
            while True:
                chunk = response.read1(65536)
                if not chunk:
                    break
                self.wfile.write(chunk)
                self.wfile.flush()
        except OSError:
            pass  # the node or the client went away: the connection ends, as a user's would
        finally:
            upstream.close()

    do_GET = do_POST = do_PUT = do_DELETE = forward


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/round_robin.py", allow_abbrev=False, description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=int, required=True, help="the port to listen on")
    parser.add_argument(
        "--node",
        type=node,
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="a node, in rotation order (repeat)",
    )
    args = parser.parse_args(argv)
    Handler.nodes = itertools.cycle(args.node)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"round-robin ready on {args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
