"""The cluster directory and the pinned mutual TLS built on it
(docs/references.md#listener-personalities, #cluster-pins).

The proxy builds no trust of its own: the cluster manager writes this node's identity and
one pin per peer, and this module only reads them. A peer is trusted when its certificate is
byte-for-byte a live pin, checked per request and on a 2 s watch, so joining or leaving a
cluster, or a pin appearing or vanishing, needs no restart and no discovery event.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Callable

import attrs
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID
from OpenSSL import SSL, crypto
from twisted.application.internet import TimerService
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
    IReactorTime,
)
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from ..core import constants
from ..core.files import FileWatch, Stamps, read_regular_file
from ..core.logs import logger
from ..core.warnonce import WarnOnce
from ..http.agentpools import AgentPools
from ..http.keypair import KeyPairError, load_key_pair

log = logger()

WATCH_INTERVAL = 2.0


class _Unreadable(Exception):
    """A pin file that cannot be read whole; its previous value stands."""


# What ``_read_or_keep`` answers for a file that is there but cannot be read now.
_KEEP = object()


URN_PREFIX = "urn:nvpair:node:"


def principal(certificate: x509.Certificate) -> str:
    """The node a certificate names: its ``urn:nvpair:node:<uuid>`` URI SAN, else its CN."""
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        for uri in san.value.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith(URN_PREFIX):
                return uri[len(URN_PREFIX) :]
    except x509.ExtensionNotFound:
        pass
    except ValueError:
        return ""  # extensions that do not parse name nobody
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


@attrs.frozen
class Identity:
    """This node's certificate and key, as loaded, plus the certificate's DER."""

    certificate: crypto.X509
    key: crypto.PKey
    der: bytes


@attrs.define
class ClusterDirectory:
    """What the cluster manager wrote, re-read on a watch; a briefly unreadable file keeps
    its previous value (the manager replaces files while we read them)."""

    path: str
    identity: Identity | None = None
    admission: dict = attrs.Factory(dict)
    pins: dict[str, bytes] = attrs.Factory(dict)
    _warned: WarnOnce[str] = attrs.Factory(WarnOnce)
    _watch: FileWatch = attrs.field(init=False)

    @_watch.default
    def _watch_the_directory(self) -> FileWatch:
        return FileWatch(self._watched)

    @property
    def member(self) -> bool:
        """An identity, and either an admission with a cluster and epoch or a pin
        (docs/references.md#cluster-membership)."""
        if self.identity is None:
            return False
        admitted = bool(self.admission.get("clusterId")) and bool(self.admission.get("epoch"))
        return admitted or bool(self.pins)

    def pin(self, node_uuid: str) -> bytes | None:
        return self.pins.get(node_uuid) if self.member else None

    def live_pins(self) -> int:
        """How many peers' pins are trusted now: none until this node is a member."""
        return len(self.pins) if self.member else 0

    def trusts(self, der: bytes) -> bool:
        """A client certificate is a pinned member's, or our own (per request,
        docs/references.md#cluster-pins)."""
        if not self.member or not der or self.identity is None:  # no identity: no member
            return False
        candidates = list(self.pins.values()) + [self.identity.der]
        return any(hmac.compare_digest(der, pinned) for pinned in candidates)

    def refresh(self, seen: Stamps | None = None) -> None:
        """Read every file again; ``seen`` is their stamps when the caller just took them."""
        self._watch.read(seen, self._read_all)

    def _read_all(self) -> None:
        for read in (self._read_identity, self._read_admission, self._read_pins):
            try:
                read()
            except Exception:
                log.failure("could not read the cluster directory {path}", path=self.path)

    def _warn_once(self, name: str, problem: str | None) -> None:
        """One line when a file goes bad (or bad in another way), none on every re-read of
        the watch while it stays so; ``None``: the file reads fine again."""
        if problem is None:
            self._warned.clear(name)
        elif self._warned.new(name, problem):
            log.warn("cluster directory {path}: {problem}", path=self.path, problem=problem)

    def _read_or_keep(self, name: str, read: Callable, unreadable: Callable[[OSError], str]):
        """``read()``; None when the file is absent, which is a state (no identity, no
        admission, no pins) and no problem; ``_KEEP`` when it is there but cannot be read now,
        warned once: a file mid-rotation or a permission slip must not drop what was trusted."""
        try:
            return read()
        except FileNotFoundError:
            self._warn_once(name, None)
            return None
        except OSError as exc:
            self._warn_once(name, unreadable(exc))
            return _KEEP

    def _read_identity(self) -> None:
        pems = self._read_or_keep(
            "identity",
            lambda: (
                read_regular_file(os.path.join(self.path, "node.crt")),
                read_regular_file(os.path.join(self.path, "node.key")),
            ),
            lambda exc: (
                f"cannot read {os.path.basename(exc.filename or '')}: {exc.strerror}; "
                "keeping the previous identity"
            ),
        )
        if pems is _KEEP:
            return
        if pems is None:
            self.identity = None
            return
        cert_pem, key_pem = pems
        try:
            cert, key = load_key_pair(cert_pem, key_pem)
        except KeyPairError:
            # Mid-rotation the manager may have replaced one file and not yet the other.
            self._warn_once(
                "identity",
                "node.crt or node.key does not load or the key does "
                "not match; keeping the previous identity",
            )
            return
        self._warn_once("identity", None)
        der = cert.to_cryptography().public_bytes(Encoding.DER)
        if self.identity is None or self.identity.der != der:
            self.identity = Identity(cert, key, der)

    def _read_admission(self) -> None:
        raw = self._read_or_keep(
            "admission.json",
            lambda: read_regular_file(os.path.join(self.path, "admission.json")),
            lambda exc: (
                f"cannot read admission.json: {exc.strerror}; keeping the previous admission"
            ),
        )
        if raw is _KEEP:
            return
        try:
            data = {} if raw is None else json.loads(raw.decode("utf-8"))
        except ValueError as exc:
            self._warn_once(
                "admission.json",
                f"admission.json is not JSON ({exc}); keeping the previous admission",
            )
            return
        self._warn_once("admission.json", None)
        self.admission = data if isinstance(data, dict) else {}

    def _read_pins(self) -> None:
        folder = os.path.join(self.path, "trusted")
        # A file (or a loop) where the folder belongs is not "no pins": the previous ones stay.
        names = self._read_or_keep(
            "trusted",
            lambda: os.listdir(folder),
            lambda exc: f"cannot list trusted: {exc.strerror}; keeping the previous pins",
        )
        if names is _KEEP:
            return
        names = names or []
        self._warn_once("trusted", None)
        pins: dict[str, bytes] = {}
        for name in names:
            full = os.path.join(folder, name)
            if not name.endswith(".json") or name.endswith(".tmp") or os.path.isdir(full):
                continue
            node_uuid = name[: -len(".json")]
            try:
                der = self._read_pin(full, node_uuid)
            except _Unreadable as exc:
                self._warn_once(
                    f"trusted/{name}",
                    f"cannot read trusted/{name} whole ({exc}); keeping its previous pin",
                )
                der = self.pins.get(node_uuid)
            else:
                self._warn_once(f"trusted/{name}", None)
            if der is not None:
                pins[node_uuid] = der
        self._warned.retain(
            lambda name: not name.startswith("trusted/") or name[len("trusted/") :] in names
        )
        self.pins = pins

    @staticmethod
    def _read_pin(path: str, node_uuid: str):
        """The pinned DER; None when the file disagrees (file name, ``nodeUuid`` and the
        certificate's principal must agree). Raises _Unreadable while it cannot be read whole."""
        try:
            data = json.loads(read_regular_file(path).decode("utf-8"))
            certificate = x509.load_pem_x509_certificate(data["certPem"].encode())
        except OSError as exc:
            raise _Unreadable(exc.strerror or str(exc)) from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _Unreadable(f"{type(exc).__name__}: {exc}") from None
        if not isinstance(data, dict) or data.get("nodeUuid") != node_uuid:
            return None
        if principal(certificate) != node_uuid:
            return None
        return certificate.public_bytes(Encoding.DER)

    def check(self, now: float | None = None, every: float = 0.0) -> None:
        """Re-derive now if any file changed (docs/references.md#pins-per-request: per request as
        well as on the watch).

        A handful of stat calls; the files are read again only when one of them changed. With
        a clock's ``now``, at most once per ``every`` seconds.
        """
        current = self._watch.changed(now, every)
        if current is not None:
            self.refresh(current)

    def _watched(self) -> list[str]:
        """Every file the directory holds, each pin included."""
        paths = [
            os.path.join(self.path, name)
            for name in ("node.crt", "node.key", "admission.json", "trusted")
        ]
        try:
            names = sorted(os.listdir(os.path.join(self.path, "trusted")))
        except OSError:
            names = []
        return paths + [os.path.join(self.path, "trusted", name) for name in names]


def trust_watch(
    directory: ClusterDirectory, clock: IReactorTime, interval: float = WATCH_INTERVAL
) -> TimerService:
    """The 2 s re-read of the cluster directory, as a service of the tree, so joining or
    leaving a cluster needs no restart; the first read happens as it starts."""
    service = TimerService(interval, directory.refresh)
    service.clock = clock
    service.setName("trust watch")
    return service


def der_of(certificate: crypto.X509) -> bytes:
    return certificate.to_cryptography().public_bytes(Encoding.DER)


def _context(identity: Identity, verify: Callable) -> SSL.Context:
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(SSL.TLS1_2_VERSION)
    context.use_certificate(identity.certificate)
    context.use_privatekey(identity.key)
    context.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, verify)
    return context


@implementer(IOpenSSLServerConnectionCreator)
class ServerCreator:
    """The ingress side: present ``node.crt``, require a client certificate.

    The handshake accepts any client certificate; whether it is a pinned member's is decided
    per request (403 ``cluster-auth``), so a pin removed mid-connection takes effect at once.
    """

    def __init__(self, directory: ClusterDirectory) -> None:
        self.directory = directory

    def serverConnectionForTLS(self, protocol) -> SSL.Connection:
        identity = self.directory.identity
        if identity is None:
            raise SSL.Error("no cluster identity")
        return SSL.Connection(_context(identity, lambda *args: True), None)


@implementer(IOpenSSLClientConnectionCreator)
class _PinnedClient:
    def __init__(self, identity: Identity, pin: bytes) -> None:
        self.identity, self.pin = identity, pin

    def _verify(self, connection, certificate, errno, depth, ok) -> bool:
        # Called for each certificate of the chain (twice for a self-signed one): the answer
        # depends only on the leaf's bytes, so it is the same every time.
        if depth != 0:
            return True
        return hmac.compare_digest(der_of(certificate), self.pin)

    def clientConnectionForTLS(self, protocol) -> SSL.Connection:
        connection = SSL.Connection(_context(self.identity, self._verify), None)
        connection.set_connect_state()
        return connection


@implementer(IPolicyForHTTPS)
class PinnedPolicy:
    """Outbound to one peer: present our certificate, require the server's to equal its pin.

    Looked up at every connection, so a pin that vanished fails closed; there is never a
    fallback to plaintext or to ordinary certificate validation.
    """

    def __init__(self, directory: ClusterDirectory, node_uuid: str) -> None:
        self.directory, self.node_uuid = directory, node_uuid

    def creatorForNetloc(self, hostname: bytes, port: int):
        identity = self.directory.identity
        pin = self.directory.pin(self.node_uuid)
        if identity is None or pin is None:
            raise SSL.Error(f"no live pin for node {self.node_uuid}")
        return _PinnedClient(identity, pin)


def tls_ingress(directory: ClusterDirectory, site, clock: IReactorTime) -> Callable:
    """For the listener's demux: the TLS factory while this node is a member, else None
    (a ClientHello is then refused by closing: no member, no handshake)."""
    from twisted.protocols.tls import TLSMemoryBIOFactory

    factory = TLSMemoryBIOFactory(ServerCreator(directory), False, site, clock=clock)
    factory.noisy = False
    return lambda: factory if directory.member else None


class PeerAgents:
    """One pooled HTTPS transport per pinned peer (docs/references.md#peer-transport), closed at
    shutdown."""

    def __init__(
        self,
        reactor,
        directory: ClusterDirectory,
        connect_timeout: float,
        idle_timeout: float,
        keepalive: float = 0.0,
    ) -> None:
        self.directory = directory
        self._pools: AgentPools[str] = AgentPools(
            reactor,
            connect_timeout,
            idle_timeout,
            max_idle_per_host=constants.PEER_MAX_IDLE,
            keepalive=keepalive,
        )
        self._pins: dict[str, bytes | None] = {}  # per peer, the pin its pool was made for

    def for_node(self, node):
        """The peer's agent for its current pin: a rotated pin gets a fresh pool, so no
        connection verified against the old pin is ever reused
        (docs/references.md#peer-transport)."""
        uuid = node.cluster_uuid
        pin = self.directory.pin(uuid)
        if self._pins.get(uuid, pin) != pin:
            self._pools.retire(uuid)
        self._pins[uuid] = pin
        return self._pools.get(uuid, lambda: PinnedPolicy(self.directory, uuid))

    def close(self):
        return self._pools.close()
