"""A certificate and its private key, loaded as a pair.

Two places present a client certificate: the cluster identity (``node.crt`` and ``node.key``,
trust.py) and an engine's ``cert_file`` and ``key_file`` (engineaccess.py). Both must refuse a
key that is not the certificate's before any handshake, because OpenSSL would otherwise
fail only later, per connection, with a less clear error. This is that one check.
"""

from __future__ import annotations

from typing import Literal

from OpenSSL import SSL, crypto

Part = Literal["certificate", "key", "match"]


class KeyPairError(ValueError):
    """The pair does not load; ``part`` says which: the certificate, the key, or the key is
    not the certificate's. The text never holds key material."""

    def __init__(self, part: Part) -> None:
        super().__init__(part)
        self.part: Part = part


def load_key_pair(cert_pem: bytes, key_pem: bytes) -> tuple[crypto.X509, crypto.PKey]:
    """The PEM certificate and its unencrypted PEM private key; raises KeyPairError."""
    try:
        certificate = crypto.load_certificate(crypto.FILETYPE_PEM, cert_pem)
    except (crypto.Error, ValueError):
        raise KeyPairError("certificate") from None
    try:
        key = crypto.load_privatekey(crypto.FILETYPE_PEM, key_pem)
    except (crypto.Error, ValueError, TypeError):
        raise KeyPairError("key") from None
    try:
        check = SSL.Context(SSL.TLS_METHOD)
        check.use_certificate(certificate)
        check.use_privatekey(key)
        check.check_privatekey()
    except SSL.Error:
        raise KeyPairError("match") from None
    return certificate, key
