"""Tests for the process-wide reservation map (spec 3.1, 5 step 3, 6; behaviours "Reservations")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.routing.reservations import Rank, Reservation, ReservationMap

NODES = ("a", "b", "c", "d")


def snapshotted(
    generation: int = 1, nodes: Sequence[str] = ("a", "b", "c"), ranks: Sequence[Rank] = ()
) -> ReservationMap:
    """A map that has applied one scheduler snapshot."""
    reservations = ReservationMap()
    reservations.set_priority(generation, nodes, ranks)
    return reservations


def burst(reservations: ReservationMap, ordered: Sequence[str], size: int) -> list[str]:
    """``size`` concurrent requests over the same owners; the nodes they were given, in order."""
    chosen = []
    for _ in range(size):
        reservation = reservations.choose(ordered)
        assert reservation is not None
        chosen.append(reservation.node_id)
    return chosen


class SpreadTests(SynchronousTestCase):
    """Concurrent dispatch spreads because each claim counts against the next choice."""

    def test_six_concurrent_requests_over_three_equal_nodes_spread_two_each(self) -> None:
        reservations = snapshotted()
        self.assertEqual(burst(reservations, ["a", "b", "c"], 6), ["a", "b", "c", "a", "b", "c"])
        self.assertEqual(reservations.reservations, {"a": 2, "b": 2, "c": 2})

    @settings(deadline=None)
    @given(nodes=st.integers(min_value=1, max_value=8), size=st.integers(0, 60))
    def test_concurrent_reservations_at_equal_load_differ_by_at_most_one(
        self, nodes: int, size: int
    ) -> None:
        ids = [f"n{i}" for i in range(nodes)]
        reservations = snapshotted(nodes=ids, ranks=[Rank(node_id, pending=2) for node_id in ids])
        burst(reservations, ids, size)
        loads = [reservations.load(node_id) for node_id in ids]
        self.assertLessEqual(max(loads) - min(loads), 1)
        self.assertEqual(sum(reservations.reservations.values()), size)

    def test_unequal_pending_converges(self) -> None:
        reservations = snapshotted(ranks=[Rank("a", pending=3)])
        self.assertEqual(
            burst(reservations, ["a", "b", "c"], 9),
            ["b", "c", "b", "c", "b", "c", "a", "b", "c"],
        )
        self.assertEqual(reservations.reservations, {"a": 1, "b": 4, "c": 4})

    def test_one_map_shared_by_two_facades_spreads_a_mixed_burst(self) -> None:
        reservations = snapshotted(nodes=["a", "b", "c", "d"])
        ollama, lmstudio = ["a", "b", "c"], ["b", "c", "d"]
        chosen = []
        for _ in range(4):
            chosen += burst(reservations, ollama, 1) + burst(reservations, lmstudio, 1)
        self.assertEqual(chosen, ["a", "b", "c", "d", "a", "b", "c", "d"])
        self.assertEqual(reservations.reservations, {"a": 2, "b": 2, "c": 2, "d": 2})

    def test_disabled_map_chooses_by_the_snapshot_alone(self) -> None:
        reservations = ReservationMap(enabled=False)
        reservations.set_priority(1, ["a", "b", "c"], [Rank("a", pending=1)])
        self.assertEqual(burst(reservations, ["a", "b", "c"], 4), ["b", "b", "b", "b"])
        self.assertEqual(reservations.load("b"), 0)
        self.assertEqual(reservations.reservations, {"b": 4})


class LoadTests(SynchronousTestCase):
    """Estimated load is pending + gpuPressure + reservations (spec 6, protocol 3)."""

    def test_load_is_pending_plus_gpu_pressure_plus_reservations(self) -> None:
        reservations = snapshotted(ranks=[Rank("a", pending=2, gpu_pressure=1.5, rank=1)])
        reservations.reserve("a")
        self.assertEqual(reservations.load("a"), 4.5)

    def test_negative_pending_reads_as_zero(self) -> None:
        reservations = snapshotted(ranks=[Rank("a", pending=-4, gpu_pressure=1)])
        self.assertEqual(reservations.load("a"), 1)

    def test_gpu_pressure_is_clamped_to_zero_through_three(self) -> None:
        reservations = snapshotted(
            ranks=[Rank("a", gpu_pressure=5), Rank("b", gpu_pressure=-1), Rank("c", gpu_pressure=2)]
        )
        self.assertEqual(
            [reservations.load("a"), reservations.load("b"), reservations.load("c")], [3, 0, 2]
        )

    def test_nan_figures_read_as_zero(self) -> None:
        nan = float("nan")
        reservations = snapshotted(ranks=[Rank("a", pending=nan, gpu_pressure=nan)])
        self.assertEqual(reservations.load("a"), 0)

    def test_a_node_without_figures_has_only_its_reservations(self) -> None:
        reservations = snapshotted()
        self.assertEqual(reservations.load("z"), 0)
        reservations.reserve("z")
        self.assertEqual(reservations.load("z"), 1)


class SnapshotTests(SynchronousTestCase):
    """node/set-priority is applied at most once per generation (spec 6, protocol 3)."""

    def test_before_any_snapshot_generation_is_zero_and_order_is_default(self) -> None:
        reservations = ReservationMap()
        self.assertEqual(
            (reservations.generation, reservations.priority, reservations.count), (0, (), 0)
        )

    def test_newer_snapshot_applies_and_counts_its_list(self) -> None:
        reservations = ReservationMap()
        self.assertTrue(reservations.set_priority(3, ["b", "a"], [Rank("b", pending=1)]))
        self.assertEqual(
            (reservations.generation, reservations.priority, reservations.count),
            (3, ("b", "a"), 2),
        )
        self.assertEqual(reservations.load("b"), 1)

    def test_same_generation_redelivered_keeps_reservations(self) -> None:
        reservations = snapshotted(generation=4)
        reservations.reserve("a")
        reservations.reserve("a")
        self.assertFalse(reservations.set_priority(4, ["c"], [Rank("a", pending=9)]))
        self.assertEqual(reservations.reservations, {"a": 2})
        self.assertEqual(reservations.load("a"), 2)
        self.assertEqual((reservations.generation, reservations.priority), (4, ("a", "b", "c")))

    def test_stale_generation_is_ignored_and_returns_false(self) -> None:
        reservations = snapshotted(generation=5, ranks=[Rank("a", pending=1)])
        reservations.reserve("b")
        self.assertFalse(reservations.set_priority(2, ["c"], [Rank("a", pending=7)]))
        self.assertEqual(reservations.reservations, {"b": 1})
        self.assertEqual([reservations.load("a"), reservations.load("b")], [1, 1])
        self.assertEqual(
            (reservations.generation, reservations.priority, reservations.count),
            (5, ("a", "b", "c"), 3),
        )

    def test_newer_generation_supersedes_every_reservation(self) -> None:
        reservations = snapshotted(generation=1)
        burst(reservations, ["a", "b", "c"], 3)
        self.assertTrue(reservations.set_priority(2, ["a", "b", "c"], [Rank("a", pending=1)]))
        self.assertEqual(reservations.reservations, {})
        self.assertEqual([reservations.load(n) for n in "abc"], [1, 0, 0])

    def test_generation_zero_raises_and_changes_nothing(self) -> None:
        reservations = snapshotted(generation=2)
        reservations.reserve("a")
        for generation in (0, -1):
            with self.assertRaises(ValueError) as raised:
                reservations.set_priority(generation, ["c"])
            self.assertEqual(
                str(raised.exception), "generation is required and must be greater than 0"
            )
        self.assertEqual((reservations.generation, reservations.count), (2, 3))
        self.assertEqual(reservations.reservations, {"a": 1})


class ChoiceTests(SynchronousTestCase):
    """Which candidate gets the reservation (spec 5 step 3, design 8.6)."""

    def test_only_listed_candidates_are_chosen_once_a_snapshot_lists_nodes(self) -> None:
        reservations = snapshotted(nodes=["b"], ranks=[Rank("b", pending=5)])
        self.assertEqual(burst(reservations, ["a", "b", "c"], 2), ["b", "b"])
        self.assertEqual(reservations.reservations, {"b": 2})

    def test_no_listed_candidate_reserves_nothing(self) -> None:
        reservations = snapshotted(nodes=["z"])
        self.assertIsNone(reservations.choose(["a", "b"]))
        self.assertIsNone(reservations.choose([]))
        self.assertEqual(reservations.reservations, {})

    def test_every_candidate_counts_as_listed_before_any_snapshot(self) -> None:
        self.assertEqual(burst(ReservationMap(), ["b", "a"], 3), ["b", "a", "b"])

    def test_every_candidate_counts_as_listed_under_an_empty_list(self) -> None:
        reservations = snapshotted(nodes=[], ranks=[Rank("b", pending=1)])
        self.assertEqual(burst(reservations, ["b", "a"], 3), ["a", "b", "a"])

    def test_only_eligible_candidates_are_reserved(self) -> None:
        reservations = snapshotted(ranks=[Rank("c", pending=4)])
        self.assertEqual(burst(reservations, ["c"], 2), ["c", "c"])
        self.assertEqual(reservations.reservations, {"c": 2})

    def test_ties_go_to_the_earlier_node_in_order(self) -> None:
        reservations = snapshotted(ranks=[Rank("a", pending=1), Rank("c", pending=1)])
        reservations.reserve("b")
        self.assertEqual(burst(reservations, ["c", "b", "a"], 1), ["c"])

    def test_choose_reserves_the_least_loaded_node_against_the_current_generation(self) -> None:
        reservations = snapshotted(ranks=[Rank("a", pending=1)])
        reservation = reservations.choose(["a", "b", "c"])
        assert reservation is not None
        self.assertEqual((reservation.node_id, reservation.generation), ("b", 1))

    def test_choose_reserves_nothing_when_no_candidate_is_listed(self) -> None:
        reservations = snapshotted(nodes=["z"])
        self.assertIsNone(reservations.choose(["b", "a"]))
        self.assertEqual(reservations.reservations, {})


class PickTests(SynchronousTestCase):
    """``pick``: the choice rule without the reservation, used again on each failover (spec 5)."""

    def test_pick_takes_no_reservation(self) -> None:
        reservations = snapshotted(ranks=[Rank("a", pending=1)])
        self.assertEqual([reservations.pick(["a", "b", "c"]) for _ in range(3)], ["b"] * 3)
        self.assertEqual(reservations.reservations, {})
        self.assertEqual([reservations.load(n) for n in "abc"], [1, 0, 0])

    def test_pick_names_the_least_loaded_listed_candidate(self) -> None:
        reservations = snapshotted(
            ranks=[
                Rank("a", pending=2),
                Rank("b", pending=1, gpu_pressure=1.5),
                Rank("c", pending=2),
            ]
        )
        reservations.reserve("a")
        self.assertEqual(reservations.pick(["a", "b", "c"]), "c")

    def test_pick_ties_go_to_the_earlier_node_in_order(self) -> None:
        reservations = snapshotted(ranks=[Rank("a", pending=1), Rank("c", pending=1)])
        reservations.reserve("b")
        self.assertEqual(reservations.pick(["c", "b", "a"]), "c")
        self.assertEqual(reservations.pick(["a", "b", "c"]), "a")

    def test_pick_ignores_unlisted_candidates_once_a_snapshot_lists_nodes(self) -> None:
        reservations = snapshotted(
            nodes=["b", "c"], ranks=[Rank("b", pending=5), Rank("c", pending=3)]
        )
        self.assertEqual(reservations.pick(["a", "b", "c", "d"]), "c")

    def test_pick_with_no_listed_candidate_names_the_first(self) -> None:
        reservations = snapshotted(nodes=["z"], ranks=[Rank("b", pending=4)])
        self.assertEqual(reservations.pick(["b", "a"]), "b")
        self.assertIsNone(reservations.pick([]))
        self.assertEqual(reservations.reservations, {})

    def test_pick_counts_every_candidate_as_listed_without_a_list(self) -> None:
        before = ReservationMap()
        before.reserve("b")
        self.assertEqual(before.pick(["b", "a"]), "a")
        empty = snapshotted(nodes=[], ranks=[Rank("b", pending=1)])
        self.assertEqual(empty.pick(["b", "a"]), "a")

    def test_disabled_map_picks_by_the_snapshot_alone(self) -> None:
        reservations = ReservationMap(enabled=False)
        reservations.set_priority(1, ["a", "b"], [Rank("a", pending=1)])
        reservations.reserve("b")
        reservations.reserve("b")
        self.assertEqual(reservations.pick(["a", "b"]), "b")

    @settings(deadline=None)
    @given(
        nodes=st.lists(st.sampled_from(NODES), max_size=4, unique=True),
        ranks=st.lists(
            st.builds(Rank, st.sampled_from(NODES), pending=st.integers(0, 3)), max_size=4
        ),
        held=st.lists(st.sampled_from(NODES), max_size=6),
        ordered=st.lists(st.sampled_from(NODES), max_size=4, unique=True),
    )
    def test_choose_reserves_what_pick_names_when_it_is_listed(
        self, nodes: list[str], ranks: list[Rank], held: list[str], ordered: list[str]
    ) -> None:
        reservations = snapshotted(nodes=nodes, ranks=ranks)
        for node_id in held:
            reservations.reserve(node_id)
        picked = reservations.pick(ordered)
        before = reservations.reservations
        chosen = reservations.choose(ordered)
        if picked is not None and (not nodes or picked in nodes):
            assert chosen is not None
            self.assertEqual(chosen.node_id, picked)
        else:
            self.assertIsNone(chosen)
            self.assertEqual(reservations.reservations, before)

    def test_failover_picks_the_less_loaded_remaining_candidate_and_moves_there(self) -> None:
        reservations = snapshotted(ranks=[Rank("b", pending=2), Rank("c", pending=1)])
        reservation = reservations.choose(["a", "b", "c"])
        assert reservation is not None
        self.assertEqual(reservation.node_id, "a")
        # a refuses; list order would fail over to b, the least loaded remaining is c.
        failover = reservations.pick(["b", "c"])
        self.assertEqual(failover, "c")
        self.assertEqual(reservations.reservations, {"a": 1})
        assert failover is not None
        reservation.move(failover)
        self.assertEqual(reservations.reservations, {"c": 1})
        self.assertEqual([reservations.load(n) for n in "abc"], [0, 2, 2])
        reservation.release()
        self.assertEqual(reservations.reservations, {})
        self.assertEqual([reservations.load(n) for n in "abc"], [0, 2, 1])

    def test_failover_counts_other_requests_claims(self) -> None:
        reservations = snapshotted()
        other = reservations.choose(["b", "a", "c"])
        assert other is not None
        reservation = reservations.choose(["a", "b", "c"])
        assert reservation is not None
        self.assertEqual((other.node_id, reservation.node_id), ("b", "a"))
        failover = reservations.pick(["b", "c"])
        self.assertEqual(failover, "c")
        assert failover is not None
        reservation.move(failover)
        self.assertEqual(reservations.reservations, {"b": 1, "c": 1})
        self.assertEqual([reservations.load(n) for n in "abc"], [0, 1, 1])
        reservation.release()
        other.release()
        self.assertEqual(reservations.reservations, {})


class LifecycleTests(SynchronousTestCase):
    """Moved with each attempt, released however the request ends (spec 6)."""

    def test_failover_moves_the_reservation(self) -> None:
        reservations = snapshotted()
        reservation = reservations.reserve("a")
        reservation.move("b")
        self.assertEqual(reservation.node_id, "b")
        self.assertEqual(reservations.reservations, {"b": 1})
        self.assertEqual([reservations.load("a"), reservations.load("b")], [0, 1])

    def test_moving_to_the_same_node_changes_nothing(self) -> None:
        reservations = snapshotted()
        reservation = reservations.reserve("a")
        reservation.move("a")
        self.assertEqual(reservations.reservations, {"a": 1})

    def test_moving_a_released_reservation_changes_nothing(self) -> None:
        reservations = snapshotted()
        reservation = reservations.reserve("a")
        reservation.release()
        reservation.move("b")
        self.assertEqual((reservation.node_id, reservations.reservations), ("a", {}))

    def test_moving_a_superseded_reservation_counts_the_new_dispatch(self) -> None:
        reservations = snapshotted(generation=1)
        reservation = reservations.reserve("a")
        reservations.set_priority(2, ["a", "b", "c"], [Rank("a", pending=1)])
        reservation.move("b")
        self.assertEqual((reservation.node_id, reservation.generation), ("b", 2))
        self.assertEqual(reservations.reservations, {"b": 1})
        reservation.release()
        self.assertEqual(reservations.reservations, {})
        self.assertEqual([reservations.load("a"), reservations.load("b")], [1, 0])

    def test_release_from_before_a_snapshot_is_dropped(self) -> None:
        reservations = snapshotted(generation=1)
        early = reservations.reserve("a")
        reservations.set_priority(2, ["a", "b"], [Rank("a", pending=1)])
        late = reservations.reserve("a")
        early.release()
        self.assertTrue(early.released)
        self.assertEqual(reservations.load("a"), 2)
        self.assertEqual(reservations.reservations, {"a": 1})
        late.release()
        self.assertEqual(reservations.load("a"), 1)
        self.assertEqual(reservations.reservations, {})

    def test_released_entries_are_deleted(self) -> None:
        reservations = snapshotted()
        first, second = reservations.reserve("a"), reservations.reserve("b")
        first.release()
        self.assertEqual(reservations.reservations, {"b": 1})
        second.release()
        self.assertEqual(reservations.reservations, {})

    def test_release_is_idempotent(self) -> None:
        reservations = snapshotted()
        first = reservations.reserve("a")
        reservations.reserve("a")
        first.release()
        first.release()
        self.assertEqual(reservations.reservations, {"a": 1})

    def test_release_before_backoff_then_retake_through_choose(self) -> None:
        reservations = snapshotted()
        reservation = reservations.choose(["a", "b"])
        assert reservation is not None
        reservation.release()
        self.assertEqual(reservations.reservations, {})
        retaken = reservations.choose(["b", "a"])
        assert retaken is not None
        self.assertEqual(
            (retaken.node_id, retaken.released, reservations.reservations), ("b", False, {"b": 1})
        )


# One step of a random history of the map, as the dispatch loop and the broker could drive it.
operations = st.one_of(
    st.tuples(
        st.just("snapshot"),
        st.integers(min_value=-1, max_value=6),
        st.lists(st.sampled_from(NODES), max_size=4, unique=True),
        st.lists(
            st.builds(
                Rank,
                st.sampled_from(NODES),
                pending=st.floats(-5, 5),
                gpu_pressure=st.floats(-2, 6),
            ),
            max_size=4,
        ),
    ),
    st.tuples(st.just("choose"), st.lists(st.sampled_from(NODES), max_size=4, unique=True)),
    st.tuples(st.just("pick"), st.lists(st.sampled_from(NODES), max_size=4, unique=True)),
    st.tuples(st.just("reserve"), st.sampled_from(NODES)),
    st.tuples(st.just("move"), st.integers(min_value=0), st.sampled_from(NODES)),
    st.tuples(st.just("release"), st.integers(min_value=0)),
)


class InterleavingTests(SynchronousTestCase):
    """No interleaving of reserve, move, release and snapshots breaks the accounting (spec 6)."""

    def assertAccounted(self, reservations: ReservationMap, taken: list[Reservation]) -> None:
        """Loads are never negative, and exactly the live claims of this generation count."""
        for node_id in NODES:
            self.assertGreaterEqual(reservations.load(node_id), 0)
        live = Counter(
            r.node_id for r in taken if not r.released and r.generation == reservations.generation
        )
        self.assertEqual(reservations.reservations, dict(live))

    @settings(max_examples=300, deadline=None)
    @given(history=st.lists(operations, max_size=40))
    def test_any_interleaving_keeps_load_non_negative_and_leaves_no_entries(
        self, history: list[tuple]
    ) -> None:
        reservations = ReservationMap()
        taken: list[Reservation] = []
        for operation in history:
            kind, *arguments = operation
            if kind == "snapshot":
                generation, nodes, ranks = arguments
                if generation <= 0:
                    self.assertRaises(ValueError, reservations.set_priority, generation, nodes)
                else:
                    before = reservations.generation
                    applied = reservations.set_priority(generation, nodes, ranks)
                    self.assertEqual(applied, generation > before)
            elif kind == "choose":
                reservation = reservations.choose(arguments[0])
                if reservation is not None:
                    taken.append(reservation)
            elif kind == "pick":
                before = reservations.reservations
                picked = reservations.pick(arguments[0])
                self.assertEqual(picked is None, not arguments[0])
                self.assertEqual(reservations.reservations, before)
            elif kind == "reserve":
                taken.append(reservations.reserve(arguments[0]))
            elif taken and kind == "move":
                taken[arguments[0] % len(taken)].move(arguments[1])
            elif taken and kind == "release":
                taken[arguments[0] % len(taken)].release()
            self.assertAccounted(reservations, taken)
        for reservation in taken:
            reservation.release()
        self.assertAccounted(reservations, taken)
        self.assertEqual(reservations.reservations, {})
