"""What an engine says it is doing: its slots and the models it holds in memory.

Standalone mode has no cluster scheduler, so the proxy places work itself, and its own count
of dispatches in flight cannot see an engine's other clients, nor whether a model is loaded
(Ollama and LM Studio load on first use, 5-60 s). Each engine is asked, without side effects,
through the routes its engine file declares (``[truth]``); this module holds the answer as a
value and reads each route's shape into it. Plain bookkeeping: no Twisted.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

import attrs


class TruthError(ValueError):
    """An answer that is not the shape its route promises: the node is then unknown."""


@attrs.frozen
class Slots:
    """How many requests an engine runs at once, and how many run now (ours included)."""

    total: int
    busy: int

    @property
    def free(self) -> int:
        return max(0, self.total - self.busy)


@attrs.frozen
class EngineTruth:
    """One read of one node's engine. Every field may be unknown (None): an engine that
    cannot say is ranked as if it had not been asked, never as free."""

    #: Clock seconds when the read was sent: a dispatch of ours begun before it is counted in
    #: the busy figures.
    read_at: float
    #: The engine's slots (a llama-server with one model loaded).
    slots: Slots | None = None
    #: The normalized names of the models loaded in memory now.
    warm: frozenset[str] | None = None
    #: Per model, its own slots (a llama-server in router mode runs each model apart).
    model_slots: Mapping[str, Slots] = attrs.Factory(dict)

    def is_warm(self, model: str) -> bool | None:
        """Whether ``model`` (normalized) is loaded; None when the engine does not say."""
        return None if self.warm is None else model in self.warm

    def slots_for(self, model: str | None) -> Slots | None:
        """The slots a request for ``model`` competes for; None when the engine does not say."""
        if model is not None and model in self.model_slots:
            return self.model_slots[model]
        return self.slots


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise TruthError("not JSON") from None


def read_slots(body: bytes) -> Slots:
    """llama.cpp ``GET /slots``: an array with one object per slot, ``is_processing`` each."""
    data = _json(body)
    if not isinstance(data, list) or not data or not all(isinstance(s, dict) for s in data):
        raise TruthError("slots is not a non-empty array of objects")
    return Slots(total=len(data), busy=sum(1 for slot in data if slot.get("is_processing") is True))


def _entries(data: Any, key: str) -> list[dict]:
    items = data.get(key) if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise TruthError(f"no {key!r} array")
    return [item for item in items if isinstance(item, dict)]


def _name(entry: dict, *keys: str) -> str | None:
    for key in keys:
        value = entry.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


def read_loaded(body: bytes, normalize: Callable[[str], str]) -> frozenset[str]:
    """Ollama ``GET /api/ps``: every model listed is loaded in memory."""
    names = (_name(entry, "model", "name") for entry in _entries(_json(body), "models"))
    return frozenset(normalize(name) for name in names if name is not None)


def _state(entry: dict) -> str | None:
    """LM Studio's ``state``, or a llama.cpp router's ``status.value``."""
    state = entry.get("state")
    if isinstance(state, str):
        return state
    status = entry.get("status")
    if isinstance(status, dict) and isinstance(status.get("value"), str):
        return status["value"]
    return None


@attrs.frozen
class ModelStates:
    """What a models route said: the warm models, or None when no entry carried a state;
    ``per_model``: the engine reports each model's own state (a llama.cpp router)."""

    warm: frozenset[str] | None
    per_model: bool


def read_models(
    body: bytes, normalize: Callable[[str], str], listed_are_loaded: bool
) -> ModelStates:
    """A list of models each with a state (LM Studio ``/api/v0/models``, a llama.cpp router's
    ``/models``); only ``loaded`` is warm (``loading`` is not yet).

    A list without states says nothing of warmth, except for an engine that lists only what
    it has loaded (a llama-server started with one model).
    """
    entries = _entries(_json(body), "data")
    states = [(_name(entry, "id"), _state(entry)) for entry in entries]
    if not any(state is not None for _, state in states):
        if listed_are_loaded:
            return ModelStates(frozenset(normalize(n) for n, _ in states if n is not None), False)
        return ModelStates(None, False)
    warm = frozenset(
        normalize(name) for name, state in states if name is not None and state == "loaded"
    )
    return ModelStates(warm, True)
