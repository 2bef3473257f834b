"""The existing implementation's flags (bin/nvpair-proxy) and systemd notifications."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core.sdnotify import notify, watchdog
from nvpair_proxy.process.cli import CliError, translate

BASE = ["twistd", "-n", "--pidfile=", "nvpair-proxy"]


class TranslateTests(SynchronousTestCase):
    def test_go_style_flags_with_one_or_two_dashes_and_either_value_form(self):
        self.assertEqual(
            translate(
                [
                    "-ipc",
                    "/run/b.sock",
                    "--cluster-dir=/c",
                    "-log-level=debug",
                    "--response-header-timeout",
                    "90s",
                    "-version",
                ]
            ),
            BASE
            + [
                "--ipc=/run/b.sock",
                "--cluster-dir=/c",
                "--log-level=debug",
                "--response-header-timeout=90s",
                "--version",
            ],
        )

    def test_unknown_flags_and_missing_values_are_refused(self):
        with self.assertRaises(CliError) as caught:
            translate(["-engine", "ollama"])
        self.assertEqual(str(caught.exception), "flag provided but not defined: -engine")
        with self.assertRaises(CliError) as caught:
            translate(["-ipc"])
        self.assertEqual(str(caught.exception), "flag needs an argument: -ipc")
        self.assertRaises(CliError, translate, ["stray"])


class NotifyTests(SynchronousTestCase):
    def _socket(self):
        folder = tempfile.mkdtemp(prefix="nvp-")
        self.addCleanup(shutil.rmtree, folder, True)
        path = os.path.join(folder, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(5)
        self.addCleanup(sock.close)
        return path, sock

    def test_ready_is_one_datagram_to_notify_socket(self):
        path, sock = self._socket()
        self.assertTrue(notify("READY=1", {"NOTIFY_SOCKET": path}))
        self.assertEqual(sock.recv(64), b"READY=1")

    def test_without_notify_socket_nothing_is_sent(self):
        self.assertFalse(notify("READY=1", {}))

    def test_watchdog_pings_at_half_the_requested_interval(self):
        path, sock = self._socket()
        clock = Clock()
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"}
        pinging = watchdog(clock, env)
        pinging.startService()
        self.assertEqual(sock.recv(64), b"WATCHDOG=1")
        clock.advance(1.9)
        sock.settimeout(0)
        self.assertRaises(BlockingIOError, sock.recv, 64)
        clock.advance(0.1)
        self.assertEqual(sock.recv(64), b"WATCHDOG=1")
        pinging.stopService()
        clock.advance(2)
        self.assertRaises(BlockingIOError, sock.recv, 64)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertIsNone(watchdog(clock, {"NOTIFY_SOCKET": path}))
