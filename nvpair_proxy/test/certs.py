"""Certificates and cluster directories for tests, made the way the cluster manager makes
them: self-signed, the node's id in a ``urn:nvpair:node:<uuid>`` URI SAN."""

from __future__ import annotations

import datetime
import json
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def make_certificate(node_uuid: str, *, san: bool = True) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) naming ``node_uuid`` by URI SAN, or by CN only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_uuid)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1))
               .not_valid_after(now + datetime.timedelta(days=30)))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(f"urn:nvpair:node:{node_uuid}")]), critical=False)
    certificate = builder.sign(key, hashes.SHA256())
    return (certificate.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def write_identity(folder: str, cert_pem: bytes, key_pem: bytes) -> None:
    os.makedirs(os.path.join(folder, "trusted"), exist_ok=True)
    with open(os.path.join(folder, "node.crt"), "wb") as handle:
        handle.write(cert_pem)
    with open(os.path.join(folder, "node.key"), "wb") as handle:
        handle.write(key_pem)


def write_admission(folder: str, cluster_id: str = "c-1", epoch: int = 1) -> None:
    with open(os.path.join(folder, "admission.json"), "w") as handle:
        json.dump({"clusterId": cluster_id, "epoch": epoch}, handle)


def write_pin(folder: str, node_uuid: str, cert_pem: bytes, file_uuid: str | None = None) -> str:
    os.makedirs(os.path.join(folder, "trusted"), exist_ok=True)
    path = os.path.join(folder, "trusted", f"{file_uuid or node_uuid}.json")
    with open(path, "w") as handle:
        json.dump({"nodeUuid": node_uuid, "certPem": cert_pem.decode()}, handle)
    return path
