"""The mutual-TLS ingress: a pinned peer's request goes straight to this node's engine.

The originating node already routed, retried and reported the job; here there is no routing,
no failover and no workload event (docs/references.md#mtls-ingress), only the per-request pin check
and a plain forward to the local backend that ``node/set-local-backend`` named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, cast
from weakref import WeakKeyDictionary

import attrs
from twisted.internet.interfaces import ISSLTransport
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from ..cluster.trust import ClusterDirectory, der_of
from ..core.interfaces import IOwners
from ..http.answers import CLUSTER_AUTH, NO_LOCAL_BACKEND, Reason
from ..http.server import BoundedRequest
from ..nodes.discovery import Node
from ..request.exchange import Exchange, Wiring
from ..routing.tickets import Direct
from .facade import Facade, Refusal, forward, refuse, refused_before_routing

if TYPE_CHECKING:
    from OpenSSL.crypto import X509


@implementer(IOwners)
@attrs.frozen
class LocalBackend:
    """Whom the ingress may send to: this node's engine, the one candidate, always."""

    backend: Node
    pin = ""

    def routable(self) -> list[Node]:
        return [self.backend]

    def candidates(self, model: str | None) -> list[Node]:
        return [self.backend]

    def is_routable(self, node_id: str) -> bool:
        return True

    def busy_for(self, model: str) -> float | None:
        return None


#: One node, no placement: nothing reserved, nothing queued (its engine's queue is the one).
NO_PLACEMENT = Direct()


def ingress_exchange(facade: Facade, request: BoundedRequest, backend: Node, route) -> Exchange:
    """A forward to the local backend: one pass, no workload, backend errors coded."""
    wiring = Wiring(
        engine=facade.engine,
        owners=LocalBackend(backend),
        placement=NO_PLACEMENT,
        health=None,
        reporter=facade.reporter,
        upstreams=facade.upstreams,
        in_flight=facade.in_flight,
        inference=False,
        bad_gateway_code="backend-error",
    )
    return Exchange(request, wiring, route)


class IngressResource(Resource):
    isLeaf = True

    def __init__(
        self,
        facade: Facade,
        directory: ClusterDirectory,
        backend: Callable[[], tuple[str, int] | None],
    ) -> None:
        super().__init__()
        self.facade, self.directory, self.backend = facade, directory, backend
        self._node: Node | None = None  # the backend as a node, made again only when it moves
        # Each TLS connection's peer certificate, as DER, for as long as the connection lives.
        self._ders: WeakKeyDictionary[object, bytes] = WeakKeyDictionary()

    def render(self, request: BoundedRequest):
        facade = self.facade
        # One decision, the facade's shape: refused before routing, or forwarded to the one
        # local backend.
        route = facade.engine.classify(request.method, request.path)
        backend = self.backend()
        refusal = refused_before_routing(facade, request) or self._refused(request, backend)
        if refusal is not None:
            refuse(facade, request, refusal, route)
            return NOT_DONE_YET
        assert backend is not None  # _refused answered its absence
        host, port = backend
        node = self._node
        if node is None or (node.port, node.addresses) != (port, (host,)):
            node = self._node = Node(
                id="local-backend", name="local-backend", port=port, addresses=(host,)
            )
        forward(ingress_exchange(facade, request, node, route))
        return NOT_DONE_YET

    def _refused(self, request: Request, backend: tuple[str, int] | None) -> Refusal | None:
        """The ingress's own refusals: a peer whose certificate is not pinned (checked for
        every request: a revoked pin refuses the next one), and no local backend."""
        self.directory.check()
        # The ingress listens on TLS only; pyOpenSSL's certificate, None without a peer's.
        transport = cast(ISSLTransport, request.channel.transport)
        der = self._ders.get(transport)
        if der is None:
            certificate = cast("X509 | None", transport.getPeerCertificate())
            if certificate is not None:
                der = self._ders[transport] = der_of(certificate)
        # Only the connection's certificate, which cannot change, is converted once.
        if der is None or not self.directory.trusts(der):
            code, text = CLUSTER_AUTH
            return Refusal(403, Reason.CLUSTER_AUTH, text, code=code)
        if backend is None:
            text = f"no local {self.facade.engine.id} backend is available on this node"
            return Refusal(503, Reason.NO_LOCAL_BACKEND, text, code=NO_LOCAL_BACKEND)
        return None
