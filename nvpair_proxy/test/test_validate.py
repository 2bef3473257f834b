"""The one definition each of an integer, a port and a loopback host (issue 9, item 5)."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.validate import is_int, is_loopback, is_port


class ValidateTests(SynchronousTestCase):
    def test_integers_exclude_bools_and_floats(self):
        self.assertEqual([is_int(v) for v in (0, -3, 2**80, True, False, 1.0, "1", None)],
                         [True, True, True, False, False, False, False, False])

    def test_ports(self):
        self.assertEqual([is_port(v) for v in (1, 65535, 0, 65536, -1, True, 80.0, "80")],
                         [True, True, False, False, False, False, False, False])
        self.assertEqual([is_port(v, zero=True) for v in (0, 65535, -1, False)],
                         [True, True, False, False])

    def test_loopback_table(self):
        table = {
            "127.0.0.1": True, "127.8.9.10": True, "::1": True, "[::1]": True,
            "::ffff:127.0.0.1": True, "::ffff:192.168.1.10": False, "fe80::1%eth0": False,
            "::1%lo": True, "192.168.1.10": False, "localhost": False, "": False,
            "not-an-address": False,
        }
        self.assertEqual({host: is_loopback(host) for host in table}, table)

    def test_names_and_scopes_only_where_allowed(self):
        self.assertTrue(is_loopback("localhost", name=True))
        self.assertFalse(is_loopback("::1%lo", scoped=False))
        self.assertFalse(is_loopback("::ffff:10.0.0.5", name=True, scoped=False))
