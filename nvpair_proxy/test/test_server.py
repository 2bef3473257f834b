"""The server side on Twisted's public hooks: the accept deadline handed from the listener to the
channel (TLS handshake included), the header deadline of every request, the 413 reported with
its request line, and a client that left getting nothing written (protocol 5 and 7)."""

from __future__ import annotations

from OpenSSL import crypto
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import CertificateOptions
from twisted.internet.task import Clock
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.test.iosim import FakeTransport, connect

from nvpair_proxy.core.constants import MAX_REQUEST_BODY
from nvpair_proxy.facade.listener import DemuxFactory
from nvpair_proxy.test.world import WorldTestCase, request_bytes
from nvpair_proxy.testing import lan, loopback
from nvpair_proxy.testing.certs import make_certificate


def _server_tls(site, clock) -> TLSMemoryBIOFactory:
    cert_pem, key_pem = make_certificate("node-a")
    options = CertificateOptions(
        privateKey=crypto.load_privatekey(crypto.FILETYPE_PEM, key_pem),
        certificate=crypto.load_certificate(crypto.FILETYPE_PEM, cert_pem),
    )
    return TLSMemoryBIOFactory(options, False, site, clock=clock)


class _Sender(Protocol):
    """A TLS client that writes ``data`` once the connection is up and keeps what comes back."""

    def __init__(self, data: bytes) -> None:
        self.data, self.received = data, b""

    def connectionMade(self) -> None:
        self.transport.write(self.data)

    def dataReceived(self, data: bytes) -> None:
        self.received += data


class AcceptDeadlineTests(WorldTestCase):
    def test_a_request_line_at_nine_seconds_gets_ten_more_seconds_for_its_headers(self):
        w = self.world()
        w.add("a")
        client = w.connect()
        w.site_clock.advance(9)
        client.protocol.dataReceived(b"GET /api/ps HTTP/1.1\r\n")
        w.site_clock.advance(9.9)
        self.assertFalse(client.transport.disconnecting)
        client.protocol.dataReceived(b"Host: x\r\n\r\n")
        w.agent.last.respond(200, body=b"{}", length=2, finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertFalse(client.transport.disconnecting)

    def test_the_gate_also_ends_the_accept_deadline_at_the_request_line(self):
        w = self.world()
        client = w.connect(lan())
        w.site_clock.advance(9)
        client.protocol.dataReceived(b"GET / HTTP/1.1\r\n")
        w.site_clock.advance(9.9)
        self.assertFalse(client.transport.disconnecting)
        client.protocol.dataReceived(b"Host: x\r\n\r\n")
        self.assertEqual(client.response().status, 403)

    def test_each_keep_alive_request_gets_its_own_header_deadline(self):
        w = self.world()
        w.add("a")
        client = w.send("GET", "/api/ps")
        w.agent.last.respond(200, body=b"{}", length=2, finish=True)
        self.assertEqual(client.response().status, 200)
        w.site_clock.advance(30)
        client.protocol.dataReceived(b"GET /api/ps HTTP/1.1\r\nHost: x\r\n")
        w.site_clock.advance(9.9)
        self.assertFalse(client.transport.disconnecting)
        w.site_clock.advance(0.1)
        self.assertTrue(client.transport.disconnecting)

    def test_a_tls_handshake_that_stalls_is_closed_ten_seconds_after_accept(self):
        w = self.world()
        factory = DemuxFactory(w.site, tls=lambda: _server_tls(w.site, w.site_clock))
        client = factory.buildProtocol(lan())
        transport = FakeTransport(client, isServer=True, peerAddress=lan())
        client.makeConnection(transport)
        w.site_clock.advance(4)
        client.dataReceived(b"\x16\x03\x01\x00\xa5\x01")  # half a ClientHello
        w.site_clock.advance(5.9)
        self.assertFalse(transport.disconnecting)
        w.site_clock.advance(0.1)
        self.assertTrue(transport.disconnecting)

    def test_a_request_line_over_tls_ends_the_accept_deadline(self):
        w = self.world()
        factory = DemuxFactory(w.site, tls=lambda: _server_tls(w.site, w.site_clock))
        server = factory.buildProtocol(loopback())
        server_transport = FakeTransport(server, isServer=True, peerAddress=loopback())
        sender = _Sender(b"GET /api/ps HTTP/1.1\r\n")
        client_clock = Clock()  # TLS buffers writes until its clock turns
        client = TLSMemoryBIOFactory(
            CertificateOptions(), True, Factory.forProtocol(lambda: sender), clock=client_clock
        ).buildProtocol(None)
        client_transport = FakeTransport(client, isServer=False)
        pump = connect(server, server_transport, client, client_transport)
        client_clock.advance(0)
        pump.flush()
        w.site_clock.advance(9.9)
        self.assertFalse(server_transport.disconnecting)
        sender.transport.write(b"Host: x\r\nX-NVPAIR-Engine-Identity-Probe: 1\r\n\r\n")
        client_clock.advance(0)
        pump.flush()
        w.site_clock.advance(0)
        pump.flush()
        self.assertTrue(sender.received.startswith(b"HTTP/1.1 409 "), sender.received)
        w.site_clock.advance(30)
        self.assertFalse(server_transport.disconnecting)


class LocalAddressTests(WorldTestCase):
    def asked_over_three_requests(self, method: str) -> tuple[int, bytes]:
        """How often the channel asked its transport ``method`` over three keep-alive
        requests on one connection, and what the client received."""
        w = self.world()
        w.add("a")
        client = w.connect()
        asked = []
        original = getattr(client.transport, method)

        def counted():
            asked.append(1)
            return original()

        setattr(client.transport, method, counted)
        for _ in range(3):
            client.protocol.dataReceived(request_bytes("GET", "/api/ps"))
            w.agent.last.respond(200, body=b"{}", length=2, finish=True)
        return len(asked), client.raw()

    def test_a_connections_local_address_is_read_once_for_all_its_requests(self):
        """twisted.web asks every request for the local address; a TCP transport would ask
        the kernel each time (getsockname), so the channel asks its transport once."""
        asked, raw = self.asked_over_three_requests("getHost")
        self.assertEqual(raw.count(b"HTTP/1.1 200 OK"), 3)
        self.assertEqual(asked, 1)

    def test_a_connections_peer_address_is_made_once_for_all_its_requests(self):
        asked, raw = self.asked_over_three_requests("getPeer")
        self.assertEqual(raw.count(b"HTTP/1.1 200 OK"), 3)
        self.assertLessEqual(asked, 1)


class RejectionTests(WorldTestCase):
    def test_a_413_is_reported_with_the_method_and_path_of_its_request_line(self):
        w = self.world()
        client = w.connect()
        client.protocol.dataReceived(
            b"PUT /api/chat?x=1 HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n" % (MAX_REQUEST_BODY + 1)
        )
        self.assertEqual(client.response().status, 413)
        reports = [p for m, p in w.emitter.sent if m == "ollama:proxy/request"]
        self.assertEqual(
            [(p["method"], p["path"], p["status"]) for p in reports], [("PUT", "/api/chat", 413)]
        )

    def test_a_lan_413_is_reported_where_the_facade_reports(self):
        w = self.world()
        client = w.connect(lan())
        client.protocol.dataReceived(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n" % (MAX_REQUEST_BODY + 1)
        )
        self.assertEqual(client.response().status, 413)
        reports = [p for m, p in w.emitter.sent if m == "ollama:proxy/request"]
        self.assertEqual(
            [(p["method"], p["path"], p["status"]) for p in reports],
            [("POST", "/v1/chat/completions", 413)],
        )


class ClientGoneTests(WorldTestCase):
    def test_a_model_list_whose_client_left_writes_nothing_and_reports_499(self):
        w = self.world()
        w.add("a")
        client = w.connect()
        client.protocol.dataReceived(request_bytes("GET", "/api/tags"))
        client.disconnect()
        self.assertEqual(client.raw(), b"")
        self.assertEqual(
            [p["status"] for m, p in w.emitter.sent if m == "ollama:proxy/request"], [499]
        )
