"""How a standalone fleet reaches an engine behind TLS or a key (docs/references.md#keyed-engines).

A nodes-file engine entry may say ``scheme = "https"`` (verified against the system CA store
or its ``ca_file``, the host name checked by ``optionsForClientTLS``, which uses
``service_identity``), present a client certificate (``cert_file`` / ``key_file``), and carry
an ``api_key`` sent as ``Authorization: Bearer`` to that engine only. The files are read when
the nodes file is, so a bad one stops start-up, or keeps the last good fleet on a reload.

Every request to such an engine (dispatch attempts, inventory probes, model-list and
preflight fan-outs) goes through ``EngineAgents.for_node``: one pooled Agent per distinct TLS
configuration, as ``PeerAgents`` has one per peer, and a per-node wrapper that puts the
engine's key in place of the caller's and reports certificate failures. The key is never
logged: nothing here formats it, and the records that hold it hide it from ``repr``.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import TYPE_CHECKING

import attrs
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from OpenSSL import SSL
from service_identity import VerificationError
from twisted.internet import ssl
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IPolicyForHTTPS
from zope.interface import implementer

from ..core.files import read_regular_file
from ..core.logs import logger
from ..core.warnonce import WarnOnce
from ..http.agentpools import AgentPools
from ..http.keypair import KeyPairError, load_key_pair

if TYPE_CHECKING:  # what platformTrust and trustRootFromCertificates build; not in ssl's API
    from twisted.internet._sslverify import IOpenSSLTrustRoot

log = logger()

TLS_FILE_FIELDS = ("ca_file", "cert_file", "key_file")
ACCESS_FIELDS = ("scheme", *TLS_FILE_FIELDS, "api_key")
# What a header value may carry without breaking the header (no spaces, no controls).
_API_KEY = re.compile(r"[\x21-\x7e]{1,4096}")


class AccessError(ValueError):
    """A bad TLS or key setting; the text names the field and the file, never a key."""


@attrs.frozen
class EngineTLS:
    """One TLS configuration. Equal configurations share a pool; a file whose content
    changed (on a reload) is a new configuration, so no connection made with the old
    material is reused."""

    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    digest: bytes = attrs.field(repr=False)
    trust: IOpenSSLTrustRoot = attrs.field(eq=False, repr=False)
    client: ssl.PrivateCertificate | None = attrs.field(eq=False, repr=False)


@attrs.frozen
class EngineAccess:
    """The TLS configuration (None for plain http) and key of one engine of one node."""

    tls: EngineTLS | None = None
    api_key: str | None = attrs.field(default=None, repr=False)


def _read(field: str, path: str) -> bytes:
    try:
        return read_regular_file(path)
    except OSError as exc:
        raise AccessError(f"{field} {path}: cannot read: {exc.strerror or exc}") from None


def load_tls(ca_file: str | None, cert_file: str | None, key_file: str | None) -> EngineTLS:
    """Raises AccessError naming the file that does not load."""
    digest = hashlib.sha256()
    if ca_file is None:
        trust = ssl.platformTrust()
    else:
        data = _read("ca_file", ca_file)
        digest.update(data)
        try:
            certificates = x509.load_pem_x509_certificates(data)
        except ValueError:
            raise AccessError(f"ca_file {ca_file}: no PEM certificate in it") from None
        trust = ssl.trustRootFromCertificates(
            [ssl.Certificate.loadPEM(c.public_bytes(Encoding.PEM)) for c in certificates]
        )
    client = None
    if cert_file is not None:
        if key_file is None:
            raise AccessError("fields 'cert_file' and 'key_file' go together")
        cert_pem, key_pem = _read("cert_file", cert_file), _read("key_file", key_file)
        digest.update(cert_pem + key_pem)
        try:
            certificate, key = load_key_pair(cert_pem, key_pem)
        except KeyPairError as exc:
            raise AccessError(
                {
                    "certificate": f"cert_file {cert_file}: not a PEM certificate",
                    "key": f"key_file {key_file}: not an unencrypted PEM private key",
                    "match": f"key_file {key_file}: does not match cert_file {cert_file}",
                }[exc.part]
            ) from None
        client = ssl.PrivateCertificate.fromCertificateAndKeyPair(
            ssl.Certificate(certificate), ssl.KeyPair(key)
        )
    return EngineTLS(ca_file, cert_file, key_file, digest.digest(), trust, client)


def resolve_path(base: str, value: str) -> str:
    """A file named in a nodes file: ``~`` expanded, relative to the file's folder ``base``."""
    return os.path.join(base, os.path.expanduser(value))


def access_from(spec: dict, base: str) -> tuple[str, EngineAccess | None]:
    """(scheme, access) of a nodes-file engine entry; relative paths are relative to the
    nodes file's folder ``base``. Raises AccessError naming the field."""
    scheme = spec.get("scheme", "http")
    if scheme not in ("http", "https"):
        raise AccessError('field \'scheme\' must be "http" or "https"')
    paths = {}
    for field in TLS_FILE_FIELDS:
        value = spec.get(field)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise AccessError(f"field {field!r} must be a non-empty string")
        if scheme != "https":
            raise AccessError(f'field {field!r} needs scheme = "https"')
        paths[field] = resolve_path(base, value)
    if ("cert_file" in paths) != ("key_file" in paths):
        raise AccessError("fields 'cert_file' and 'key_file' go together")
    api_key = spec.get("api_key")
    if api_key is not None and (not isinstance(api_key, str) or not _API_KEY.fullmatch(api_key)):
        raise AccessError(
            "field 'api_key' must be a string of visible ASCII characters without spaces"
        )
    tls = None
    if scheme == "https":
        tls = load_tls(paths.get("ca_file"), paths.get("cert_file"), paths.get("key_file"))
    if tls is None and api_key is None:
        return scheme, None
    return scheme, EngineAccess(tls, api_key)


@implementer(IPolicyForHTTPS)
class EnginePolicy:
    """Verify the engine against the configured roots and the name we dialled (an address or
    a DNS name), presenting the client certificate when there is one. No ALPN: HTTP/1.1."""

    def __init__(self, tls: EngineTLS) -> None:
        self.tls = tls

    def creatorForNetloc(self, hostname: bytes, port: int):
        return ssl.optionsForClientTLS(
            hostname.decode("ascii"), trustRoot=self.tls.trust, clientCertificate=self.tls.client
        )


def tls_problem(failure: Failure) -> str | None:
    """The certificate or handshake problem inside a failed request, or None."""
    pending = [failure]
    while pending:
        current = pending.pop(0)
        value = current.value if isinstance(current, Failure) else current
        if isinstance(value, VerificationError):
            return "the certificate does not name the host dialled"
        if isinstance(value, SSL.Error):
            reasons = [
                part[2]
                for part in (value.args[0] if value.args else [])
                if isinstance(part, tuple) and len(part) == 3 and part[2]
            ]
            return ", ".join(reasons) or "TLS handshake failed"
        pending.extend(getattr(value, "reasons", None) or [])
    return None


@implementer(IAgent)
class _NodeAgent:
    """One node's view of its agent: its key in place of the caller's, TLS failures reported."""

    def __init__(
        self, agent: IAgent, node_id: str, api_key: str | None, agents: "EngineAgents"
    ) -> None:
        self.agent, self.node_id, self.agents = agent, node_id, agents
        self._authorization = None if api_key is None else b"Bearer " + api_key.encode()

    def request(
        self, method: bytes, uri: bytes, headers: Headers | None = None, bodyProducer=None
    ) -> Deferred:
        if self._authorization is not None:
            headers = headers.copy() if headers is not None else Headers()
            headers.removeHeader(b"x-api-key")
            headers.setRawHeaders(b"Authorization", [self._authorization])
        requested = self.agent.request(method, uri, headers, bodyProducer)
        return requested.addCallbacks(self._answered, self._failed)

    def _answered(self, response):
        self.agents.tls_worked(self.node_id)
        return response

    def _failed(self, failure: Failure) -> Failure:
        problem = tls_problem(failure)
        if problem is not None:
            self.agents.tls_failed(self.node_id, problem)
        return failure


class EngineAgents:
    """One pooled HTTPS Agent per distinct TLS configuration; closed at shutdown."""

    def __init__(
        self,
        reactor,
        agent: IAgent,
        connect_timeout: float,
        idle_timeout: float,
        max_idle_per_host: int = 256,
        keepalive: float = 0.0,
    ) -> None:
        self.agent = agent
        self._pools: AgentPools[EngineTLS] = AgentPools(
            reactor, connect_timeout, idle_timeout, max_idle_per_host, keepalive
        )
        self._warned: WarnOnce[str] = WarnOnce()

    def for_node(self, node) -> IAgent:
        access = node.access
        if access is None:
            return self.agent
        agent = self.agent if access.tls is None else self._tls_agent(access.tls)
        return _NodeAgent(agent, node.id, access.api_key, self)

    @property
    def keepalive(self) -> float:
        """The TCP keepalive its clients' connections probe with (0: none)."""
        return self._pools.keepalive

    def _tls_agent(self, tls: EngineTLS) -> IAgent:
        return self._pools.get(tls, lambda: EnginePolicy(tls))

    def retain(self, configs) -> None:
        """Forget the clients of TLS configurations no node uses any more (a node removed, a
        CA rotated): their idle connections close now; requests still on one finish, and
        their connections close as they come back."""
        self._pools.retain(lambda tls: tls in configs)

    def tls_failed(self, node_id: str, problem: str) -> None:
        """Once per node per change of the reason: an engine whose certificate stays bad
        does not fill the log, and a new problem is still seen."""
        if self._warned.new(node_id, problem):
            log.warn("TLS to node {node} failed, failing over: {why}", node=node_id, why=problem)

    def tls_worked(self, node_id: str) -> None:
        if self._warned.clear(node_id):
            log.info("TLS to node {node} works again", node=node_id)

    def close(self) -> Deferred:
        return self._pools.close()
