"""Who may serve a request and in which order (docs/references.md#owner-filter and #owner-order).

The capability filter always runs first: a pin or a priority list can reorder owners but
never widen the set, so failover never reaches a node that does not advertise the model.
"""

from __future__ import annotations

from typing import Sequence

from .discovery import Node


def owners(nodes: Sequence[Node], model: str) -> list[Node]:
    """Nodes advertising the (already normalized) model right now."""
    return [node for node in nodes if node.advertises(model)]


def _node_id(node: Node) -> str:
    return node.id


def order(nodes: Sequence[Node], pin: str = "", priority: Sequence[str] = ()) -> list[Node]:
    """Pin first, then the scheduler's priority list, then the rest by node id.

    Unknown ids in the priority list are ignored; an empty list is id order.
    """
    if not priority and not pin:
        return sorted(nodes, key=_node_id)
    rank = {node_id: index for index, node_id in enumerate(priority)}
    listed = sorted((n for n in nodes if n.id in rank), key=lambda n: rank[n.id])
    rest = sorted((n for n in nodes if n.id not in rank), key=lambda n: n.id)
    ordered = listed + rest
    pinned = [n for n in ordered if pin and n.id == pin]
    return pinned + [n for n in ordered if not (pin and n.id == pin)]
