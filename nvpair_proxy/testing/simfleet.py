"""A simulated fleet of LLM engine nodes (Ollama, LM Studio, llama.cpp) on real sockets.

The proxy is only as well tested as its fake engine is honest, so each node speaks its
dialect's real wire formats (Ollama NDJSON, OpenAI SSE, Anthropic Messages and OpenAI Responses
SSE, the model-list envelopes, the error bodies) and fails on demand in the ways real engines
fail: an error status, silence before or after the headers, or a connection that drops
mid-stream. Time comes from the injected reactor, so tests drive token spacing with a ``Clock``.

Every response carries ``X-Sim-Node: <id>`` so a demo or a test can see which node answered.

Engine truth: each node answers its dialect's side-effect-free truth routes (the ``[truth]``
of its engine file) with the real shapes: llama.cpp ``GET /slots`` (an array, one object per
slot with ``id`` and ``is_processing``; 501 as with ``--no-slots`` when the node has no slot
count), Ollama ``GET /api/ps`` (the loaded models) and LM Studio ``GET /api/v0/models`` (every
model with ``state`` ``loaded`` or ``not-loaded``). A llama.cpp node with ``router = true``
runs like ``llama-server --models-dir``: it serves every model in ``models``, reports each one's
``status`` on ``/models``, runs ``slots`` per model, and answers ``/slots`` only with
``?model=<a loaded one>`` (400 without). No truth route ever loads a model.

Knobs (SimNode fields, fleet-file keys, most also ``/_sim/fault`` fields):

- ``slots`` (default None: unlimited, no ``/slots``): requests run at once. Busy slots are the
  inference requests in progress; when all are busy a new one waits inside the engine, in
  arrival order, and starts when one ends (a real engine's own queue).
- ``loaded`` (default None: every model is warm): for Ollama, LM Studio and a llama.cpp router
  the warm subset of ``models``; a model outside it is cold. For plain llama.cpp (no
  autoload) the only models it answers for at all.
- ``cold_load_delay`` (default 0): seconds the first inference request for a cold model holds
  its slot before its first byte; then the model counts as loaded. Requests for a model that
  is loading wait for the same load.
- ``router`` (llama.cpp only, default false): see above.
- ``prompt_delay`` (default 0): seconds a generation reads its prompt before its first byte
  (headers and first token come together, as from a real engine), when the prompt cache does
  not hold the conversation's head.
- ``prompt_cache`` (default 0: off) and ``cached_prompt_delay`` (default 0): the prompt cache
  (llama.cpp's reuse of a slot's prefix and its host-RAM prompt cache; Ollama and LM Studio
  inherit both). The node remembers the heads of the last ``prompt_cache`` conversations it
  generated for, the one used longest ago going first. A head is a digest of the model and
  the conversation's stable start: the system prompt (``system``, ``instructions`` or a
  leading system or developer message) and the first user message, or for a bare ``prompt``
  its first 4 KiB. A generation whose head is held (a hit) reads its prompt in
  ``cached_prompt_delay`` instead of ``prompt_delay`` and reuses the prompt tokens the node
  read for that head last time, at most all but one of its own; a miss reads them all. Every
  generation that starts puts its head first in the cache. llama.cpp reports the split in its
  ``timings`` as llama.cpp does: ``cache_n`` reused, ``prompt_n`` read (``usage`` still counts
  the whole prompt); ``prompt_ms`` is the time spent reading. Embeddings never touch the cache.

- ``close_after_stream`` (default: as the dialect's engine, so true for llama.cpp, which
  closes right after every streamed answer though its headers say keep-alive): close the
  connection once a stream's terminator is written.
- ``drop_after_read`` (default false): read each request, then close its connection without
  a byte of answer (``dropped`` counts them): a request the engine saw and lost.

``/_sim/state`` also reports ``busy`` and ``queued`` (inference requests running, and waiting
inside the engine), ``truth_reads`` (requests to the truth routes), ``cache_hits`` and
``cache_misses`` (generations whose head the prompt cache held, or did not; both stay 0 while
``prompt_cache`` is 0) and ``cached_heads`` (the heads it holds now).

Admin routes: ``POST /_sim/fault`` (a JSON object of ``FAULT_FIELDS``) changes a node at
runtime, ``GET /_sim/state`` reports its fields and what it served, and
``GET /_sim/stalled?count=N`` answers once N streams have been paused by a slow reader. They are
loopback
test aids with no authentication: the CLI listens on 127.0.0.1 only, and nothing should ever
expose them further.

CLI: ``python -m nvpair_proxy.testing.simfleet FLEET.toml`` (the file format is in ``parse_fleet``).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import tomllib
from collections import OrderedDict, deque
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Protocol, Sequence, cast

import attrs
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IDelayedCall, IListeningPort, IReactorTCP, IReactorTime
from twisted.internet.protocol import ServerFactory
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

DIALECTS = ("ollama", "lmstudio", "llamacpp")

# The fields POST /_sim/fault may change; identity (id, dialect, port) and records may not.
FAULT_FIELDS = (
    "models",
    "loaded",
    "tokens",
    "token_delay",
    "chunk_size",
    "status",
    "hang_before_headers",
    "headers_delay",
    "hang_after_headers",
    "die_after_tokens",
    "slots",
    "cold_load_delay",
    "prompt_delay",
    "prompt_cache",
    "cached_prompt_delay",
    "close_after_stream",
    "drop_after_read",
)

_FILLER = "abcdefghijklmnopqrstuvwxyz0123456789"

# Simulated cost floors, so a zero-delay run still reports finite, non-zero rates.
_SECONDS_PER_PROMPT_TOKEN = 0.001
_MIN_SECONDS_PER_TOKEN = 0.001
_LOAD_SECONDS = 0.001
# How much of a bare prompt (completions, Ollama generate) is its conversation's head.
_PROMPT_HEAD = 4 * 1024


def token_text(node_id: str, index: int, chunk_size: int = 0) -> str:
    """The content of token ``index``; it names the node so a test can see who answered.

    With ``chunk_size`` the text is padded with a fixed pattern to that many characters, so
    multi-megabyte streams stay deterministic and can be compared byte for byte.
    """
    text = f"{node_id} says hello {index} "
    missing = chunk_size - len(text)
    if missing > 0:
        text += (_FILLER * (missing // len(_FILLER) + 1))[:missing]
    return text


# -- the node ------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(low: int, high: int | None = None):
    def check(instance, attribute, value):
        if not _is_int(value) or value < low or (high is not None and value > high):
            bound = f"{low}-{high}" if high is not None else f">= {low}"
            raise ValueError(f"{attribute.name} must be an integer {bound} (got {value!r})")

    return check


def _optional(check):
    def optional_check(instance, attribute, value):
        if value is not None:
            check(instance, attribute, value)

    return optional_check


def _flag(instance, attribute, value):
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true or false (got {value!r})")


def _seconds(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _non_negative_seconds(instance, attribute, value):
    if not isinstance(value, float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{attribute.name} must be a number of seconds >= 0 (got {value!r})")


def _names(instance, attribute, value):
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{attribute.name} must be a list of non-empty strings (got {value!r})")


def _node_id(instance, attribute, value):
    if not isinstance(value, str) or not value:
        raise ValueError(f"id must be a non-empty string (got {value!r})")


def _dialect(instance, attribute, value):
    if value not in DIALECTS:
        raise ValueError(f"dialect must be one of {', '.join(DIALECTS)} (got {value!r})")


def ollama_name(name: str) -> str:
    """Ollama's own naming rule: a missing tag means ``:latest``."""
    name = name.strip()
    last = name.rsplit("/", 1)[-1]
    if name and ":" not in last and "@" not in last:
        name += ":latest"
    return name


@attrs.define
class SimNode:
    """One simulated engine node: its identity, catalog, pacing, fault switches and records.

    Fault switches are read when a request arrives, so a change through ``/_sim/fault``
    applies to the next request and never to one already streaming.
    """

    node_id: str = attrs.field(validator=_node_id)
    dialect: str = attrs.field(validator=_dialect)
    models: list[str] = attrs.field(factory=list, validator=_names)
    # Plain llama.cpp runs without model autoload: only these make it answer. Ollama, LM
    # Studio and a llama.cpp router: the warm ones (the rest load on first use). None: all.
    loaded: list[str] | None = attrs.field(default=None, validator=_optional(_names))
    port: int = attrs.field(default=0, validator=_int_in(0, 65535))
    tokens: int = attrs.field(default=6, validator=_int_in(0))
    token_delay: float = attrs.field(
        default=0.0, converter=_seconds, validator=_non_negative_seconds
    )
    chunk_size: int = attrs.field(default=0, validator=_int_in(0))
    status: int | None = attrs.field(default=None, validator=_optional(_int_in(400, 599)))
    hang_before_headers: bool = attrs.field(default=False, validator=_flag)
    # Seconds an inference request waits before it is answered at all (a busy engine's
    # queue): a link cut inside this wait is what stops the answer, not the node.
    headers_delay: float = attrs.field(
        default=0.0, converter=_seconds, validator=_non_negative_seconds
    )
    hang_after_headers: bool = attrs.field(default=False, validator=_flag)
    die_after_tokens: int | None = attrs.field(default=None, validator=_optional(_int_in(0)))
    # Inference requests run at once (per model for a llama.cpp router); None: unlimited.
    slots: int | None = attrs.field(default=None, validator=_optional(_int_in(1)))
    # Seconds the first request for a cold model waits before its first byte.
    cold_load_delay: float = attrs.field(
        default=0.0, converter=_seconds, validator=_non_negative_seconds
    )
    # llama.cpp only: a router (``--models-dir``) that loads any of models on first use.
    router: bool = attrs.field(default=False, validator=_flag)
    # Seconds a generation reads its prompt before its first byte (a prompt cache miss).
    prompt_delay: float = attrs.field(
        default=0.0, converter=_seconds, validator=_non_negative_seconds
    )
    # Conversation heads the prompt cache holds (0: no cache), and the seconds a generation
    # whose head it holds reads its prompt instead of prompt_delay.
    prompt_cache: int = attrs.field(default=0, validator=_int_in(0))
    cached_prompt_delay: float = attrs.field(
        default=0.0, converter=_seconds, validator=_non_negative_seconds
    )
    # Close the connection right after a streamed answer, whatever its headers said, as
    # llama-server does (it sends ``Keep-Alive: timeout=5, max=100`` and closes). None: as
    # the dialect's engine does (llama.cpp closes, Ollama and LM Studio keep it open).
    close_after_stream: bool | None = attrs.field(default=None, validator=_optional(_flag))
    # Read each request (any route but the admin ones), then close its connection without
    # answering: a request the engine saw and dropped.
    drop_after_read: bool = attrs.field(default=False, validator=_flag)
    # Requests read and dropped by drop_after_read.
    dropped: int = 0
    # Inference requests running now, and waiting inside the engine for a slot.
    busy: int = 0
    queued: int = 0
    # Requests to the truth routes (/slots, /api/ps, /api/v0/models, llama.cpp /models).
    truth_reads: int = 0
    # Generations whose head the prompt cache held, and did not (only while it is on).
    cache_hits: int = 0
    cache_misses: int = 0
    # What runs, waits and loads now, shared by every resource serving this node.
    engine: _EngineState = attrs.field(
        init=False, factory=lambda: _EngineState(), eq=False, repr=False
    )
    # Every inference request that reached this node, whatever it was answered.
    served: list[tuple[str, str]] = attrs.field(factory=list)
    # The last non-admin request's headers: lower-case name -> values in arrival order
    # (a list, so a test can see whether a proxy kept repeated headers apart).
    headers_seen: dict[str, list[str]] = attrs.field(factory=dict)
    # Streams a slow reader paused (the transport's backpressure reached this engine).
    stalled: int = 0

    def __attrs_post_init__(self) -> None:
        if self.router and self.dialect != "llamacpp":
            raise ValueError("router is for llamacpp nodes only")

    @property
    def closes_after_streams(self) -> bool:
        if self.close_after_stream is None:
            return self.dialect == "llamacpp"
        return self.close_after_stream

    @property
    def loads_on_demand(self) -> bool:
        """Whether a model outside ``loaded`` is cold (loads on first use) rather than absent."""
        return self.dialect != "llamacpp" or self.router

    def available(self) -> list[str]:
        """The models this node answers for (and lists, for llama.cpp)."""
        if not self.loads_on_demand and self.loaded is not None:
            return list(self.loaded)
        return list(self.models)

    def model_key(self, model: str) -> str:
        """The name a model is known by here (Ollama's implied ``:latest``)."""
        return ollama_name(model) if self.dialect == "ollama" else model

    def has_model(self, model: str) -> bool:
        return self.model_key(model) in {self.model_key(m) for m in self.available()}

    def is_warm(self, model: str) -> bool:
        """Whether ``model`` is loaded (a model this node answers for)."""
        if self.loaded is None or not self.loads_on_demand:
            return True
        return self.model_key(model) in {self.model_key(m) for m in self.loaded}

    def mark_loaded(self, model: str) -> None:
        if not self.is_warm(model):
            assert self.loaded is not None
            self.loaded.append(self.model_key(model))

    def set_faults(self, changes: Mapping[str, Any]) -> None:
        """Apply a ``/_sim/fault`` body all or nothing; ValueError names the bad field."""
        unknown = sorted(set(changes) - set(FAULT_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown field(s): {', '.join(unknown)}; want any of {', '.join(FAULT_FIELDS)}"
            )
        checked = attrs.evolve(self, **changes)
        for name in changes:
            setattr(self, name, getattr(checked, name))
        self.engine.trim_cache(self.prompt_cache)

    def read_prompt(self, head: bytes | None, prompt_tokens: int) -> tuple[int, float]:
        """A generation with this ``head`` (None: none) starts: (the prompt tokens it reuses
        from the prompt cache, the seconds it reads its prompt). Puts the head first in the
        cache."""
        if not self.prompt_cache:
            return 0, self.prompt_delay
        cache = self.engine.cache
        held = cache.get(head) if head is not None else None
        if held is None:
            self.cache_misses += 1
        else:
            self.cache_hits += 1
        if head is not None:
            cache[head] = prompt_tokens
            cache.move_to_end(head)
            self.engine.trim_cache(self.prompt_cache)
        if held is None:
            return 0, self.prompt_delay
        return min(held, prompt_tokens - 1), self.cached_prompt_delay

    def state(self) -> dict[str, Any]:
        """The node as ``/_sim/state`` reports it."""
        fields = attrs.asdict(self, filter=lambda attribute, value: attribute.name != "engine")
        return {**fields, "served_count": len(self.served), "cached_heads": len(self.engine.cache)}


class _EngineState:
    """A node's requests in progress: per slot group (a router's model, else None) the count
    running and the queue waiting, per model loading now, who waits for it, and the prompt
    cache: each head held -> the prompt tokens last read for it, the one used last at the end."""

    def __init__(self) -> None:
        self.busy: dict[str | None, int] = {}
        self.waiting: dict[str | None, deque[tuple[Request, str, dict, str]]] = {}
        self.loading: dict[str, list[tuple[Request, Callable[[], None]]]] = {}
        self.cache: OrderedDict[bytes, int] = OrderedDict()

    def trim_cache(self, size: int) -> None:
        """Forget the heads used longest ago beyond ``size``."""
        while len(self.cache) > size:
            self.cache.popitem(last=False)


# -- wire helpers --------------------------------------------------------------------------


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _sse(value: Any, event: str | None = None) -> bytes:
    prefix = f"event: {event}\n".encode("ascii") if event else b""
    return prefix + b"data: " + _dumps(value) + b"\n\n"


def _ndjson(value: Any) -> bytes:
    return _dumps(value) + b"\n"


def _headers_of(request: Request) -> dict[str, list[str]]:
    return {
        name.decode("latin-1").lower(): [v.decode("latin-1") for v in values]
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_LLAMACPP_ERRORS = {
    400: "invalid_request_error",
    404: "not_found_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


def _error_body(style: str, status: int, message: str) -> dict[str, Any]:
    """An error in the shape the route's own clients parse."""
    if style == "ollama":
        return {"error": message}
    if style == "anthropic":
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_ERRORS.get(status, "api_error"), "message": message},
        }
    if style == "llamacpp":
        return {
            "error": {
                "code": status,
                "message": message,
                "type": _LLAMACPP_ERRORS.get(status, "server_error"),
            }
        }
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": None,
        }
    }


def _prompt_words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_prompt_words(item) for item in value)
    if isinstance(value, dict):
        return sum(_prompt_words(v) for k, v in value.items() if k in ("content", "text"))
    return 0


def _prompt_tokens(body: Mapping[str, Any]) -> int:
    """Words of the prompt stand in for tokens, so a test can predict the count."""
    return max(
        1,
        sum(
            _prompt_words(body.get(key))
            for key in ("prompt", "system", "instructions", "messages", "input")
        ),
    )


def _text_of(value: Any) -> str:
    """The text of a message's content: a string, or the ``text`` of its parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(
            _text_of(part.get("text", part.get("content")))
            if isinstance(part, dict)
            else _text_of(part)
            for part in value
        )
    return ""


def _conversation_head(model: str, body: Mapping[str, Any]) -> bytes | None:
    """The digest of what a conversation's every turn starts with (see ``prompt_cache``):
    the model, the system prompt and the first user message, or a bare prompt's first
    4 KiB; None for a body without one."""
    system = _text_of(body.get("system")) or _text_of(body.get("instructions"))
    first: str | None = None
    given = body.get("messages")
    if not isinstance(given, list):
        given = body.get("input")
    if isinstance(given, str):
        first = given
    elif isinstance(given, list):
        for message in given:
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            if role in ("system", "developer") and not system:
                system = _text_of(message.get("content"))
            elif role in ("user", None) and "content" in message:
                first = _text_of(message["content"])
                break
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            first = prompt[:_PROMPT_HEAD]
    if first is None:
        return None
    return hashlib.sha256(_dumps([model, system, first])).digest()


def _embedding(node_id: str, model: str, text: str) -> list[float]:
    digest = hashlib.sha256(f"{node_id}\0{model}\0{text}".encode("utf-8")).digest()
    return [round(byte / 127.5 - 1.0, 6) for byte in digest[:4]]


def _inputs(value: Any) -> list[str]:
    items = value if isinstance(value, list) else ([] if value is None else [value])
    return [item if isinstance(item, str) else json.dumps(item) for item in items]


# -- one generation ------------------------------------------------------------------------


@attrs.frozen
class _Job:
    """What one generation request asked for, fixed when it arrived."""

    node_id: str
    dialect: str
    model: str
    reply_id: str
    created: float
    prompt_tokens: int
    completion_tokens: int
    chunk_size: int
    include_usage: bool
    # Prompt tokens reused from the prompt cache, and seconds spent reading the rest.
    cached_tokens: int = 0
    prompt_seconds: float = 0.0

    def text(self, index: int) -> str:
        return token_text(self.node_id, index, self.chunk_size)

    def full_text(self) -> str:
        return "".join(self.text(i) for i in range(self.completion_tokens))

    def eval_seconds(self, now: float) -> float:
        return max(
            now - self.created - self.prompt_seconds,
            self.completion_tokens * _MIN_SECONDS_PER_TOKEN,
        )

    def read_seconds(self) -> float:
        """Seconds spent reading the prompt tokens not reused from the cache."""
        read = self.prompt_tokens - self.cached_tokens
        return max(self.prompt_seconds, read * _SECONDS_PER_PROMPT_TOKEN)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def timings(self, now: float) -> dict[str, float]:
        predicted_ms = self.eval_seconds(now) * 1000.0
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": self.prompt_tokens - self.cached_tokens,
            "prompt_ms": self.read_seconds() * 1000.0,
            "predicted_n": self.completion_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_second": self.completion_tokens / predicted_ms * 1000.0
            if predicted_ms
            else 0.0,
        }

    def ollama_stats(self, now: float) -> dict[str, int]:
        load = round(_LOAD_SECONDS * 1e9)
        prompt = round(self.read_seconds() * 1e9)
        evaluation = round(self.eval_seconds(now) * 1e9)
        return {
            "total_duration": load + prompt + evaluation,
            "load_duration": load,
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": prompt,
            "eval_count": self.completion_tokens,
            "eval_duration": evaluation,
        }

    def openai_extras(self, now: float, streaming: bool) -> dict[str, Any]:
        """Usage (always off-stream; on a stream when asked, or always for LM Studio) and
        llama.cpp's own timings."""
        extras: dict[str, Any] = {}
        if not streaming or self.include_usage:
            extras["usage"] = self.usage()
        if self.dialect == "llamacpp":
            extras["timings"] = self.timings(now)
        return extras


class _Format(Protocol):
    """One dialect's generation body: what a stream starts with, each token, its end, or the
    whole answer when not streaming; ``id_prefix`` starts its reply ids."""

    content_type: bytes
    id_prefix: str

    def prologue(self, job: _Job) -> bytes: ...

    def token(self, job: _Job, index: int, now: float) -> bytes: ...

    def epilogue(self, job: _Job, now: float) -> bytes: ...

    def whole(self, job: _Job, now: float) -> dict[str, Any]: ...


class _OllamaNative:
    """``/api/chat`` and ``/api/generate``: NDJSON lines, the last one ``"done":true``."""

    content_type = b"application/x-ndjson"
    id_prefix = ""

    def __init__(self, chat: bool):
        self._chat = chat

    def _frame(self, job: _Job, now: float, content: str) -> dict[str, Any]:
        frame: dict[str, Any] = {"model": job.model, "created_at": _rfc3339(now)}
        if self._chat:
            frame["message"] = {"role": "assistant", "content": content}
        else:
            frame["response"] = content
        return frame

    def prologue(self, job: _Job) -> bytes:
        return b""

    def token(self, job: _Job, index: int, now: float) -> bytes:
        return _ndjson({**self._frame(job, now, job.text(index)), "done": False})

    def epilogue(self, job: _Job, now: float) -> bytes:
        return _ndjson(self._whole(job, "", now))

    def whole(self, job: _Job, now: float) -> dict[str, Any]:
        return self._whole(job, job.full_text(), now)

    def _whole(self, job: _Job, content: str, now: float) -> dict[str, Any]:
        return {
            **self._frame(job, now, content),
            "done_reason": "stop",
            "done": True,
            **job.ollama_stats(now),
        }


class _OpenAI:
    """``/v1/chat/completions`` and ``/v1/completions``: SSE chunks, then ``data: [DONE]``."""

    content_type = b"text/event-stream"

    def __init__(self, chat: bool):
        self._chat = chat
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"

    def _head(self, job: _Job, obj: str) -> dict[str, Any]:
        return {"id": job.reply_id, "object": obj, "created": int(job.created), "model": job.model}

    def _choice(self, content: str | None, finish: str | None, streaming: bool):
        if not self._chat:
            return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
        if streaming:
            delta = {} if content is None else {"role": "assistant", "content": content}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "logprobs": None,
            "finish_reason": finish,
        }

    def prologue(self, job: _Job) -> bytes:
        return b""

    def token(self, job: _Job, index: int, now: float) -> bytes:
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        return _sse(
            {
                **self._head(job, obj),
                "choices": [self._choice(job.text(index), None, streaming=True)],
            }
        )

    def epilogue(self, job: _Job, now: float) -> bytes:
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        final = {
            **self._head(job, obj),
            "choices": [self._choice(None, "stop", streaming=True)],
            **job.openai_extras(now, streaming=True),
        }
        return _sse(final) + b"data: [DONE]\n\n"

    def whole(self, job: _Job, now: float) -> dict[str, Any]:
        obj = "chat.completion" if self._chat else "text_completion"
        return {
            **self._head(job, obj),
            "choices": [self._choice(job.full_text(), "stop", streaming=False)],
            **job.openai_extras(now, streaming=False),
        }


class _Anthropic:
    """``/v1/messages``: named SSE events, ``message_stop`` last."""

    content_type = b"text/event-stream"
    id_prefix = "msg_"

    def _message(self, job: _Job, content: list, stop: str | None, output: int):
        return {
            "id": job.reply_id,
            "type": "message",
            "role": "assistant",
            "model": job.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": job.prompt_tokens, "output_tokens": output},
        }

    def prologue(self, job: _Job) -> bytes:
        return _sse(
            {"type": "message_start", "message": self._message(job, [], None, 0)}, "message_start"
        ) + _sse(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        )

    def token(self, job: _Job, index: int, now: float) -> bytes:
        return _sse(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": job.text(index)},
            },
            "content_block_delta",
        )

    def epilogue(self, job: _Job, now: float) -> bytes:
        return (
            _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + _sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": job.completion_tokens},
                },
                "message_delta",
            )
            + _sse({"type": "message_stop"}, "message_stop")
        )

    def whole(self, job: _Job, now: float) -> dict[str, Any]:
        return self._message(
            job, [{"type": "text", "text": job.full_text()}], "end_turn", job.completion_tokens
        )


class _Responses:
    """``/v1/responses`` (OpenAI Responses): named SSE events, ``response.completed`` last.

    The event sequence and fields are OpenAI's (``sequence_number`` counting from 0), because
    that is what the ``openai`` client and the proxy's stats reader are tested against; usage
    comes only in the final ``response.completed``, and llama.cpp adds its ``timings`` there.
    """

    content_type = b"text/event-stream"
    id_prefix = "resp_"
    # response.created, response.in_progress, output_item.added, content_part.added
    _OPENING_EVENTS = 4

    def _item_id(self, job: _Job) -> str:
        return "msg_" + job.reply_id[len(self.id_prefix) :]

    def _response(self, job: _Job, status: str, output: list, usage: dict | None):
        return {
            "id": job.reply_id,
            "object": "response",
            "created_at": int(job.created),
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "max_output_tokens": None,
            "model": job.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": {},
        }

    def _item(self, job: _Job, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self._part(text)]
        return {
            "id": self._item_id(job),
            "type": "message",
            "status": "in_progress" if text is None else "completed",
            "role": "assistant",
            "content": content,
        }

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _usage(self, job: _Job) -> dict[str, Any]:
        return {
            "input_tokens": job.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": job.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": job.prompt_tokens + job.completion_tokens,
        }

    def _event(self, name: str, sequence: int, **fields: Any) -> bytes:
        return _sse({"type": name, "sequence_number": sequence, **fields}, name)

    def _where(self, job: _Job) -> dict[str, Any]:
        return {"item_id": self._item_id(job), "output_index": 0, "content_index": 0}

    def prologue(self, job: _Job) -> bytes:
        opening = self._response(job, "in_progress", [], None)
        return (
            self._event("response.created", 0, response=opening)
            + self._event("response.in_progress", 1, response=opening)
            + self._event(
                "response.output_item.added", 2, output_index=0, item=self._item(job, None)
            )
            + self._event("response.content_part.added", 3, **self._where(job), part=self._part(""))
        )

    def token(self, job: _Job, index: int, now: float) -> bytes:
        return self._event(
            "response.output_text.delta",
            self._OPENING_EVENTS + index,
            **self._where(job),
            delta=job.text(index),
            logprobs=[],
        )

    def epilogue(self, job: _Job, now: float) -> bytes:
        text = job.full_text()
        sequence = self._OPENING_EVENTS + job.completion_tokens
        extra = {"timings": job.timings(now)} if job.dialect == "llamacpp" else {}
        return (
            self._event(
                "response.output_text.done", sequence, **self._where(job), text=text, logprobs=[]
            )
            + self._event(
                "response.content_part.done",
                sequence + 1,
                **self._where(job),
                part=self._part(text),
            )
            + self._event(
                "response.output_item.done",
                sequence + 2,
                output_index=0,
                item=self._item(job, text),
            )
            + self._event(
                "response.completed", sequence + 3, response=self.whole(job, now), **extra
            )
        )

    def whole(self, job: _Job, now: float) -> dict[str, Any]:
        return self._response(
            job, "completed", [self._item(job, job.full_text())], self._usage(job)
        )


class _Generation:
    """Writes one answer as time passes on the injected clock.

    Step ``i`` (at ``i * delay`` after the prompt was read: ``prompt_seconds`` after arrival)
    writes token ``i``; step ``tokens`` the terminal frame (or, off-stream, the whole body:
    headers come only with the first byte, as with a real engine). It is the request's push
    producer, so a slow reader slows it.
    """

    def __init__(
        self,
        request: Request,
        clock: IReactorTime,
        fmt: _Format,
        job: _Job,
        streaming: bool,
        delay: float,
        die_after: int | None,
        on_pause: Callable[[], None] = lambda: None,
        close_after: bool = False,
    ):
        self._on_pause = on_pause
        self._close_after = close_after
        self._request = request
        self._clock = clock
        self._fmt = fmt
        self._job = job
        self._streaming = streaming
        self._delay = delay
        self._die_after = die_after
        self._step = 0
        self._call: IDelayedCall | None = None
        self._paused = False
        self._done = False

    def start(self) -> None:
        content_type = self._fmt.content_type if self._streaming else b"application/json"
        self._request.setHeader(b"Content-Type", content_type)
        self._request.notifyFinish().addErrback(self._client_gone)
        self._request.registerProducer(self, True)
        if self._job.prompt_seconds > 0:
            self._call = self._clock.callLater(self._job.prompt_seconds, self._run)
        else:
            self._run()

    def _run(self) -> None:
        """Take every step that is due; steps keep to ``start + i * delay``, so a late
        wake-up (a busy reactor, a paused client) catches up instead of drifting."""
        self._call = None
        while not self._done and not self._paused:
            self._take_step()
            wait = (
                self._job.created
                + self._job.prompt_seconds
                + self._step * self._delay
                - self._clock.seconds()
            )
            if not self._done and wait > 0:
                self._call = self._clock.callLater(wait, self._run)
                return

    def _take_step(self) -> None:
        index, job = self._step, self._job
        self._step += 1
        if index == self._die_after:
            if self._streaming:
                self._request.write(self._fmt.prologue(job) if index == 0 else b"")
            self._end(die=True)
            return
        head = self._fmt.prologue(job) if index == 0 and self._streaming else b""
        if index < job.completion_tokens:
            if self._streaming:
                self._request.write(head + self._fmt.token(job, index, self._clock.seconds()))
            return
        if self._streaming:
            self._request.write(head + self._fmt.epilogue(job, self._clock.seconds()))
        else:
            body = _dumps(self._fmt.whole(job, self._clock.seconds()))
            self._request.setHeader(b"Content-Length", b"%d" % len(body))
            self._request.write(body)
        self._end(die=False)

    def _end(self, die: bool) -> None:
        """Stop for good; a death closes the socket without the chunked terminator.

        ``loseConnection`` (not an abort) so the tokens already written still reach the
        client: it sees exactly ``die_after_tokens`` tokens, then the connection closing.
        """
        self._stop()
        self._request.unregisterProducer()
        if die:
            transport = self._request.channel.transport
            assert transport is not None, "a request being answered has its connection"
            transport.loseConnection()
            return
        channel = self._request.channel
        self._request.finish()
        if self._close_after and channel is not None and channel.transport is not None:
            channel.transport.loseConnection()  # after the terminator is written

    def _stop(self) -> None:
        self._done = True
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _client_gone(self, reason: Failure) -> None:
        self._stop()

    def pauseProducing(self) -> None:
        if not self._paused and not self._done:
            self._on_pause()
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        if not self._done and self._call is None:
            self._run()

    def stopProducing(self) -> None:
        self._stop()


# -- the resource --------------------------------------------------------------------------

_GENERATION: dict[str, _Format] = {
    "ollama-chat": _OllamaNative(chat=True),
    "ollama-generate": _OllamaNative(chat=False),
    "chat": _OpenAI(chat=True),
    "completion": _OpenAI(chat=False),
    "messages": _Anthropic(),
    "responses": _Responses(),
}

# What all three engines serve alike: the OpenAI set, Anthropic Messages, OpenAI Responses.
_SHARED_ROUTES = {
    ("POST", "/v1/chat/completions"): "chat",
    ("POST", "/v1/completions"): "completion",
    ("POST", "/v1/embeddings"): "embeddings",
    ("POST", "/v1/messages"): "messages",
    ("POST", "/v1/responses"): "responses",
}

_INFERENCE = {
    "ollama": {
        ("POST", "/api/chat"): "ollama-chat",
        ("POST", "/api/generate"): "ollama-generate",
        ("POST", "/api/embed"): "ollama-embed",
        ("POST", "/api/embeddings"): "ollama-embeddings",
        **_SHARED_ROUTES,
    },
    "lmstudio": dict(_SHARED_ROUTES),
    "llamacpp": dict(_SHARED_ROUTES),
}

_MODEL_LISTS = {
    "ollama": {"/api/tags": "ollama", "/v1/models": "openai"},
    "lmstudio": {"/v1/models": "openai"},
    "llamacpp": {"/models": "openai", "/v1/models": "openai"},
}

_OWNED_BY = {"ollama": "library", "lmstudio": "organization_owner", "llamacpp": "llamacpp"}

# The side-effect-free routes each engine file's [truth] names (llama.cpp's /models is also a
# model list, counted there).
_TRUTH = {
    "ollama": {"/api/ps": "ps"},
    "lmstudio": {"/api/v0/models": "v0-models"},
    "llamacpp": {"/slots": "slots"},
}


def _error_style(dialect: str, kind: str) -> str:
    """llama.cpp answers every route's errors in its own shape; the others follow the route."""
    if kind.startswith("ollama-"):
        return "ollama"
    if dialect == "llamacpp":
        return "llamacpp"
    return "anthropic" if kind == "messages" else "openai"


def _wants_stream(kind: str, body: Mapping[str, Any]) -> bool:
    """Ollama's native routes stream unless told not to; the OpenAI and Anthropic ones only
    when asked."""
    if kind in ("ollama-chat", "ollama-generate"):
        return body.get("stream") is not False
    return kind in _GENERATION and body.get("stream") is True


def _body(request: Request) -> bytes:
    """The request body as read (none at all reads as empty)."""
    return request.content.read() if request.content is not None else b""


class SimNodeResource(Resource):
    """One node's HTTP surface, rendered entirely here (a leaf: no child lookup)."""

    isLeaf = True

    def __init__(self, node: SimNode, reactor: IReactorTime):
        super().__init__()
        self.node = node
        self._clock = reactor
        self._serial = 0
        self._stall_waiters: list[tuple[int, Request]] = []
        self._engine = node.engine

    def _stalled(self) -> None:
        """A stream was paused: answer the ``/_sim/stalled`` waits this count satisfies."""
        self.node.stalled += 1
        waiting, self._stall_waiters = self._stall_waiters, []
        for count, request in waiting:
            self._answer_stalled(count, request)

    def _answer_stalled(self, count: int, request: Request) -> None:
        if request.finished or request.channel is None:
            return
        if self.node.stalled < count:
            self._stall_waiters.append((count, request))
            return
        request.setHeader(b"Content-Type", b"application/json")
        request.write(_dumps(self.node.state()))
        request.finish()

    def render(self, request: Request):
        request.setHeader(b"X-Sim-Node", self.node.node_id.encode("utf-8"))
        method = request.method.decode("latin-1")
        path = request.path.decode("latin-1")
        if path.startswith("/_sim/"):
            return self._admin(request, method, path)
        self.node.headers_seen = _headers_of(request)
        if self.node.drop_after_read:
            self.node.dropped += 1
            transport = request.channel.transport
            assert transport is not None, "a request being read has its connection"
            transport.loseConnection()
            return NOT_DONE_YET
        kind = _INFERENCE[self.node.dialect].get((method, path))
        if kind is not None:
            self.node.served.append((method, path))
            return self._infer(request, kind)
        truth = _TRUTH[self.node.dialect].get(path) if method == "GET" else None
        if truth is not None:
            self.node.truth_reads += 1
            return self._truth(request, truth)
        envelope = _MODEL_LISTS[self.node.dialect].get(path) if method == "GET" else None
        if envelope is not None:
            if self.node.dialect == "llamacpp" and path == "/models":
                self.node.truth_reads += 1
            return self._model_list(request, envelope)
        return self._no_route(request, method, path)

    def _json(self, request: Request, value: Any, status: int = 200) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"Content-Type", b"application/json")
        return _dumps(value)

    def _error(self, request: Request, style: str, status: int, message: str) -> bytes:
        return self._json(request, _error_body(style, status, message), status)

    def _no_route(self, request: Request, method: str, path: str) -> bytes:
        """Each engine's own 404 for a path it does not serve."""
        dialect = self.node.dialect
        if dialect == "ollama":
            request.setResponseCode(404)
            request.setHeader(b"Content-Type", b"text/plain")
            return b"404 page not found"
        if dialect == "lmstudio":
            return self._json(
                request, {"error": f"Unexpected endpoint or method. ({method} {path})"}, 404
            )
        return self._error(request, "llamacpp", 404, "File Not Found")

    def _admin(self, request: Request, method: str, path: str) -> bytes | int:
        if (method, path) == ("GET", "/_sim/state"):
            return self._json(request, self.node.state())
        if (method, path) == ("GET", "/_sim/stalled"):
            # Answers once ``count`` streams were paused by backpressure: an event to wait
            # on, where a test would otherwise sleep until buffers filled.
            args: dict[bytes, list[bytes]] = request.args or {}
            raw = args.get(b"count", [b"1"])[0]
            count = int(raw) if raw.isdigit() else 1
            self._answer_stalled(count, request)
            return NOT_DONE_YET
        if (method, path) == ("POST", "/_sim/fault"):
            try:
                changes = json.loads(_body(request))
                if not isinstance(changes, dict):
                    raise ValueError("the body must be a JSON object")
                self.node.set_faults(changes)
            except (TypeError, ValueError) as exc:
                return self._json(request, {"error": str(exc)}, 400)
            for key in list(self._engine.waiting):
                self._start_waiting(key)  # more slots take waiting requests at once
            return self._json(request, self.node.state())
        return self._json(request, {"error": f"no admin route {method} {path}"}, 404)

    def _model_list(self, request: Request, envelope: str) -> bytes:
        node = self.node
        now = self._clock.seconds()
        if node.dialect == "ollama":
            names = list(dict.fromkeys(ollama_name(m) for m in node.available()))
        else:
            names = node.available()
        if envelope == "ollama":
            return self._json(
                request,
                {
                    "models": [
                        {
                            "name": name,
                            "model": name,
                            "modified_at": _rfc3339(now),
                            "size": 1_000_000_000 + len(name),
                            "digest": hashlib.sha256(name.encode("utf-8")).hexdigest(),
                            "details": {},
                        }
                        for name in names
                    ]
                },
            )
        entries = []
        for name in names:
            entry: dict[str, Any] = {"id": name, "object": "model"}
            if node.dialect != "lmstudio":
                entry["created"] = int(now)
            entry["owned_by"] = _OWNED_BY[node.dialect]
            if node.router:
                entry["status"] = {"value": self._load_state(name, "unloaded")}
            entries.append(entry)
        return self._json(request, {"object": "list", "data": entries})

    def _load_state(self, model: str, cold: str) -> str:
        if self.node.model_key(model) in self._engine.loading:
            return "loading" if self.node.router else cold
        return "loaded" if self.node.is_warm(model) else cold

    def _truth(self, request: Request, route: str) -> bytes:
        """A truth route: what the engine runs and holds now. Reads only: nothing loads."""
        node = self.node
        now = self._clock.seconds()
        if route == "ps":
            names = [
                ollama_name(m)
                for m in dict.fromkeys(node.available())
                if node.is_warm(m) and node.model_key(m) not in self._engine.loading
            ]
            return self._json(
                request,
                {
                    "models": [
                        {
                            "name": name,
                            "model": name,
                            "size": 1_000_000_000 + len(name),
                            "digest": hashlib.sha256(name.encode("utf-8")).hexdigest(),
                            "details": {"format": "gguf", "family": "llama"},
                            "expires_at": _rfc3339(now + 300),
                            "size_vram": 1_000_000_000 + len(name),
                        }
                        for name in dict.fromkeys(names)
                    ]
                },
            )
        if route == "v0-models":
            return self._json(
                request,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": name,
                            "object": "model",
                            "type": "llm",
                            "publisher": "sim",
                            "arch": "llama",
                            "compatibility_type": "gguf",
                            "quantization": "Q4_K_M",
                            "state": self._load_state(name, "not-loaded"),
                            "max_context_length": 4096,
                        }
                        for name in node.available()
                    ],
                },
            )
        # llama.cpp /slots: one server's slots; a router's for the model named in the query.
        key: str | None = None
        if node.router:
            args: dict[bytes, list[bytes]] = request.args or {}
            wanted = args.get(b"model", [b""])[0].decode("utf-8", "replace")
            if not wanted:
                return self._error(
                    request, "llamacpp", 400, "model name is missing from the request"
                )
            if not node.has_model(wanted) or not node.is_warm(wanted):
                # A real router would load it to answer; the simulation never does.
                return self._error(request, "llamacpp", 400, f'model "{wanted}" is not loaded')
            key = wanted
        if node.slots is None:
            return self._error(
                request,
                "llamacpp",
                501,
                "This server does not support slots endpoint. Start it with `--slots`",
            )
        busy = self._engine.busy.get(key, 0)
        return self._json(
            request,
            [
                {
                    "id": index,
                    "id_task": index if index < busy else -1,
                    "n_ctx": 4096,
                    "speculative": False,
                    "is_processing": index < busy,
                }
                for index in range(node.slots)
            ],
        )

    def _infer(self, request: Request, kind: str):
        node = self.node
        style = _error_style(node.dialect, kind)
        try:
            body = json.loads(_body(request))
        except ValueError as exc:
            return self._error(request, style, 400, f"invalid JSON body: {exc}")
        if not isinstance(body, dict):
            return self._error(request, style, 400, "the request body must be a JSON object")
        if node.hang_before_headers:
            return NOT_DONE_YET
        if node.headers_delay:
            later = self._clock.callLater(
                node.headers_delay, self._answer_later, request, kind, body
            )

            # A client that leaves while the answer waits takes the answer with it.
            def forget(reason: Failure) -> None:
                if later.active():
                    later.cancel()

            request.notifyFinish().addErrback(forget)
            return NOT_DONE_YET
        return self._answer(request, kind, body)

    def _answer_later(self, request: Request, kind: str, body: dict) -> None:
        self._deliver(request, self._answer(request, kind, body))

    def _deliver(self, request: Request, result: bytes | int) -> None:
        """Finish a request answered outside ``render`` (whose return value Site writes)."""
        if result is not NOT_DONE_YET:
            assert isinstance(result, bytes)
            request.write(result)
            request.finish()

    def _answer(self, request: Request, kind: str, body: dict):
        node = self.node
        style = _error_style(node.dialect, kind)
        if node.status is not None:
            return self._error(
                request,
                style,
                node.status,
                f"simulated fault on {node.node_id}: HTTP {node.status}",
            )
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            # Ollama insists on a model; the OpenAI-style servers answer with what they have.
            if node.dialect == "ollama" or not node.available():
                return self._error(request, style, 400, "model is required")
            model = node.available()[0]
        elif not node.has_model(model):
            return self._error(request, style, 404, f'model "{model}" not found on {node.node_id}')
        return self._admit(request, kind, body, model)

    def _admit(self, request: Request, kind: str, body: dict, model: str):
        """Run the request in a free slot, or queue it inside the engine (FIFO) for one."""
        node = self.node
        key = node.model_key(model) if node.router else None
        if node.slots is not None and self._engine.busy.get(key, 0) >= node.slots:
            waiting = self._engine.waiting.setdefault(key, deque())
            entry = (request, kind, body, model)
            waiting.append(entry)
            node.queued += 1

            def gone(reason: Failure) -> None:
                for index, other in enumerate(waiting):
                    if other is entry:
                        del waiting[index]
                        node.queued -= 1
                        return

            request.notifyFinish().addErrback(gone)
            return NOT_DONE_YET
        return self._run(request, kind, body, model, key)

    def _start_waiting(self, key: str | None) -> None:
        """Start the requests queued for ``key`` that free slots now take, oldest first."""
        node = self.node
        waiting = self._engine.waiting.get(key)
        while waiting and (node.slots is None or self._engine.busy.get(key, 0) < node.slots):
            request, kind, body, model = waiting.popleft()
            node.queued -= 1
            self._deliver(request, self._run(request, kind, body, model, key))
        if not waiting:
            self._engine.waiting.pop(key, None)

    def _run(self, request: Request, kind: str, body: dict, model: str, key: str | None):
        """Hold a slot until the answer ends (or its client leaves); a cold model loads first."""
        node = self.node
        self._engine.busy[key] = self._engine.busy.get(key, 0) + 1
        node.busy += 1

        def release(result: object) -> None:
            self._engine.busy[key] -= 1
            node.busy -= 1
            self._start_waiting(key)

        request.notifyFinish().addBoth(release)
        if not node.is_warm(model):
            if not node.cold_load_delay:
                node.mark_loaded(model)
            else:
                self._load(
                    model,
                    request,
                    lambda: self._deliver(request, self._generate(request, kind, body, model)),
                )
                return NOT_DONE_YET
        return self._generate(request, kind, body, model)

    def _load(self, model: str, request: Request, then: Callable[[], None]) -> None:
        """Load ``model`` (one load however many wait for it), then call ``then``."""
        name = self.node.model_key(model)
        waiters = self._engine.loading.get(name)
        if waiters is None:
            waiters = self._engine.loading[name] = []
            self._clock.callLater(self.node.cold_load_delay, self._loaded, name, model)
        waiters.append((request, then))

    def _loaded(self, name: str, model: str) -> None:
        waiters = self._engine.loading.pop(name, [])
        self.node.mark_loaded(model)
        for request, then in waiters:
            if not request.finished and request.channel is not None:  # its client is still there
                then()

    def _generate(self, request: Request, kind: str, body: dict, model: str):
        node = self.node
        streaming = _wants_stream(kind, body)
        fmt = _GENERATION.get(kind)
        if node.hang_after_headers:
            request.setHeader(
                b"Content-Type",
                fmt.content_type if streaming and fmt is not None else b"application/json",
            )
            request.write(b"")
            return NOT_DONE_YET
        if fmt is None:
            return self._json(request, self._embeddings(kind, model, body))
        self._serial += 1
        stream_options = body.get("stream_options")
        prompt_tokens = _prompt_tokens(body)
        cached, reading = node.read_prompt(
            _conversation_head(node.model_key(model), body), prompt_tokens
        )
        job = _Job(
            node_id=node.node_id,
            dialect=node.dialect,
            model=model,
            reply_id=f"{fmt.id_prefix}{node.node_id}-{self._serial}",
            created=self._clock.seconds(),
            prompt_tokens=prompt_tokens,
            completion_tokens=node.tokens,
            chunk_size=node.chunk_size,
            include_usage=(
                node.dialect == "lmstudio"
                or (
                    isinstance(stream_options, dict) and stream_options.get("include_usage") is True
                )
            ),
            cached_tokens=cached,
            prompt_seconds=reading,
        )
        _Generation(
            request,
            self._clock,
            fmt,
            job,
            streaming,
            node.token_delay,
            node.die_after_tokens,
            on_pause=self._stalled,
            close_after=streaming and node.closes_after_streams,
        ).start()
        return NOT_DONE_YET

    def _embeddings(self, kind: str, model: str, body: Mapping[str, Any]) -> dict[str, Any]:
        node_id = self.node.node_id
        if kind == "ollama-embeddings":
            prompt = body.get("prompt")
            return {
                "embedding": _embedding(node_id, model, prompt if isinstance(prompt, str) else "")
            }
        texts = _inputs(body.get("input"))
        count = sum(len(text.split()) for text in texts)
        vectors = [_embedding(node_id, model, text) for text in texts]
        if kind == "ollama-embed":
            load = round(_LOAD_SECONDS * 1e9)
            return {
                "model": model,
                "embeddings": vectors,
                "total_duration": load + round(count * _SECONDS_PER_PROMPT_TOKEN * 1e9),
                "load_duration": load,
                "prompt_eval_count": count,
            }
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "embedding": vector, "index": index}
                for index, vector in enumerate(vectors)
            ],
            "model": model,
            "usage": {"prompt_tokens": count, "total_tokens": count},
        }


# -- fleets --------------------------------------------------------------------------------


def start_fleet(
    reactor: IReactorTCP, nodes: Sequence[SimNode], interface: str = "127.0.0.1"
) -> list[tuple[SimNode, IListeningPort]]:
    """Listen every node on its ``port`` (0: ephemeral) and record the bound port on it.

    All or nothing: if one node cannot listen, the ones already listening are stopped and
    the CannotListenError is raised. ``reactor`` must also provide IReactorTime.
    """
    clock = cast(IReactorTime, reactor)
    started: list[tuple[SimNode, IListeningPort]] = []
    try:
        for node in nodes:
            # Site is an HTTPFactory, a ServerFactory; its stubs do not say so.
            site = cast(ServerFactory, Site(SimNodeResource(node, clock), reactor=reactor))
            port = reactor.listenTCP(node.port, site, interface=interface)
            address = port.getHost()
            assert isinstance(address, (IPv4Address, IPv6Address))
            node.port = address.port
            started.append((node, port))
    except CannotListenError:
        for _, port in started:
            port.stopListening()
        raise
    return started


class FleetFileError(ValueError):
    """A fleet file that cannot be used; the message names the file and the node."""


_FILE_KEYS = {
    "id": "node_id",
    "dialect": "dialect",
    "port": "port",
    "models": "models",
    "loaded": "loaded",
    "tokens": "tokens",
    "token_delay": "token_delay",
    "chunk_size": "chunk_size",
    "status": "status",
    "hang_before_headers": "hang_before_headers",
    "headers_delay": "headers_delay",
    "hang_after_headers": "hang_after_headers",
    "die_after_tokens": "die_after_tokens",
    "slots": "slots",
    "cold_load_delay": "cold_load_delay",
    "router": "router",
    "prompt_delay": "prompt_delay",
    "prompt_cache": "prompt_cache",
    "cached_prompt_delay": "cached_prompt_delay",
}


def parse_fleet(data: Mapping[str, Any], source: str) -> list[SimNode]:
    """Nodes from a decoded fleet file::

        [[node]]
        id = "gpu-a"            # required
        dialect = "ollama"      # required: ollama, lmstudio or llamacpp
        port = 11434            # optional, 0 (default): ephemeral
        models = ["llama3:latest"]
        loaded = ["llama3"]     # the loaded (warm) subset of models (default: all); for
                                # llama.cpp without router, the only ones it answers for
        slots = 1               # requests run at once (default: unlimited); more wait inside
        cold_load_delay = 5.0   # seconds a cold model takes to load on first use
        router = false          # llama.cpp only: a router that loads any of models on demand
        prompt_delay = 0.5      # seconds before the first byte while reading a prompt
        prompt_cache = 8        # conversation heads remembered (default 0: no prompt cache)
        cached_prompt_delay = 0.05  # prompt_delay instead when the cache holds the head
        tokens = 6
        token_delay = 0.05      # seconds between streamed tokens
        chunk_size = 0          # pad each token to about this many bytes
        status = 503            # fault: answer inference with this error status
        hang_before_headers = false
        headers_delay = 0.5     # fault: answer inference only after this many seconds
        hang_after_headers = false
        die_after_tokens = 3    # fault: drop the connection after this many tokens
        close_after_stream = true  # close right after a streamed answer (llamacpp's default)
        drop_after_read = false # fault: read each request, close without answering

    A typo must fail loudly: a silently ignored fault switch makes a demo lie.
    """
    unknown = sorted(set(data) - {"node"})
    if unknown:
        raise FleetFileError(f"{source}: unknown top-level key(s): {', '.join(unknown)}")
    tables = data.get("node")
    if not isinstance(tables, list) or not tables:
        raise FleetFileError(f"{source}: needs at least one [[node]] table")
    nodes: list[SimNode] = []
    ids: set[str] = set()
    ports: set[int] = set()
    for index, table in enumerate(tables):
        where = f"{source}: node[{index}]"
        if not isinstance(table, dict):
            raise FleetFileError(f"{where}: must be a table")
        if isinstance(table.get("id"), str):
            where += f" ({table['id']})"
        bad = sorted(set(table) - set(_FILE_KEYS))
        if bad:
            raise FleetFileError(
                f"{where}: unknown key(s): {', '.join(bad)}; want any of {', '.join(_FILE_KEYS)}"
            )
        for key in ("id", "dialect"):
            if key not in table:
                raise FleetFileError(f"{where}: missing key {key!r}")
        try:
            node = SimNode(**{_FILE_KEYS[key]: value for key, value in table.items()})
        except (TypeError, ValueError) as exc:
            raise FleetFileError(f"{where}: {exc}") from None
        if node.node_id in ids:
            raise FleetFileError(f"{where}: id {node.node_id!r} is used twice")
        if node.port and node.port in ports:
            raise FleetFileError(f"{where}: port {node.port} is used twice")
        ids.add(node.node_id)
        ports.add(node.port)
        nodes.append(node)
    return nodes


def load_fleet(path: str) -> list[SimNode]:
    """Read and check a fleet file; every failure is a FleetFileError."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise FleetFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise FleetFileError(f"{path}: not valid TOML: {exc}") from None
    return parse_fleet(data, path)


_USAGE = "usage: python -m nvpair_proxy.testing.simfleet FLEET.toml"


def main(argv: Sequence[str] | None = None) -> int:
    """Run a fleet on 127.0.0.1 until SIGTERM or SIGINT.

    The ready line is the contract with the demo script: it waits for it, then reads the
    ports from it (useful when the file asks for port 0).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    if len(args) != 1:
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        nodes = load_fleet(args[0])
    except FleetFileError as exc:
        print(f"simfleet: {exc}", file=sys.stderr)
        return 2

    from twisted.internet import reactor
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    globalLogBeginner.beginLoggingTo(
        [
            FilteringLogObserver(
                textFileLogObserver(sys.stderr),
                [LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)],
            )
        ],
        redirectStandardIO=False,
    )
    try:
        listening = start_fleet(reactor, nodes)
    except CannotListenError as exc:
        print(f"simfleet: {exc}", file=sys.stderr)
        return 1
    ready = " ".join(f"{node.node_id}={node.port}" for node, _ in listening)
    print(f"simfleet ready: {ready}", flush=True)
    reactor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
