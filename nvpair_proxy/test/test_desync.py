"""The desync oracle: hostile framings sent through a facade to an engine that records exactly
the bytes it receives, judged by a strict, independent parser (``h11``).

A facade is the real listener demux, ``BoundedChannel`` and ``BoundedRequest`` over an
in-memory transport, and the proxy's own upstream client (client.py) dialling through a
``MemoryReactorClock``: the engine's end of each dialled connection is a ``StringTransport``
holding every byte the proxy wrote, and answers each request it reads. What twisted.web makes
of the bytes is the point, not the socket, so no socket is opened (``test_http_hostile`` and
``test_safety_process`` send the same kinds of input to a running process).

For each framing the proxy either

- refuses it: a 4xx, or the connection closed (at once, or by the request-line, header or
  idle deadline, advanced on the site's Clock), and the engine received nothing; or
- forwards it: the engine's bytes, read by h11, are exactly the requests our server read
  (method, target and body, in order), nothing is left after the last of them that could be
  read as one more, and each carries one ``Content-Length`` or ``chunked``, never both.

And h11 reading the client's own bytes never disagrees with us: where both accept, both read
the same requests (the target as the origin-form path we send). Where h11 refuses and we
accept, the case says why (``LENIENT``). The framings refused and why:
docs/decisions.md#request-framing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import h11
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core.constants import SERVER_IDLE_TIMEOUT
from nvpair_proxy.http.client import Client
from nvpair_proxy.http.server import BoundedRequest
from nvpair_proxy.test.support import Wire
from nvpair_proxy.test.world import World

CHAT = json.dumps({"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}).encode()
N = len(CHAT)
CL = b"Content-Length: %d\r\n" % N
TE = b"Transfer-Encoding: chunked\r\n"
SMUGGLED = b"GET /api/smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n"
    b'{"done":true}\n'
)


def post(headers: bytes, body: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return b"POST /api/chat " + version + b"\r\nHost: x\r\n" + headers + b"\r\n" + body


def chunks(
    body: bytes = CHAT, size: bytes | None = None, end: bytes = b"\r\n", last: bytes = b"0\r\n\r\n"
) -> bytes:
    """``body`` as one chunk and the last chunk; ``size``, ``end`` and ``last`` replace the
    chunk-size line's size, the chunk's CRLF and the last chunk with its trailer section."""
    return (size if size is not None else b"%x" % len(body)) + b"\r\n" + body + end + last


REFUSED, FORWARDED = "refused", "forwarded"
GOOD = post(CL, CHAT)


@dataclass(frozen=True)
class Case:
    group: str
    name: str
    data: bytes
    expect: str
    requests: int = 1  # forwarded: how many requests our server reads (and the engine gets)


CORPUS = [
    # CL.TE, TE.CL, TE.TE: two framings for one body; a parser that picks the other one
    # reads the smuggled request as a request of its own.
    Case("two framings", "CL.TE", post(CL + TE, chunks() + SMUGGLED), REFUSED),
    Case("two framings", "TE.CL", post(TE + CL, chunks() + SMUGGLED), REFUSED),
    Case(
        "two framings",
        "TE with Content-Length 0",
        post(TE + b"Content-Length: 0\r\n", chunks() + SMUGGLED),
        REFUSED,
    ),
    Case("two framings", "TE.TE, chunked twice", post(TE + TE, chunks()), REFUSED),
    Case(
        "two framings",
        "TE.TE, the second obfuscated",
        post(TE + b"Transfer-Encoding: x\r\n", chunks() + SMUGGLED),
        REFUSED,
    ),
    # Transfer-Encoding obfuscations.
    Case(
        "te obfuscation",
        "coding upper case",
        post(b"Transfer-Encoding: CHUNKED\r\n", chunks()),
        FORWARDED,
    ),
    Case(
        "te obfuscation",
        "name mixed case",
        post(b"tRANSFER-eNCODING: chunked\r\n", chunks()),
        FORWARDED,
    ),
    Case(
        "te obfuscation",
        "tab before the value",
        post(b"Transfer-Encoding:\tchunked\r\n", chunks()),
        FORWARDED,
    ),
    Case(
        "te obfuscation",
        "space after the value",
        post(b"Transfer-Encoding: chunked \r\n", chunks()),
        FORWARDED,
    ),
    Case(
        "te obfuscation",
        "space before the colon",
        post(b"Transfer-Encoding : chunked\r\n", chunks() + SMUGGLED),
        REFUSED,
    ),
    Case(
        "te obfuscation",
        "chunked, identity",
        post(b"Transfer-Encoding: chunked, identity\r\n", chunks()),
        REFUSED,
    ),
    Case(
        "te obfuscation",
        "identity, chunked",
        post(b"Transfer-Encoding: identity, chunked\r\n", chunks()),
        REFUSED,
    ),
    Case(
        "te obfuscation",
        "identity alone",
        post(b"Transfer-Encoding: identity\r\n", CHAT + SMUGGLED),
        REFUSED,
    ),
    Case(
        "te obfuscation",
        "chunked,chunked in one line",
        post(b"Transfer-Encoding: chunked,chunked\r\n", chunks()),
        REFUSED,
    ),
    Case(
        "te obfuscation",
        "vertical tab before the value",
        post(b"Transfer-Encoding:\x0bchunked\r\n", chunks() + SMUGGLED),
        REFUSED,
    ),
    Case(
        "te obfuscation",
        "vertical tab after the value",
        post(b"Transfer-Encoding: chunked\x0b\r\n", chunks() + SMUGGLED),
        REFUSED,
    ),
    Case("te obfuscation", "xchunked", post(b"Transfer-Encoding: xchunked\r\n", chunks()), REFUSED),
    Case("te obfuscation", "quoted", post(b'Transfer-Encoding: "chunked"\r\n', chunks()), REFUSED),
    Case(
        "te obfuscation",
        "folded onto the next line",
        post(b"Transfer-Encoding:\r\n chunked\r\n", chunks() + SMUGGLED),
        REFUSED,
    ),
    Case(
        "te obfuscation",
        "in HTTP/1.0 (read, then closed)",
        post(TE, chunks() + SMUGGLED, b"HTTP/1.0"),
        FORWARDED,
    ),
    # Content-Length spellings.
    Case("content-length", "plus sign", post(b"Content-Length: +%d\r\n" % N, CHAT), REFUSED),
    Case("content-length", "minus sign", post(b"Content-Length: -%d\r\n" % N, CHAT), REFUSED),
    Case("content-length", "space inside", post(b"Content-Length: 6 8\r\n", CHAT), REFUSED),
    Case("content-length", "space after", post(b"Content-Length: %d \r\n" % N, CHAT), FORWARDED),
    Case(
        "content-length", "leading zeros", post(b"Content-Length: 000%d\r\n" % N, CHAT), FORWARDED
    ),
    Case("content-length", "a list", post(b"Content-Length: %d, %d\r\n" % (N, N), CHAT), REFUSED),
    Case("content-length", "a duplicate of the same value", post(CL + CL, CHAT), REFUSED),
    Case(
        "content-length",
        "a duplicate of another value",
        post(b"Content-Length: 2\r\n" + CL, CHAT),
        REFUSED,
    ),
    Case("content-length", "hexadecimal", post(b"Content-Length: 0x44\r\n", CHAT), REFUSED),
    Case("content-length", "underscore", post(b"Content-Length: 6_8\r\n", CHAT), REFUSED),
    Case(
        "content-length",
        "past 64 bits",
        post(b"Content-Length: 99999999999999999999999\r\n", CHAT),
        REFUSED,
    ),
    Case(
        "content-length",
        "space before the colon",
        post(b"Content-Length : %d\r\n" % N, CHAT),
        REFUSED,
    ),
    Case("content-length", "folded", post(b"Content-Length:\r\n %d\r\n" % N, CHAT), REFUSED),
    # Chunk sizes and terminators.
    Case("chunks", "an extension", post(TE, chunks(size=b"%x;name=value" % N)), FORWARDED),
    Case(
        "chunks",
        "a quoted extension with a semicolon",
        post(TE, chunks(size=b'%x;a="b;c"' % N)),
        FORWARDED,
    ),
    Case(
        "chunks",
        "size past 64 bits (held, then closed idle)",
        post(TE, chunks(size=b"1" + b"0" * 16 + b"44")),
        REFUSED,
    ),
    Case("chunks", "0x prefix", post(TE, chunks(size=b"0x44")), REFUSED),
    Case("chunks", "negative size", post(TE, chunks(size=b"-44")), REFUSED),
    Case("chunks", "plus sign", post(TE, chunks(size=b"+44")), REFUSED),
    Case("chunks", "space after the size", post(TE, chunks(size=b"44 ")), REFUSED),
    Case("chunks", "bad chunk terminator", post(TE, chunks(end=b"XX")), REFUSED),
    Case("chunks", "bare LF chunk terminator", post(TE, chunks(end=b"\n")), REFUSED),
    Case("chunks", "bare LF after the size", post(TE, b"44\n" + CHAT + b"\r\n0\r\n\r\n"), REFUSED),
    Case("chunks", "a trailer field", post(TE, chunks(last=b"0\r\nX-T: 1\r\n\r\n")), FORWARDED),
    Case(
        "chunks",
        "a request line in the trailer section",
        post(TE, chunks(last=b"0\r\n" + SMUGGLED)),
        REFUSED,
    ),
    Case(
        "chunks",
        "Content-Length in the trailer section",
        post(TE, chunks(last=b"0\r\nContent-Length: 5\r\n\r\n")),
        REFUSED,
    ),
    # Line endings, folding, header syntax.
    Case(
        "header syntax",
        "bare LF line endings (held, then closed)",
        b"POST /api/chat HTTP/1.1\nHost: x\nContent-Length: %d\n\n%s" % (N, CHAT),
        REFUSED,
    ),
    Case(
        "header syntax",
        "bare LF inside the headers",
        b"POST /api/chat HTTP/1.1\r\nHost: x\n" + CL + b"\r\n" + CHAT,
        REFUSED,
    ),
    Case(
        "header syntax",
        "bare CR inside the headers",
        b"POST /api/chat HTTP/1.1\r\nHost: x\rContent-Length: 5\r\n" + CL + b"\r\n" + CHAT,
        REFUSED,
    ),
    Case(
        "header syntax",
        "obs-fold of another header",
        post(b"X-A: one\r\n two\r\n" + CL, CHAT),
        FORWARDED,
    ),
    Case(
        "header syntax",
        "tab before the colon",
        post(b"Content-Length\t: %d\r\n" % N, CHAT),
        REFUSED,
    ),
    Case("header syntax", "space in a name", post(b"X A: b\r\n" + CL, CHAT), REFUSED),
    Case("header syntax", "empty name", post(b": b\r\n" + CL, CHAT), REFUSED),
    Case("header syntax", "NUL in a value", post(b"X-A: a\x00b\r\n" + CL, CHAT), REFUSED),
    Case("header syntax", "CR in a value", post(b"X-A: a\rb\r\n" + CL, CHAT), REFUSED),
    Case("header syntax", "vertical tab in a value", post(b"X-A: a\x0bb\r\n" + CL, CHAT), REFUSED),
    Case("header syntax", "form feed in a value", post(b"X-A: a\x0cb\r\n" + CL, CHAT), REFUSED),
    Case("header syntax", "ESC in a value", post(b"X-A: a\x1bb\r\n" + CL, CHAT), REFUSED),
    Case("header syntax", "DEL in a value", post(b"X-A: a\x7fb\r\n" + CL, CHAT), REFUSED),
    # Request targets and methods.
    Case(
        "targets",
        "absolute-form",
        b"POST http://evil:1/api/chat HTTP/1.1\r\nHost: x\r\n" + CL + b"\r\n" + CHAT,
        FORWARDED,
    ),
    Case(
        "targets",
        "absolute-form https",
        b"GET https://evil/api/version HTTP/1.1\r\nHost: x\r\n\r\n",
        FORWARDED,
    ),
    Case("targets", "asterisk-form", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", REFUSED),
    Case(
        "targets",
        "CONNECT",
        b"CONNECT 10.0.0.1:11434 HTTP/1.1\r\nHost: x\r\n\r\n" + SMUGGLED,
        REFUSED,
    ),
    Case(
        "targets",
        "two spaces in the request line",
        b"GET  /api/version HTTP/1.1\r\nHost: x\r\n\r\n",
        REFUSED,
    ),
    Case("targets", "HTTP/0.9 request line", b"GET /api/version\r\n\r\n", REFUSED),
    Case("targets", "HTTP/1.2", b"GET /api/version HTTP/1.2\r\nHost: x\r\n\r\n", REFUSED),
    Case(
        "targets",
        "an upgrade to h2c, sent without it",
        b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
        FORWARDED,
    ),
    # Versions and Expect.
    Case(
        "versions",
        "HTTP/1.0 with keep-alive, a request behind it",
        post(b"Connection: keep-alive\r\n" + CL, CHAT + SMUGGLED, b"HTTP/1.0"),
        FORWARDED,
    ),
    Case("versions", "HTTP/1.0 without a length (no body)", post(b"", b"", b"HTTP/1.0"), FORWARDED),
    Case(
        "versions", "Expect: 100-continue", post(b"Expect: 100-continue\r\n" + CL, CHAT), FORWARDED
    ),
    Case(
        "versions",
        "Expect: 100-continue, chunked",
        post(b"Expect: 100-continue\r\n" + TE, chunks()),
        FORWARDED,
    ),
    # Pipelining behind a body: each request read is forwarded as itself, in order.
    Case("pipelined", "behind a Content-Length body", post(CL, CHAT + SMUGGLED), FORWARDED, 2),
    Case("pipelined", "behind a chunked body", post(TE, chunks() + SMUGGLED), FORWARDED, 2),
    Case(
        "pipelined",
        "a length shorter than the body",
        post(b"Content-Length: 2\r\n", b"{}" + SMUGGLED),
        FORWARDED,
        2,
    ),
    Case(
        "pipelined",
        "a request as a GET's body",
        b"GET /api/version HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
        % (len(SMUGGLED), SMUGGLED),
        FORWARDED,
    ),
    Case(
        "pipelined",
        "an empty line before a pipelined request",
        post(CL, CHAT + b"\r\n" + SMUGGLED),
        FORWARDED,
        2,
    ),
    Case(
        "pipelined",
        "Connection: close, then a request",
        b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: close, te\r\n\r\n" + SMUGGLED,
        FORWARDED,
    ),
]

# Accepted by us, read otherwise by h11 reading the client's bytes, and why that is safe: h11
# is stricter than RFC 9112 here, and each request we forward is one it reads whole.
LENIENT = {
    "an empty line before a pipelined request": "RFC 9112 2.2: a server SHOULD ignore at least "
    "one empty line before a request line; h11 "
    "does not, so it reads only the first",
}


@dataclass
class Outcome:
    read: list[tuple[bytes, bytes, bytes]]  # what our server read: method, target, body
    wires: list[bytes]  # what the engine received, per connection dialled
    answer: bytes  # what the client received
    closed: bool
    idle: bool = field(default=False)  # closed only once the deadlines ran


def through(data: bytes) -> Outcome:
    """``data`` from one client through a facade with one node, whose engine answers every
    request it reads."""
    read: list[tuple[bytes, bytes, bytes]] = []

    class Recorded(BoundedRequest):
        def process(self):
            if not self._rejected:
                self.content.seek(0)
                read.append((self.method, self.uri, self.content.read()))
                self.content.seek(0)
            return super().process()

    reactor = MemoryReactorClock()
    w = World(agent=Client(reactor))
    w.site.requestFactory = Recorded
    w.add("a")
    client = w.connect()
    client.protocol.dataReceived(data)
    wires: list[tuple[Wire, bytearray]] = []
    answered = True
    while answered:
        # The proxy's client writes each request whole, in one write, and one at a time on a
        # connection: each new batch of bytes is one request to answer.
        while len(wires) < len(reactor.tcpClients):
            wires.append((Wire(reactor, len(wires)), bytearray()))
        answered = False
        for wire, received in wires:
            got = wire.sent()
            if got:
                received += got
                wire.reply(ANSWER)
                answered = True
    idle = False
    if not client.transport.disconnecting and not client.answered():
        # Held: the request-line, header and idle deadlines are what end it.
        w.site_clock.advance(SERVER_IDLE_TIMEOUT + 1)
        idle = True
    return Outcome(
        read,
        [bytes(received) for _, received in wires],
        client.raw(),
        client.transport.disconnecting,
        idle,
    )


@dataclass
class Read:
    """What h11 reads of a byte string, as a server: each request whole, and how it ended."""

    requests: list[tuple[bytes, bytes, bytes]]
    framing: list[list[bytes]]  # each request's Content-Length and Transfer-Encoding lines
    error: str | None  # why h11 refused, or None
    leftover: bytes  # bytes after the last whole request that h11 did not read


def strict_read(data: bytes) -> Read:
    parser = h11.Connection(h11.SERVER)
    parser.receive_data(data)
    requests: list[list] = []
    framing: list[list[bytes]] = []
    ended = 0
    error = None
    while True:
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError as why:
            error = str(why) or "refused"
            break
        if isinstance(event, h11.Request):
            requests.append([event.method, event.target, b""])
            framing.append(
                [
                    name + b": " + value
                    for name, value in event.headers.raw_items()
                    if name.lower() in (b"content-length", b"transfer-encoding")
                ]
            )
        elif isinstance(event, h11.Data):
            requests[-1][2] += event.data
        elif isinstance(event, h11.EndOfMessage) or (
            event is h11.PAUSED and parser.their_state is h11.DONE
        ):
            ended += isinstance(event, h11.EndOfMessage)
            parser.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            parser.send(h11.EndOfMessage())
            if parser.our_state is h11.MUST_CLOSE:
                break
            parser.start_next_cycle()
        else:  # NEED_DATA, PAUSED on an upgrade, ConnectionClosed
            if parser.their_state not in (h11.IDLE, h11.DONE, h11.MUST_CLOSE):
                error = "incomplete"
            break
    leftover, _ = parser.trailing_data
    return Read([tuple(r) for r in requests[:ended]], framing[:ended], error, bytes(leftover))


def origin_form(target: bytes) -> bytes:
    """An absolute-form target as the origin form we send, for comparing with h11's target."""
    for scheme in (b"http://", b"https://"):
        if target.lower().startswith(scheme):
            rest = target[len(scheme) :]
            cut = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
            path = rest[cut:]
            return path if path.startswith(b"/") else b"/" + path
    return target


def status_of(answer: bytes) -> int | None:
    """The final status the client got (past any 100 Continue)."""
    while answer.startswith(b"HTTP/1.1 100 "):
        answer = answer.partition(b"\r\n\r\n")[2]
    parts = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


class Oracle:
    """The checks every framing must pass, pinned corpus case or mutated example."""

    def __init__(self, test: SynchronousTestCase) -> None:
        self.test = test

    def check(self, name: str, data: bytes, lenient: bool = False) -> Outcome:
        outcome = through(data)
        self.judge(name, data, outcome, lenient)
        return outcome

    def judge(self, name: str, data: bytes, outcome: Outcome, lenient: bool = False) -> None:
        test = self.test
        if not outcome.read:
            self.refused(name, outcome)
            return outcome
        engine_read = [strict_read(wire) for wire in outcome.wires]
        forwarded = []
        for wire, read in zip(outcome.wires, engine_read):
            test.assertIsNone(read.error, (name, "h11 refused what we forwarded", wire))
            test.assertEqual(read.leftover, b"", (name, "left on the upstream connection"))
            for (method, target, body), framing in zip(read.requests, read.framing):
                # Canonical: no Transfer-Encoding, one Content-Length when there is a body.
                test.assertEqual(
                    framing,
                    [b"Content-Length: %d" % len(body)]
                    if body
                    else [b"Content-Length: 0"]
                    if framing
                    else [],
                    (name, wire),
                )
                forwarded.append((method, target, body))
        test.assertEqual(forwarded, outcome.read, (name, "the engine read other requests"))
        test.assertEqual(status_of(outcome.answer), 200, (name, outcome.answer[:200]))
        # We may refuse what h11 accepts, never forward what it does not read: each request
        # we read is one h11 read whole, the same, in the same place.
        client_read = strict_read(data)
        theirs = [(m, origin_form(t), b) for m, t, b in client_read.requests]
        if outcome.read != theirs[: len(outcome.read)]:
            test.assertTrue(
                lenient and client_read.error not in (None, "incomplete"),
                (name, "h11 reads the client's bytes otherwise", client_read.error, theirs),
            )

    def refused(self, name: str, outcome: Outcome) -> None:
        self.test.assertEqual(
            outcome.wires,
            [b""] * len(outcome.wires),
            (name, "the engine received bytes of a refused request"),
        )
        status = status_of(outcome.answer)
        self.test.assertTrue(status is None or 400 <= status < 500, (name, outcome.answer[:200]))
        self.test.assertTrue(outcome.closed, (name, "a refused request's connection stays open"))


class CorpusTests(SynchronousTestCase):
    def test_the_corpus_covers_each_family(self) -> None:
        self.assertGreaterEqual(len(CORPUS), 40)
        self.assertEqual(len({(case.group, case.name) for case in CORPUS}), len(CORPUS))
        self.assertEqual(
            {case.group for case in CORPUS},
            {
                "two framings",
                "te obfuscation",
                "content-length",
                "chunks",
                "header syntax",
                "targets",
                "versions",
                "pipelined",
            },
        )

    def test_each_framing_is_refused_or_forwarded_as_exactly_what_we_read(self) -> None:
        oracle = Oracle(self)
        for case in CORPUS:
            outcome = oracle.check(case.name, case.data, lenient=case.name in LENIENT)
            if case.expect == REFUSED:
                self.assertEqual(outcome.read, [], case.name)
            else:
                self.assertEqual(len(outcome.read), case.requests, case.name)

    def test_refused_framings_are_answered_400_at_once_unless_held(self) -> None:
        for case in CORPUS:
            if case.expect != REFUSED:
                continue
            outcome = through(case.data)
            if "held" in case.name:
                self.assertTrue(outcome.idle and outcome.answer == b"", case.name)
            else:
                self.assertFalse(outcome.idle, case.name)
                self.assertIn(status_of(outcome.answer), (400, 413), case.name)

    def test_the_oracle_catches_a_forwarded_desync(self) -> None:
        """A guard that cannot fail guards nothing: two requests on the engine's wire where
        our server read one, and a body framed twice, are both caught."""
        oracle = Oracle(self)
        smuggled = Outcome(
            [(b"POST", b"/api/chat", CHAT)],
            [b"POST /api/chat HTTP/1.1\r\nHost: e\r\n" + CL + b"\r\n" + CHAT + SMUGGLED],
            b"HTTP/1.1 200 OK\r\n\r\n",
            False,
        )
        both = Outcome(
            [(b"POST", b"/api/chat", CHAT)],
            [b"POST /api/chat HTTP/1.1\r\nHost: e\r\n" + CL + TE + b"\r\n" + chunks()],
            b"HTTP/1.1 200 OK\r\n\r\n",
            False,
        )
        for outcome in (smuggled, both):
            self.assertRaises(self.failureException, oracle.judge, "fake", GOOD, outcome)
        refused = Outcome([], [b"GET /api/smuggled HTTP/1.1\r\n\r\n"], b"", True)
        self.assertRaises(self.failureException, oracle.judge, "fake", GOOD, refused)
        oracle.judge(
            "fake",
            GOOD,
            Outcome(
                [(b"POST", b"/api/chat", CHAT)],
                [b"POST /api/chat HTTP/1.1\r\nHost: e\r\n" + CL + b"\r\n" + CHAT],
                b"HTTP/1.1 200 OK\r\n\r\n",
                False,
            ),
        )


# The mutations of a valid request, by family; each takes (head lines, body, framing) and
# returns the bytes to send.
def _valid(method: bytes, path: bytes, body: bytes, chunked: bool) -> tuple[list[bytes], bytes]:
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: x"]
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
        return lines, chunks(body) if body else b"0\r\n\r\n"
    lines.append(b"Content-Length: %d" % len(body))
    return lines, body


TE_SPELLINGS = [
    b"chunked",
    b"CHUNKED",
    b" chunked",
    b"chunked ",
    b"\tchunked",
    b"chunked, identity",
    b"identity, chunked",
    b"identity",
    b"\x0bchunked",
    b"chunked\x0b",
    b'"chunked"',
    b"chunked,chunked",
    b"gzip, chunked",
    b"xchunked",
    b"chunked;q=1",
    b"",
]
CL_SPELLINGS = [
    b"+%d",
    b"-%d",
    b" %d",
    b"%d ",
    b"0%d",
    b"00000%d",
    b"%d, %d",
    b"%d,%d",
    b"0x%x",
    b"%d.0",
    b"%de0",
    b"%d\x0b",
    b"\x0c%d",
    b"1%d",
    b"%d0",
    b"",
]
CHUNK_SIZES = [
    b"%x;ext",
    b'%x;a=b;c="d"',
    b"0x%x",
    b"-%x",
    b"+%x",
    b"%x ",
    b" %x",
    b"%X",
    b"000%x",
    b"1000000000000000%x",
    b"%x\x00",
    b"%x\x0b",
]
CONTROLS = [bytes([c]) for c in (*range(0, 9), *range(10, 32), 127)]


@st.composite
def mutated(draw) -> tuple[bytes, str | None]:
    """A valid request mutated one way, and the ``LENIENT`` case that allows it, if any."""
    method = draw(st.sampled_from([b"POST", b"GET", b"PUT"]))
    # Routes the facade forwards as they came (a model list is the proxy's own fan-out).
    path = draw(st.sampled_from([b"/api/chat", b"/api/version", b"/api/version?x=1"]))
    body = draw(st.sampled_from([CHAT, b"", b"{}"]))
    chunked = draw(st.booleans())
    lines, payload = _valid(method, path, body, chunked)
    tail = draw(st.sampled_from([b"", SMUGGLED, b"0\r\n\r\n", b"\r\n" + SMUGGLED]))
    lenient = "an empty line before a pipelined request" if tail.startswith(b"\r\n") else None
    family = draw(
        st.sampled_from(
            [
                "te",
                "cl",
                "chunk",
                "endings",
                "fold",
                "colon",
                "control",
                "target",
                "version",
                "expect",
                "duplicate",
            ]
        )
    )
    index = draw(st.integers(1, len(lines)))
    if family == "te":
        spelling = draw(st.sampled_from(TE_SPELLINGS))
        name = draw(
            st.sampled_from(
                [
                    b"Transfer-Encoding",
                    b"transfer-encoding",
                    b"TRANSFER-ENCODING",
                    b"Transfer-Encoding ",
                ]
            )
        )
        lines.insert(index, name + b":" + spelling)
    elif family == "cl":
        spelling = draw(st.sampled_from(CL_SPELLINGS))
        length = draw(st.sampled_from([len(body), 0, 2, len(body) + 5]))
        value = spelling % ((length,) * spelling.count(b"%")) if b"%" in spelling else spelling
        lines.insert(index, b"Content-Length: " + value)
    elif family == "chunk":
        if body:
            size = draw(st.sampled_from(CHUNK_SIZES))
            end = draw(st.sampled_from([b"\r\n", b"\n", b"XX", b"", b"\r\r\n"]))
            last = draw(
                st.sampled_from(
                    [
                        b"0\r\n\r\n",
                        b"0\r\nX-T: 1\r\n\r\n",
                        b"0\r\n",
                        b"0\n\n",
                        b"00\r\n\r\n",
                        b"0;e\r\n\r\n",
                    ]
                )
            )
            payload = chunks(body, size % len(body), end, last)
            if not chunked:
                lines.append(b"Transfer-Encoding: chunked")
    elif family == "endings":
        head = b"\r\n".join(lines) + b"\r\n\r\n"
        where = draw(st.integers(0, head.count(b"\r\n") - 1))
        pieces = head.split(b"\r\n")
        joiner = draw(st.sampled_from([b"\n", b"\r", b"\n\r"]))
        head = b"\r\n".join(pieces[: where + 1]) + joiner + b"\r\n".join(pieces[where + 1 :])
        return head + payload + tail, lenient
    elif family == "fold":
        lines.insert(index, draw(st.sampled_from([b" folded", b"\tfolded", b" 5", b" chunked"])))
    elif family == "colon":
        line = lines[index - 1] if index > 1 else lines[-1]
        name, _, value = line.partition(b":")
        spaced = name + draw(st.sampled_from([b" ", b"\t", b"\x0b"])) + b":" + value
        lines[lines.index(line)] = spaced
    elif family == "control":
        control = draw(st.sampled_from(CONTROLS))
        lines.insert(index, b"X-A: a" + control + b"b")
    elif family == "target":
        target = draw(
            st.sampled_from(
                [
                    b"http://evil:1" + path,
                    b"https://e" + path,
                    b"*",
                    b"evil:80",
                    b"7" + path,
                    path + b"#f",
                    b"//" + path,
                ]
            )
        )
        verb = draw(st.sampled_from([method, b"CONNECT", b"OPTIONS"]))
        lines[0] = verb + b" " + target + b" HTTP/1.1"
    elif family == "version":
        version = draw(
            st.sampled_from([b"HTTP/1.0", b"HTTP/1.2", b"http/1.1", b"HTTP/2.0", b"HTTP/1.1 ", b""])
        )
        lines[0] = method + b" " + path + (b" " + version if version else b"")
        if draw(st.booleans()):
            lines.insert(index, b"Connection: keep-alive")
    elif family == "expect":
        lines.insert(
            index,
            b"Expect: " + draw(st.sampled_from([b"100-continue", b"100-Continue", b"200-ok"])),
        )
    else:  # a framing header repeated
        line = next(
            line
            for line in lines
            if line.lower().startswith((b"content-length", b"transfer-encoding"))
        )
        lines.insert(index, line)
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload + tail, lenient


class MutationTests(SynchronousTestCase):
    @settings(derandomize=True)
    @given(mutated())
    def test_a_mutated_request_is_refused_or_forwarded_as_exactly_what_we_read(self, example):
        data, lenient = example
        self.assertTrue(lenient is None or lenient in LENIENT)
        Oracle(self).check("mutated", data, lenient=lenient is not None)
