"""The local engine's parallel slots, as a newer broker relays them
(docs/references.md#local-slots).

``node/set-local-backend`` may carry ``slots: {"default": n, "models": {"<model>": n}}``:
how many requests the engine on this node runs at once, overall and per model, as the engine
manager reported it. The broker sends it whether or not this proxy uses it, so a well-formed
value is always accepted: counts below 1 say nothing and are dropped, and model names are
compared the way requests name them (the engine's model-id rule), so two spellings of one
model are one entry; the smaller count wins there, since promising more parallelism than the
engine has would overload it. A malformed value is refused as a whole, before anything
changes, so a broker bug cannot leave half a setting behind.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..core.validate import is_int
from .engines import Engine


@attrs.frozen
class Slots:
    """Counts of at least 1: ``default`` for any model (None: not given), ``models`` by
    normalized model id."""

    default: int | None
    models: dict[str, int]

    def describe(self) -> dict:
        """The ``slots`` field of the self node in ``nodes/list``."""
        return {"default": self.default, "models": dict(sorted(self.models.items()))}


def parse_slots(engine: Engine, value: Any) -> Slots | None:
    """The slots of ``value``; None when absent or when no count of 1 or more remains.

    Raises ValueError, naming ``slots``, when the value is not of the protocol's shape.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("slots must be an object")
    default = value.get("default")
    if default is not None and not is_int(default):
        raise ValueError("slots.default must be an integer")
    models = value.get("models")
    if models is None:
        models = {}
    if not isinstance(models, dict):
        raise ValueError("slots.models must be an object")
    if not all(is_int(count) for count in models.values()):
        raise ValueError("slots.models counts must be integers")
    kept: dict[str, int] = {}
    for name, count in models.items():
        model = engine.normalize_model(name)
        if count >= 1 and model:
            kept[model] = min(count, kept.get(model, count))
    default = default if default is not None and default >= 1 else None
    if default is None and not kept:
        return None
    return Slots(default=default, models=kept)
