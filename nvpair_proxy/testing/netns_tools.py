"""Small stdlib-only programs the multi-host fixture runs inside a host's network namespace
(``ip netns exec NS python netns_tools.py MODE JSON``): they start fast and import nothing
of the product, so what they see is exactly what crossed the namespace's interfaces.

Modes:

- ``request``: one or more HTTP/1.1 requests (plaintext or TLS with a client certificate and
  an optional server pin), all started at once. Prints ``{"event": "body"}`` when the first
  one received its first body byte, then one JSON line with every result: status, headers,
  the raw body as received (de-chunked), whether it was complete, the error if any.
- ``impostor``: a TLS server presenting a given certificate; prints one JSON line per
  connection saying whether the handshake completed and what bytes arrived.
- ``relay``: a TCP relay that delays each direction by a fixed time (the fallback when
  ``tc netem`` is missing); prints ``{"event": "ready"}`` once listening.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import socket
import ssl
import sys
import threading
import time


def emit(value: dict) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


# -- request ------------------------------------------------------------------------------


class _Printed:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first_body = False

    def body(self) -> None:
        with self.lock:
            if not self.first_body:
                self.first_body = True
                emit({"event": "body"})


def _connect(spec: dict) -> socket.socket:
    sock = socket.create_connection((spec["host"], spec["port"]), timeout=spec.get("timeout", 30))
    tls = spec.get("tls")
    if not tls:
        return sock
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls["cert"], tls["key"])
    wrapped = context.wrap_socket(sock)
    pin = tls.get("pin_sha256")
    if pin:
        got = hashlib.sha256(wrapped.getpeercert(binary_form=True) or b"").hexdigest()
        if got != pin:
            wrapped.close()
            raise ssl.SSLError(f"server certificate {got} is not the pin {pin}")
    return wrapped


def _parse(raw: bytes) -> dict:
    """Status, headers and body of what arrived; ``complete`` when the framing ended."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return {"status": None, "headers": {}, "body": "", "complete": False}
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), value.strip())
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body, complete = b"", False
        while True:
            size_line, sep, after = rest.partition(b"\r\n")
            if not sep:
                break
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError:
                break
            if size == 0:
                complete = True
                break
            body += after[:size]
            if len(after) < size + 2:
                break
            rest = after[size + 2 :]
    elif "content-length" in headers:
        length = int(headers["content-length"])
        body, complete = rest[:length], len(rest) >= length
    else:
        body, complete = rest, True
    return {
        "status": status,
        "headers": headers,
        "body": body.decode("latin-1"),
        "complete": complete,
    }


def _one(spec: dict, printed: _Printed, results: list, index: int) -> None:
    start = time.monotonic()
    raw, error = b"", None
    try:
        sock = _connect(spec)
        body = spec.get("body", "").encode()
        headers = {
            "Host": f"{spec['host']}:{spec['port']}",
            "Connection": "close",
            "Content-Length": str(len(body)),
            **spec.get("headers", {}),
        }
        if body:
            headers.setdefault("Content-Type", "application/json")
        request = f"{spec.get('method', 'POST')} {spec['path']} HTTP/1.1\r\n"
        request += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(request.encode() + body)
        while True:
            data = sock.recv(65536)
            if not data:
                break
            raw += data
            if b"\r\n\r\n" in raw and raw.index(b"\r\n\r\n") + 4 < len(raw):
                printed.body()
        sock.close()
    except (OSError, ssl.SSLError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    result = _parse(raw)
    result.update(error=error, elapsed=round(time.monotonic() - start, 3))
    results[index] = result


def request(config: dict) -> int:
    specs = config["requests"]
    printed = _Printed()
    results: list = [None] * len(specs)
    threads = [
        threading.Thread(target=_one, args=(spec, printed, results, i), daemon=True)
        for i, spec in enumerate(specs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    emit({"event": "done", "results": results})
    return 0


# -- impostor -----------------------------------------------------------------------------


def impostor(config: dict) -> int:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config["cert"], config["key"])
    listener = socket.create_server((config["host"], config["port"]))
    emit({"event": "ready"})
    while True:
        conn, peer = listener.accept()
        conn.settimeout(5)
        record = {"event": "connection", "peer": peer[0], "handshake": False, "received": ""}
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                record["handshake"] = True
                data = tls.recv(65536)
                record["received"] = data.decode("latin-1")
                if data:
                    tls.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nimpostor"
                    )
        except (OSError, ssl.SSLError) as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        emit(record)


# -- relay --------------------------------------------------------------------------------


async def _pump(reader, writer, delay: float) -> None:
    """Copy one direction, each chunk released ``delay`` after it arrived, order kept: the
    chunks wait in a queue and one loop timer, set for the head's due time, releases them."""
    loop = asyncio.get_running_loop()
    queue: collections.deque = collections.deque()
    timer: list = []
    done = loop.create_future()

    def release() -> None:
        timer.clear()
        while queue and queue[0][0] <= loop.time():
            _, data = queue.popleft()
            if data is None:
                try:
                    writer.write_eof()
                except OSError:
                    writer.close()
                if not done.done():
                    done.set_result(None)
                return
            writer.write(data)
        if queue:
            timer.append(loop.call_at(queue[0][0], release))

    try:
        while True:
            data = await reader.read(65536)
            queue.append((loop.time() + delay, data or None))
            if not timer:
                timer.append(loop.call_at(queue[0][0], release))
            if not data:
                break
        await done
    except (OSError, asyncio.CancelledError):
        for handle in timer:
            handle.cancel()
        writer.close()


async def _relay(config: dict) -> None:
    delay = config["delay"]

    async def handle(client_reader, client_writer):
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                config["target_host"], config["target_port"]
            )
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            _pump(client_reader, upstream_writer, delay),
            _pump(upstream_reader, client_writer, delay),
            return_exceptions=True,
        )
        upstream_writer.close()
        client_writer.close()

    server = await asyncio.start_server(handle, config["host"], config["port"])
    emit({"event": "ready"})
    async with server:
        await server.serve_forever()


def relay(config: dict) -> int:
    asyncio.run(_relay(config))
    return 0


def main(argv: list[str]) -> int:
    modes = {"request": request, "impostor": impostor, "relay": relay}
    if len(argv) != 2 or argv[0] not in modes:
        print(f"usage: netns_tools.py {{{','.join(modes)}}} JSON", file=sys.stderr)
        return 2
    return modes[argv[0]](json.loads(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
