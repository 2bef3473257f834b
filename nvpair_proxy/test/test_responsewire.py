"""The framing rules of an engine's response, byte by byte (RFC 9112 sections 4 to 7)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.http.responsewire import (
    CHUNKED,
    LENGTH,
    UNTIL_CLOSE,
    ChunkedBody,
    Chunking,
    WireError,
    body_framing,
    find_head_end,
    keep_alive_for,
    parse_head,
    persistent,
)
from nvpair_proxy.test.strategies import HEADS, splits


def head(*lines: bytes, status: bytes = b"HTTP/1.1 200 OK"):
    return parse_head(b"\r\n".join((status,) + lines))


class HeadTests(SynchronousTestCase):
    def test_status_line_and_fields_in_arrival_order(self):
        parsed = head(
            b"Content-Type: text/event-stream",
            b"X-A:one",
            b"x-a:  two \t",
            status=b"HTTP/1.1 404 Not Found Here",
        )
        self.assertEqual(
            (parsed.version, parsed.code, parsed.phrase), (b"HTTP/1.1", 404, b"Not Found Here")
        )
        self.assertEqual(
            parsed.fields, {b"content-type": [b"text/event-stream"], b"x-a": [b"one", b"two"]}
        )

    def test_a_status_line_without_a_phrase(self):
        self.assertEqual(
            (head(status=b"HTTP/1.0 204").code, head(status=b"HTTP/1.0 204").phrase), (204, b"")
        )

    def test_what_is_not_a_response_head(self):
        for status in (
            b"ICY 200 OK",
            b"HTTP/2 200",
            b"HTTP/1.1 2000 OK",
            b"HTTP/1.1 abc OK",
            b"HTTP/1.1",
        ):
            self.assertRaises(WireError, parse_head, status)
        for line in (b"no colon", b": empty name", b"Bad Name: x", b"Name : x", b" folded"):
            self.assertRaises(WireError, head, b"A: b", line)


class KeepAliveTests(SynchronousTestCase):
    def test_the_servers_idle_timeout_less_a_second(self):
        cases = {
            b"timeout=5, max=100": 4.0,
            b"max=100, timeout=30": 29.0,
            b'Timeout="10"': 9.0,
            b"timeout=1": 0.0,
            b"timeout=0": 0.0,
        }
        for value, expected in cases.items():
            self.assertEqual(keep_alive_for(head(b"Keep-Alive: " + value)), expected, value)

    def test_no_timeout_or_a_malformed_one_sets_no_limit(self):
        for lines in (
            (),
            (b"Keep-Alive: max=100",),
            (b"Keep-Alive: timeout=soon",),
            (b"Keep-Alive: timeout=-3",),
            (b"Keep-Alive: xtimeout=3",),
        ):
            self.assertEqual(keep_alive_for(head(*lines)), float("inf"), lines)


class FramingTests(SynchronousTestCase):
    def test_responses_without_a_body(self):
        for code, method in ((204, b"GET"), (304, b"GET"), (200, b"HEAD"), (103, b"GET")):
            parsed = head(b"Content-Length: 10", status=b"HTTP/1.1 %d X" % code)
            self.assertEqual(body_framing(parsed, method), (LENGTH, 0))

    def test_chunked_wins_over_a_length_and_another_coding_reads_to_the_close(self):
        self.assertEqual(
            body_framing(head(b"Transfer-Encoding: gzip, Chunked", b"Content-Length: 5"), b"GET"),
            (CHUNKED, -1),
        )
        self.assertEqual(
            body_framing(head(b"Transfer-Encoding: chunked, gzip"), b"GET"), (UNTIL_CLOSE, -1)
        )

    def test_a_length_repeated_alike_is_one_length_and_conflicting_ones_are_refused(self):
        self.assertEqual(
            body_framing(head(b"Content-Length: 7, 7", b"Content-Length: 7"), b"GET"), (LENGTH, 7)
        )
        for values in (
            (b"Content-Length: 7", b"Content-Length: 8"),
            (b"Content-Length: -1",),
            (b"Content-Length: 0x10",),
            (b"Content-Length: " + b"9" * 19,),
        ):
            self.assertRaises(WireError, body_framing, head(*values), b"GET")

    def test_no_framing_header_reads_to_the_close(self):
        self.assertEqual(body_framing(head(), b"POST"), (UNTIL_CLOSE, -1))

    def test_which_connections_may_carry_another_request(self):
        self.assertTrue(persistent(head(b"Content-Length: 1"), LENGTH))
        self.assertFalse(persistent(head(b"Connection: keep-alive, Close"), LENGTH))
        self.assertFalse(persistent(head(status=b"HTTP/1.0 200 OK"), LENGTH))
        self.assertFalse(persistent(head(), UNTIL_CLOSE))


class ChunkedTests(SynchronousTestCase):
    WIRE = b"5;name=value\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n0\r\nTrailer: yes\r\n\r\n"

    def decode(self, pieces):
        out: list[bytes] = []
        body = ChunkedBody(out.append)
        rests = [body.feed(piece) for piece in pieces]
        return b"".join(out), rests

    def test_decoded_alike_however_the_bytes_are_split(self):
        whole, rests = self.decode([self.WIRE])
        self.assertEqual((whole, rests), (b"hello" + b"x" * 26, [b""]))
        for size in (1, 2, 3, 7):
            pieces = [self.WIRE[i : i + size] for i in range(0, len(self.WIRE), size)]
            data, rests = self.decode(pieces)
            self.assertEqual(data, whole, size)
            self.assertEqual([r for r in rests if r is not None], [b""], size)
            self.assertIsNone(rests[-2] if len(rests) > 1 else None, size)

    def test_bytes_after_the_last_chunk_are_handed_back(self):
        self.assertEqual(self.decode([b"0\r\n\r\nHTTP/1.1"])[1], [b"HTTP/1.1"])

    def test_each_step_moves_the_decoder_as_its_states_say(self):
        out: list[bytes] = []
        body = ChunkedBody(out.append)
        for piece, state, rest in (
            (b"3\r\nabc\r\n", Chunking.SIZE, None),  # a whole chunk
            (b"5\r\nhe", Chunking.DATA, None),
            (b"llo", Chunking.DATA_END, None),
            (b"\r", Chunking.DATA_END, None),  # half a CRLF waits
            (b"\n", Chunking.SIZE, None),
            (b"0\r\nX-T: 1\r\n", Chunking.TRAILER, None),
            (b"\r\nafter", Chunking.TRAILER, b"after"),
        ):
            self.assertEqual((body.feed(piece), body.state), (rest, state), piece)
        self.assertEqual(out, [b"abc", b"he", b"llo"])

    def test_the_chunks_of_one_read_are_delivered_in_one_call(self):
        out: list[bytes] = []
        body = ChunkedBody(out.append)
        self.assertIsNone(body.feed(b"2\r\nab\r\n3\r\ncde\r\n4\r\nfg"))
        self.assertEqual(out, [b"abcdefg"])  # two whole chunks and the start of a third
        self.assertEqual(body.feed(b"hi\r\n1\r\nj\r\n0\r\n\r\n"), b"")
        self.assertEqual(out, [b"abcdefg", b"hij"])

    def test_what_decoded_before_broken_framing_is_delivered_then_refused(self):
        out: list[bytes] = []
        body = ChunkedBody(out.append)
        self.assertRaises(WireError, body.feed, b"2\r\nab\r\n3\r\ncde\r\nzz\r\n")
        self.assertEqual(out, [b"abcde"])

    def test_each_state_is_documented_with_what_moves_it_on(self):
        for member in Chunking:
            self.assertIn(f"- ``{member.name}``:", Chunking.__doc__, member)

    def test_broken_framing_is_refused(self):
        for wire in (
            b"zz\r\n",
            b"5\r\nhelloXY",
            b"-1\r\n",
            b"\r\n",
            b"1" * 17 + b"\r\n",
            b"5" * 5000,
        ):
            self.assertRaises(WireError, ChunkedBody(lambda data: None).feed, wire)


# -- hostile and random input: an engine or peer is a surface a stranger can write to ------

FUZZ = settings.default.max_examples


class ChunkedProperties(SynchronousTestCase):
    @settings(max_examples=FUZZ, deadline=None)
    @given(
        body=st.binary(max_size=2000),
        sizes=st.lists(st.integers(1, 300), max_size=40),
        extension=st.sampled_from([b"", b";x=1", b' ;name="v"']),
        trailers=st.sampled_from([b"", b"X-T: 1\r\n", b"A: b\r\nC: d\r\n"]),
        upper=st.booleans(),
        cuts=st.lists(st.integers(0, 10_000), max_size=30),
    )
    def test_any_chunking_split_anywhere_decodes_to_the_body(
        self, body, sizes, extension, trailers, upper, cuts
    ):
        wire, position = b"", 0
        for size in sizes + [len(body)]:
            piece = body[position : position + size]
            if not piece:
                break
            digits = b"%x" % len(piece)
            wire += (digits.upper() if upper else digits) + extension + b"\r\n" + piece + b"\r\n"
            position += len(piece)
        wire += b"0" + extension + b"\r\n" + trailers + b"\r\n"
        out: list[bytes] = []
        decoder = ChunkedBody(out.append)
        rests = [decoder.feed(piece) for piece in splits(wire, cuts)]
        self.assertEqual(b"".join(out), body)
        self.assertEqual([r for r in rests if r is not None], [b""])
        self.assertIsNotNone(rests[-1])

    @settings(max_examples=FUZZ, deadline=None)
    @given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 10_000), max_size=20))
    def test_arbitrary_bytes_are_decoded_or_refused_never_anything_else(self, data, cuts):
        decoder = ChunkedBody(lambda piece: None)
        try:
            for piece in splits(data, cuts):
                if decoder.feed(piece) is not None:
                    break
        except WireError:
            pass


class HeadProperties(SynchronousTestCase):
    @settings(max_examples=FUZZ, deadline=None)
    @given(
        data=st.one_of(HEADS, st.binary(max_size=2000)),
        method=st.sampled_from([b"GET", b"HEAD", b"POST"]),
    )
    def test_arbitrary_heads_parse_or_are_refused_never_anything_else(self, data, method):
        """Parsed heads' fields are always ones Twisted's Headers accepts, so nothing the
        client builds from them can raise past its WireError handling."""
        from twisted.web.http_headers import Headers

        try:
            head = parse_head(data)
            Headers(head.fields)
            framing, length = body_framing(head, method)
            persistent(head, framing)
        except WireError:
            return
        self.assertIn(framing, (LENGTH, CHUNKED, UNTIL_CLOSE))
        self.assertTrue(length == -1 or length >= 0)

    @settings(max_examples=FUZZ, deadline=None)
    @given(data=st.binary(max_size=500))
    def test_the_end_of_a_head_is_found_in_any_bytes_or_not_at_all(self, data):
        found = find_head_end(data)
        if found is not None:
            end, after = found
            self.assertLessEqual(end, after)
            self.assertLessEqual(after, len(data))
            self.assertIn(data[end:after], (b"\r\n\r\n", b"\n\n", b"\n\r\n"))
