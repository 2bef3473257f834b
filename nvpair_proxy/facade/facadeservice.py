"""Binding and running the facades: one ``FacadeService`` per enabled engine, under ``Facades``.

What a facade does with a request is ``facade.py``'s; this module is its place in the service
tree.

A FacadeService owns what one facade binds and runs: its listening port, the alias ports of
its engine's host variable, its prober, and the facade (with its router). Both modes open
them through ``Facades``: standalone mode once at start-up, broker mode on ``facade/enable``.
Stopping one is the facade's part of the shutdown (docs/references.md#shutdown-order): stop
accepting, cancel the requests in flight, then wait at most the grace for the ports to close.
"""

from __future__ import annotations

from typing import Callable

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred
from twisted.internet.error import CannotListenError

from ..cluster.admission import LocalBackend, admit_into
from ..cluster.trust import ClusterDirectory, tls_ingress
from ..core import constants
from ..core.acceptguard import listen_tcp, stop_accepting
from ..core.logs import logger
from ..core.views import FacadeView
from ..fleet.inventory import Prober
from ..http.server import BoundedSite
from ..lan.apikeys import LanGate
from ..nodes.discovery import Node
from ..nodes.engines import Engine
from ..nodes.selfcheck import SelfCheck, is_local_address
from ..nodes.slots import Slots
from .facade import Facade, facade_site
from .ingress import IngressResource
from .listener import DemuxFactory, listen_everywhere

log = logger()


def listen_on(reactor) -> Callable:
    """``listen(port, factory, interface)``: ``"::"`` means every address, both families."""

    def listen(port: int, factory, interface: str):
        if interface == "::":
            return listen_everywhere(reactor, port, factory)
        return listen_tcp(reactor, port, factory, interface, "facade alias")

    return listen


def listener_factory(
    facade: Facade,
    directory: ClusterDirectory | None,
    local_backend: LocalBackend,
    lan: LanGate | None = None,
) -> DemuxFactory:
    """Loopback plaintext for local clients (LAN clients with a key, when keys are
    configured); pinned mTLS for peers when a member."""
    site = facade_site(facade, facade.clock)
    if directory is None:
        return DemuxFactory(site, lan=lan)
    ingress = BoundedSite(
        IngressResource(facade, directory, local_backend),
        reactor=facade.clock,
        timeout=site.timeOut,
        on_rejected=site.on_rejected,
    )
    return DemuxFactory(site, tls=tls_ingress(directory, ingress, facade.clock), lan=lan)


class FacadeService(MultiService):
    """One facade, its ports and its prober (a child, so it starts and stops with it).

    Built bound: a port that cannot be had raises CannotListenError here, before anything
    is announced, so ``facade/enable`` can answer -32010 with nothing left behind.
    """

    def __init__(
        self,
        facade: Facade,
        factory: DemuxFactory,
        listen: Callable,
        prober: Prober,
        clock,
        port: int,
        is_local: Callable[[str], bool] = is_local_address,
        poller: Service | None = None,
    ) -> None:
        super().__init__()
        self.listening = listen(port, factory, "::")
        self.port = port
        self.setName(facade.engine.id)
        self.facade, self.factory, self.listen, self.clock = facade, factory, listen, clock
        self.prober = prober
        prober.setServiceParent(self)
        # Standalone mode: what each node's engine reports (truthpoller.py), also a child.
        self.poller = poller
        if poller is not None:
            poller.setServiceParent(self)
        self.aliases: list = []
        self.alias_port: int | None = None
        #: A successor serves these ports now (``drain``): they are left open at the stop.
        self.handed_over = False
        # The listening port whose bound port ``own_ports`` read last, and that port.
        self._bound: tuple[object, int] = (None, 0)
        # The local engine's parallel slots as the broker last relayed them
        # (docs/references.md#local-slots), for nodes/list and the admin listener's /status; None
        # when none are known.
        self.slots: Slots | None = None
        facade.router.check_self(SelfCheck(self.own_ports, is_local))

    def own_ports(self) -> frozenset[int]:
        """The ports a request reaches this facade on: the primary as bound (port 0 asks
        the system for one) and the alias port, when one is bound. Asked for every request
        in broker mode (the local backend's self check), so the bound port is read from the
        kernel once per listening port, not each time."""
        bound = self.bound_port()
        if self.alias_port and self.alias_port != bound:
            return frozenset((bound, self.alias_port))
        return frozenset((bound,))

    def bound_port(self) -> int:
        """The primary port as bound, read from the kernel once per listening port (and so
        still known once a drain has closed it)."""
        listening, bound = self._bound
        if listening is not self.listening:
            listening, bound = self._bound = (self.listening, self.listening.getHost().port)
        return bound

    def view(self) -> FacadeView:
        """The facade as the admin listener shows it: on its port as bound, with the slots
        the broker last relayed."""
        slots = self.slots.describe() if self.slots is not None else None
        return self.facade.view(port=self.bound_port(), slots=slots)

    @property
    def ports(self) -> list:
        return [self.listening] + self.aliases

    def bind_aliases(self, hosts: list[str], port: int) -> CannotListenError | None:
        """Both families bound together or neither: on failure nothing stays bound and the
        refusal is returned (an occupied alias is only a warning,
        docs/references.md#host-aliases)."""
        bound = []
        try:
            for host in hosts:
                bound.append(self.listen(port, self.factory, host))
        except CannotListenError as exc:
            for listening in bound:
                listening.stopListening()
            return exc
        self.aliases, self.alias_port = bound, port
        self.facade.router.recheck_self()
        return None

    def move(self, port: int, confirm: Callable[[], None]) -> None:
        """Listen on ``port``, then stop the old one, so no client is refused in between.

        ``confirm`` runs once the new port is bound and can still call the move off by
        raising; the new port is then closed and the old one kept.
        """
        listening = self.listen(port, self.factory, "::")
        try:
            confirm()
        except Exception:
            listening.stopListening()
            raise
        old, self.listening, self.port = self.listening, listening, port
        old.stopListening()
        self.facade.router.recheck_self()

    def drain(self, handed_over: bool = False) -> None:
        """Stop accepting on every port, close idle connections and let the busy ones finish
        (docs/operations.md#restarts). When a successor serves the same listening sockets
        (``handed_over``), they are only no longer read, and left open until the process
        exits (acceptguard.stop_accepting)."""
        for listening in self.ports:
            if handed_over:
                stop_accepting(listening)
            else:
                listening.stopListening()
        self.handed_over = handed_over
        self.factory.drain()

    def drained(self) -> bool:
        """Nothing admitted is left (queued requests included), and no connection is open."""
        return not self.facade.in_flight and not self.factory.connections

    def stopService(self) -> Deferred:
        """Stop accepting, cancel in-flight requests (each reported cancelled), then give the
        ports at most the grace to close (docs/references.md#shutdown-order); the pool is closed
        after this, by the runtime, because in-flight requests hold its connections until they are
        cancelled."""
        Service.stopService(self)
        closing = [
            maybeDeferred(listening.stopListening)
            for listening in self.ports
            if not self.handed_over
        ]
        self.facade.shutdown()
        closing.append(maybeDeferred(self.prober.stopService))
        if self.poller is not None:
            closing.append(maybeDeferred(self.poller.stopService))
        closed = DeferredList(closing, consumeErrors=True)
        closed.addTimeout(constants.FACADE_SHUTDOWN_GRACE, self.clock)
        return closed.addBoth(lambda _: None)


class Facades(MultiService):
    """The facades node: opens FacadeServices, and stops them together (one shared grace,
    not one per facade)."""

    def __init__(
        self,
        *,
        make_facade: Callable[[Engine], Facade],
        listen: Callable,
        make_prober: Callable[[Facade, Callable[[Node], bool]], Prober],
        clock,
        admission: bool = False,
        directory: ClusterDirectory | None = None,
        lan: LanGate | None = None,
        make_poller: Callable[[Facade], Service] | None = None,
    ) -> None:
        super().__init__()
        self.setName("facades")
        self.make_facade, self.listen, self.make_prober = make_facade, listen, make_prober
        self.clock, self.admission = clock, admission
        self.directory, self.lan = directory, lan
        self.make_poller = make_poller

    def open(
        self,
        engine: Engine,
        port: int,
        should_probe: Callable[[Node], bool],
        local_backend: LocalBackend = lambda: None,
        is_local: Callable[[str], bool] = is_local_address,
        listen: Callable | None = None,
    ) -> FacadeService:
        """A facade bound on ``port`` (CannotListenError when it cannot be), not yet started:
        ``add`` starts it, so a caller can announce it first. ``listen`` replaces the
        facades' own (standalone mode: one that serves an inherited socket)."""
        facade = self.make_facade(engine)
        factory = listener_factory(
            facade, self.directory if self.admission else None, local_backend, self.lan
        )
        service = FacadeService(
            facade,
            factory,
            listen or self.listen,
            self.make_prober(facade, should_probe),
            self.clock,
            port,
            is_local,
            self.make_poller(facade) if self.make_poller else None,
        )
        if self.admission:
            admit_into(facade, self.directory, local_backend)
        return service

    def add(self, service: FacadeService) -> None:
        """Into the tree; started at once when the tree runs (broker mode's enable)."""
        service.setServiceParent(self)

    def __getitem__(self, engine_id: str) -> FacadeService:
        return self.getServiceNamed(engine_id)

    def views(self) -> tuple[FacadeView, ...]:
        """Every facade as the admin listener shows it, in the order they were opened."""
        return tuple(service.view() for service in self)

    def cluster_pins(self) -> int | None:
        """Cluster peers with a live pin; None without a cluster directory."""
        return self.directory.live_pins() if self.directory is not None else None

    def stopService(self) -> Deferred:
        return super().stopService().addCallback(lambda _: None)
