"""Hypothesis strategies and helpers the property tests share (the response reader's and the
client's), in their own module as klein keeps its strategies."""

from __future__ import annotations

from hypothesis import strategies as st


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` in non-empty pieces, cut where ``cuts`` say."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0] + points, points + [len(data)])]
    return [piece for piece in pieces if piece]


# Heads a hostile engine might send: a status line (mostly well-formed), header lines that
# are mostly well-formed (names of token characters, any value), and at most one line that
# is not: arbitrary bytes, or a name with characters a name must not hold.
TOKEN_TEXT = st.text("abcxyzABC0123-_!#$%&'*+.^`|~", min_size=1, max_size=12)
GOOD_LINES = st.lists(
    st.builds(
        lambda name, value: name.encode() + b": " + value,
        TOKEN_TEXT,
        st.one_of(
            st.sampled_from([b"1", b"0", b"chunked", b"close", b"5, 5", b"-1", b"gzip, chunked"]),
            st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
        ),
    ),
    max_size=6,
)
BAD_LINE = st.one_of(
    st.binary(min_size=1, max_size=30).map(lambda b: b.replace(b"\r\n", b"")),
    st.builds(
        lambda name: name.encode("utf-8") + b": x",
        st.text('ab()<>@,;\\"/[]?={} \t\u00e9\x00', min_size=1, max_size=8),
    ),
)
STATUS_LINES = st.sampled_from(
    [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 200 OK",
        b"HTTP/1.0 204",
        b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 101 Up",
        b"HTTP/1.1 099 Low",
        b"HTTP/2 200",
        b"ICY 200 OK",
    ]
)
HEADS = st.builds(
    lambda status, lines, bad, where: b"\r\n".join(
        [status] + (lines[:where] + [bad] + lines[where:] if bad is not None else lines)
    ),
    STATUS_LINES,
    GOOD_LINES,
    st.one_of(st.none(), BAD_LINE),
    st.integers(0, 6),
)
