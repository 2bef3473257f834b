"""The HTTP answers the proxy generates itself (protocol 5), byte for byte in one place."""

from __future__ import annotations

import json

from twisted.web.server import Request

JSON_HEADERS = ((b"Content-Type", b"application/json"), (b"X-Content-Type-Options", b"nosniff"))

BODY_TOO_LARGE = "request body exceeds 32 MiB limit"
LOOPBACK_ONLY = ("loopback-only", "plaintext requests are accepted only from loopback; "
                 "cluster peers must use the mTLS ingress")

_REASONS = {403: b"Forbidden", 409: b"Conflict", 413: b"Request Entity Too Large",
            500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable",
            504: b"Gateway Timeout"}


def error_body(text: str, code: str | None = None) -> bytes:
    body = {"error": text}
    if code is not None:
        body["code"] = code
    return json.dumps(body).encode()


def send_error(request: Request, status: int, text: str, *, code: str | None = None,
               retry_after: bool = False) -> None:
    """Answer ``{"error": text}`` and finish; no CORS permission is ever granted here."""
    body = error_body(text, code)
    request.setResponseCode(status)
    for name, value in JSON_HEADERS:
        request.responseHeaders.setRawHeaders(name, [value])
    if retry_after:
        request.responseHeaders.setRawHeaders(b"Retry-After", [b"1"])
    request.responseHeaders.setRawHeaders(b"Content-Length", [str(len(body)).encode()])
    if request.method != b"HEAD":
        request.write(body)
    request.finish()


def raw_error(status: int, text: str, code: str | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers given mid-parse."""
    body = error_body(text, code)
    head = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error"))]
    head += [name + b": " + value for name, value in JSON_HEADERS]
    head += [b"Content-Length: %d" % len(body), b"Connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body
