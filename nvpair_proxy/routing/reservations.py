"""The process-wide reservation map and the chooser (docs/references.md#one-process,
#reserve-least-loaded, #reservations).

Between scheduler snapshots the scheduler cannot see what this process has just dispatched,
so a burst would pile onto whichever node the last snapshot called idle. A reservation is the
proxy's own count of that unseen work (docs/references.md#reservations): one entry per in-flight
dispatch made since the last snapshot, added to the scheduler's figures when choosing a node. There
is exactly one map per process, shared by every facade, because bursts arriving through Ollama, LM
Studio and llama.cpp at once must see each other's claims (docs/references.md#one-process).

Everything here runs on the reactor thread (docs/references.md#reactor-thread), so the map needs no
locks and must not import Twisted: it is plain bookkeeping that the dispatch loop drives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

# node/set-priority (docs/references.md#priority-snapshot): the scheduler's gpuPressure is trusted
# only within 0..3.
MAX_GPU_PRESSURE = 3.0


@attrs.frozen
class Rank:
    """One node's figures in a scheduler snapshot (docs/references.md#priority-snapshot, ``ranks``),
    as received.

    Kept unclamped so the record says what the scheduler sent; the map clamps on applying it.
    """

    id: str
    pending: float = 0
    gpu_pressure: float = 0
    rank: int = 0


def _clamp(value: float, low: float, high: float) -> float:
    """Clamp into low..high; NaN (which json accepts) reads as ``low``.

    A NaN load would compare false both ways and make the least-loaded choice arbitrary.
    """
    if not value >= low:
        return low
    return min(value, high)


@attrs.define(eq=False)
class Reservation:
    """One dispatch's claim on a node, stamped with the generation it was counted against.

    The stamp is what lets a snapshot supersede the claim (docs/references.md#snapshot-generation):
    the snapshot's ``pending`` already includes the work, so once the map has moved to a newer
    generation this claim no longer counts and releasing it must not subtract anything.
    """

    node_id: str
    generation: int
    _map: ReservationMap = attrs.field(repr=False)
    released: bool = attrs.field(default=False, init=False)

    def move(self, node_id: str) -> None:
        """Follow the node an attempt actually targets
        (docs/references.md#reservation-follows-attempt).

        The node that refused is not doing the work, and an attempt can hold its node for the
        whole first-content budget, so the claim moves with each dispatch rather than waiting
        for the commit. The new dispatch is unseen by the scheduler even when the original
        claim was superseded, so it counts on the new node at the current generation.
        """
        if self.released or node_id == self.node_id:
            return
        self._map._transfer(self, node_id)

    def release(self) -> None:
        """End the claim: the request ended, or is about to back off
        (docs/references.md#reservation-release).

        Idempotent, because the terminal path and the backoff path may both reach it. A claim
        from an older generation is dropped rather than subtracted: subtracting it would count
        the completion twice and drive the node's load below zero, which reads as permanently
        idle and attracts every later dispatch.
        """
        if self.released:
            return
        self.released = True
        self._map._release(self)


@attrs.define
class ReservationMap:
    """Estimated load per node: the scheduler's snapshot plus this process's reservations.

    ``enabled=False`` keeps the bookkeeping but leaves reservations out of the load, which is
    how a proxy without them would choose; ``bench/burst`` uses it as the baseline.
    """

    enabled: bool = True
    _generation: int = attrs.field(default=0, init=False)
    _priority: tuple[str, ...] = attrs.field(default=(), init=False)
    _listed: frozenset[str] = attrs.field(default=frozenset(), init=False)
    _scheduled: dict[str, float] = attrs.field(factory=dict, init=False)
    _held: dict[str, int] = attrs.field(factory=dict, init=False)
    #: Told the node of every claim that ends or moves away: a slot there is free again
    #: (standalone placement lets a waiting request go at once).
    on_release: list[Callable[[str], None]] = attrs.field(factory=list, init=False)
    #: Told the node of every claim that starts or moves there (standalone ranking moves it).
    on_count: list[Callable[[str], None]] = attrs.field(factory=list, init=False)

    @property
    def generation(self) -> int:
        """The applied snapshot's generation; 0 before any."""
        return self._generation

    @property
    def priority(self) -> tuple[str, ...]:
        """The snapshot's node order; empty means default order
        (docs/references.md#priority-snapshot)."""
        return self._priority

    @property
    def count(self) -> int:
        """What ``node/set-priority`` answers as ``{"count": N}``, stale or not
        (docs/references.md#priority-snapshot)."""
        return len(self._priority)

    @property
    def reservations(self) -> Mapping[str, int]:
        """Counted reservations per node; a node with none has no entry at all."""
        return dict(self._held)

    def set_priority(
        self, generation: int, nodes: Sequence[str], ranks: Sequence[Rank] = ()
    ) -> bool:
        """Apply a scheduler snapshot at most once (docs/references.md#snapshot-generation,
        #priority-snapshot).

        A stale or redelivered generation changes nothing and returns False: a redelivery
        clearing live reservations would make a busy burst read as idle again. A newer one
        replaces the figures and drops every reservation taken before it, since its
        ``pending`` already counts that work.
        """
        if generation <= 0:
            raise ValueError("generation is required and must be greater than 0")
        if generation <= self._generation:
            return False
        self._generation = generation
        self._priority = tuple(nodes)
        self._listed = frozenset(nodes)
        self._scheduled = {
            rank.id: _clamp(rank.pending, 0.0, float("inf"))
            + _clamp(rank.gpu_pressure, 0.0, MAX_GPU_PRESSURE)
            for rank in ranks
        }
        self._held = {}
        return True

    def load(self, node_id: str) -> float:
        """pending + gpuPressure + reservations (docs/references.md#estimated-load); a node the
        snapshot omits has 0."""
        scheduled = self._scheduled.get(node_id, 0.0)
        if not self.enabled:
            return scheduled
        return scheduled + self._held.get(node_id, 0)

    def reserve(self, node_id: str) -> Reservation:
        """Count one dispatch to ``node_id`` against the current generation."""
        self._count(node_id)
        return Reservation(node_id, self._generation, self)

    def pick(self, ordered: Sequence[str], prefer: str | None = None) -> str | None:
        """The least estimated-loaded scheduler-listed candidate, reserving nothing.

        ``ordered`` is the candidates already in pin, priority, id order, so a tie goes to the
        earlier one. Before any snapshot, or with an empty list, every candidate counts as
        listed (docs/references.md#reservations-before-priority). When none is listed, the first of
        ``ordered``; None when it is empty. This is the one rule for placing work: ``choose``
        applies it at the start of a round, and failover applies it to the round's remaining
        candidates before each dispatch, so refusals spread instead of piling onto the head of the
        priority list. ``prefer`` (broker mode's opt-in affinity) only breaks a tie: it wins when
        it is listed
        and as lightly loaded as the least loaded.
        """
        listed = [node_id for node_id in ordered if self._is_listed(node_id)]
        if listed:
            least = min(listed, key=self.load)
            if prefer is not None and prefer in listed and self.load(prefer) == self.load(least):
                return prefer
            return least
        return ordered[0] if ordered else None

    def choose(self, ordered: Sequence[str], prefer: str | None = None) -> Reservation | None:
        """Reserve the candidate ``pick`` names, if it is scheduler-listed
        (docs/references.md#reserve-least-loaded).

        ``ordered`` is the eligible owners, so only they can be reserved. None, reserving
        nothing, when no candidate is listed (``pick`` then names an unlisted one, or none).
        Callers skip this when an eligible ``node/select`` pin applies.
        """
        node_id = self.pick(ordered, prefer)
        if node_id is None or not self._is_listed(node_id):
            return None
        return self.reserve(node_id)

    def _is_listed(self, node_id: str) -> bool:
        return not self._listed or node_id in self._listed

    def _count(self, node_id: str) -> None:
        self._held[node_id] = self._held.get(node_id, 0) + 1
        for listener in self.on_count:
            listener(node_id)

    def _transfer(self, reservation: Reservation, node_id: str) -> None:
        self._release(reservation)
        reservation.node_id = node_id
        reservation.generation = self._generation
        self._count(node_id)

    def _release(self, reservation: Reservation) -> None:
        """Uncount a claim that still counts: only one stamped with the current generation."""
        if reservation.generation == self._generation:
            remaining = self._held[reservation.node_id] - 1
            if remaining:
                self._held[reservation.node_id] = remaining
            else:
                del self._held[reservation.node_id]
        for listener in self.on_release:
            listener(reservation.node_id)
