"""The request target as the path we send upstream, and nothing else (RFC 9112 3.2).

Every upstream URL is the node's origin followed by what this returns, so the target can never
move where we dial: ``GET 7/api/version`` appended to ``http://host:2000`` would have dialled
port 20007. And the path we classify is exactly the path we send, so no spelling of a route
(a fragment, a dot segment, a percent-encoded letter or slash) can reach an engine's inference
route without the model filter, the workload and the busy gate.

- origin-form (``/path?query``): kept, with dot segments removed and percent-encoded
  unreserved characters decoded (RFC 3986 6.2.2: the same resource, the form engines route);
  a dot segment spelled with escapes (``/x/%2e%2E/api/chat``) is decoded first and so removed
  like a literal one: the path sent has no ``.`` or ``..`` segment left for an engine to
  resolve another way, so these are served by the path they name rather than refused;
- absolute-form (``http://authority/path?query``): its path and query, as RFC 9112 3.2.2
  requires a server to accept; the authority is never dialled;
- asterisk-form, authority-form (``CONNECT``), anything else, a fragment, or a byte outside
  printable ASCII: refused (400);
- a path with an encoded ``/`` or ``\\`` (``%2F``, ``%5C``, any case): refused (400). Unlike
  the escapes above, these have no single meaning to normalise to: RFC 3986 makes ``%2F`` a
  data octet, not a separator, but Ollama's Gin and llama.cpp's cpp-httplib decode the path
  before routing, so ``/api%2Fchat`` (classified by us as no route, so no model filter, no
  workload, no busy gate) would be served as ``/api/chat``. Decoding it ourselves would
  change the resource for an engine that does not; so neither spelling is sent.
"""

from __future__ import annotations

import re

# Bytes allowed in a target: printable ASCII, no space (RFC 9112 3.2; RFC 3986 2).
_OUTSIDE = re.compile(rb"[^\x21-\x7e]")
_ABSOLUTE = re.compile(rb"(?i)https?://[^/?]*")
# An escaped path separator: a slash, or a backslash (which some servers read as a slash).
_ESCAPED_SEPARATOR = re.compile(rb"%(?:2[fF]|5[cC])")
_UNRESERVED_ESCAPE = re.compile(rb"%(?:[46][1-9a-fA-F]|[57][0-9aA]|3[0-9]|2[dDeE]|5[fF]|7[eE])")


class BadTarget(ValueError):
    """Why a request target is refused; the text is the 400's."""


def origin_form(method: bytes, target: bytes) -> bytes:
    """The path and query to send upstream for ``target``; BadTarget when it has none."""
    if method == b"CONNECT":
        raise BadTarget("CONNECT is not supported")
    if target == b"*":
        raise BadTarget("an asterisk-form target is not supported")
    if _OUTSIDE.search(target):
        raise BadTarget("bytes outside printable ASCII")
    if b"#" in target:
        raise BadTarget("a fragment is not part of a request target")
    if not target.startswith(b"/"):
        absolute = _ABSOLUTE.match(target)
        if absolute is None:
            raise BadTarget("want a path (/...) or an absolute http(s) URL")
        target = target[absolute.end() :]
        if not target.startswith(b"/"):
            target = b"/" + target
    path, mark, query = target.partition(b"?")
    if b"%" in path:
        if _ESCAPED_SEPARATOR.search(path):
            raise BadTarget("an escaped / or \\ in the path")
        path = _UNRESERVED_ESCAPE.sub(lambda m: bytes([int(m.group()[1:], 16)]), path)
    if b"/." in path:
        path = remove_dot_segments(path)
    return path + mark + query


def remove_dot_segments(path: bytes) -> bytes:
    """RFC 3986 5.2.4 for an absolute path: ``/a/./b/../c`` is ``/a/c``."""
    segments = path.split(b"/")[1:]
    out: list[bytes] = []
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == b".":
            if last:
                out.append(b"")
        elif segment == b"..":
            if out:
                out.pop()
            if last:
                out.append(b"")
        else:
            out.append(segment)
    return b"/" + b"/".join(out)
