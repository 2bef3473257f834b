"""bench/scale's fake Ollama fleet.

Run as ``python bench/scale_support.py engine PORTS MODEL``: one Twisted process listening on
PORTS ports of 127.0.0.1 (each port a node), raw HTTP/1.1 with keep-alive, answers
pre-rendered, so the fleet is never what a measurement waits on. It prints one line,
``engine ready ctl=PORT ports=P1,P2,...``, and then serves:

- ``GET /api/ps`` (the proxy's engine-truth read for Ollama): the model loaded; every read's
  time (CLOCK_MONOTONIC, the same clock as the bench's ``time.monotonic``) is recorded;
- ``GET /api/tags``: the model list;
- ``POST /api/chat``: a JSON answer at once (``"stream": false``), or an NDJSON stream of
  ``x_tokens`` tokens (default 10), one a second per stream. Extra body fields steer it:
  ``x_seq`` (recorded, in the order requests arrive), ``x_hold`` (no answer until ``release``),
  ``x_gate`` (a stream sends its headers, then waits for ``go`` before its first token).

Streams are ticked from one timer every 50 ms, each stream in one of 20 phases, so a
second's tokens are spread over the second rather than sent in one burst.

The control port takes one command a line and answers one JSON line: ``state`` (counters),
``truth`` (the truth reads' times since the last ``reset``), ``order`` (the ``x_seq`` values
in arrival order), ``reset``, ``release`` (answer every held request), ``release1`` (answer
the first held one), ``go`` (start the gated streams; later gated ones start at once).
"""

from __future__ import annotations

import json
import sys
import time

TICK = 0.05
PHASES = 20  # ticks a second: a stream's token every PHASES ticks
#: The engine's counters that ``reset`` zeroes.
COUNTS = ("requests", "streams_started", "streams_done", "streams_lost", "tokens")


# -- the fake engine -------------------------------------------------------------------------


def _engine(ports: int, model: str) -> None:
    # Run as a script from bench/, whose framing helpers the fake engine of bench/overhead has.
    from fake_engine import NDJSON_HEAD, STAMP, chunk, json_response, ollama_chat
    from twisted.internet import reactor, task
    from twisted.internet.protocol import Factory, Protocol
    from twisted.protocols.basic import LineReceiver

    ps = json_response(
        json.dumps(
            {
                "models": [
                    {
                        "name": model,
                        "model": model,
                        "size": 1,
                        "digest": "0" * 64,
                        "details": {},
                        "expires_at": "2099-01-01T00:00:00Z",
                        "size_vram": 1,
                    }
                ]
            }
        ).encode()
    )
    tags = json_response(
        json.dumps(
            {
                "models": [
                    {"name": model, "model": model, "modified_at": STAMP, "size": 1, "details": {}}
                ]
            }
        ).encode()
    )
    whole = json_response(ollama_chat(model, "tok tok tok tok", 4))
    stream_head = NDJSON_HEAD
    token = chunk(ollama_chat(model, "tok ") + b"\n")

    def last(tokens: int) -> bytes:
        return chunk(ollama_chat(model, "", tokens) + b"\n") + b"0\r\n\r\n"

    not_found = json_response(b'{"error":"not found"}', status=b"404 Not Found")
    state = {
        "truth": [],
        "order": [],
        "held": [],
        "gated": [],
        "requests": 0,
        "streams_started": 0,
        "streams_done": 0,
        "streams_lost": 0,
        "tokens": 0,
        "gate_open": False,  # after "go" a gated stream starts at once
    }
    phases: list[list] = [[] for _ in range(PHASES)]
    clock = {"tick": 0}

    class Stream:
        __slots__ = ("proto", "left", "total")

        def __init__(self, proto, tokens: int) -> None:
            self.proto, self.left, self.total = proto, tokens, tokens

    class Engine(Protocol):
        def connectionMade(self) -> None:
            self.buffer = b""
            self.busy = False  # a held or streaming answer owns the connection
            self.gone = False

        def connectionLost(self, reason=None) -> None:
            self.gone = True

        def dataReceived(self, data: bytes) -> None:
            self.buffer += data
            while not self.busy:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buffer[:end].decode("latin-1")
                lines = head.split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                if len(self.buffer) < end + 4 + length:
                    return
                body = self.buffer[end + 4 : end + 4 + length]
                self.buffer = self.buffer[end + 4 + length :]
                self.handle(method, path, body)

        def handle(self, method: str, path: str, body: bytes) -> None:
            write = self.transport.write
            if path == "/api/ps":
                state["truth"].append(time.monotonic())
                write(ps)
            elif path == "/api/tags":
                write(tags)
            elif method == "POST" and path == "/api/chat":
                state["requests"] += 1
                request = json.loads(body)
                if "x_seq" in request:
                    state["order"].append(request["x_seq"])
                if request.get("x_hold"):
                    self.busy = True
                    state["held"].append(self)
                elif request.get("stream", True):
                    self.busy = True
                    write(stream_head)
                    stream = Stream(self, int(request.get("x_tokens", 10)))
                    state["streams_started"] += 1
                    if request.get("x_gate") and not state["gate_open"]:
                        state["gated"].append(stream)
                    else:
                        phases[clock["tick"] % PHASES].append(stream)
                else:
                    write(whole)
            else:
                write(not_found)

        def finished(self) -> None:
            self.busy = False
            if self.buffer and not self.gone:
                self.dataReceived(b"")

    def tick() -> None:
        clock["tick"] += 1
        bucket = phases[clock["tick"] % PHASES]
        keep = []
        for stream in bucket:
            proto = stream.proto
            if proto.gone:
                state["streams_lost"] += 1
                continue
            if stream.left > 0:
                stream.left -= 1
                state["tokens"] += 1
                proto.transport.write(token)
                keep.append(stream)
            else:
                proto.transport.write(last(stream.total))
                state["streams_done"] += 1
                proto.finished()
        bucket[:] = keep

    class Control(LineReceiver):
        delimiter = b"\n"

        def lineReceived(self, line: bytes) -> None:
            command = line.decode().strip()
            answer: object = {"ok": True}
            if command == "state":
                answer = {
                    key: (len(value) if isinstance(value, list) else value)
                    for key, value in state.items()
                }
                answer["open_streams"] = sum(len(b) for b in phases) + len(state["gated"])
            elif command == "truth":
                answer = state["truth"]
            elif command == "order":
                answer = state["order"]
            elif command == "reset":
                state["truth"] = []
                state["order"] = []
                for key in COUNTS:
                    state[key] = 0
            elif command in ("release", "release1"):
                count = 1 if command == "release1" else len(state["held"])
                held = state["held"][:count]
                del state["held"][:count]
                for proto in held:
                    if not proto.gone:
                        proto.transport.write(whole)
                        proto.finished()
                answer = {"released": len(held)}
            elif command == "go":
                gated, state["gated"] = state["gated"], []
                state["gate_open"] = True
                for index, stream in enumerate(gated):
                    phases[index % PHASES].append(stream)
                answer = {"started": len(gated)}
            self.sendLine(json.dumps(answer).encode())

    engine_factory = Factory.forProtocol(Engine)
    listening = [reactor.listenTCP(0, engine_factory, backlog=4096, interface="127.0.0.1")]
    for _ in range(ports - 1):
        listening.append(reactor.listenTCP(0, engine_factory, backlog=4096, interface="127.0.0.1"))
    control = reactor.listenTCP(0, Factory.forProtocol(Control), interface="127.0.0.1")
    task.LoopingCall(tick).start(TICK, now=False)
    numbers = ",".join(str(port.getHost().port) for port in listening)
    sys.stdout.write(f"engine ready ctl={control.getHost().port} ports={numbers}\n")
    sys.stdout.flush()
    reactor.run()


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "engine":
        try:
            from twisted.internet import epollreactor

            epollreactor.install()
        except Exception:
            pass
        _engine(int(argv[1]), argv[2])
        return 0
    sys.stderr.write("usage: scale_support.py engine PORTS MODEL\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
