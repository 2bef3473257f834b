"""The admin listener (``--admin HOST:PORT``, docs/references.md#admin-listener): ``/metrics``,
``/status``, ``/healthz`` and the status page at ``/``, on a loopback address only.

Loopback only, because what it shows (fleet addresses, models, traffic) is for the operator of
this machine; the Host header must name a loopback address or ``localhost`` too, so a web
page that rebinds its own name to 127.0.0.1 cannot read it from a browser on this machine.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Callable

from prometheus_client.registry import CollectorRegistry
from twisted.application.service import Service
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import LoopingCall
from twisted.web.resource import Resource
from twisted.web.server import Request

from ..core import constants
from ..core.acceptguard import listen_tcp, stop_accepting
from ..core.interfaces import IStatusSource
from ..core.logs import logger
from ..core.validate import is_loopback, split_host_port
from ..http.server import BoundedSite
from ..nodes.discovery import host_port
from .history import HISTORY_INTERVAL
from .metrics import CONTENT_TYPE_LATEST, registry, scrape
from .recorder import Recorder
from .status import ProcessView, status

log = logger()

PAGE = "statuspage.html"
PAGE_POLICY = (
    b"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    b"connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)


def loopback_host(header: bytes | None) -> bool:
    """A Host header naming this machine: a loopback literal or localhost, any port."""
    if not header:
        return False
    text = header.decode("latin-1")
    try:
        host, _ = split_host_port(text.strip(), zero=True, port_required=False)
    except ValueError:
        return False
    return is_loopback(host.lower(), name=True)


def status_page() -> bytes:
    return resources.files(__package__).joinpath(PAGE).read_bytes()


class AdminResource(Resource):
    """Every path of the admin listener; read-only, GET and HEAD."""

    isLeaf = True

    def __init__(self, view: ProcessView, registry: CollectorRegistry, page: bytes) -> None:
        super().__init__()
        self.view, self.registry, self.page = view, registry, page

    def render(self, request: Request) -> bytes:
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-content-type-options", b"nosniff")
        if not loopback_host(request.getHeader(b"host")):
            return self._plain(request, 403, "the admin listener answers to localhost only")
        if request.method not in (b"GET", b"HEAD"):
            request.setHeader(b"allow", b"GET, HEAD")
            return self._plain(request, 405, "read-only")
        path = request.path
        if path == b"/metrics":
            request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode())
            return scrape(self.registry)
        if path == b"/status":
            request.setHeader(b"content-type", b"application/json")
            return json.dumps(status(self.view), sort_keys=True).encode() + b"\n"
        if path == b"/healthz":
            return self._healthz(request)
        if path in (b"/", b"/index.html"):
            request.setHeader(b"content-type", b"text/html; charset=utf-8")
            request.setHeader(b"content-security-policy", PAGE_POLICY)
            request.setHeader(b"x-frame-options", b"DENY")
            return self.page
        return self._plain(request, 404, "not found: try /, /status, /metrics or /healthz")

    def _healthz(self, request: Request) -> bytes:
        """200 while the process serves; 503 while it drains or stops, or (broker mode)
        while the link to the broker is down."""
        view = self.view
        snapshot = view.snapshot()
        if not snapshot.running:
            return self._plain(request, 503, "stopping")
        if snapshot.draining:
            return self._plain(request, 503, "draining")
        if view.link_up(snapshot) is False:
            return self._plain(request, 503, "broker link down")
        return self._plain(request, 200, "ok")

    @staticmethod
    def _plain(request: Request, status: int, text: str) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        return text.encode() + b"\n"


class AdminService(Service):
    """The admin listener's place in the tree: after the runtime, so it stops after the
    facades and shows the drain; bound before the reactor runs, so a taken port stops
    start-up with one line. It reads the process through ``source`` (the tree's snapshots)
    and what the facades' reporters told ``recorder``."""

    name = "admin"  # type: ignore[assignment]  # Twisted leaves Service.name untyped (None)

    def __init__(
        self,
        source: IStatusSource,
        recorder: Recorder,
        address: tuple[str, int],
        reactor,
        mode: str,
        listen: Callable[[int, BoundedSite, str], IListeningPort] | None = None,
    ) -> None:
        self.source, self.recorder, self.address, self.reactor = source, recorder, address, reactor
        self.mode = mode
        #: ``listen(port, site, host)``, when not this module's own (standalone mode: one that
        #: serves the socket a predecessor or systemd handed over).
        self.listen = listen
        self.listening: IListeningPort | None = None
        self.view: ProcessView | None = None
        self._sampling: LoopingCall | None = None

    def privilegedStartService(self) -> None:
        view = self.view = ProcessView(
            source=self.source,
            recorder=self.recorder,
            mode=self.mode,
            clock=self.reactor.seconds,
            started=self.reactor.seconds(),
        )
        site = BoundedSite(
            AdminResource(view, registry(view), status_page()),
            reactor=self.reactor,
            timeout=constants.SERVER_IDLE_TIMEOUT,
        )
        host, port = self.address
        try:
            if self.listen is not None:
                self.listening = self.listen(port, site, host)
            else:
                self.listening = listen_tcp(self.reactor, port, site, host, "admin")
        except CannotListenError as exc:
            raise SystemExit(
                f"nvpair-proxy: --admin: cannot listen on {host} port {port}: {exc.socketError}"
            ) from None
        log.info("admin listener on {url}", url=self.url)
        super().privilegedStartService()

    def startService(self) -> None:
        super().startService()
        sampling = self._sampling = LoopingCall(self._sample)
        sampling.clock = self.reactor
        sampling.start(HISTORY_INTERVAL, now=False)

    def _sample(self) -> None:
        """One history sample (history.py): never lets a failure stop the timer."""
        view = self.view
        try:
            if view is not None:
                view.sample()
        except Exception:
            log.failure("sampling the history")

    @property
    def url(self) -> str:
        """Where the listener is bound, once it is."""
        if self.listening is None:
            raise RuntimeError("the admin listener is not bound yet")
        host = self.listening.getHost()
        assert isinstance(host, (IPv4Address, IPv6Address))  # listenTCP's, either family
        return f"http://{host_port(host.host, host.port)}/"

    def hand_over(self) -> None:
        """A successor serves this listening socket now (a hot handoff): stop accepting on
        it, and leave it open until the process exits (acceptguard.stop_accepting)."""
        if self.listening is not None:
            stop_accepting(self.listening)
            self.listening = None

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        sampling, self._sampling = self._sampling, None
        if sampling is not None and sampling.running:
            sampling.stop()
        if self.listening is not None:
            return self.listening.stopListening()
        return None
