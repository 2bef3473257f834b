"""A fake LLM engine for bench/overhead that is never the bottleneck.

Raw asyncio HTTP/1.1 with keep-alive (no web framework), every answer pre-rendered and cached:

- ``GET /api/tags``: the model list (Ollama envelope); ``GET /v1/models``: the OpenAI one;
- ``POST /api/chat``: Ollama; JSON when ``"stream": false``, NDJSON otherwise (Ollama's default);
- ``POST /v1/chat/completions``: OpenAI; SSE when ``"stream": true``, JSON otherwise.

Two extra request fields steer the answer: ``x_tokens`` (tokens in the answer, default 8) and
``x_delay_ms`` (a delay before each token, default 0). Streams go out as one chunked-encoding
chunk per token, each its own write. Usage: python bench/fake_engine.py PORT MODEL...
Prints "engine ready PORT" once listening, on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import sys

MODELS: list[str] = []
CACHE: dict = {}


def _tags() -> bytes:
    return json.dumps(
        {
            "models": [
                {
                    "name": m,
                    "model": m,
                    "modified_at": "2024-01-01T00:00:00Z",
                    "size": 1,
                    "digest": "0" * 64,
                    "details": {},
                }
                for m in MODELS
            ]
        }
    ).encode()


def _openai_models() -> bytes:
    return json.dumps(
        {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "bench"} for m in MODELS
            ],
        }
    ).encode()


def json_response(
    body: bytes, content_type: bytes = b"application/json", status: bytes = b"200 OK"
) -> bytes:
    """A whole HTTP/1.1 answer with a Content-Length (bench/scale_support.py's engine too)."""
    return b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        status,
        content_type,
        len(body),
        body,
    )


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


#: Every answer's creation time: fixed, so that an answer is rendered once.
STAMP = "2024-01-01T00:00:00Z"
#: The head of a chunked NDJSON stream (Ollama's).
NDJSON_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def ollama_chat(model: str, content: str, done_tokens: int | None = None) -> bytes:
    """One Ollama ``/api/chat`` object: a streamed token (``done_tokens`` None), else an
    answer's last object or a whole answer, with its stats (``done_tokens`` generated)
    (bench/scale_support.py's engine too)."""
    answer: dict = {
        "model": model,
        "created_at": STAMP,
        "message": {"role": "assistant", "content": content},
        "done": done_tokens is not None,
    }
    if done_tokens is not None:
        answer.update(
            done_reason="stop",
            total_duration=1000,
            prompt_eval_count=8,
            eval_count=done_tokens,
            eval_duration=1000,
        )
    return json.dumps(answer).encode()


def render(path: bytes, stream: bool, tokens: int, model: str):
    """(head, [chunk, ...]) for a stream, (whole response, None) otherwise; cached."""
    key = (path, stream, tokens, model)
    hit = CACHE.get(key)
    if hit is not None:
        return hit
    if path == b"/api/chat":
        if not stream:
            hit = (json_response(ollama_chat(model, "tok " * tokens, tokens)), None)
        else:
            parts = [ollama_chat(model, "tok ") + b"\n" for _ in range(tokens)]
            parts.append(ollama_chat(model, "", tokens) + b"\n")
            hit = (NDJSON_HEAD, [chunk(p) for p in parts])
    else:  # /v1/chat/completions
        if not stream:
            body = json.dumps(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 1700000000,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "tok " * tokens},
                        }
                    ],
                    "usage": {
                        "prompt_tokens": 8,
                        "completion_tokens": tokens,
                        "total_tokens": 8 + tokens,
                    },
                }
            ).encode()
            hit = (json_response(body), None)
        else:

            def event(delta, finish=None, usage=None):
                obj = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 1700000000,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
                if usage:
                    obj["usage"] = usage
                return b"data: " + json.dumps(obj).encode() + b"\n\n"

            parts = [event({"content": "tok "}) for _ in range(tokens)]
            parts.append(
                event(
                    {},
                    "stop",
                    {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
                )
                + b"data: [DONE]\n\n"
            )
            head = (
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            hit = (head, [chunk(p) for p in parts])
    CACHE[key] = hit
    return hit


NOT_FOUND = (
    b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
)


class Engine(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buf = b""
        self.busy = False
        self.closed = False

    def connection_lost(self, exc) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.process()

    def process(self) -> None:
        while not self.busy and not self.closed:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].split(b"\r\n")
            method, path = lines[0].split(b" ", 2)[:2]
            length, chunked = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
            rest = self.buf[end + 4 :]
            if chunked:
                body, pos = b"", 0
                while True:
                    eol = rest.find(b"\r\n", pos)
                    if eol < 0:
                        return
                    size = int(rest[pos:eol].split(b";")[0], 16)
                    if len(rest) < eol + 2 + size + 2:
                        return
                    body += rest[eol + 2 : eol + 2 + size]
                    pos = eol + 2 + size + 2
                    if size == 0:
                        break
                self.buf = rest[pos:]
            else:
                if len(rest) < length:
                    return
                body, self.buf = rest[:length], rest[length:]
            self.answer(method, path.split(b"?")[0], body)

    def answer(self, method: bytes, path: bytes, body: bytes) -> None:
        write = self.transport.write
        if method == b"GET" and path == b"/api/tags":
            write(CACHE.setdefault("tags", json_response(_tags())))
            return
        if method == b"GET" and path == b"/v1/models":
            write(CACHE.setdefault("models", json_response(_openai_models())))
            return
        if method != b"POST" or path not in (b"/api/chat", b"/v1/chat/completions"):
            write(NOT_FOUND)
            return
        try:
            req = json.loads(body) if body else {}
        except ValueError:
            req = {}
        stream = bool(req.get("stream", path == b"/api/chat"))
        tokens = int(req.get("x_tokens", 8))
        delay = float(req.get("x_delay_ms", 0)) / 1000.0
        head, chunks = render(path, stream, tokens, str(req.get("model", MODELS[0])))
        if chunks is None:
            write(head)
            return
        write(head)
        if delay <= 0:
            for chunk in chunks:
                write(chunk)
            write(b"0\r\n\r\n")
            return
        self.busy = True
        asyncio.get_running_loop().create_task(self.paced(chunks, delay))

    async def paced(self, chunks, delay: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        for chunk in chunks:
            due += delay
            pause = due - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)
            if self.closed:
                return
            self.transport.write(chunk)
        self.transport.write(b"0\r\n\r\n")
        self.busy = False
        self.process()


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Engine, "127.0.0.1", port, backlog=4096)
    print(f"engine ready {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    MODELS.extend(sys.argv[2:] or ["bench:latest"])
    try:
        asyncio.run(main(int(sys.argv[1])))
    except KeyboardInterrupt:
        pass
