"""The committed stream: built at commit, it owns what the commit handed over (the relay and
the reservation) and reports to its conductor, the exchange, through one declared sink."""

from __future__ import annotations

from nvpair_proxy.request.attempt import Committed
from nvpair_proxy.request.stream import Happened, Stream
from nvpair_proxy.test.world import WorldTestCase

NDJSON = {"Content-Type": "application/x-ndjson"}


class CommitHandsOverTheReservation(WorldTestCase):
    def committed(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        upstream = w.agent.last.respond(200, NDJSON)
        (exchange,) = w.facade.in_flight
        self.assertEqual(w.reservations.reservations, {"a": 1})
        upstream.write(b'{"done":false}\n')
        return w, client, upstream, exchange

    def test_the_committed_value_carries_the_claim_and_the_dispatch_lets_go(self):
        w, client, upstream, exchange = self.committed()
        stream = exchange.stream
        self.assertIsInstance(stream, Stream)
        self.assertIsInstance(stream.committed, Committed)
        self.assertIsNotNone(stream.committed.reservation)
        self.assertIsNone(exchange.ticket.reservation)
        self.assertEqual(w.reservations.reservations, {"a": 1})  # held while it streams
        upstream.write(b'{"done":true}\n')
        upstream.finish()
        self.assertTrue(stream.committed.reservation.released)
        self.assertEqual(w.reservations.reservations, {})

    def test_a_client_leaving_mid_stream_releases_the_claim_once(self):
        w, client, upstream, exchange = self.committed()
        reservation = exchange.stream.committed.reservation
        client.disconnect()
        self.assertTrue(reservation.released)
        self.assertEqual(w.reservations.reservations, {})
        self.assertTrue(upstream.transport.stopped)
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "cancelled"))

    def test_a_stopped_stream_relays_nothing_and_keeps_no_timer(self):
        w, client, upstream, exchange = self.committed()
        stream = exchange.stream
        client.pause()  # the dead-client deadline starts
        self.assertIsNotNone(stream.timer)
        exchange.shutdown()
        self.assertTrue(stream.stopped)
        self.assertIsNone(stream.timer)
        self.assertIsNone(exchange.stream, "the ended exchange lets go of its stream")
        written = stream.bytes_written
        stream.write(b'{"done":true}\n')
        self.assertEqual(stream.bytes_written, written)


class OneCallback(WorldTestCase):
    def test_the_outcome_is_reported_before_the_response_is_finished(self):
        w, client, upstream = self.streaming()
        (exchange,) = w.facade.in_flight
        upstream.write(b'{"done":false}\n')
        stream = exchange.stream
        seen = []
        report = exchange.streamed

        def spy(event):
            seen.append((event.happened, stream.request.finished, exchange.ended))
            report(event)

        self.patch(exchange, "streamed", spy)
        upstream.write(b'{"done":true}\n')
        upstream.finish()
        self.assertEqual(seen, [(Happened.UPSTREAM_DONE, False, False)])
        self.assertTrue(exchange.ended)
        self.assertTrue(client.response().complete)

    def test_counters_and_the_terminal_frame_are_the_streams(self):
        w, client, upstream = self.streaming()
        (exchange,) = w.facade.in_flight
        w.clock.advance(2)
        upstream.write(b'{"done":false}\n')
        stream = exchange.stream
        self.assertEqual((stream.first_byte_at, stream.bytes_written), (2.0, 15))
        self.assertFalse(stream.delivered_terminal())
        upstream.write(b'{"done":true}\n')
        self.assertTrue(stream.delivered_terminal())
        upstream.finish()
