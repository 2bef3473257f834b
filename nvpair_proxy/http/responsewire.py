"""An engine's HTTP/1.1 response as bytes: the head in one pass, then the body's framing.

Plain functions over bytes, no I/O and no Twisted, so the client (``client.py``) stays a thin
protocol and every framing rule is tested on its own. It reads what engines and peers send:
a status line, headers, and a body framed by ``Content-Length``, ``chunked`` or the close of
the connection (RFC 9112 section 6.3). Anything else is a ``WireError``: the connection is not
trusted again and the attempt fails over.
"""

from __future__ import annotations

import enum
import math
import re
from typing import Callable

# A head larger than this is not an engine's; the connection is dropped.
MAX_HEAD = 64 * 1024
# A chunk-size line (hex digits and extensions) longer than this is not one.
MAX_CHUNK_LINE = 4096
MAX_TRAILERS = 64 * 1024

# Body framings.
LENGTH, CHUNKED, UNTIL_CLOSE = "length", "chunked", "until-close"

# A header name: an RFC 9110 token.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A chunk-size line: hex digits, optional extensions (ignored), CRLF.
_CHUNK_SIZE = re.compile(rb"([0-9a-fA-F]{1,16})[ \t]*(?:;[^\r\n]*)?\r\n")


class WireError(Exception):
    """The bytes are not an HTTP/1.1 response we can frame."""


class Head:
    """A parsed status line and header block; ``fields`` maps lower-case names to their
    values in arrival order."""

    __slots__ = ("version", "code", "phrase", "fields")

    def __init__(
        self, version: bytes, code: int, phrase: bytes, fields: dict[bytes, list[bytes]]
    ) -> None:
        self.version, self.code, self.phrase, self.fields = version, code, phrase, fields


def find_head_end(buffer: bytes, start: int = 0) -> tuple[int, int] | None:
    """(end of the head, start of what follows) once the blank line that ends a head is in
    ``buffer`` (searched from ``start``), else None. Lines end in CRLF; a bare LF is read as
    one too (RFC 9112 2.2), as Twisted's client did."""
    end = buffer.find(b"\r\n\r\n", start)
    limit = len(buffer) if end < 0 else end + 1  # a bare-LF end can only come before it
    bare = buffer.find(b"\n\n", start, limit)
    if bare >= 0:
        return bare, bare + 2
    # The blank line may itself be a CRLF after a bare-LF line: "...\n\r\n".
    mixed = buffer.find(b"\n\r\n", start, limit)
    if mixed >= 0 and (end < 0 or mixed < end):
        return mixed, mixed + 3
    return None if end < 0 else (end, end + 4)


def parse_head(block: bytes) -> Head:
    """``block`` is everything before the blank line that ends the head."""
    lines = block.split(b"\r\n")
    if block.count(b"\n") != len(lines) - 1:  # some line ends in a bare LF
        lines = [line[:-1] if line.endswith(b"\r") else line for line in block.split(b"\n")]
    status = lines[0].split(b" ", 2)
    if len(status) < 2 or not status[0].startswith(b"HTTP/1."):
        raise WireError("not an HTTP/1.x status line")
    code = status[1]
    if len(code) != 3 or not code.isdigit():
        raise WireError("invalid status code")
    fields: dict[bytes, list[bytes]] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            # Obsolete folding (a line starting with whitespace) lands here too (RFC 9112 5.2),
            # as does a name Twisted's Headers would refuse.
            raise WireError("malformed header line")
        lower = name.lower()
        value = value.strip(b" \t")
        existing = fields.get(lower)
        if existing is None:
            fields[lower] = [value]
        else:
            existing.append(value)
    return Head(status[0], int(code), status[2] if len(status) == 3 else b"", fields)


def body_framing(head: Head, method: bytes) -> tuple[str, int]:
    """(framing, length): ``LENGTH`` with its byte count (0 for a response that has no body),
    ``CHUNKED`` or ``UNTIL_CLOSE`` with -1 (RFC 9112 6.3, in its order)."""
    code = head.code
    if method == b"HEAD" or code < 200 or code in (204, 304):
        return LENGTH, 0
    codings = head.fields.get(b"transfer-encoding")
    if codings is not None:
        last = b",".join(codings).split(b",")[-1].strip().lower()
        return (CHUNKED, -1) if last == b"chunked" else (UNTIL_CLOSE, -1)
    lengths = head.fields.get(b"content-length")
    if lengths is None:
        return UNTIL_CLOSE, -1
    values = {part.strip() for value in lengths for part in value.split(b",")}
    if len(values) != 1:
        raise WireError("conflicting Content-Length")
    value = values.pop()
    if not value.isdigit() or len(value) > 18:
        raise WireError("invalid Content-Length")
    return LENGTH, int(value)


def persistent(head: Head, framing: str) -> bool:
    """Whether the connection can carry another request after this response. Not after one
    that sent both ``Transfer-Encoding`` and ``Content-Length`` (RFC 9112 6.1: a sign of
    response splitting; the coding wins for this response, and the connection is closed)."""
    if framing == UNTIL_CLOSE or head.version != b"HTTP/1.1":
        return False
    if b"transfer-encoding" in head.fields and b"content-length" in head.fields:
        return False
    connection = head.fields.get(b"connection")
    if connection is None:
        return True
    return b"close" not in {
        token.strip().lower() for value in connection for token in value.split(b",")
    }


# How long before the server's own idle timeout we stop reusing its connection: a request
# written just as that timeout fires meets a connection closed under it, and a written request
# is never sent again (client.py). One second, as Node's undici keeps by default.
KEEP_ALIVE_MARGIN = 1.0

_KEEP_ALIVE_TIMEOUT = re.compile(rb"(?:^|,)\s*timeout\s*=\s*\"?([0-9]{1,9})\"?\s*(?:,|$)", re.I)


def keep_alive_for(head: Head) -> float:
    """How long the connection may stay idle and still be reused, by the server's
    ``Keep-Alive: timeout=N`` (RFC 9110's informal header; llama-server sends
    ``timeout=5, max=100``): ``N`` less ``KEEP_ALIVE_MARGIN``, at least 0; without one, no
    limit of the server's (``inf``). A malformed value says nothing."""
    values = head.fields.get(b"keep-alive")
    if values is None:
        return math.inf
    found = _KEEP_ALIVE_TIMEOUT.search(b",".join(values))
    if found is None:
        return math.inf
    return max(0.0, int(found.group(1)) - KEEP_ALIVE_MARGIN)


class Chunking(enum.Enum):
    """Where a chunked body's decoder is, and what moves it on. A ``WireError`` can end it
    in any of them; bytes short of what a step needs wait in the decoder's buffer.

    - ``SIZE``: a chunk-size line is next. A size of 0 moves it to ``TRAILER``; a chunk whose
      data and CRLF are all in hand is handed on whole and leaves it in ``SIZE``; any other
      to ``DATA``.
    - ``DATA``: inside a chunk's data, ``remaining`` bytes of it to come. Its last byte moves
      it to ``DATA_END``.
    - ``DATA_END``: the CRLF after a chunk's data is next; it moves it back to ``SIZE``.
    - ``TRAILER``: after the last chunk, trailer lines (none kept) until an empty one, which
      ends the body: ``feed`` returns what followed it.
    """

    SIZE = "size"
    DATA = "data"
    DATA_END = "data-end"
    TRAILER = "trailer"


# Module names, read per chunk without an attribute lookup; compared with ``is``.
SIZE, DATA, DATA_END, TRAILER = Chunking


class ChunkedBody:
    """Decodes a chunked body as it arrives. ``feed`` hands chunk data to ``deliver`` and
    returns None until the last chunk and its trailers are in, then the bytes that followed
    (which a well-behaved server never sends). ``state`` is a ``Chunking``. One decoder can
    serve a connection's responses in turn, restarted for each.

    The data of every chunk one ``feed`` completes goes to ``deliver`` in one call, after
    the whole read is decoded (also when broken framing then raises): the chunks arrived
    together, so joining them delays nothing, and each delivery costs the relay one client
    write and one pass of the body observer. A busy proxy reads several tokens at once, and
    so writes less per token exactly when it is busy (docs/decisions.md#joined-chunks).
    """

    __slots__ = ("deliver", "remaining", "buffer", "state")

    def __init__(self, deliver: Callable[[bytes], None]) -> None:
        self.restart(deliver)

    def restart(self, deliver: Callable[[bytes], None]) -> None:
        """Decode a new body, handing its chunk data to ``deliver``."""
        self.deliver = deliver
        self.remaining = 0
        self.buffer = b""
        self.state = SIZE

    def feed(self, data: bytes) -> bytes | None:
        decoded: list[bytes] = []
        try:
            return self._decode(data, decoded)
        finally:
            if decoded:
                self.deliver(decoded[0] if len(decoded) == 1 else b"".join(decoded))

    def _decode(self, data: bytes, decoded: list[bytes]) -> bytes | None:
        """Decode ``data``, appending chunk data to ``decoded``; ``feed``'s answer."""
        if self.buffer:
            data, self.buffer = self.buffer + data, b""
        position, end = 0, len(data)
        keep = decoded.append
        while position < end:
            state = self.state
            if state is SIZE:
                # The common case, a whole chunk and its CRLF in hand: one match, one slice.
                match = _CHUNK_SIZE.match(data, position)
                if match is None:
                    if data.find(b"\r\n", position) >= 0 or end - position > MAX_CHUNK_LINE:
                        raise WireError("invalid chunk size")
                    self._keep(data, position, MAX_CHUNK_LINE)
                    return None
                size = int(match[1], 16)
                position = match.end()
                if not size:
                    self.state = TRAILER
                    continue
                stop = position + size
                if stop + 2 <= end:
                    if data[stop : stop + 2] != b"\r\n":
                        raise WireError("chunk data not followed by CRLF")
                    keep(data[position:stop])
                    position = stop + 2
                    continue
                self.remaining, self.state = size, DATA
            elif state is DATA:
                take = min(self.remaining, end - position)
                keep(data[position : position + take])
                position += take
                self.remaining -= take
                if self.remaining == 0:
                    self.state = DATA_END
            elif state is DATA_END:
                if end - position < 2:
                    self._keep(data, position, 2)
                    return None
                if data[position : position + 2] != b"\r\n":
                    raise WireError("chunk data not followed by CRLF")
                position += 2
                self.state = SIZE
            else:  # TRAILER: header lines, none kept, until an empty one
                newline = data.find(b"\r\n", position)
                if newline < 0:
                    self._keep(data, position, MAX_TRAILERS)
                    return None
                empty = newline == position
                position = newline + 2
                if empty:
                    return data[position:]
        return None

    def _keep(self, data: bytes, position: int, limit: int) -> None:
        """Hold the bytes from ``position`` until more arrive, unless they are already
        longer than the step waiting for them can be."""
        rest = data[position:]
        if len(rest) > limit:
            raise WireError("chunked framing line too long")
        self.buffer = rest
