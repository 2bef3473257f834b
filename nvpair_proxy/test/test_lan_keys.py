"""LAN clients with API keys, from a real non-loopback source address (issue 11), and the proof
that no key or credential reaches the log at any level.

The client binds to one of this machine's own non-loopback addresses and connects to the
facade listening on that address, so the proxy sees a real LAN peer. Without such an address
the tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock
from twisted.logger import formatEvent
from twisted.trial.unittest import TestCase
from twisted.web.http_headers import Headers

from nvpair_proxy.core.logs import level_name, set_level
from nvpair_proxy.lan.apikeys import KeyStore, LanGate, parse_cidrs
from nvpair_proxy.request.dispatch import Bounds
from nvpair_proxy.request.events import LogEmitter
from nvpair_proxy.test.support import LogCapture, failures, rewrite
from nvpair_proxy.test.tlsfleet import CALLER_KEY, ENGINE_KEY, TLSFleet, write

KEY = "lan-key-" + "A1b2C3d4" * 4  # 40 characters of the key alphabet
ROTATED = "rotated~key+" + "Zz09" * 8 + "=="
WRONG = "wrong.key_" + "x" * 30


def _ip_addresses() -> list[str]:
    try:
        out = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]


def _udp_address() -> list[str]:
    """The source address the kernel would pick for the outside world (nothing is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))
        return [probe.getsockname()[0]]
    except OSError:
        return []
    finally:
        probe.close()


def lan_address() -> str | None:
    """One of this machine's own non-loopback IPv4 addresses that accepts a bind, or None."""
    for address in _ip_addresses() + _udp_address():
        if address.startswith("127."):
            continue
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((address, 0))
            sock.close()
            return address
        except OSError:
            continue
    return None


ADDRESS = lan_address()


class LanClient:
    """A facade on the LAN address with a plain engine behind it, keys from a file whose
    re-reads follow ``clock``."""

    def __init__(
        self, test: TestCase, *, cidrs: str = "", env: str | None = None, emitter=None
    ) -> None:
        self.fleet = TLSFleet(test)
        self.engine = self.fleet.engine("a")
        self.clock = Clock()
        self.keys_file = write(self.fleet.folder, "proxy-api-keys", f"# team\n{KEY}\n".encode())
        self.gate = LanGate(
            KeyStore(self.clock, env=env, path=self.keys_file), allowed=parse_cidrs(cidrs)
        )
        self.fleet.start(emitter=emitter, lan=self.gate, interface=ADDRESS, bind=ADDRESS)

    @inlineCallbacks
    def get(self, headers: dict | None = None):
        code, body = yield self.fleet.request(b"GET", "/api/tags", headers)
        return code, json.loads(body)

    def rotate(self, text: str, mode: int = 0o600) -> None:
        rewrite(self.keys_file, text)
        os.chmod(self.keys_file, mode)
        self.clock.advance(1)


class LanKeyTests(TestCase):
    if ADDRESS is None:
        skip = "this machine has no non-loopback IPv4 address to connect from"

    @inlineCallbacks
    def test_a_source_outside_the_allowlist_gets_403_source_not_allowed(self):
        lan = LanClient(self, cidrs="198.51.100.0/24")
        code, body = yield lan.get({"Authorization": f"Bearer {KEY}"})
        self.assertEqual((code, body["code"]), (403, "source-not-allowed"))
        self.assertEqual(lan.engine.seen, [])

    @inlineCallbacks
    def test_a_source_inside_the_allowlist_with_the_key_is_served(self):
        lan = LanClient(self, cidrs=f"{ADDRESS}/32")
        code, _ = yield lan.get({"Authorization": f"Bearer {KEY}"})
        self.assertEqual(code, 200)

    @inlineCallbacks
    def test_missing_wrong_and_right_keys(self):
        lan = LanClient(self)
        code, body = yield lan.get()
        self.assertEqual((code, body["code"]), (401, "unauthorized"))
        code, body = yield lan.get({"Authorization": f"Bearer {WRONG}"})
        self.assertEqual((code, body["code"]), (401, "unauthorized"))
        self.assertEqual(lan.engine.seen, [])
        code, body = yield lan.get({"Authorization": f"Bearer {KEY}"})
        self.assertEqual((code, body["models"][0]["name"]), (200, "llama3:latest"))
        [(_, _, headers)] = lan.engine.seen
        self.assertIsNone(headers.getRawHeaders(b"authorization"))
        self.assertEqual(failures(lan.gate, ADDRESS), 2)

    @inlineCallbacks
    def test_x_api_key_is_accepted_and_not_forwarded(self):
        lan = LanClient(self)
        code, _ = yield lan.get({"X-Api-Key": KEY})
        self.assertEqual(code, 200)
        [(_, _, headers)] = lan.engine.seen
        self.assertIsNone(headers.getRawHeaders(b"x-api-key"))

    @inlineCallbacks
    def test_a_key_is_rotated_by_editing_the_file(self):
        lan = LanClient(self)
        code, _ = yield lan.get({"X-Api-Key": ROTATED})
        self.assertEqual(code, 401)
        lan.rotate(f"{ROTATED}\n")
        code, _ = yield lan.get({"X-Api-Key": ROTATED})
        self.assertEqual(code, 200)
        code, _ = yield lan.get({"X-Api-Key": KEY})
        self.assertEqual(code, 401)

    @inlineCallbacks
    def test_a_world_readable_keys_file_is_refused(self):
        lan = LanClient(self)
        lan.rotate(f"{KEY}\n", mode=0o644)
        code, body = yield lan.get({"Authorization": f"Bearer {KEY}"})
        self.assertEqual((code, body["code"]), (403, "loopback-only"))


class NoCredentialInTheLogTests(TestCase):
    """Every log record made at debug, formatted and raw, holds none of the keys used."""

    if ADDRESS is None:
        skip = "this machine has no non-loopback IPv4 address to connect from"

    def setUp(self) -> None:
        previous = level_name()
        set_level("debug")
        self.addCleanup(set_level, previous)

    @inlineCallbacks
    def test_no_key_or_credential_appears_in_any_log_line(self):
        logs = LogCapture(self)
        env_key = "env-key-" + "Q" * 32
        bad_env = "x" * 40 + ",short-bad-entry-" + "y" * 3
        LanGate(KeyStore(Clock(), env=bad_env, path=None)).decide("192.0.2.9", Headers())
        lan = LanClient(self, env=env_key, emitter=LogEmitter())
        for headers in (
            {},
            {"Authorization": f"Bearer {WRONG}"},
            {"X-Api-Key": WRONG},
            {"Authorization": f"Bearer {KEY}"},
            {"X-Api-Key": env_key},
        ):
            yield lan.get(headers)
        for _ in range(6):
            yield lan.get({"Authorization": f"Bearer {WRONG}"})
        lan.rotate(f"{KEY}\n{ROTATED}\nnot-a-valid-key {ROTATED[:20]}\n")
        yield lan.get({"X-Api-Key": ROTATED})

        fleet = TLSFleet(self)
        client_cert, client_key = fleet.ca.issue(client=True)
        cert_file = write(fleet.folder, "client.pem", client_cert)
        key_file = write(fleet.folder, "client.key", client_key)
        fleet.engine(
            "a", tls=fleet.ca.issue(dns=("wrong.example",)), extra=f'api_key = "{ENGINE_KEY}"\n'
        )
        fleet.engine(
            "b",
            tls=fleet.ca.issue(ips=("127.0.0.1",)),
            extra=f'api_key = "{ENGINE_KEY}"\ncert_file = "{cert_file}"\nkey_file = "{key_file}"\n',
        )
        fleet.start(Bounds(max_attempts=3, backoff=(0.0,), jitter=0.0), emitter=LogEmitter())
        code, _ = yield fleet.chat({"Authorization": f"Bearer {CALLER_KEY}"})
        self.assertEqual(code, 200)
        yield fleet.request(b"GET", "/api/tags", {"Authorization": f"Bearer {CALLER_KEY}"})

        secrets = [
            KEY,
            ROTATED,
            ROTATED[:20],
            WRONG,
            env_key,
            "short-bad-entry",
            ENGINE_KEY,
            CALLER_KEY,
            client_key.decode().splitlines()[1],
        ]
        self.assertGreater(len(logs.events), 20)
        debug = [
            e
            for e in logs.events
            if e.get("log_level") is not None and e["log_level"].name == "debug"
        ]
        self.assertTrue(debug, "nothing was logged at debug")
        for event in logs.events:
            lines = [formatEvent(event), repr(event)]
            if event.get("log_failure") is not None:
                lines.append(event["log_failure"].getTraceback())
            for line in lines:
                for secret in secrets:
                    self.assertNotIn(secret, line)
