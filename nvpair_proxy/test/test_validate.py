"""The one definition each of an integer, a port and a loopback host (issue 9, item 5)."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core.validate import (
    BRACKETS_FOR_IPV6,
    PORT_OUT_OF_RANGE,
    WANT_HOST_PORT,
    ip_of,
    is_int,
    is_loopback,
    is_port,
    parse_port,
    split_host_port,
)


def split_or_reason(text: str, **flags):
    try:
        return split_host_port(text, **flags)
    except ValueError as exc:
        return str(exc)


class ValidateTests(SynchronousTestCase):
    def test_integers_exclude_bools_and_floats(self):
        self.assertEqual(
            [is_int(v) for v in (0, -3, 2**80, True, False, 1.0, "1", None)],
            [True, True, True, False, False, False, False, False],
        )

    def test_ports(self):
        self.assertEqual(
            [is_port(v) for v in (1, 65535, 0, 65536, -1, True, 80.0, "80")],
            [True, True, False, False, False, False, False, False],
        )
        self.assertEqual(
            [is_port(v, zero=True) for v in (0, 65535, -1, False)], [True, True, False, False]
        )

    def test_loopback_table(self):
        table = {
            "127.0.0.1": True,
            "127.8.9.10": True,
            "::1": True,
            "[::1]": True,
            "::ffff:127.0.0.1": True,
            "::ffff:192.168.1.10": False,
            "fe80::1%eth0": False,
            "::1%lo": True,
            "192.168.1.10": False,
            "localhost": False,
            "": False,
            "not-an-address": False,
        }
        self.assertEqual({host: is_loopback(host) for host in table}, table)

    def test_names_and_scopes_only_where_allowed(self):
        self.assertTrue(is_loopback("localhost", name=True))
        self.assertFalse(is_loopback("::1%lo", scoped=False))
        self.assertFalse(is_loopback("::ffff:10.0.0.5", name=True, scoped=False))

    def test_a_mapped_loopback_is_the_ipv4_inside_it(self):
        self.assertEqual(
            [str(ip_of(h)) for h in ("::ffff:127.0.0.1", "[::ffff:127.0.0.2]")],
            ["127.0.0.1", "127.0.0.2"],
        )
        self.assertTrue(is_loopback("[::ffff:127.0.0.1]", scoped=False))


class HostPortTests(SynchronousTestCase):
    def test_host_port_table(self):
        table = {
            "127.0.0.1:11434": ("127.0.0.1", 11434),
            "[::1]:11434": ("::1", 11434),
            "localhost:1": ("localhost", 1),
            "[::ffff:127.0.0.1]:80": ("::ffff:127.0.0.1", 80),
            "example.com:65535": ("example.com", 65535),
            "[fe80::1%eth0]:9": ("fe80::1%eth0", 9),
            "127.0.0.1": WANT_HOST_PORT,
            ":11434": WANT_HOST_PORT,
            "127.0.0.1:": WANT_HOST_PORT,
            "127.0.0.1:port": WANT_HOST_PORT,
            "127.0.0.1: 80": WANT_HOST_PORT,
            "127.0.0.1:+80": WANT_HOST_PORT,
            "127.0.0.1:-1": WANT_HOST_PORT,
            "127.0.0.1:\u0661\u0662": WANT_HOST_PORT,
            "127.0.0.1:\u00b2": WANT_HOST_PORT,
            "::1:11434": WANT_HOST_PORT,
            "[::1]": WANT_HOST_PORT,
            "[::1:80": WANT_HOST_PORT,
            "http://127.0.0.1:80": WANT_HOST_PORT,
            "": WANT_HOST_PORT,
            "127.0.0.1:0": PORT_OUT_OF_RANGE,
            "127.0.0.1:65536": PORT_OUT_OF_RANGE,
            "127.0.0.1:" + "9" * 5000: PORT_OUT_OF_RANGE,
            "[127.0.0.1]:80": BRACKETS_FOR_IPV6,
            "[]:80": BRACKETS_FOR_IPV6,
        }
        self.assertEqual({text: split_or_reason(text) for text in table}, table)

    def test_port_zero_only_where_allowed(self):
        self.assertEqual(split_host_port("[::1]:0", zero=True), ("::1", 0))
        self.assertEqual(parse_port("0", zero=True), 0)
        self.assertEqual(split_or_reason("[::1]:0"), PORT_OUT_OF_RANGE)

    def test_an_optional_port(self):
        table = {
            "localhost": ("localhost", None),
            "[::1]": ("::1", None),
            "127.0.0.1:9464": ("127.0.0.1", 9464),
            "[::1]:9464": ("::1", 9464),
            "::1": WANT_HOST_PORT,
            "localhost:": WANT_HOST_PORT,
            "": WANT_HOST_PORT,
        }
        self.assertEqual({t: split_or_reason(t, port_required=False) for t in table}, table)
