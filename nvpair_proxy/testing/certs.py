"""Certificates and cluster directories for tests, made the way the cluster manager makes
them: self-signed, the node's id in a ``urn:nvpair:node:<uuid>`` URI SAN."""

from __future__ import annotations

import datetime
import json
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def make_certificate(node_uuid: str, *, san: bool = True) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) naming ``node_uuid`` by URI SAN, or by CN only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_uuid)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
    )
    if san:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"urn:nvpair:node:{node_uuid}")]
            ),
            critical=False,
        )
    certificate = builder.sign(key, hashes.SHA256())
    return (
        certificate.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


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


class TestCA:
    """A certificate authority for engines behind TLS: it issues server
    certificates for given DNS names and addresses, expired ones, and client certificates."""

    def __init__(self, name: str = "nvpair test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        *,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        expired: bool = False,
        client: bool = False,
    ) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) signed by this CA."""
        import ipaddress

        key = ec.generate_private_key(ec.SECP256R1())
        common = (dns or ips or ("client",))[0]
        now = datetime.datetime.now(datetime.timezone.utc)
        start, end = (
            (now - datetime.timedelta(days=30), now - datetime.timedelta(days=1))
            if expired
            else (now - datetime.timedelta(days=1), now + datetime.timedelta(days=30))
        )
        names = [x509.DNSName(n) for n in dns] + [
            x509.IPAddress(ipaddress.ip_address(a)) for a in ips
        ]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]
                ),
                critical=False,
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        return (
            certificate.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
