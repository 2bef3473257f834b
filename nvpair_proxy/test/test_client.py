"""The proxy's own HTTP/1.1 client (client.py): the bytes it sends, how it frames what comes
back, what it tells the attempt, and the pool. Driven in memory: a ``MemoryReactorClock``
records each dial and a ``StringTransport`` is the engine's end of the wire."""

from __future__ import annotations

import socket

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import error as ierror
from twisted.internet import reactor
from twisted.internet.defer import CancelledError, Deferred, inlineCallbacks
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import (
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
    readBody,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer, IPolicyForHTTPS
from twisted.web.resource import Resource
from twisted.web.server import Site
from zope.interface import implementer

from nvpair_proxy.http.client import Client, State
from nvpair_proxy.http.pool import ConnectionPool
from nvpair_proxy.http.relay import clean_end
from nvpair_proxy.http.requestbody import BytesProducer
from nvpair_proxy.http.responsewire import WireError
from nvpair_proxy.test.strategies import HEADS, splits
from nvpair_proxy.test.support import Collect, Wire

URL = b"http://10.0.0.1:11434/api/chat"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


@implementer(IBodyProducer)
class Producer:
    """A body producer that writes when the test says, and says whether it was stopped."""

    def __init__(self, length) -> None:
        self.length, self.stopped, self.consumer = length, False, None
        self.done = Deferred()

    def startProducing(self, consumer):
        self.consumer = consumer
        return self.done

    def stopProducing(self) -> None:
        self.stopped = True


class ClientCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.pool = ConnectionPool(self.reactor, max_idle_per_host=2, idle_timeout=90.0)
        self.client = Client(self.reactor, self.pool, connect_timeout=7.0)

    def respond(self, data: bytes, method: bytes = b"GET", url: bytes = URL):
        """Send one request and answer it, on a new connection or the pooled one it took."""
        dialled = len(self.reactor.tcpClients)
        d = self.client.request(method, url)
        if len(self.reactor.tcpClients) > dialled:
            self.wire = Wire(self.reactor)
        self.wire.reply(data)
        return self.successResultOf(d), self.wire

    def body_of(self, response) -> Collect:
        body = Collect()
        response.deliverBody(body)
        return body


class RequestBytesTests(ClientCase):
    def test_the_head_and_body_go_out_in_one_write_with_our_framing(self):
        headers = Headers(
            {
                b"Content-Type": [b"application/json"],
                b"X-Two": [b"a", b"b"],
                b"Content-Length": [b"999"],
                b"Connection": [b"close"],
                b"Transfer-Encoding": [b"chunked"],
            }
        )
        self.client.request(
            b"POST", URL + b"?stream=1#frag", headers, BytesProducer(b'{"model":"m"}')
        )
        host, port, _, timeout, _ = self.reactor.tcpClients[0]
        self.assertEqual((host, port, timeout), ("10.0.0.1", 11434, 7.0))
        wire = Wire(self.reactor)
        self.assertEqual(
            wire.sent(),
            b"POST /api/chat?stream=1 HTTP/1.1\r\n"
            b"Host: 10.0.0.1:11434\r\n"
            b"Content-Type: application/json\r\n"
            b"X-Two: a\r\nX-Two: b\r\n"
            b"Content-Length: 13\r\n\r\n"
            b'{"model":"m"}',
        )

    def test_the_host_header_as_agent_writes_it_and_a_callers_own_kept(self):
        for url, host in (
            (b"http://[::1]:8080/x", b"[::1]:8080"),
            (b"http://127.0.0.1:80", b"127.0.0.1"),
            (b"http://engine.lan:8080/x", b"engine.lan:8080"),
        ):
            self.client.request(b"GET", url)
            self.assertIn(b"\r\nHost: " + host + b"\r\n", Wire(self.reactor).sent())
        self.client.request(b"GET", URL, Headers({b"Host": [b"named.example"]}))
        self.assertEqual(
            Wire(self.reactor).sent(), b"GET /api/chat HTTP/1.1\r\nHost: named.example\r\n\r\n"
        )

    def test_another_producers_body_is_read_whole_then_sent_with_its_length(self):
        producer = Producer(UNKNOWN_LENGTH)
        d = self.client.request(b"PUT", URL, None, producer)
        producer.consumer.write(b"abc")
        producer.consumer.write(b"de")
        self.assertEqual(self.reactor.tcpClients, [], "nothing dialled while the body is read")
        producer.done.callback(None)
        self.assertEqual(
            Wire(self.reactor).sent(),
            b"PUT /api/chat HTTP/1.1\r\nHost: 10.0.0.1:11434\r\nContent-Length: 5\r\n\r\nabcde",
        )
        self.assertNoResult(d)

    def test_a_body_that_fails_or_misstates_its_length_fails_the_request_undialled(self):
        for length, outcome in ((4, "fail"), (9, "short")):
            producer = Producer(length)
            d = self.client.request(b"POST", URL, None, producer)
            producer.consumer.write(b"abcd")
            if outcome == "fail":
                producer.done.errback(ValueError("disk"))
            else:
                producer.done.callback(None)
            failure = self.failureResultOf(d, RequestTransmissionFailed)
            self.assertTrue(failure.value.reasons[0].check(ValueError))
        self.assertEqual(self.reactor.tcpClients, [])

    def test_a_cancel_while_the_body_is_read_stops_its_producer(self):
        producer = Producer(3)
        d = self.client.request(b"POST", URL, None, producer)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertTrue(producer.stopped)
        producer.done.callback(None)
        self.assertEqual(self.reactor.tcpClients, [])

    def test_whitespace_in_the_target_is_refused_before_anything_is_sent(self):
        self.assertRaises(ValueError, self.client.request, b"GET", URL + b" HTTP/1.1\r\nX: y")
        self.assertEqual(self.reactor.tcpClients, [])


class ResponseTests(ClientCase):
    def test_status_headers_and_a_length_framed_body_then_a_clean_end(self):
        response, wire = self.respond(
            b"HTTP/1.1 201 Made\r\nX-Engine: one\r\nContent-Length: 10\r\n\r\nhello"
        )
        self.assertEqual(
            (response.code, response.phrase, response.length, response.version),
            (201, b"Made", 10, (b"HTTP", 1, 1)),
        )
        self.assertEqual(response.headers.getRawHeaders(b"x-engine"), [b"one"])
        self.assertEqual((response.request.method, response.request.absoluteURI), (b"GET", URL))
        body = self.body_of(response)
        self.assertEqual((body.body, body.reason), (b"hello", None))
        wire.reply(b"world")
        self.assertEqual(body.chunks, [b"hello", b"world"])
        self.assertTrue(body.reason.check(ResponseDone))
        self.assertEqual(self.pool.idle_count(), 1)

    def test_a_chunked_body_is_decoded_and_the_connection_reused(self):
        response, wire = self.respond(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
        )
        self.assertIs(response.length, UNKNOWN_LENGTH)
        body = self.body_of(response)
        wire.reply(b"2\r\nde\r\n0\r\n\r\n")
        self.assertEqual(body.chunks, [b"abc", b"de"])
        self.assertTrue(body.reason.check(ResponseDone))
        d = self.client.request(b"GET", URL)
        self.assertEqual(len(self.reactor.tcpClients), 1, "reused, not dialled again")
        self.assertTrue(
            wire.sent().endswith(b"GET /api/chat HTTP/1.1\r\nHost: 10.0.0.1:11434\r\n\r\n")
        )
        wire.reply(OK)
        self.assertEqual(self.successResultOf(d).code, 200)

    def test_a_body_until_the_close_ends_with_potential_data_loss_and_is_not_pooled(self):
        response, wire = self.respond(b"HTTP/1.1 200 OK\r\n\r\npart")
        body = self.body_of(response)
        wire.close()
        self.assertEqual(body.body, b"part")
        self.assertTrue(body.reason.check(PotentialDataLoss))
        self.assertTrue(clean_end(body.reason))
        self.assertEqual(self.pool.idle_count(), 0)

    def test_a_body_broken_off_is_a_response_failure(self):
        response, wire = self.respond(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        body = self.body_of(response)
        wire.close(ierror.ConnectionLost)
        self.assertTrue(body.reason.check(ResponseFailed))
        self.assertFalse(clean_end(body.reason))

    def test_a_body_that_arrived_before_delivery_is_held_then_handed_over(self):
        response, wire = self.respond(OK)
        self.assertEqual(self.pool.idle_count(), 1, "the bytes are read; the connection is free")
        body = self.body_of(response)
        self.assertEqual(body.body, b"hello")
        self.assertTrue(body.reason.check(ResponseDone))

    def test_responses_without_a_body_end_at_once(self):
        for status, method in (
            (b"204 No Content", b"GET"),
            (b"304 Not Modified", b"GET"),
            (b"200 OK", b"HEAD"),
        ):
            response, wire = self.respond(
                b"HTTP/1.1 " + status + b"\r\nContent-Length: 9\r\n\r\n", method=method
            )
            self.assertEqual(response.length, 0)
            self.assertTrue(self.body_of(response).reason.check(ResponseDone))

    def test_an_interim_response_is_skipped(self):
        response, wire = self.respond(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Hints\r\nLink: x\r\n\r\n" + OK
        )
        self.assertEqual((response.code, self.body_of(response).body), (200, b"hello"))

    def test_heads_with_bare_lf_line_ends_are_read(self):
        for data in (
            b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
            b"HTTP/1.1 200 OK\nContent-Length: 2\n\r\nok",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\nok",
        ):
            response, wire = self.respond(data)
            self.assertEqual((response.code, self.body_of(response).body), (200, b"ok"), data)

    def test_a_flood_of_interim_responses_is_read_without_recursion(self):
        response, wire = self.respond(b"HTTP/1.1 100 Continue\r\n\r\n" * 5000 + OK)
        self.assertEqual(self.body_of(response).body, b"hello")

    def test_a_length_beside_chunked_is_dropped_and_the_connection_not_reused(self):
        response, wire = self.respond(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n"
        )
        self.assertIsNone(response.headers.getRawHeaders(b"content-length"))
        self.assertEqual(self.body_of(response).body, b"hello")
        self.assertTrue(wire.transport.disconnected)
        self.assertEqual(self.pool.idle_count(), 0)

    def test_a_head_split_anywhere_is_read_alike(self):
        d = self.client.request(b"GET", URL)
        wire = Wire(self.reactor)
        head_end = OK.index(b"\r\n\r\n") + 4
        for byte in range(len(OK)):
            if byte < head_end:
                self.assertNoResult(d)
            wire.reply(OK[byte : byte + 1])
        self.assertEqual(
            self.body_of(self.successResultOf(d)).chunks,
            list(b"hello"[i : i + 1] for i in range(5)),
        )

    def test_connection_close_and_http_1_0_are_not_pooled(self):
        for head in (b"HTTP/1.1 200 OK\r\nConnection: close\r\n", b"HTTP/1.0 200 OK\r\n"):
            response, wire = self.respond(head + b"Content-Length: 1\r\n\r\nx")
            self.assertTrue(self.body_of(response).reason.check(ResponseDone))
            self.assertTrue(wire.transport.disconnecting)
            self.assertEqual(self.pool.idle_count(), 0)

    def test_bytes_after_a_complete_response_close_the_connection(self):
        response, wire = self.respond(OK + b"HTTP/1.1 200 OK\r\n")
        self.assertTrue(self.body_of(response).reason.check(ResponseDone))
        self.assertTrue(wire.transport.disconnected)
        self.assertEqual(self.pool.idle_count(), 0)

    def test_an_unframeable_head_fails_the_request_and_aborts(self):
        for data in (
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.1 101 Switching\r\n\r\n",
            b"HTTP/1.1 000 Zero\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000,
            b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
        ):
            d = self.client.request(b"GET", URL)
            wire = Wire(self.reactor)
            wire.reply(data)
            failure = self.failureResultOf(d, ResponseFailed)
            self.assertTrue(failure.value.reasons[0].check(WireError))
            self.assertTrue(wire.transport.disconnected)

    def test_broken_chunked_framing_fails_the_body_and_aborts(self):
        response, wire = self.respond(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n"
        )
        body = self.body_of(response)
        self.assertEqual(body.body, b"ok")
        self.assertTrue(body.reason.check(ResponseFailed))
        self.assertTrue(wire.transport.disconnected)


class FailureTests(ClientCase):
    def test_a_connect_error_passes_through_as_the_endpoint_raised_it(self):
        d = self.client.request(b"GET", URL)
        connector = self.reactor.connectors[0]
        factory = self.reactor.tcpClients[0][2]
        factory.clientConnectionFailed(connector, Failure(ierror.ConnectionRefusedError()))
        self.failureResultOf(d, ierror.ConnectionRefusedError)

    def test_closed_before_any_response_byte_is_response_never_received(self):
        d = self.client.request(b"GET", URL)
        Wire(self.reactor).close(ierror.ConnectionLost)
        failure = self.failureResultOf(d, ResponseNeverReceived)
        self.assertTrue(failure.value.reasons[0].check(ierror.ConnectionLost))

    def test_closed_inside_the_head_is_a_response_failure(self):
        d = self.client.request(b"GET", URL)
        wire = Wire(self.reactor)
        wire.reply(b"HTTP/1.1 200 OK\r\nX-")
        wire.close()
        self.failureResultOf(d, ResponseFailed)

    def test_cancel_while_waiting_aborts_the_connection_which_is_never_reused(self):
        d = self.client.request(b"GET", URL)
        wire = Wire(self.reactor)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertTrue(wire.transport.disconnected)
        wire.reply(OK)
        wire.close()
        self.assertEqual(self.pool.idle_count(), 0)

    def test_cancel_while_dialling_stops_the_dial(self):
        d = self.client.request(b"GET", URL)
        d.cancel()
        self.failureResultOf(d)
        self.assertTrue(self.reactor.connectors[0].stoppedConnecting)


class BodyTransportTests(ClientCase):
    def test_pause_and_resume_reach_the_socket(self):
        response, wire = self.respond(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
        body = self.body_of(response)
        body.transport.pauseProducing()
        self.assertEqual(wire.transport.producerState, "paused")
        body.transport.resumeProducing()
        self.assertEqual(wire.transport.producerState, "producing")

    def test_a_connection_paused_when_its_body_ended_is_resumed_before_it_is_pooled(self):
        d = self.client.request(b"GET", URL)
        wire = Wire(self.reactor)
        wire.reply(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")

        class PauseAtOnce(Collect):
            def dataReceived(self, data):
                super().dataReceived(data)
                self.transport.pauseProducing()

        body = PauseAtOnce()
        self.successResultOf(d).deliverBody(body)
        wire.reply(b"hello")
        self.assertEqual(wire.transport.producerState, "paused")
        wire.reply(b"world")
        self.assertTrue(body.reason.check(ResponseDone))
        self.assertEqual(wire.transport.producerState, "producing")
        self.assertEqual(self.pool.idle_count(), 1)

    def test_after_the_body_ended_the_consumer_cannot_touch_the_pooled_connection(self):
        response, wire = self.respond(OK)
        body = self.body_of(response)
        body.transport.pauseProducing()
        body.transport.stopProducing()
        self.assertEqual(wire.transport.producerState, "producing")
        self.assertFalse(wire.transport.disconnecting)
        self.assertEqual(self.pool.idle_count(), 1)

    def test_stop_aborts_delivers_nothing_more_and_ends_once_the_socket_is_gone(self):
        response, wire = self.respond(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
        )
        body = self.body_of(response)
        body.transport.stopProducing()
        self.assertTrue(wire.transport.disconnected)
        wire.reply(b"3\r\ndef\r\n0\r\n\r\n")
        self.assertEqual((body.body, body.reason), (b"abc", None))
        wire.close(ierror.ConnectionAborted)
        self.assertTrue(body.reason.check(ResponseFailed))
        self.assertEqual(self.pool.idle_count(), 0)


class PoolTests(ClientCase):
    def idle_connections(self, count: int, url: bytes = URL) -> list[Wire]:
        requests = [self.client.request(b"GET", url) for _ in range(count)]
        wires = [Wire(self.reactor, index) for index in range(-count, 0)]
        for d, wire in zip(requests, wires):
            wire.reply(OK)
            self.body_of(self.successResultOf(d))
        return wires

    def test_the_newest_idle_connection_is_reused_first(self):
        first, second = self.idle_connections(2)
        first.sent(), second.sent()
        self.client.request(b"GET", URL)
        self.assertEqual((first.sent(), second.sent()[:15]), (b"", b"GET /api/chat H"))

    def test_idle_connections_beyond_the_cap_are_closed(self):
        wires = self.idle_connections(3)
        self.assertEqual(self.pool.idle_count(), 2)
        self.assertEqual([w.transport.disconnecting for w in wires], [False, False, True])

    def test_one_timer_expires_idle_connections(self):
        first, second = self.idle_connections(2)
        self.assertEqual(len(self.reactor.getDelayedCalls()), 1)
        self.reactor.advance(89)
        self.assertEqual(self.pool.idle_count(), 2)
        self.assertFalse(first.transport.disconnecting)
        self.reactor.advance(1)
        self.assertEqual(self.pool.idle_count(), 0)
        self.assertTrue(first.transport.disconnecting and second.transport.disconnecting)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_the_timer_rearms_for_the_connections_that_went_idle_later(self):
        (first,) = self.idle_connections(1)
        self.reactor.advance(60)
        (second,) = self.idle_connections(1, b"http://10.0.0.9:11434/")
        self.reactor.advance(30)
        self.assertEqual(
            (first.transport.disconnecting, second.transport.disconnecting), (True, False)
        )
        self.reactor.advance(60)
        self.assertTrue(second.transport.disconnecting)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_connection_the_server_closed_or_spoke_on_leaves_the_pool(self):
        first, second = self.idle_connections(2)
        first.close()
        self.assertEqual(self.pool.idle_count(), 1)
        second.reply(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
        self.assertEqual(self.pool.idle_count(), 0)
        self.assertTrue(second.transport.disconnected)
        self.client.request(b"GET", URL)
        self.assertEqual(len(self.reactor.tcpClients), 3, "a fresh dial")

    def test_close_cached_connections_fires_once_they_are_all_gone(self):
        first, second = self.idle_connections(2)
        d = self.pool.closeCachedConnections()
        self.assertTrue(
            first.transport.disconnected and second.transport.disconnected,
            "aborted: a graceful TLS close waits for a peer's close_notify",
        )
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        first.close()
        self.assertNoResult(d)
        second.close()
        self.successResultOf(d)
        self.assertEqual(self.pool.idle_count(), 0)


KEPT_5 = b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nContent-Length: 2\r\n\r\nok"
STREAM = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Keep-Alive: timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
)


class WokenBy(Collect):
    """A body whose end sends the next request at once, as late binding does when a
    request's end frees a slot for the next waiter."""

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client, self.next = client, None

    def connectionLost(self, reason) -> None:
        super().connectionLost(reason)
        self.next = self.client.request(b"POST", URL, bodyProducer=BytesProducer(b"{}"))


class ReuseTests(ClientCase):
    """When a pooled connection may carry another request (docs/decisions.md#sent-once):
    only while its server still keeps it, as far as can be known before writing."""

    def test_a_connection_is_not_reused_past_the_servers_keep_alive_timeout(self):
        response, wire = self.respond(KEPT_5)
        self.body_of(response)
        self.reactor.advance(3.9)
        self.client.request(b"GET", URL)
        self.assertEqual(len(self.reactor.tcpClients), 1, "within timeout - 1 s: reused")
        wire.reply(KEPT_5)
        self.reactor.advance(4)
        self.client.request(b"GET", URL)
        self.assertEqual(len(self.reactor.tcpClients), 2, "4 s idle of the server's 5: a new dial")
        self.assertTrue(wire.transport.disconnecting, "and the stale one closed")

    def test_the_pools_timer_closes_a_connection_at_its_servers_timeout(self):
        response, wire = self.respond(KEPT_5)
        self.body_of(response)
        self.assertEqual([c.getTime() for c in self.reactor.getDelayedCalls()], [4.0])
        self.reactor.advance(4)
        self.assertEqual(self.pool.idle_count(), 0)
        self.assertTrue(wire.transport.disconnecting)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_a_server_keeping_a_connection_a_second_or_less_is_not_pooled(self):
        response, wire = self.respond(
            b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=1\r\nContent-Length: 0\r\n\r\n"
        )
        self.assertEqual(self.pool.idle_count(), 0)
        self.assertTrue(wire.transport.disconnecting)

    def test_the_request_a_streams_end_wakes_goes_on_a_new_connection(self):
        # llama-server closes right after a stream, whatever its headers say: the request
        # sent from inside the stream's end must not be written on that connection.
        d = self.client.request(b"POST", URL, bodyProducer=BytesProducer(b"{}"))
        wire = Wire(self.reactor)
        wire.sent()
        woken = WokenBy(self.client)
        head = STREAM.index(b"\r\n\r\n") + 4
        wire.reply(STREAM[:head])
        self.successResultOf(d).deliverBody(woken)
        wire.reply(STREAM[head:])
        self.assertTrue(woken.reason.check(ResponseDone))
        self.assertEqual(
            (len(self.reactor.tcpClients), wire.sent()),
            (2, b""),
            "the woken request dialled; nothing was written on the stream's",
        )
        self.assertEqual(self.pool.idle_count(), 1, "the stream's connection pooled after")

    def test_a_stream_whose_end_closed_the_idle_connections_is_closed_too(self):
        # Told its end before it is pooled, the connection was idle in all but name when the
        # pool was emptied (a shutdown, or a test's cleanup inside the end): not pooled after.
        head = STREAM.index(b"\r\n\r\n") + 4
        response, wire = self.respond(STREAM[:head], b"POST")

        class Emptying(Collect):
            def connectionLost(inner, reason) -> None:
                self.pool.closeCachedConnections()

        response.deliverBody(Emptying())
        wire.reply(STREAM[head:])
        self.assertEqual((self.pool.idle_count(), self.reactor.getDelayedCalls()), (0, []))
        self.assertTrue(wire.transport.disconnecting)

    def test_an_origin_that_closes_right_after_streams_is_not_pooled_after_them(self):
        response, first = self.respond(STREAM, b"POST")
        self.body_of(response)
        self.reactor.advance(0.5)
        first.close()  # the server closed it half a second after the stream
        self.assertEqual(self.pool.idle_count(), 0)
        response, second = self.respond(STREAM, b"POST")
        self.body_of(response)
        self.assertEqual(self.pool.idle_count(), 0, "learned: closed after its stream")
        self.assertTrue(second.transport.disconnecting)
        response, third = self.respond(KEPT_5)
        self.body_of(response)
        self.assertEqual(self.pool.idle_count(), 1, "a length-framed answer is still pooled")

    def test_a_close_seen_before_a_reuse_is_not_written_to_and_teaches_too(self):
        # A transport already closing (the TLS layer closes as it reads a close_notify, before
        # the socket's FIN) is as good as closed: the next request dials anew.
        response, first = self.respond(STREAM, b"POST")
        self.body_of(response)
        first.transport.loseConnection()
        first.sent()
        self.client.request(b"GET", URL)
        self.assertEqual((len(self.reactor.tcpClients), first.sent()), (2, b""))
        response, second = self.respond(STREAM, b"POST")
        self.body_of(response)
        self.assertEqual(self.pool.idle_count(), 0, "learned from the close seen at the reuse")

    def test_a_close_that_loses_the_next_request_teaches_too(self):
        response, first = self.respond(STREAM, b"POST")
        self.body_of(response)
        lost = self.client.request(b"POST", URL, bodyProducer=BytesProducer(b"{}"))
        first.close(ierror.ConnectionLost)  # the race: written, then the close after the stream
        self.failureResultOf(lost, ResponseNeverReceived)
        response, second = self.respond(STREAM, b"POST")
        self.body_of(response)
        self.assertEqual(self.pool.idle_count(), 0, "learned: not pooled after its stream")

    def test_a_close_at_the_servers_idle_timeout_teaches_nothing(self):
        response, first = self.respond(STREAM, b"POST")
        self.body_of(response)
        self.reactor.advance(1.5)
        first.close()
        response, second = self.respond(STREAM, b"POST")
        self.body_of(response)
        self.assertEqual(self.pool.idle_count(), 1, "still pooled after streams")


class TLSTests(ClientCase):
    def test_https_goes_through_the_policy_for_the_host_and_port(self):
        asked = []

        @implementer(IPolicyForHTTPS)
        class Policy:
            def creatorForNetloc(self, hostname, port):
                asked.append((hostname, port))
                from twisted.internet.ssl import optionsForClientTLS

                return optionsForClientTLS("peer.example")

        client = Client(self.reactor, self.pool, tls=Policy())
        client.request(b"GET", b"https://10.0.0.2:9443/v1/models")
        client.request(b"GET", b"https://10.0.0.2:9443/v1/other")
        self.assertEqual(
            asked,
            [(b"10.0.0.2", 9443)] * 2,
            "asked at every new connection: the pinned-peer policy reads this "
            "node's current identity then",
        )
        self.assertEqual(self.reactor.tcpClients[0][:2], ("10.0.0.2", 9443))
        hello = Wire(self.reactor, 0).sent()
        self.assertEqual(hello[:2], b"\x16\x03", "a TLS handshake, not plaintext HTTP")
        self.assertNotIn(b"GET /v1/models", hello)


class Ok(Resource):
    isLeaf = True

    def render_GET(self, request) -> bytes:
        return b"ok"


class KeepAliveTests(TestCase):
    """Real sockets, since the socket options are the point."""

    @inlineCallbacks
    def connection_options(self, keepalive: float) -> dict:
        site = Site(Ok(), timeout=None)  # no idle timer left behind by the server side
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        pool = ConnectionPool(reactor)
        self.addCleanup(pool.closeCachedConnections)
        client = Client(reactor, pool, keepalive=keepalive)
        number = port.getHost().port
        response = yield client.request(b"GET", b"http://127.0.0.1:%d/" % number)
        self.assertEqual((yield readBody(response)), b"ok")
        connection = pool.take((b"http", b"127.0.0.1", number))
        pool.give(connection)
        handle = connection.transport.getHandle()
        return {
            name: handle.getsockopt(level, getattr(socket, name))
            for level, name in (
                (socket.SOL_SOCKET, "SO_KEEPALIVE"),
                (socket.IPPROTO_TCP, "TCP_KEEPIDLE"),
                (socket.IPPROTO_TCP, "TCP_KEEPINTVL"),
                (socket.IPPROTO_TCP, "TCP_KEEPCNT"),
                (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT"),
            )
        }

    @inlineCallbacks
    def test_upstream_connections_probe_an_idle_peer(self):
        options = yield self.connection_options(7.5)
        self.assertEqual(
            options,
            {
                "SO_KEEPALIVE": 1,
                "TCP_KEEPIDLE": 8,
                "TCP_KEEPINTVL": 8,
                "TCP_KEEPCNT": 4,
                "TCP_USER_TIMEOUT": 40_000,
            },
        )

    @inlineCallbacks
    def test_zero_leaves_the_kernels_defaults(self):
        options = yield self.connection_options(0)
        self.assertEqual((options["SO_KEEPALIVE"], options["TCP_USER_TIMEOUT"]), (0, 0))


class Counted(Protocol):
    """An engine's end that answers each request head with ``ok`` and keeps what it read."""

    def connectionMade(self) -> None:
        self.received = b""
        self.factory.connections.append(self)

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if b"\r\n\r\n" in data:  # one request a read, here
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


class ClosedBeforeWritingTests(TestCase):
    """Real sockets, since what the kernel knows before the reactor reads it is the point."""

    timeout = 15

    @inlineCallbacks
    def test_a_pooled_connection_its_server_already_closed_is_not_written_to(self):
        factory = Factory.forProtocol(Counted)
        factory.connections = []
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        pool = ConnectionPool(reactor)
        self.addCleanup(pool.closeCachedConnections)
        client = Client(reactor, pool)
        url = b"http://127.0.0.1:%d/api/pull" % port.getHost().port
        response = yield client.request(b"GET", url)
        self.assertEqual((yield readBody(response)), b"ok")
        first = factory.connections[0]
        # The server closes its end; our reactor has not read that yet when we send.
        first.transport.getHandle().shutdown(socket.SHUT_RDWR)
        response = yield client.request(b"POST", url, bodyProducer=BytesProducer(b"{}"))
        self.assertEqual((yield readBody(response)), b"ok")
        self.assertEqual(len(factory.connections), 2, "sent on a new connection")
        self.assertEqual(first.received.count(b"HTTP/1.1"), 1, "nothing written on the closed one")
        for connection in factory.connections:
            connection.transport.abortConnection()


class HostileEngineProperties(SynchronousTestCase):
    """Whatever an engine or peer sends, split however: nothing escapes the protocol, the
    request's Deferred fires once, and a delivered body ends exactly once when the connection
    goes: the attempt above always learns how its dispatch ended."""

    @settings(max_examples=settings.default.max_examples, deadline=None)
    @given(
        data=st.one_of(
            st.binary(max_size=600),
            st.builds(
                lambda head, body: head + body,
                st.sampled_from(
                    [
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
                        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No\r\n\r\n",
                        b"HTTP/1.0 200 OK\n\n",
                    ]
                ),
                st.binary(max_size=300),
            ),
        ),
        cuts=st.lists(st.integers(0, 1000), max_size=12),
        method=st.sampled_from([b"GET", b"HEAD"]),
    )
    def test_any_reply_ends_the_request_once(self, data, cuts, method):
        self.check_reply(data, cuts, method)

    @settings(max_examples=settings.default.max_examples, deadline=None)
    @given(
        head=HEADS,
        body=st.binary(max_size=100),
        cuts=st.lists(st.integers(0, 1000), max_size=12),
        method=st.sampled_from([b"GET", b"HEAD"]),
    )
    def test_any_head_ends_the_request_once(self, head, body, cuts, method):
        """Heads with well-formed and hostile header lines (test_responsewire.HEADS)."""
        self.check_reply(head + b"\r\n\r\n" + body, cuts, method)

    def check_reply(self, data, cuts, method):
        reactor = MemoryReactorClock()
        client = Client(reactor, ConnectionPool(reactor))
        d = client.request(method, URL)
        wire = Wire(reactor)
        outcomes: list = []
        bodies: list[Collect] = []

        def got(response):
            body = Collect()
            bodies.append(body)
            response.deliverBody(body)
            outcomes.append("response")

        d.addCallbacks(got, lambda failure: outcomes.append(failure.type))
        for piece in splits(data, cuts):
            if not wire.transport.disconnected:
                wire.reply(piece)
        wire.close()
        self.assertEqual(len(outcomes), 1, outcomes)
        if outcomes[0] == "response":
            self.assertIsNotNone(bodies[0].reason, "the body never ended")
        else:
            self.assertIn(outcomes[0], (ResponseFailed, ResponseNeverReceived))


class StateTests(ClientCase):
    """Each move of a connection's ``State``, by what the caller and the server see."""

    def connection(self, wire: Wire):
        """The client's connection behind the endpoint's wrapping protocol."""
        return wire.protocol._wrappedProtocol

    def test_an_exchange_walks_waiting_head_body_idle_then_closed(self):
        d = self.client.request(b"GET", URL)
        wire = Wire(self.reactor)
        connection = self.connection(wire)
        self.assertIs(connection.state, State.WAITING, "the request went out on connect")
        wire.reply(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
        self.assertIs(connection.state, State.HEAD, "interim answers are part of the head")
        wire.reply(b"Content-Length: 5\r\n\r\nhe")
        self.assertIs(connection.state, State.BODY)
        body = self.body_of(self.successResultOf(d))
        wire.reply(b"llo")
        self.assertIs(connection.state, State.IDLE)
        self.assertEqual((body.body, self.pool.idle_count()), (b"hello", 1))
        wire.close()
        self.assertIs(connection.state, State.CLOSED)
        self.assertEqual(self.pool.idle_count(), 0)

    def test_a_connection_is_pooled_only_once_idle_not_while_its_body_is_read(self):
        response, wire = self.respond(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
        body = self.body_of(response)
        self.client.request(b"GET", URL)
        self.assertEqual(
            (len(self.reactor.tcpClients), self.pool.idle_count()),
            (2, 0),
            "a connection carrying a body is not lent to another request",
        )
        wire.reply(b"world")
        self.assertTrue(body.reason.check(ResponseDone))
        self.client.request(b"GET", URL)
        self.assertEqual(len(self.reactor.tcpClients), 2, "idle again: reused, not dialled")
        self.assertTrue(
            wire.sent().endswith(b"GET /api/chat HTTP/1.1\r\nHost: 10.0.0.1:11434\r\n\r\n")
        )

    def test_closed_after_an_interim_answer_is_a_response_failure(self):
        d = self.client.request(b"GET", URL)
        wire = Wire(self.reactor)
        wire.reply(b"HTTP/1.1 100 Continue\r\n\r\n")
        wire.close(ierror.ConnectionLost)
        failure = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(failure.value.reasons[0].check(ierror.ConnectionLost))

    def test_a_written_request_on_a_reused_connection_closed_unanswered_is_not_sent_again(self):
        # The engine may have read it (docs/decisions.md#sent-once): a pull or a generation
        # must not start twice, so the loss is the caller's to see, as on a new connection.
        response, wire = self.respond(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(self.pool.idle_count(), 1)
        wire.sent()
        d = self.client.request(b"POST", URL, bodyProducer=BytesProducer(b"{}"))
        self.assertTrue(wire.sent().startswith(b"POST /api/chat "))
        wire.close(ierror.ConnectionLost)
        failure = self.failureResultOf(d, ResponseNeverReceived)
        self.assertTrue(failure.value.reasons[0].check(ierror.ConnectionLost))
        self.assertEqual(len(self.reactor.tcpClients), 1, "no new dial: never sent again")

    def test_a_new_connection_closed_unanswered_is_response_never_received(self):
        d = self.client.request(b"GET", URL)
        Wire(self.reactor).close(ierror.ConnectionLost)
        self.failureResultOf(d, ResponseNeverReceived)
        self.assertEqual(len(self.reactor.tcpClients), 1, "no second try")

    def test_a_reused_connection_lost_after_the_head_began_is_not_sent_again(self):
        response, wire = self.respond(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        d = self.client.request(b"GET", URL)
        wire.reply(b"HTTP/1.1 200")
        wire.close(ierror.ConnectionLost)
        self.failureResultOf(d, ResponseFailed)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_bytes_after_the_connection_was_aborted_are_refused(self):
        for abort in ("cancel", "unframeable", "spoke out of turn"):
            d = self.client.request(b"GET", URL)
            wire = Wire(self.reactor)
            if abort == "cancel":
                d.cancel()
            elif abort == "unframeable":
                wire.reply(b"SSH-2.0-OpenSSH\r\n\r\n")
            else:
                wire.reply(OK)
                self.body_of(self.successResultOf(d))
                wire.reply(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
            if abort != "spoke out of turn":
                self.failureResultOf(d)
            self.assertIs(self.connection(wire).state, State.CLOSED, abort)
            wire.reply(OK)
            self.assertIs(self.connection(wire).state, State.CLOSED, abort)
            self.assertEqual(self.pool.idle_count(), 0, abort)

    def test_a_body_stopped_at_the_response_gets_none_of_the_bytes_beside_the_head(self):
        d = self.client.request(b"GET", URL)
        wire = Wire(self.reactor)
        body = Collect()

        def stop_at_once(response):
            response.deliverBody(body)
            body.transport.stopProducing()

        d.addCallback(stop_at_once)
        wire.reply(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
        self.assertIs(self.connection(wire).state, State.STOPPED)
        self.assertTrue(wire.transport.disconnected)
        wire.reply(b"world")
        wire.close(ierror.ConnectionAborted)
        self.assertEqual(body.chunks, [])
        self.assertTrue(body.reason.check(ResponseFailed))
        self.assertIs(self.connection(wire).state, State.CLOSED)

    def test_a_body_until_the_close_that_was_stopped_does_not_end_cleanly(self):
        response, wire = self.respond(b"HTTP/1.1 200 OK\r\n\r\npart")
        body = self.body_of(response)
        body.transport.stopProducing()
        wire.close()
        self.assertEqual(body.body, b"part")
        self.assertTrue(body.reason.check(ResponseFailed), "the close was ours, not the end")
        self.assertFalse(clean_end(body.reason))

    def test_a_stopped_body_no_longer_pauses_or_resumes_the_socket(self):
        response, wire = self.respond(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
        body = self.body_of(response)
        body.transport.stopProducing()
        body.transport.pauseProducing()
        self.assertEqual(wire.transport.producerState, "producing")

    def test_each_state_is_documented_with_what_moves_it_on(self):
        for member in State:
            self.assertIn(f"- ``{member.name}``:", State.__doc__, member)
