"""Newline-delimited JSON-RPC 2.0 (docs/references.md#rpc-transport): framing, parsing, answering.

Bad input never stops the link: a line that is not JSON, not an object or not 2.0 is logged
and skipped, and an over-long line is discarded up to its newline (LineReceiver would drop
the connection instead, twisted-notes). Requests get exactly one answer; notifications none.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable

from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from zope.interface import implementer

from ..core import constants
from ..core.interfaces import IEmitter
from ..core.logs import logger
from ..request.events import quoted

log = logger()

PARSE_ERROR = -32700
INVALID_PARAMS = -32602
METHOD_NOT_FOUND = -32601
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000
NO_FACADE = -32002
BIND_FAILED = -32010


class RpcError(Exception):
    """An error answer with a code and an exact message (docs/references.md#exact-texts)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class MethodNotFound(RpcError):
    def __init__(self, method: str) -> None:
        super().__init__(METHOD_NOT_FOUND, f"method not found: {method}")


class NoAnswer(Exception):
    """Raised by a handler whose method is never answered (``discovery:nodes``)."""


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _int_or_infinity(text: str) -> int | float:
    """An integer beyond float range reads as an infinite float, as ``1e400`` does: exact
    within range, and no handler that reads a count as a float can overflow on one."""
    value = int(text)
    if abs(value) > sys.float_info.max:
        return math.inf if value > 0 else -math.inf
    return value


# Made once: json.dumps with any option builds a new encoder per call, and a cluster sends
# five or more notifications per request (docs/references.md#bare-proxy-cpu).
_STRICT = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_LENIENT = json.JSONEncoder(separators=(",", ":"), allow_nan=True)


def _encode(value: Any, strict: bool = True) -> bytes:
    """Compact JSON; ``strict`` refuses what is not JSON (NaN, Infinity) rather than write it."""
    return (_STRICT if strict else _LENIENT).encode(value).encode()


class LineFramer(Protocol):
    """Splits the stream into lines of at most ``max_line`` bytes; discards longer ones."""

    def __init__(
        self,
        on_line: Callable[[bytes], None],
        on_closed: Callable[[Failure], None],
        max_line: int = constants.MAX_RPC_LINE,
    ) -> None:
        self.on_line, self.on_closed, self.max_line = on_line, on_closed, max_line
        self._buffer = bytearray()
        self._discarding = False

    def dataReceived(self, data: bytes) -> None:
        # Scan only the new bytes: re-scanning (or re-copying) the whole buffer for every
        # chunk is quadratic in the line length, and a discarded line is never kept at all.
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            if self._discarding:
                if end < 0:
                    return
                self._discarding = False
                start = end + 1
                continue
            if end < 0:
                self._buffer += data[start:]
                if len(self._buffer) > self.max_line:
                    log.warn(
                        "discarding an over-long JSON-RPC line (over {limit} bytes)",
                        limit=self.max_line,
                    )
                    self._discarding = True
                    self._buffer = bytearray()
                return
            self._buffer += data[start:end]
            start = end + 1
            line, self._buffer = bytes(self._buffer), bytearray()
            if len(line) > self.max_line:
                log.warn("discarded an over-long JSON-RPC line ({size} bytes)", size=len(line))
                continue
            try:
                self.on_line(line.rstrip(b"\r"))
            except Exception:
                # An exception leaving dataReceived would drop the connection, and EOF on
                # the link shuts the process down: bad input must never stop the link.
                log.failure("failed handling a JSON-RPC line")

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.on_closed(reason)

    def send(self, message: dict) -> None:
        # Notifications are ours and must never fail on the way out (a request's end is
        # reported through here); an answer is checked strictly before it is sent.
        self.write(_encode(message, strict=False), message.get("method", "a reply"))

    def is_open(self) -> bool:
        """A transport is attached and its peer has not left: a line written now is sent."""
        return self.transport is not None and not getattr(self.transport, "disconnected", False)

    def write(self, line: bytes, what: str = "a reply") -> None:
        if self.transport is None or getattr(self.transport, "disconnected", False):
            log.debug("link closed; dropped {method}", method=what)
            return
        self.transport.write(line + b"\n")


@implementer(IEmitter)
class RpcLink:
    """The broker link: routes inbound messages to ``dispatch`` and sends what it answers.

    The broker consumes every notification: ``listening`` is always true.

    ``dispatch(method, params)`` returns the result, or raises RpcError / NoAnswer.
    """

    listening = True

    def __init__(
        self, dispatch: Callable[[str, Any], Any], on_closed: Callable[[], None] = lambda: None
    ) -> None:
        self.dispatch = dispatch
        self.framer = LineFramer(self.line_received, lambda reason: on_closed())
        self.after_answer: list[Callable[[], None]] = []
        self._heads: dict[tuple[str | None, str], str] = {}

    def is_open(self) -> bool:
        """Whether the link to the broker is open now (the admin listener shows it)."""
        return self.framer.is_open()

    def notify(self, method: str, params: dict, engine: str | None = None) -> None:
        name = f"{engine}:{method}" if engine else method
        self.framer.send({"jsonrpc": "2.0", "method": name, "params": params})

    def notify_json(self, method: str, params: str, engine: str | None = None) -> None:
        """``params`` spliced into the line that :meth:`notify` would write for them."""
        key = (engine, method)
        head = self._heads.get(key)
        if head is None:
            name = f"{engine}:{method}" if engine else method
            # A few per engine: the events of every request (workload:*, proxy/request*).
            head = self._heads[key] = '{"jsonrpc":"2.0","method":' + quoted(name) + ',"params":'
        self.framer.write((head + params + "}").encode(), method)

    def line_received(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            # UTF-8 only (docs/references.md#rpc-transport): json.loads(bytes) would also take
            # UTF-16/32, and NaN / Infinity are not JSON.
            message = json.loads(
                line.decode("utf-8"), parse_constant=_not_json, parse_int=_int_or_infinity
            )
        except (ValueError, UnicodeDecodeError, RecursionError):
            log.warn("skipped a JSON-RPC line that is not JSON")
            return
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            log.warn("skipped a JSON-RPC line that is not a 2.0 object")
            return
        method = message.get("method")
        if not isinstance(method, str):
            if "result" not in message and "error" not in message:
                log.warn("skipped a JSON-RPC message without a method")
            else:
                # This link sends only notifications, so nothing should answer it.
                log.debug("skipped a JSON-RPC response: this link sends no requests")
            return
        try:
            self._handle(message, method)
        finally:
            # Whatever the outcome, what was queued to run after the answer runs now, once,
            # and never leaks into a later message's turn.
            callbacks, self.after_answer[:] = list(self.after_answer), []
            for callback in callbacks:
                callback()

    def _handle(self, message: dict, method: str) -> None:
        answer_id = None
        if "id" in message:
            # Encoded once, before the method runs: an id that cannot be echoed as JSON (a
            # number beyond float range, or nested nearly as deep as the parser allows, which
            # would not encode deeper in the stack) must not run a request left unanswered.
            try:
                answer_id = _encode(message["id"])
            except (ValueError, RecursionError):
                log.warn("skipped a JSON-RPC request whose id cannot be echoed")
                return
        params = message.get("params", {})
        try:
            result = self.dispatch(method, params)
        except NoAnswer:
            return
        except RpcError as exc:
            if answer_id is not None:
                self._answer(answer_id, error={"code": exc.code, "message": exc.message})
            elif exc.code == METHOD_NOT_FOUND:
                # A newer broker may notify what this version does not know: not a fault.
                log.debug("skipped a JSON-RPC notification of a method this version does not know")
            else:
                # A notification has no answer to carry the error: the log is its only trace.
                log.warn("refused a JSON-RPC notification (error {code})", code=exc.code)
            return
        except Exception:
            log.failure("internal error handling {method}", method=method)
            if answer_id is not None:
                self._answer(
                    answer_id,
                    error={"code": INTERNAL_ERROR, "message": f"internal error handling {method}"},
                )
            return
        if answer_id is not None:
            try:
                self._answer(answer_id, result=result)
            except (TypeError, ValueError):
                # A result that does not serialize still gets its one answer.
                log.failure("internal error handling {method}", method=method)
                self._answer(
                    answer_id,
                    error={"code": INTERNAL_ERROR, "message": f"internal error handling {method}"},
                )

    def _answer(self, message_id: bytes, result=None, error=None) -> None:
        """``message_id`` is the request's id, already encoded."""
        head = b'{"jsonrpc":"2.0","id":' + message_id
        if error is not None:
            self.framer.write(head + b',"error":' + _encode(error) + b"}")
        else:
            self.framer.write(head + b',"result":' + _encode(result) + b"}")
