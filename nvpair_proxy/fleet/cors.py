"""Browser policy (docs/references.md#browser-policy): what a browser may do through a facade that
fronts many engines.

Each engine has its own CORS policy, and a facade must not be more permissive than any of
them. A preflight only one engine was asked is that engine's answer, passed through
untouched, missing headers and denials included. An answer several engines were asked for (a
preflight fanned out to the fleet, a merged model list) carries only what every responding
engine granted: an origin, a method or a header is allowed only if all of them allow it, and a
denial from any one of them is what the browser sees, never rewritten into a permission. The
proxy's own errors grant nothing.
Nothing here is cached: every preflight asks the engines again.
"""

from __future__ import annotations

import enum
from typing import Callable, Sequence

from twisted.web.http_headers import Headers

from ..core import constants
from .inventory import Reply

# Preflight fan-out (docs/references.md#fan-out-limits).
PREFLIGHT_WIDTH = constants.PREFLIGHT_WIDTH
PREFLIGHT_TIMEOUT = constants.PREFLIGHT_TIMEOUT
PREFLIGHT_MAX_AGE = b"%d" % constants.PREFLIGHT_MAX_AGE
# A preflight answer is a few headers; anything this large is not one (treated as unavailable).
PREFLIGHT_MAX_BODY = 64 * 1024

# A preflight carries no credentials, and the fleet must not receive the caller's
# (docs/references.md#browser-policy).
PREFLIGHT_STRIPPED = (b"host", b"content-length", b"authorization", b"cookie")

ALLOW_ORIGIN = b"Access-Control-Allow-Origin"
ALLOW_CREDENTIALS = b"Access-Control-Allow-Credentials"
ALLOW_METHODS = b"Access-Control-Allow-Methods"
ALLOW_HEADERS = b"Access-Control-Allow-Headers"
ALLOW_PRIVATE_NETWORK = b"Access-Control-Allow-Private-Network"
MAX_AGE = b"Access-Control-Max-Age"
VARY = b"Vary"


class Verdict(enum.Enum):
    """What the engines' model lists say together when a browser (an Origin) asked."""

    #: An engine refuses the origin: its denial is what the browser sees.
    DENIED = "denied"
    #: None answered, or some answer is not a valid inventory: no list is shown.
    INVALID = "invalid"
    #: Every responding engine allows the origin: the merged list goes out.
    AGREED = "agreed"


DENIED, INVALID, AGREED = Verdict


def is_preflight(method: bytes, headers: Headers) -> bool:
    """An OPTIONS carrying Origin and Access-Control-Request-Method; any other is ordinary."""
    return (
        method == b"OPTIONS"
        and headers.hasHeader(b"origin")
        and headers.hasHeader(b"access-control-request-method")
    )


def _one(reply: Reply, name: bytes) -> bytes | None:
    """A header a browser accepts only once: repeated, it counts as absent."""
    values = reply.headers.getRawHeaders(name, [])
    return values[0].strip() if len(values) == 1 else None


def allows(reply: Reply, origin: bytes) -> bool:
    """The answer lets ``origin`` read it: Allow-Origin is exactly the origin, or ``*`` in an
    answer that grants no credentials (Fetch: ``*`` with credentials refuses them)."""
    value = _one(reply, ALLOW_ORIGIN)
    return value == origin or (value == b"*" and not grants_credentials(reply))


def grants_credentials(reply: Reply) -> bool:
    return _one(reply, ALLOW_CREDENTIALS) == b"true"


def _tokens(reply: Reply, name: bytes) -> list[bytes]:
    out: list[bytes] = []
    for value in reply.headers.getRawHeaders(name, []):
        out.extend(token.strip() for token in value.split(b",") if token.strip())
    return out


def _intersection(
    replies: Sequence[Reply],
    name: bytes,
    fold: Callable[[bytes], bytes],
    never_wild: frozenset[bytes] = frozenset(),
) -> list[bytes]:
    """The tokens of list header ``name`` that every reply grants, first reply's spelling.

    ``*`` is a wildcard only in an answer that grants no credentials (Fetch); there it
    covers every token but ``never_wild`` (Authorization is never covered by a wildcard). A
    literal ``*`` of a credentialed answer matches nothing real, so it is dropped. The
    result is ``*`` only when every reply is a wildcard.
    """
    grants = []
    for reply in replies:
        tokens = _tokens(reply, name)
        wild = b"*" in tokens and not grants_credentials(reply)
        grants.append((wild, {fold(t) for t in tokens if t != b"*"}))
    candidates: list[bytes] = []
    seen: set[bytes] = set()
    for reply in replies:
        for token in _tokens(reply, name):
            if token != b"*" and fold(token) not in seen:
                seen.add(fold(token))
                candidates.append(token)
    every_wild = all(wild for wild, _ in grants)
    out = [b"*"] if every_wild else []
    for token in candidates:
        key = fold(token)
        if every_wild and key not in never_wild:
            continue
        if all(key in listed or (wild and key not in never_wild) for wild, listed in grants):
            out.append(token)
    return out


def vary(replies: Sequence[Reply], *extra: bytes) -> bytes | None:
    """Every engine's Vary, once each (case-insensitive), then ``extra``; ``*`` absorbs all."""
    tokens: list[bytes] = []
    seen: set[bytes] = set()
    for token in [t for reply in replies for t in _tokens(reply, VARY)] + list(extra):
        if token == b"*":
            return b"*"
        if token.lower() not in seen:
            seen.add(token.lower())
            tokens.append(token)
    return b", ".join(tokens) if tokens else None


def _set(headers: Headers, name: bytes, value: bytes | None) -> None:
    if value is not None:
        headers.setRawHeaders(name, [value])


def combined(replies: Sequence[Reply], origin: bytes) -> Headers:
    """The permission every reply granted ``origin`` on an actual (non-preflight) answer.

    Empty unless all of them allow it. The origin is echoed rather than ``*``, and
    credentials are allowed only when every reply allows them.
    """
    headers = Headers()
    if not replies or not all(allows(reply, origin) for reply in replies):
        return headers
    headers.setRawHeaders(ALLOW_ORIGIN, [origin])
    if all(grants_credentials(reply) for reply in replies):
        headers.setRawHeaders(ALLOW_CREDENTIALS, [b"true"])
    _set(headers, VARY, vary(replies, b"Origin"))
    return headers


# Preflights.


def _preflight_allows(reply: Reply, origin: bytes) -> bool:
    """A browser accepts a preflight only with an ok status and its origin allowed."""
    return 200 <= reply.status < 300 and allows(reply, origin)


def judge_preflight(replies: Sequence[Reply], origin: bytes, targets: int) -> Reply | Headers:
    """The answer to a preflight asked of ``targets`` engines, from those that responded
    (at least one).

    The only target speaks for itself, unchanged. When several were asked, the first denial
    (in candidate order) is passed through unchanged; when all responders allow, the result
    is the headers of a synthesized answer granting only the intersection, cached for 60 s
    at most. That holds even when one of them answered: the browser asked the fleet, and an
    engine that was unavailable this time may refuse what the responder allowed, so its
    answer must not be cached for the engine's own Max-Age as if it spoke for all.
    """
    if targets == 1:
        return replies[0]
    for reply in replies:
        if not _preflight_allows(reply, origin):
            return reply
    headers = Headers()
    headers.setRawHeaders(ALLOW_ORIGIN, [origin])
    if all(grants_credentials(reply) for reply in replies):
        headers.setRawHeaders(ALLOW_CREDENTIALS, [b"true"])
    methods = _intersection(replies, ALLOW_METHODS, fold=lambda m: m)
    if methods:
        headers.setRawHeaders(ALLOW_METHODS, [b", ".join(methods)])
    names = _intersection(
        replies, ALLOW_HEADERS, fold=bytes.lower, never_wild=frozenset({b"authorization"})
    )
    if names:
        headers.setRawHeaders(ALLOW_HEADERS, [b", ".join(names)])
    if all(_one(reply, ALLOW_PRIVATE_NETWORK) == b"true" for reply in replies):
        headers.setRawHeaders(ALLOW_PRIVATE_NETWORK, [b"true"])
    headers.setRawHeaders(MAX_AGE, [PREFLIGHT_MAX_AGE])
    _set(headers, VARY, vary(replies, b"Origin"))
    return headers


# Model lists requested with an Origin.


def denies_inventory(reply: Reply, origin: bytes) -> bool:
    """An engine refusing the origin: 401, 403, or a success without permission for it."""
    return reply.status in (401, 403) or (200 <= reply.status < 300 and not allows(reply, origin))


def judge_inventory(
    replies: Sequence[Reply], origin: bytes, all_valid: bool
) -> tuple[Verdict, Reply | None]:
    """Every responding engine must agree before a merged list reaches a browser.

    (DENIED, the first denial) when any engine refuses the origin; (INVALID, None) when
    none answered or not ``all_valid`` (some answer is not a valid inventory), since a
    partial list would pass off one engine's view as the fleet's; otherwise (AGREED, None).
    """
    for reply in replies:
        if denies_inventory(reply, origin):
            return DENIED, reply
    if not replies or not all_valid:
        return INVALID, None
    return AGREED, None
