"""The attempt and the exchange are explicit state machines: every move is in a table, and a
move outside it raises rather than happening (issue 9, item 6)."""

from __future__ import annotations

import itertools

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.request.attempt import (
    CANCELLED,
    COMMITTED,
    DIALING,
    FAILED,
    PEEKING,
    TRANSITIONS,
    AttemptFailure,
    Committed,
    InvalidTransition,
    State,
)
from nvpair_proxy.request.exchange import PHASES, InvalidPhase, Phase
from nvpair_proxy.test.support import Outcomes, attempt
from nvpair_proxy.test.world import WorldTestCase
from nvpair_proxy.testing import FakeAgent

NDJSON = {"Content-Type": "application/x-ndjson"}


def peeking():
    """An attempt whose NDJSON headers arrived and no body byte yet: (attempt, clock, its
    outcomes, the upstream response)."""
    agent, clock = FakeAgent(), Clock()
    outcomes = Outcomes()
    a = attempt(agent, clock, outcomes)
    a.start()
    return a, clock, outcomes, agent.last.respond(200, NDJSON)


class AttemptStateTests(SynchronousTestCase):
    def test_the_table_allows_exactly_these_moves(self):
        self.assertEqual(
            {s: set(t) for s, t in TRANSITIONS.items()},
            {
                DIALING: {PEEKING, COMMITTED, FAILED, CANCELLED},
                PEEKING: {COMMITTED, FAILED, CANCELLED},
                COMMITTED: set(),
                FAILED: set(),
                CANCELLED: set(),
            },
        )

    def test_every_move_outside_the_table_raises_and_changes_nothing(self):
        for start, target in itertools.product(State, State):
            if target in TRANSITIONS[start]:
                continue
            a = attempt(FakeAgent(), Clock())
            a.state = start
            with self.assertRaises(InvalidTransition):
                a._enter(target)
            self.assertIs(a.state, start)

    def test_every_move_in_the_table_is_made(self):
        for start, targets in TRANSITIONS.items():
            for target in targets:
                a = attempt(FakeAgent(), Clock())
                a.state = start
                a._enter(target)
                self.assertIs(a.state, target, (start, target))

    def test_a_first_byte_wins_and_a_later_cancel_is_a_no_op(self):
        a, clock, outcomes, upstream = peeking()
        self.assertIs(a.state, PEEKING)
        upstream.write(b"{")
        self.assertIs(a.state, COMMITTED)
        self.assertFalse(a.cancel("target left discovery"))
        self.assertIs(a.state, COMMITTED)
        self.assertIsInstance(outcomes[0], Committed)
        self.assertEqual(clock.getDelayedCalls(), [])
        upstream.finish()

    def test_a_cancel_wins_and_stops_the_upstream(self):
        a, clock, outcomes, upstream = peeking()
        self.assertTrue(a.cancel("target left discovery"))
        self.assertIs(a.state, CANCELLED)
        self.assertTrue(upstream.transport.stopped)
        self.assertEqual([o.kind for o in outcomes], ["cancelled"])
        self.assertIs(outcomes[0].kind, AttemptFailure.CANCELLED, "a kind is a type, not a string")
        self.assertEqual(clock.getDelayedCalls(), [])


class ExchangePhaseTests(WorldTestCase):
    def test_the_table_allows_exactly_these_moves(self):
        self.assertEqual(
            {p: set(t) for p, t in PHASES.items()},
            {
                Phase.ADMITTING: {Phase.DISPATCHING, Phase.ENDED},
                Phase.DISPATCHING: {Phase.STREAMING, Phase.ENDED},
                Phase.STREAMING: {Phase.ENDED},
                Phase.ENDED: set(),
            },
        )

    def test_a_request_goes_admitting_dispatching_streaming_ended(self):
        w, client, upstream = self.streaming()
        (exchange,) = w.facade.in_flight
        self.assertIs(exchange.phase, Phase.DISPATCHING)
        upstream.write(b'{"done":true}\n')
        self.assertIs(exchange.phase, Phase.STREAMING)
        upstream.finish()
        self.assertIs(exchange.phase, Phase.ENDED)
        self.assertEqual(w.facade.in_flight, set())
        with self.assertRaises(InvalidPhase):
            exchange._enter(Phase.STREAMING)
        self.assertIs(exchange.phase, Phase.ENDED)

    def test_every_move_outside_the_table_raises_and_changes_nothing(self):
        w, client, upstream = self.streaming()
        (exchange,) = w.facade.in_flight
        for start, target in itertools.product(Phase, Phase):
            if target in PHASES[start]:
                continue
            exchange.phase = start
            with self.assertRaises(InvalidPhase):
                exchange._enter(target)
            self.assertIs(exchange.phase, start)
        exchange.phase = Phase.DISPATCHING  # as it was, so the request can end
        upstream.finish()

    def test_every_move_in_the_table_is_made(self):
        w, client, upstream = self.streaming()
        (exchange,) = w.facade.in_flight
        for start, targets in PHASES.items():
            for target in targets:
                exchange.phase = start
                exchange._enter(target)
                self.assertIs(exchange.phase, target, (start, target))
        exchange.phase = Phase.DISPATCHING  # as it was, so the request can end
        upstream.finish()

    def test_a_commit_that_arrives_after_the_end_is_aborted_not_streamed(self):
        w, client, upstream = self.streaming()
        (exchange,) = w.facade.in_flight
        exchange.shutdown()
        self.assertIs(exchange.phase, Phase.ENDED)
        relay_aborted = []

        class Relay:
            def abort(self):
                relay_aborted.append(True)

        exchange._dispatched(Committed(node=None, address="", response=None, relay=Relay()))
        self.assertEqual(relay_aborted, [True])
        self.assertIs(exchange.phase, Phase.ENDED)
