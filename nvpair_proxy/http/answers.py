"""The HTTP answers the proxy generates itself (docs/references.md#proxy-answers), byte for byte in
one place."""

from __future__ import annotations

import enum
import json

from twisted.web.http_headers import Headers
from twisted.web.server import Request

from .hopbyhop import end_to_end

JSON_HEADERS = ((b"Content-Type", b"application/json"), (b"X-Content-Type-Options", b"nosniff"))

BODY_TOO_LARGE = "request body exceeds 32 MiB limit"
# A request read one way only (server.py): these texts, then why.
BAD_TARGET = "invalid request target"
BAD_FRAMING = "invalid request framing"
INVENTORY_UNAVAILABLE = "model inventory unavailable"
ORIGIN_DENIED = "origin not allowed by every engine"
SHUTTING_DOWN = "the proxy is shutting down"
NO_PREFLIGHT_ANSWER = "no engine answered the preflight"
LOOPBACK_ONLY = (
    "loopback-only",
    "plaintext requests are accepted only from loopback; cluster peers must use the mTLS ingress",
)
# Opt-in LAN keys (docs/references.md#lan-keys): the allowlist refusal, and the missing or wrong
# key.
SOURCE_NOT_ALLOWED = ("source-not-allowed", "this source address is not allowed to use this proxy")
UNAUTHORIZED = (
    "unauthorized",
    "a valid API key is required for non-loopback requests; "
    "send it as Authorization: Bearer <key> or X-Api-Key: <key>",
)
# The mutual-TLS ingress's refusals (their codes are what the admin listener counts by).
CLUSTER_AUTH = ("cluster-auth", "client certificate is not a pinned member of this node's cluster")
NO_LOCAL_BACKEND = "no-local-backend"
# A request that already passed through this process (its own token in Via, loopguard.py).
FORWARDING_LOOP = "forwarding loop: this request already passed through this proxy"
# The identity probe's 409 (docs/references.md#identity-probe): this text, then the engine's id.
FACADE_FOR = "this port is the nvpair-proxy facade for "


class Reason(enum.Enum):
    """Why a request did not complete: the exact text it is reported with (on ``proxy/request``,
    in the workload's ``error``, in the answer's body), or the fixed start of it when a detail
    follows, and the label the admin listener counts it by (a bounded vocabulary).

    A request's end carries one of these, so nothing reads a reason back out of a sentence.
    """

    # Answers before routing (the code is what proxy/request carries for the coded ones).
    UNAUTHORIZED = (UNAUTHORIZED[0], "unauthorized")
    LOOPBACK_ONLY = (LOOPBACK_ONLY[0], "loopback_only")
    SOURCE_NOT_ALLOWED = (SOURCE_NOT_ALLOWED[0], "source_not_allowed")
    CLUSTER_AUTH = (CLUSTER_AUTH[0], "cluster_auth")
    NO_LOCAL_BACKEND = (NO_LOCAL_BACKEND, "no_local_backend")
    SHUTTING_DOWN = (SHUTTING_DOWN, "shutting_down")
    BODY_TOO_LARGE = (BODY_TOO_LARGE, "body_too_large")
    IDENTITY_PROBE = (FACADE_FOR, "identity_probe")
    FORWARDING_LOOP = (FORWARDING_LOOP, "forwarding_loop")
    BAD_TARGET = (BAD_TARGET + ": ", "bad_request")
    BAD_FRAMING = (BAD_FRAMING + ": ", "bad_request")
    # The fleet's own answers (model list, preflight).
    INVENTORY_UNAVAILABLE = (INVENTORY_UNAVAILABLE, "inventory_unavailable")
    ORIGIN_DENIED = (ORIGIN_DENIED, "origin_denied")
    NO_PREFLIGHT_ANSWER = (NO_PREFLIGHT_ANSWER, "no_preflight_answer")
    # Routing and dispatch (docs/references.md#proxy-answers).
    NO_OWNER = ("no available node advertises the requested model", "no_owner")
    NO_CANDIDATE = ("no active node selected or available", "no_candidate")
    ALL_OWNERS_BUSY = ("every node advertising the requested model is busy; retry shortly", "busy")
    DEADLINE_PASSED = (
        "the retry deadline passed while dispatch attempts were still failing",
        "deadline",
    )
    NO_OWNER_RETURNED = (
        "no node advertising the requested model became available before the retry deadline",
        "owner_never_returned",
    )
    EVERY_ATTEMPT_FAILED = ("every dispatch attempt failed", "attempts_exhausted")
    # Late binding: a request that waited in the queue for a free slot until its deadline.
    NO_FREE_SLOT = (
        "no slot became free on a node advertising the requested model before "
        "the retry deadline; retry later",
        "queue_deadline",
    )
    NO_CONTENT = (
        "upstream error: upstream sent no response body within the first-byte budget",
        "no_content",
    )
    TRANSPORT = ("upstream error: ", "transport")
    UPSTREAM_STATUS = ("upstream returned HTTP ", "upstream_status")
    # How a request in flight ended without an answer of its own (docs/references.md#end-texts).
    CLIENT_GONE = ("client disconnected before completion", "client_gone")
    SHUTDOWN = ("request cancelled before completion", "shutdown")
    BACKSTOP = ("request handler exited before completion", "internal")
    INTERNAL = ("internal error", "internal")

    def __init__(self, text: str, label: str) -> None:
        self.text, self.label = text, label

    def says(self, detail: object = "") -> str:
        """The text reported: the fixed part, then ``detail`` for the reasons that carry one."""
        return f"{self.text}{detail}" if detail != "" else self.text


# The labels a request that did not complete is counted under: the reasons', a status's when
# an engine's own answer was relayed (no reason of ours), and ``other``.
OTHER = "other"
STATUS_LABELS = {
    400: "bad_request",
    401: "unauthorized",
    409: "identity_probe",
    413: "body_too_large",
    499: "client_gone",
}
LABELS = frozenset({*(reason.label for reason in Reason), *STATUS_LABELS.values(), OTHER})


_REASONS = {
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    409: b"Conflict",
    413: b"Request Entity Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    508: b"Loop Detected",
}


def error_body(text: str, code: str | None = None) -> bytes:
    body = {"error": text}
    if code is not None:
        body["code"] = code
    return json.dumps(body).encode()


def send_error(
    request: Request,
    status: int,
    text: str,
    *,
    code: str | None = None,
    retry_after: int = 0,
    headers: Headers | None = None,
) -> None:
    """Answer ``{"error": text}`` and finish.

    A proxy error grants no CORS permission of its own (docs/references.md#browser-policy):
    ``headers`` carries only what the engines themselves said (the combined permission of an invalid
    inventory, the policy of the engine that refused an origin).
    """
    body = error_body(text, code)
    # twisted.web knows no phrase for 508 (RFC 5842): without one the line says "Unknown Status".
    request.setResponseCode(status, _REASONS.get(status))
    for name, values in (headers or Headers()).getAllRawHeaders():
        request.responseHeaders.setRawHeaders(name, list(values))
    for name, value in JSON_HEADERS:
        request.responseHeaders.setRawHeaders(name, [value])
    if retry_after:
        request.responseHeaders.setRawHeaders(b"Retry-After", [str(retry_after).encode()])
    request.responseHeaders.setRawHeaders(b"Content-Length", [str(len(body)).encode()])
    if request.method != b"HEAD":
        request.write(body)
    request.finish()


def send_whole(
    request: Request, status: int, headers: Headers, body: bytes, phrase: bytes | None = None
) -> None:
    """Answer with a response read whole (an engine's, or one the proxy put together).

    Only hop-by-hop headers and the framing are replaced; nothing is added, not even a
    default Content-Type, so an engine's answer reaches the browser as the engine sent it.
    """
    request.setResponseCode(status, phrase)
    request.defaultContentType = None
    for name, values in end_to_end(headers, drop=(b"content-length",)).getAllRawHeaders():
        request.responseHeaders.setRawHeaders(name, list(values))
    if status not in (204, 304):
        request.responseHeaders.setRawHeaders(b"Content-Length", [str(len(body)).encode()])
        if request.method != b"HEAD":
            request.write(body)
    request.finish()


def answer_internal_error(request: Request) -> None:
    """500 when nothing was sent yet; otherwise drop the connection, so the client sees a broken
    response rather than a complete-looking one (docs/references.md#request-containment).
    ``request`` is a ``server.BoundedRequest``: ``client_gone`` says the client already left
    (notifyFinish). Typed as the Request it extends: server.py builds on this module, not the
    other way."""
    if not request.startedWriting and not request.finished and not request.client_gone:  # type: ignore[attr-defined]
        send_error(request, 500, "internal error")
    elif not request.finished and request.channel is not None:
        # The channel's TCP or TLS transport (both abort), while the request is not finished.
        request.channel.transport.abortConnection()  # type: ignore[union-attr]


def raw_error(status: int, text: str, code: str | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers given mid-parse."""
    body = error_body(text, code)
    head = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error"))]
    head += [name + b": " + value for name, value in JSON_HEADERS]
    head += [b"Content-Length: %d" % len(body), b"Connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body
