"""Broker mode: how a discovered node is reached, or that it is not
(docs/references.md#listener-personalities, #peer-transport).

The self node is reached through the local backend the broker named, whether it came in a
snapshot or by ``add-manual`` (docs/references.md#self-by-address); a peer only
over pinned mutual TLS, and only while this node is a cluster member; any other manual node as
written. Standalone mode admits every node but self as written, so it installs none of this.
"""

from __future__ import annotations

from typing import Callable

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IAgent

from ..core.memo import Memo
from ..nodes.discovery import Node
from .trust import ClusterDirectory, PeerAgents

# Pins are re-derived per request (docs/references.md#pins-per-request); one stat pass serves a
# burst of resolutions.
TRUST_RECHECK = 0.1

LocalBackend = Callable[[], "tuple[str, int] | None"]


@attrs.define(eq=False)
class Admission:
    """One facade's admission of discovered nodes, asked each time its node set is read."""

    directory: ClusterDirectory | None
    clock: IReactorTime
    local_backend: LocalBackend
    # The node as admitted, per discovered node and what decided it (the backend, or that a
    # pin exists): the decision is made at every call, the admitted copy made once
    # (docs/references.md#bare-proxy-cpu: a copy per request re-parsed its addresses).
    _made: Memo[str, tuple[Node, object, Node]] = attrs.field(
        factory=lambda: Memo(4096), init=False, repr=False
    )

    def __call__(self, node: Node) -> Node | None:
        if node.local:
            backend = self.local_backend()
            if backend is None:
                return None
            return self._copy(node, backend)
        if node.source == "manual":
            return node
        if self.directory is None or not node.cluster_uuid:
            return None
        self._recheck(self.directory)
        if self.directory.pin(node.cluster_uuid):
            return self._copy(node, "https")
        return None

    def state(self) -> tuple:
        """What every answer of ``__call__`` depends on besides the node: the local backend,
        membership and the pins, after the throttled re-check of the directory. The node set
        re-admits its nodes only when this changes, not at every read of a request (three per
        request, each asking every node)."""
        backend = self.local_backend()
        directory = self.directory
        if directory is None:
            return (backend,)
        self._recheck(directory)
        return (backend, directory.member, directory.pins)

    def _copy(self, node: Node, decided) -> Node:
        made = self._made.get(node.id)
        if made is not None and made[0] is node and made[1] == decided:
            return made[2]
        if decided == "https":
            admitted = attrs.evolve(node, scheme="https")
        else:
            host, port = decided
            admitted = attrs.evolve(node, addresses=(host,), port=port, scheme="http")
        self._made.remember(node.id, (node, decided, admitted))
        return admitted

    def _recheck(self, directory: ClusterDirectory) -> None:
        """A pin that appeared or vanished counts at once, not only on the 2 s watch
        (docs/references.md#pins-per-request); throttled so a burst of resolutions costs one stat
        pass."""
        directory.check(self.clock.seconds(), TRUST_RECHECK)


def admit_into(facade, directory: ClusterDirectory | None, local_backend: LocalBackend) -> None:
    """Install broker-mode admission on a facade: its node set asks ``Admission``."""
    admission = Admission(directory, facade.clock, local_backend)
    facade.router.set_admission(admission, admission.state)


def peer_dialler(peer_agents: PeerAgents, agent: IAgent) -> Callable[[Node], IAgent]:
    """The agent per node in broker mode: a peer admitted over https is dialled on that peer's
    pinned pool, so no connection verified against another pin is reused; the rest share
    ``agent``."""
    return lambda node: peer_agents.for_node(node) if node.scheme == "https" else agent
