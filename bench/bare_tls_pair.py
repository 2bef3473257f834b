"""Two bare Twisted proxies joined by mutual TLS: ``bench/overhead --cluster``'s baseline.

The same shape as the cluster path (client, proxy A, pinned mutual TLS, proxy B's ingress,
B's engine) with nothing but forwarding, each side ``bench/bare_proxy.py``'s proxy (Agent +
``HTTPConnectionPool`` of 256 per host, the body straight into ``request.write`` with the
upstream connection as the producer):

- ``front``: plaintext HTTP on 127.0.0.1; dials the back over TLS, presenting its
  certificate and requiring the back's to be byte-for-byte the pinned one;
- ``back``: terminates TLS on 127.0.0.1 and requires a client certificate (the pinned one),
  then forwards over plain HTTP to the engine.

Both TLS contexts are the ones ``nvpair_proxy/cluster/trust.py`` builds for peers:
``SSL.TLS_METHOD``, minimum TLS 1.2, OpenSSL's default ciphers and groups, this node's
certificate and key, ``VERIFY_PEER | VERIFY_FAIL_IF_NO_PEER_CERT``; the server side is a
``TLSMemoryBIOFactory`` over the site, as ours' ingress is.

Usage: python bench/bare_tls_pair.py front LISTEN_PORT BACK_PORT CERT KEY PEER_CERT
       python bench/bare_tls_pair.py back LISTEN_PORT ENGINE_PORT CERT KEY PEER_CERT
Prints "bare front ready PORT" / "bare back ready PORT".
"""

from __future__ import annotations

import hmac
import os
import sys

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from OpenSSL import SSL, crypto
from twisted.internet import reactor
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
)
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IPolicyForHTTPS
from twisted.web.server import Site
from zope.interface import implementer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bare_proxy import Proxy  # noqa: E402


def der_of(certificate: crypto.X509) -> bytes:
    return certificate.to_cryptography().public_bytes(Encoding.DER)


def context(cert: crypto.X509, key: crypto.PKey, verify) -> SSL.Context:
    """As trust.py's ``_context``: the same method, floor, identity and verification."""
    ctx = SSL.Context(SSL.TLS_METHOD)
    ctx.set_min_proto_version(SSL.TLS1_2_VERSION)
    ctx.use_certificate(cert)
    ctx.use_privatekey(key)
    ctx.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, verify)
    return ctx


class Pinned:
    def __init__(self, pin: bytes) -> None:
        self.pin = pin

    def __call__(self, connection, certificate, errno, depth, ok) -> bool:
        if depth != 0:
            return True
        return hmac.compare_digest(der_of(certificate), self.pin)


@implementer(IOpenSSLClientConnectionCreator)
class ClientCreator:
    def __init__(self, cert, key, pin: bytes) -> None:
        self.cert, self.key, self.verify = cert, key, Pinned(pin)

    def clientConnectionForTLS(self, protocol) -> SSL.Connection:
        # A context per connection, as trust.py's _PinnedClient makes one.
        connection = SSL.Connection(context(self.cert, self.key, self.verify), None)
        connection.set_connect_state()
        return connection


@implementer(IPolicyForHTTPS)
class PinnedPolicy:
    def __init__(self, cert, key, pin: bytes) -> None:
        self.cert, self.key, self.pin = cert, key, pin

    def creatorForNetloc(self, hostname: bytes, port: int):
        return ClientCreator(self.cert, self.key, self.pin)


@implementer(IOpenSSLServerConnectionCreator)
class ServerCreator:
    def __init__(self, cert, key, pin: bytes) -> None:
        self.cert, self.key, self.verify = cert, key, Pinned(pin)

    def serverConnectionForTLS(self, protocol) -> SSL.Connection:
        # A context per connection, as trust.py's ServerCreator makes one.
        return SSL.Connection(context(self.cert, self.key, self.verify), None)


def load(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def main() -> None:
    role, listen_port, upstream_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cert = crypto.load_certificate(crypto.FILETYPE_PEM, load(sys.argv[4]))
    key = crypto.load_privatekey(crypto.FILETYPE_PEM, load(sys.argv[5]))
    pin = x509.load_pem_x509_certificate(load(sys.argv[6])).public_bytes(Encoding.DER)
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = 256
    if role == "front":
        agent = Agent(reactor, contextFactory=PinnedPolicy(cert, key, pin), pool=pool)
        site = Site(Proxy(agent, b"https://127.0.0.1:%d" % upstream_port))
        site.log = lambda request: None
        port = reactor.listenTCP(listen_port, site, interface="127.0.0.1", backlog=1024)
    elif role == "back":
        agent = Agent(reactor, pool=pool)
        site = Site(Proxy(agent, b"http://127.0.0.1:%d" % upstream_port))
        site.log = lambda request: None
        factory = TLSMemoryBIOFactory(ServerCreator(cert, key, pin), False, site)
        factory.noisy = False
        port = reactor.listenTCP(listen_port, factory, interface="127.0.0.1", backlog=1024)
    else:
        raise SystemExit(f"bare_tls_pair: unknown role {role!r} (front or back)")
    print(f"bare {role} ready {port.getHost().port}", flush=True)
    reactor.run()


if __name__ == "__main__":
    main()
