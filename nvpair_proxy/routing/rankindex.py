"""Standalone placement's owners of each model, kept in rank order as their standings change,
so that a request does not weigh and sort the whole fleet (docs/decisions.md#rank-index).

Ranking every owner per request costs a key per node: at 1,000 nodes that is most of a
request's CPU. Yet a node's key (free before full, warm before cold, fewer busy, then id;
``placement.rank_key``) changes only when something happens to that node: one of our
dispatches starts or ends there, its engine's report is read. So each model's owners are
kept sorted, and each such event moves the one node it concerns (a bisect and a list move:
``O(log n)`` comparisons and a memmove). A request copies the ready order.

What this does not hold: held and cooling nodes, which go last for a while (time, not an
event, ends that), are put last when the order is read, and only while there are any; and the
node set itself: a change to it (a node joins or leaves, a probe changes its models) starts
the index again at the next read. Plain bookkeeping: no Twisted.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Mapping

from ..nodes.discovery import Node

#: A node's key for one model, its id last: what ``ranked`` sorts by.
Key = tuple


class _Owners:
    """One model's owners in rank order: keys and nodes side by side."""

    __slots__ = ("keys", "nodes", "key_of")

    def __init__(self, entries: list[tuple[Key, Node]]) -> None:
        entries.sort(key=_first)
        self.keys: list[Key] = [key for key, _ in entries]
        self.nodes: list[Node] = [node for _, node in entries]
        self.key_of: dict[str, Key] = {node.id: key for key, node in entries}

    def at(self, node_id: str) -> int | None:
        """Where ``node_id`` stands now (a bisect by its key), None when it is no owner."""
        key = self.key_of.get(node_id)
        return None if key is None else bisect_left(self.keys, key)

    def move(self, at: int, key: Key) -> None:
        """Move the node standing ``at`` to where ``key`` puts it."""
        if self.keys[at] == key:
            return
        node = self.nodes.pop(at)
        del self.keys[at]
        to = bisect_left(self.keys, key)
        self.keys.insert(to, key)
        self.nodes.insert(to, node)
        self.key_of[node.id] = key


def _first(entry: tuple[Key, Node]) -> Key:
    return entry[0]


class RankIndex:
    """Each asked model's owners among a routable set, in the order ``key`` gives them."""

    def __init__(self, key: Callable[[Node, str], Key]) -> None:
        #: ``key(node, model)``: the node's standing for the model, its id last.
        self.key = key
        self._source: Mapping[str, Node] | None = None
        self._models: dict[str, _Owners] = {}
        #: How many node keys were computed: what the scale test counts (test_scale.py).
        self.keyed = 0

    def ranked(self, routable: Mapping[str, Node], model: str) -> list[Node]:
        """``model``'s owners in ``routable`` (the node set's own mapping, kept between
        changes: a new one starts the index again), best first: a copy."""
        if routable is not self._source:
            self._source, self._models = routable, {}
        owners = self._models.get(model)
        if owners is None:
            found = [node for node in routable.values() if node.advertises(model)]
            self.keyed += len(found)
            owners = self._models[model] = _Owners(
                [(self.key(node, model), node) for node in found]
            )
        return list(owners.nodes)

    def touch(self, node_id: str) -> None:
        """Something ``key`` reads changed for ``node_id``: move it where it belongs now, in
        every model it owns."""
        for model, owners in self._models.items():
            at = owners.at(node_id)
            if at is not None:
                self.keyed += 1
                owners.move(at, self.key(owners.nodes[at], model))

    def reset(self) -> None:
        """Start again at the next read (what every key reads may have changed)."""
        self._source, self._models = None, {}
