"""What an engine says it is doing: its slots and the models it holds in memory.

Standalone mode has no cluster scheduler, so the proxy places work itself, and its own count
of dispatches in flight cannot see an engine's other clients, nor whether a model is loaded
(Ollama and LM Studio load on first use, 5-60 s). Each engine is asked, without side effects,
through the routes its engine file declares; this module holds the answer as a value.
Plain bookkeeping: no Twisted.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class EngineTruth:
    """One read of one node's engine. Every field may be unknown (None): an engine that
    cannot say is ranked as if it had not been asked, never as free."""

    #: Clock seconds when the read was sent: a dispatch of ours begun before it is counted in
    #: ``slots_busy``.
    read_at: float
    #: How many requests the engine runs at once.
    slots_total: int | None = None
    #: How many of them are running now (ours included).
    slots_busy: int | None = None
    #: The normalized names of the models loaded in memory now.
    warm: frozenset[str] | None = None

    def is_warm(self, model: str) -> bool | None:
        """Whether ``model`` (normalized) is loaded; None when the engine does not say."""
        return None if self.warm is None else model in self.warm
