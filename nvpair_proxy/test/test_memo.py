"""The one bounded memo (memo.py): values kept per key, all forgotten at the bound."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core.memo import Memo


class MemoTests(SynchronousTestCase):
    def test_a_remembered_value_is_returned_and_read_back(self):
        memo: Memo[str, bytes] = Memo(4)
        self.assertEqual(memo.remember("a", b"1"), b"1")
        self.assertEqual((memo.get("a"), memo.get("b")), (b"1", None))

    def test_a_key_remembered_again_takes_the_new_value_and_the_rest_stay(self):
        memo: Memo[str, int] = Memo(3)
        memo.remember("a", 1)
        memo.remember("b", 2)
        memo.remember("b", 3)
        self.assertEqual(dict(memo), {"a": 1, "b": 3})

    def test_it_never_holds_more_than_its_limit_and_empties_when_full(self):
        memo: Memo[int, int] = Memo(3)
        sizes = []
        for key in range(7):
            memo.remember(key, key)
            sizes.append(len(memo))
        self.assertEqual(sizes, [1, 2, 3, 1, 2, 3, 1])
        self.assertEqual(dict(memo), {6: 6})
