"""Affinity: which conversation a request continues, and the node that holds its cache.

An engine keeps what it has already read: llama.cpp reuses a slot's longest common prefix and
restores earlier prompts from its host-RAM cache, and Ollama and LM Studio inherit both. A
conversation's next turn sent to the node that served its last one skips re-reading its
history (seconds of time to first token on a long context). So each inference request gets a
key, computed once at admission from what the client sent, and each facade remembers the node
that last committed a request of each key (docs/decisions.md#affinity).

A key is a digest, never the text: neither it nor anything derived from it is ever logged
(docs/references.md#no-content-logging). Hashing is bounded (:data:`HASHED`), so a 200 KiB
context costs no more than a short one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Mapping

import attrs
from twisted.web.http_headers import Headers

#: The client's own name for a session, first match wins: OpenCode, Claude Code, Codex (both
#: spellings), and the generic one.
SESSION_HEADERS = (
    b"x-session-affinity",
    b"x-claude-code-session-id",
    b"session_id",
    b"session-id",
    b"x-session-id",
)
#: The most bytes of a conversation's head that are hashed per request.
HASHED = 16 * 1024
#: How much of a completion prompt is its stable head.
PROMPT_HEAD = 4 * 1024
#: A session name longer than this is cut before hashing.
NAME_LIMIT = 1024
#: The default bounds of a facade's table: keys remembered, and seconds a key is kept unused.
MAX_KEYS = 10_000
IDLE_EXPIRY = 30 * 60.0


def _digest(kind: bytes, model: str, parts: Iterable[bytes]) -> bytes:
    """A 16-byte digest of at most ``HASHED`` bytes of ``parts`` (each length-prefixed, so
    two different splits of the same bytes differ), scoped to the model."""
    hasher = hashlib.blake2b(kind + b"\0" + model.encode("utf-8", "replace"), digest_size=16)
    budget = HASHED
    for part in parts:
        part = part[:budget]
        hasher.update(len(part).to_bytes(4, "big"))
        hasher.update(part)
        budget -= len(part)
        if budget <= 0:
            break
    return hasher.digest()


def _text(value: Any, budget: int = HASHED) -> Iterator[bytes]:
    """The text of a message's content: a string, or the parts of a list (OpenAI content
    parts, Anthropic blocks, Responses input items), each part's text or, for a part without
    one (an image), its type. Stops once ``budget`` bytes were given."""
    if isinstance(value, str):
        yield value[:budget].encode("utf-8", "replace")
    elif isinstance(value, list):
        for part in value:
            if budget <= 0:
                return
            if isinstance(part, str):
                piece = part
            elif isinstance(part, dict):
                inner = part.get("text", part.get("content"))
                if isinstance(inner, (str, list)):
                    for chunk in _text(inner, budget):
                        budget -= len(chunk)
                        yield chunk
                    continue
                piece = str(part.get("type", ""))
            else:
                continue
            chunk = piece[:budget].encode("utf-8", "replace")
            budget -= len(chunk)
            yield chunk


def _head_of_messages(messages: list, system: Any) -> list[bytes] | None:
    """The system prompt (or instructions) and the first user message; None without one."""
    parts = [b"".join(_text(system))] if system is not None else []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role in ("system", "developer") and not parts:
            parts.append(b"".join(_text(message.get("content"))))
        elif role == "user" or (role is None and "content" in message):
            parts.append(b"".join(_text(message.get("content"))))
            return parts
    return None


# A Responses answer's id: the first ``"id"`` of its head, the response's own in both the
# ``response.created`` event of a stream and a whole JSON answer.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
#: How much of an answer's head is searched for its id.
RESPONSE_HEAD = 4096


def response_key(model: str, response_id: bytes) -> bytes:
    """The table key of an OpenAI Responses answer's id (a digest: never the id)."""
    return _digest(b"response", model, (response_id,))


def previous_response(body: Any) -> bytes | None:
    """The ``previous_response_id`` a Responses request continues, or None."""
    named = body.get("previous_response_id") if isinstance(body, dict) else None
    if isinstance(named, str) and named.strip():
        return named.strip()[:NAME_LIMIT].encode("utf-8", "replace")
    return None


def response_id_in(head: bytes) -> bytes | None:
    """The id a Responses answer gives itself in its first bytes, or None."""
    found = _RESPONSE_ID.search(head[:RESPONSE_HEAD])
    return found.group(1) if found else None


#: A shared head shorter than this (bytes of system prompt and tools) is not worth an entry:
#: reading it again costs little.
MIN_HEAD = 2048
#: How much of the first user message extends a head at its second boundary.
HEAD_START = 1024


def _system_of(body: Mapping[str, Any]) -> bytes:
    """A conversation's system prompt (Anthropic's field, Responses' instructions, or a first
    system or developer message)."""
    for field in ("system", "instructions"):
        if body.get(field):
            return b"".join(_text(body[field]))
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        if messages[0].get("role") in ("system", "developer"):
            return b"".join(_text(messages[0].get("content")))
    return b""


def _first_user(body: Mapping[str, Any]) -> bytes:
    given = body.get("messages", body.get("input"))
    if isinstance(given, str):
        return given[:HEAD_START].encode("utf-8", "replace")
    if isinstance(given, list):
        for message in given:
            if isinstance(message, dict) and message.get("role") == "user":
                return b"".join(_text(message.get("content"), HEAD_START))
    return b""


def shared_head(body: Any, model: str) -> tuple[tuple[bytes, ...], int]:
    """A conversation's shared head: its digests, the longest first (its system prompt and
    tool definitions with the start of its first user message, then without it), and its
    bytes (system prompt and tools), to weigh its re-read by. No digests when the head is
    shorter than ``MIN_HEAD`` (or there is no conversation). Sessions of one agent harness
    share the shorter; a parent's sub-agents share both."""
    if not isinstance(body, dict):
        return (), 0
    system = _system_of(body)
    tools = body.get("tools")
    described = json.dumps(tools, sort_keys=True) if tools else ""
    size = len(system) + len(described)
    hashed = described[:HASHED].encode()
    if len(system) + len(hashed) < MIN_HEAD:
        return (), size
    base = _digest(b"head", model, (system, hashed))
    # The longer head extends the shorter's digest: its bytes are hashed once.
    return (_digest(b"head+", model, (base, _first_user(body))), base), size


def session_of(headers: Headers, body: Mapping[str, Any]) -> bytes | None:
    """The session the client names: a header, else the body's ``prompt_cache_key``."""
    for name in SESSION_HEADERS:
        values = headers.getRawHeaders(name)
        if values and values[0].strip():
            return values[0].strip()[:NAME_LIMIT]
    named = body.get("prompt_cache_key")
    if isinstance(named, str) and named.strip():
        return named.strip()[:NAME_LIMIT].encode("utf-8", "replace")
    return None


def affinity_key(headers: Headers, body: Any, model: str, path: str) -> bytes | None:
    """The key of a request to inference ``path`` for the normalized ``model``, or None (an
    embedding, or a body without a conversation)."""
    if not isinstance(body, dict) or "embed" in path:
        return None
    session = session_of(headers, body)
    if session is not None:
        return _digest(b"session", model, (session,))
    messages = body.get("messages")
    if isinstance(messages, list):
        # Chat (OpenAI, Ollama) and Anthropic Messages, whose system prompt is a field.
        parts = _head_of_messages(messages, body.get("system"))
        return None if parts is None else _digest(b"chat", model, parts)
    given = body.get("input")
    if isinstance(given, (str, list)):
        # OpenAI Responses: its instructions and its first input.
        first = (
            given
            if isinstance(given, str)
            else (_head_of_messages(given, None) or [b"".join(_text(given[:1]))])
        )
        parts = [b"".join(_text(body.get("instructions")))] if body.get("instructions") else []
        parts += [b"".join(_text(first))] if isinstance(first, str) else first
        return _digest(b"responses", model, parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        # Completions and Ollama generate: the start of the prompt (and its system, if any).
        parts = [b"".join(_text(body.get("system")))] if body.get("system") else []
        parts.append(prompt[:PROMPT_HEAD].encode("utf-8", "replace"))
        return _digest(b"prompt", model, parts)
    return None


@attrs.define(eq=False)
class AffinityTable:
    """Key -> the node that last committed a request of that key, bounded by count (the key
    used longest ago goes first) and by idle time."""

    max_keys: int = MAX_KEYS
    idle_expiry: float = IDLE_EXPIRY
    #: A conversation that spilled stays bound to its node before (``--affinity-spill keep``).
    spill_keeps: bool = False
    _entries: "OrderedDict[bytes, tuple[str, float]]" = attrs.Factory(OrderedDict)
    #: Keys whose last hit found the node's engine had evicted them: still sent there when it
    #: is free, but never waited for (the spill rule).
    _evicted: set[bytes] = attrs.Factory(set)
    #: The prompt tokens each key's last answer said its engine saw (the next hit should
    #: reuse about that many).
    _prompts: dict[bytes, int] = attrs.Factory(dict)

    def __len__(self) -> int:
        return len(self._entries)

    def node_for(self, key: bytes, now: float) -> str | None:
        """The affine node, None when the key is new or its entry expired (a miss)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        node, used = entry
        if now - used > self.idle_expiry:
            self._forget(key)
            return None
        return node

    def committed(self, key: bytes, node_id: str, now: float, spilled: bool = False) -> None:
        entry = self._entries.get(key)
        if spilled and self.spill_keeps and entry is not None:
            node_id = entry[0]  # short congestion does not migrate it
        else:
            self._evicted.discard(key)
        self._entries[key] = (node_id, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_keys:
            self._forget(next(iter(self._entries)))

    def _forget(self, key: bytes) -> None:
        del self._entries[key]
        self._evicted.discard(key)
        self._prompts.pop(key, None)

    def evicted(self, key: bytes) -> None:
        """The key's last hit read (nearly) its whole context again: its node's cache does not
        keep it, so waiting for that node is no longer worth it."""
        if key in self._entries:
            self._evicted.add(key)

    def is_evicted(self, key: bytes) -> bool:
        return key in self._evicted

    def prompt_seen(self, key: bytes, tokens: int) -> int | None:
        """Remember that ``key``'s last answer saw ``tokens`` prompt tokens; the count its
        previous answer saw, None when none did."""
        if key not in self._entries:
            return None
        before = self._prompts.get(key)
        self._prompts[key] = tokens
        return before

    def prompt_of(self, key: bytes) -> int | None:
        """The prompt tokens ``key``'s last answer saw, None when none said."""
        return self._prompts.get(key)

    def forget_nodes_except(self, nodes: set[str]) -> None:
        """A node that left the fleet leaves the table."""
        for key in [k for k, (node, _) in self._entries.items() if node not in nodes]:
            self._forget(key)

    def keys_per_node(self, now: float) -> dict[str, int]:
        """How many live keys point at each node."""
        counts: dict[str, int] = {}
        for node, used in self._entries.values():
            if now - used <= self.idle_expiry:
                counts[node] = counts.get(node, 0) + 1
        return counts
