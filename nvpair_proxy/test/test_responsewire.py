"""The framing rules of an engine's response, byte by byte (RFC 9112 sections 4 to 7)."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.responsewire import (CHUNKED, LENGTH, UNTIL_CLOSE, ChunkedBody, WireError,
                                       body_framing, parse_head, persistent)


def head(*lines: bytes, status: bytes = b"HTTP/1.1 200 OK"):
    return parse_head(b"\r\n".join((status,) + lines))


class HeadTests(SynchronousTestCase):
    def test_status_line_and_fields_in_arrival_order(self):
        parsed = head(b"Content-Type: text/event-stream", b"X-A:one", b"x-a:  two \t",
                      status=b"HTTP/1.1 404 Not Found Here")
        self.assertEqual((parsed.version, parsed.code, parsed.phrase),
                         (b"HTTP/1.1", 404, b"Not Found Here"))
        self.assertEqual(parsed.fields, {b"content-type": [b"text/event-stream"],
                                         b"x-a": [b"one", b"two"]})

    def test_a_status_line_without_a_phrase(self):
        self.assertEqual((head(status=b"HTTP/1.0 204").code, head(status=b"HTTP/1.0 204").phrase),
                         (204, b""))

    def test_what_is_not_a_response_head(self):
        for status in (b"ICY 200 OK", b"HTTP/2 200", b"HTTP/1.1 2000 OK", b"HTTP/1.1 abc OK",
                       b"HTTP/1.1"):
            self.assertRaises(WireError, parse_head, status)
        for line in (b"no colon", b": empty name", b"Bad Name: x", b"Name : x", b" folded"):
            self.assertRaises(WireError, head, b"A: b", line)


class FramingTests(SynchronousTestCase):
    def test_responses_without_a_body(self):
        for code, method in ((204, b"GET"), (304, b"GET"), (200, b"HEAD"), (103, b"GET")):
            parsed = head(b"Content-Length: 10", status=b"HTTP/1.1 %d X" % code)
            self.assertEqual(body_framing(parsed, method), (LENGTH, 0))

    def test_chunked_wins_over_a_length_and_another_coding_reads_to_the_close(self):
        self.assertEqual(body_framing(head(b"Transfer-Encoding: gzip, Chunked",
                                           b"Content-Length: 5"), b"GET"), (CHUNKED, -1))
        self.assertEqual(body_framing(head(b"Transfer-Encoding: chunked, gzip"), b"GET"),
                         (UNTIL_CLOSE, -1))

    def test_a_length_repeated_alike_is_one_length_and_conflicting_ones_are_refused(self):
        self.assertEqual(body_framing(head(b"Content-Length: 7, 7", b"Content-Length: 7"),
                                      b"GET"), (LENGTH, 7))
        for values in ((b"Content-Length: 7", b"Content-Length: 8"), (b"Content-Length: -1",),
                       (b"Content-Length: 0x10",), (b"Content-Length: " + b"9" * 19,)):
            self.assertRaises(WireError, body_framing, head(*values), b"GET")

    def test_no_framing_header_reads_to_the_close(self):
        self.assertEqual(body_framing(head(), b"POST"), (UNTIL_CLOSE, -1))

    def test_which_connections_may_carry_another_request(self):
        self.assertTrue(persistent(head(b"Content-Length: 1"), LENGTH))
        self.assertFalse(persistent(head(b"Connection: keep-alive, Close"), LENGTH))
        self.assertFalse(persistent(head(status=b"HTTP/1.0 200 OK"), LENGTH))
        self.assertFalse(persistent(head(), UNTIL_CLOSE))


class ChunkedTests(SynchronousTestCase):
    WIRE = (b"5;name=value\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n0\r\nTrailer: yes\r\n\r\n")

    def decode(self, pieces):
        out: list[bytes] = []
        body = ChunkedBody(out.append)
        rests = [body.feed(piece) for piece in pieces]
        return b"".join(out), rests

    def test_decoded_alike_however_the_bytes_are_split(self):
        whole, rests = self.decode([self.WIRE])
        self.assertEqual((whole, rests), (b"hello" + b"x" * 26, [b""]))
        for size in (1, 2, 3, 7):
            pieces = [self.WIRE[i:i + size] for i in range(0, len(self.WIRE), size)]
            data, rests = self.decode(pieces)
            self.assertEqual(data, whole, size)
            self.assertEqual([r for r in rests if r is not None], [b""], size)
            self.assertIsNone(rests[-2] if len(rests) > 1 else None, size)

    def test_bytes_after_the_last_chunk_are_handed_back(self):
        self.assertEqual(self.decode([b"0\r\n\r\nHTTP/1.1"])[1], [b"HTTP/1.1"])

    def test_broken_framing_is_refused(self):
        for wire in (b"zz\r\n", b"5\r\nhelloXY", b"-1\r\n", b"\r\n", b"1" * 17 + b"\r\n",
                     b"5" * 5000):
            self.assertRaises(WireError, ChunkedBody(lambda data: None).feed, wire)
