"""A certificate and its key loaded as a pair (keypair.py), each way it can fail named."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.http.keypair import KeyPairError, load_key_pair
from nvpair_proxy.testing.certs import make_certificate


class LoadKeyPairTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.cert_pem, self.key_pem = make_certificate("node-a")

    def failed_part(self, cert_pem: bytes, key_pem: bytes) -> str:
        with self.assertRaises(KeyPairError) as raised:
            load_key_pair(cert_pem, key_pem)
        self.assertNotIn(self.key_pem.decode(), str(raised.exception))
        return raised.exception.part

    def test_a_matching_pair_loads(self):
        certificate, key = load_key_pair(self.cert_pem, self.key_pem)
        self.assertEqual(certificate.get_subject().CN, "node-a")
        self.assertEqual(key.bits(), 256)

    def test_each_failure_names_its_part(self):
        other_cert, other_key = make_certificate("node-b")
        self.assertEqual(self.failed_part(b"not a certificate", self.key_pem), "certificate")
        self.assertEqual(self.failed_part(self.cert_pem, b"not a key"), "key")
        self.assertEqual(self.failed_part(self.cert_pem, other_key), "match")
        self.assertEqual(self.failed_part(other_cert, self.key_pem), "match")

    def test_it_is_a_value_error(self):
        self.assertIsInstance(KeyPairError("key"), ValueError)
