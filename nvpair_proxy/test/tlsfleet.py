"""Real engines on loopback for the engine-access tests (plain, HTTPS with a test CA, with
client certificates), the nodes file naming them as an operator writes it, and the proxy's
facade on a real port in front: what the TLS and the LAN-key tests both stand on."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from OpenSSL import crypto
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.ssl import Certificate, CertificateOptions
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import Site

from nvpair_proxy.facade.facade import facade_site, make_facade
from nvpair_proxy.facade.listener import DemuxFactory
from nvpair_proxy.http.client import Client
from nvpair_proxy.http.pool import ConnectionPool
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.request.dispatch import Bounds
from nvpair_proxy.standalone.engineaccess import EngineAgents
from nvpair_proxy.standalone.nodesfile import load_nodes_file
from nvpair_proxy.testing import RecordingEmitter
from nvpair_proxy.testing.certs import TestCA

ENGINES = load_engines([])
ENGINE_KEY = "engine-secret-0123456789abcdefXYZ"
CALLER_KEY = "caller-secret-9876543210zyxwvuQRS"


class EngineResource(Resource):
    """An Ollama-speaking engine that remembers the headers of every request it got."""

    isLeaf = True

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.seen: list[tuple[bytes, bytes, Headers]] = []

    def render(self, request):
        self.seen.append((request.method, request.path, request.requestHeaders.copy()))
        request.setHeader(b"Content-Type", b"application/json")
        if request.path == b"/api/tags":
            return json.dumps({"models": [{"name": "llama3:latest"}]}).encode()
        return json.dumps({"message": {"content": f"hi from {self.name}"}, "done": True}).encode()


def write(folder: str, name: str, data: bytes, mode: int = 0o600) -> str:
    path = os.path.join(folder, name)
    with open(path, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)
    return path


def server_options(cert_pem: bytes, key_pem: bytes, client_ca: TestCA | None = None):
    kwargs = {}
    if client_ca is not None:
        kwargs = dict(
            verify=True,
            requireCertificate=True,
            caCerts=[Certificate.loadPEM(client_ca.pem).original],
        )
    return CertificateOptions(
        privateKey=crypto.load_privatekey(crypto.FILETYPE_PEM, key_pem),
        certificate=crypto.load_certificate(crypto.FILETYPE_PEM, cert_pem),
        **kwargs,
    )


class TLSFleet:
    """Engines on loopback (TLS or not), a nodes file naming them, and the proxy's facade."""

    def __init__(self, test: TestCase) -> None:
        self.test = test
        self.ca = TestCA()
        self.folder = tempfile.mkdtemp()
        test.addCleanup(shutil.rmtree, self.folder, True)
        self.ca_file = write(self.folder, "ca.pem", self.ca.pem)
        self.engines: dict[str, EngineResource] = {}
        self.entries: list[str] = []

    def engine(
        self,
        node_id: str,
        *,
        tls: tuple[bytes, bytes] | None = None,
        client_ca: TestCA | None = None,
        address: str = "127.0.0.1",
        extra: str = "",
        models: bool = True,
    ) -> EngineResource:
        resource = EngineResource(node_id)
        site = Site(resource)
        if tls is None:
            port = reactor.listenTCP(0, site, interface="127.0.0.1")
            access = ""
        else:
            port = reactor.listenSSL(
                0, site, server_options(*tls, client_ca), interface="127.0.0.1"
            )
            access = f'scheme = "https"\nca_file = "{self.ca_file}"\n'
        self.test.addCleanup(port.stopListening)
        self.engines[node_id] = resource
        listed = 'models = ["llama3:latest"]\n' if models else ""
        self.entries.append(
            f'[[node]]\nid = "{node_id}"\naddress = "{address}"\n'
            f"[node.engines.ollama]\nport = {port.getHost().port}\n"
            f"{listed}{access}{extra}"
        )
        return resource

    def start(
        self,
        bounds: Bounds = Bounds(max_attempts=2, backoff=(0.0,), jitter=0.0),
        emitter=None,
        lan=None,
        interface: str = "127.0.0.1",
        bind: str | None = None,
    ):
        """The facade on ``interface`` behind the listener (with ``lan`` keys, if given);
        the test's client connects from ``bind``."""
        path = write(self.folder, "nodes.toml", "\n".join(self.entries).encode())
        fleet = load_nodes_file(path, ENGINES)
        pool = ConnectionPool(reactor)
        self.agents = EngineAgents(reactor, Client(reactor, pool), 5.0, 5.0)
        self.test.addCleanup(self.agents.close)
        self.test.addCleanup(pool.closeCachedConnections)
        self.facade = make_facade(
            ENGINES["ollama"],
            clock=reactor,
            agent=self.agents.agent,
            emitter=emitter or RecordingEmitter(),
            run_id="0123456789abcdef",
            random=lambda: 0.5,
            bounds=bounds,
            agent_for_node=self.agents.for_node,
        )
        self.facade.router.replace_discovered(list(fleet.nodes["ollama"]))
        listening = reactor.listenTCP(
            0, DemuxFactory(facade_site(self.facade, reactor), lan=lan), interface=interface
        )
        self.test.addCleanup(listening.stopListening)
        self.url = f"http://{interface}:{listening.getHost().port}"
        self.client = Agent(
            reactor,
            pool=HTTPConnectionPool(reactor, persistent=False),
            bindAddress=(bind, 0) if bind else None,
        )
        return self

    @inlineCallbacks
    def request(
        self, method: bytes, path: str, headers: dict | None = None, body: bytes | None = None
    ):
        from io import BytesIO

        from twisted.web.client import FileBodyProducer

        raw = Headers({k.encode(): [v.encode()] for k, v in (headers or {}).items()})
        response = yield self.client.request(
            method,
            (self.url + path).encode(),
            raw,
            FileBodyProducer(BytesIO(body)) if body else None,
        )
        data = yield readBody(response)
        return response.code, data

    def chat(self, headers: dict | None = None):
        return self.request(
            b"POST", "/api/chat", headers, json.dumps({"model": "llama3", "stream": False}).encode()
        )
