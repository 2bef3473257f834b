"""Opt-in API keys for LAN clients (issue 11, protocol 5): the key store and the gate's answers,
with in-memory transports and a Clock."""

from __future__ import annotations

import os
import tempfile

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from nvpair_proxy.lan import apikeys
from nvpair_proxy.lan.apikeys import KeyStore, Verdict
from nvpair_proxy.test.support import KEY, LogCapture, failures, gate, rewrite
from nvpair_proxy.test.world import World, WorldTestCase
from nvpair_proxy.testing import lan, loopback

OTHER = "Z" * 40
UNAUTHORIZED = {
    "error": "a valid API key is required for non-loopback requests; send it as "
    "Authorization: Bearer <key> or X-Api-Key: <key>",
    "code": "unauthorized",
}
LOOPBACK_ONLY = {
    "error": "plaintext requests are accepted only from loopback; cluster peers "
    "must use the mTLS ingress",
    "code": "loopback-only",
}


def keys_file(test, text: str, mode: int = 0o600) -> str:
    folder = tempfile.mkdtemp()
    test.addCleanup(lambda: __import__("shutil").rmtree(folder, ignore_errors=True))
    path = os.path.join(folder, "proxy-api-keys")
    with open(path, "w") as handle:
        handle.write(text)
    os.chmod(path, mode)
    return path


class KeyStoreTests(SynchronousTestCase):
    def test_no_keys_means_the_gate_is_off(self):
        store = KeyStore(Clock(), env=None, path="/nonexistent/proxy-api-keys")
        self.assertIsNone(store.digests())

    def test_env_keys_are_comma_separated(self):
        store = KeyStore(Clock(), env=f"{KEY}, {OTHER}", path=None)
        self.assertEqual(len(store.digests()), 2)

    def test_file_keys_skip_comments_and_blank_lines(self):
        path = keys_file(self, f"# team keys\n\n{KEY}  # alice\n{OTHER}\n")
        self.assertEqual(len(KeyStore(Clock(), path=path).digests()), 2)

    def test_a_short_key_disables_the_gate_and_the_error_names_the_line_never_the_key(self):
        logs = LogCapture(self)
        path = keys_file(self, f"{KEY}\n# comment\nshort-key-here\n")
        self.assertIsNone(KeyStore(Clock(), path=path).digests())
        [error] = logs.at("error")
        text = error["why"]
        self.assertIn("line 3", text)
        self.assertNotIn("short-key-here", repr(error))
        self.assertNotIn(KEY, repr(error))

    def test_a_key_with_a_character_outside_the_alphabet_disables_the_gate(self):
        store = KeyStore(Clock(), env=f"{KEY},{'x' * 39}!", path=None)
        self.assertIsNone(store.digests())

    def test_a_key_under_32_characters_disables_the_gate(self):
        self.assertIsNone(KeyStore(Clock(), env="a" * 31).digests())
        self.assertIsNotNone(KeyStore(Clock(), env="a" * 32).digests())
        self.assertIsNone(KeyStore(Clock(), path=keys_file(self, "b" * 31 + "\n")).digests())
        self.assertIsNotNone(KeyStore(Clock(), path=keys_file(self, "b" * 32 + "\n")).digests())

    def test_a_key_over_512_characters_disables_the_gate(self):
        self.assertIsNone(KeyStore(Clock(), env="a" * 513).digests())
        self.assertIsNotNone(KeyStore(Clock(), env="a" * 512).digests())

    def test_a_file_group_or_others_can_read_is_refused(self):
        for mode in (0o644, 0o640, 0o604):
            path = keys_file(self, KEY + "\n", mode)
            self.assertIsNone(KeyStore(Clock(), path=path).digests(), oct(mode))

    def test_a_file_owned_by_someone_else_is_refused(self):
        path = keys_file(self, KEY + "\n")
        owner = os.stat(path).st_uid
        self.assertIsNotNone(KeyStore(Clock(), path=path, uid=owner).digests())
        if owner == 0:
            os.chown(path, 12345, -1)
            self.addCleanup(os.chown, path, 0, -1)
            self.assertIsNone(KeyStore(Clock(), path=path, uid=0).digests())
        else:
            self.assertIsNone(KeyStore(Clock(), path=path, uid=owner + 1).digests())

    def test_a_file_over_64_kib_is_refused(self):
        lines = (KEY + "\n") * (64 * 1024 // (len(KEY) + 1) + 1)
        self.assertIsNone(KeyStore(Clock(), path=keys_file(self, lines)).digests())

    def test_the_file_is_re_read_at_most_once_a_second(self):
        clock = Clock()
        path = keys_file(self, KEY + "\n")
        store = KeyStore(clock, path=path)
        self.assertEqual(len(store.digests()), 1)
        rewrite(path, f"{KEY}\n{OTHER}\n")
        clock.advance(0.5)
        self.assertEqual(len(store.digests()), 1)
        clock.advance(0.5)
        self.assertEqual(len(store.digests()), 2)

    def test_an_invalid_env_entry_disables_file_keys_too(self):
        path = keys_file(self, KEY + "\n")
        self.assertIsNone(KeyStore(Clock(), env="bad", path=path).digests())


class GateDecisionTests(SynchronousTestCase):
    def test_the_verdicts(self):
        g = gate(Clock(), cidrs="192.168.1.0/24")
        bearer = Headers({b"Authorization": [b"Bearer " + KEY.encode()]})
        self.assertIs(g.decide("192.168.1.20", bearer), Verdict.SERVE)
        self.assertIs(g.decide("10.0.0.9", bearer), Verdict.NOT_ALLOWED)
        self.assertIs(g.decide("192.168.1.20", Headers()), Verdict.MISSING)
        self.assertIs(
            g.decide("192.168.1.20", Headers({b"X-Api-Key": [OTHER.encode()]})), Verdict.REJECTED
        )
        self.assertIs(
            g.decide("::ffff:192.168.1.20", Headers({b"x-api-key": [KEY.encode()]})), Verdict.SERVE
        )

    def test_a_basic_credential_is_no_key(self):
        g = gate(Clock())
        self.assertIs(
            g.decide("192.168.1.20", Headers({b"Authorization": [b"Basic " + KEY.encode()]})),
            Verdict.MISSING,
        )

    def test_the_bearer_scheme_is_case_insensitive(self):
        g = gate(Clock())
        self.assertIs(
            g.decide("192.168.1.20", Headers({b"Authorization": [b"bearer " + KEY.encode()]})),
            Verdict.SERVE,
        )

    def test_without_keys_every_lan_request_is_loopback_only(self):
        g = gate(Clock(), env=None, cidrs="192.168.1.0/24")
        self.assertIs(g.decide("10.0.0.9", Headers()), Verdict.LOOPBACK_ONLY)

    def test_failed_attempts_are_counted_and_a_burst_is_logged_once_a_minute_with_the_address(self):
        logs = LogCapture(self)
        clock = Clock()
        g = gate(clock)
        for _ in range(20):
            g.decide("192.168.1.20", Headers())
            clock.advance(1)
        self.assertEqual(failures(g, "192.168.1.20"), 20)
        [warn] = logs.at("warn")
        self.assertEqual(warn["address"], "192.168.1.20")
        clock.advance(60)
        for _ in range(5):
            g.decide("192.168.1.20", Headers({b"X-Api-Key": [OTHER.encode()]}))
        self.assertEqual(len(logs.at("warn")), 2)
        self.assertNotIn(OTHER, repr(list(logs.events)))

    def test_many_sources_inside_their_window_do_not_grow_the_failure_map(self):
        self.patch(apikeys, "MAX_SOURCES", 4)
        clock = Clock()
        g = gate(clock)
        sources = [f"192.0.2.{n}" for n in range(10)]
        for source in sources:
            g.decide(source, Headers())
            clock.advance(1)  # every window still open when the last source fails
        self.assertEqual([failures(g, s) for s in sources], [0] * 6 + [1] * 4)

    def test_the_source_forgotten_is_the_one_whose_window_began_first(self):
        self.patch(apikeys, "MAX_SOURCES", 3)
        clock = Clock()
        g = gate(clock)
        g.decide("192.0.2.1", Headers())
        clock.advance(30)
        g.decide("192.0.2.2", Headers())
        clock.advance(31)  # the window of .1 has ended; that of .2 has not
        g.decide("192.0.2.1", Headers())  # a new window for .1, begun after that of .2
        g.decide("192.0.2.3", Headers())
        g.decide("192.0.2.4", Headers())  # the map is full: .2 goes
        self.assertEqual([failures(g, f"192.0.2.{n}") for n in (1, 2, 3, 4)], [1, 0, 1, 1])


class GateAnswerTests(WorldTestCase):
    """The answers through the listener, from a LAN peer, byte for byte (protocol 5)."""

    def world(self, **kwargs) -> World:
        self.clock = Clock()
        w = super().world(lan=gate(self.clock, **kwargs))
        w.add("a")
        return w

    def rejections(self, w: World) -> list:
        return [(p["status"], p["error"]) for m, p in w.emitter.sent if m == "ollama:proxy/request"]

    def test_a_missing_key_is_401_with_a_plain_challenge(self):
        w = self.world()
        response = w.send("POST", "/api/chat", {"model": "llama3"}, peer=lan()).response()
        self.assertEqual((response.status, response.json()), (401, UNAUTHORIZED))
        self.assertEqual(response.header("www-authenticate"), 'Bearer realm="nvpair-proxy"')
        self.assertEqual(response.header("content-type"), "application/json")
        self.assertEqual(w.agent.requests, [])
        self.assertEqual(self.rejections(w), [(401, "unauthorized")])

    def test_a_wrong_key_is_401_with_invalid_token(self):
        w = self.world()
        response = w.send(
            "GET", "/api/tags", peer=lan(), headers={"Authorization": f"Bearer {OTHER}"}
        ).response()
        self.assertEqual((response.status, response.json()), (401, UNAUTHORIZED))
        self.assertEqual(
            response.header("www-authenticate"),
            'Bearer realm="nvpair-proxy", error="invalid_token"',
        )

    def test_outside_the_allowlist_is_403_without_a_challenge(self):
        w = self.world(cidrs="10.0.0.0/8")
        response = w.send(
            "GET", "/api/tags", peer=lan(), headers={"Authorization": f"Bearer {KEY}"}
        ).response()
        self.assertEqual(response.status, 403)
        self.assertEqual(response.json()["code"], "source-not-allowed")
        self.assertIsNone(response.header("www-authenticate"))
        self.assertEqual(self.rejections(w), [(403, "source-not-allowed")])

    def test_a_valid_key_is_served_as_loopback_without_either_credential_header(self):
        w = self.world()
        w.send(
            "POST",
            "/api/chat",
            {"model": "llama3"},
            peer=lan(),
            headers={"Authorization": f"Bearer {KEY}", "X-Api-Key": OTHER, "X-Other": "kept"},
        )
        [upstream] = w.agent.requests
        self.assertFalse(upstream.headers.hasHeader(b"authorization"))
        self.assertFalse(upstream.headers.hasHeader(b"x-api-key"))
        self.assertEqual(upstream.headers.getRawHeaders(b"x-other"), [b"kept"])
        w.agent.last.respond(200, length=0, finish=True)

    def test_a_preflight_gets_no_exemption(self):
        w = self.world()
        response = w.send(
            "OPTIONS",
            "/v1/chat/completions",
            peer=lan(),
            headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
        ).response()
        self.assertEqual(response.status, 401)
        self.assertEqual(w.agent.requests, [])

    def test_loopback_is_never_asked_and_its_authorization_passes_through(self):
        w = self.world()
        w.send(
            "POST",
            "/api/chat",
            {"model": "llama3"},
            peer=loopback(),
            headers={"Authorization": "Bearer engine-token"},
        )
        self.assertEqual(
            w.agent.last.headers.getRawHeaders(b"authorization"), [b"Bearer engine-token"]
        )
        w.agent.last.respond(200, length=0, finish=True)

    def test_with_no_keys_lan_plaintext_is_still_loopback_only(self):
        w = self.world(env=None)
        response = w.send(
            "GET", "/api/tags", peer=lan(), headers={"Authorization": f"Bearer {KEY}"}
        ).response()
        self.assertEqual((response.status, response.json()), (403, LOOPBACK_ONLY))

    def test_each_request_of_a_keep_alive_connection_is_decided(self):
        w = self.world()
        client = w.send("GET", "/api/ps", peer=lan(), headers={"X-Api-Key": KEY})
        w.agent.last.respond(200, body=b"{}", length=2, finish=True)
        client.transport.clear()
        client.protocol.dataReceived(b"GET /api/ps HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(client.response().status, 401)
