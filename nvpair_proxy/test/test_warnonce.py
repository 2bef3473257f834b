"""Warn once per change (warnonce.py): news per subject, forgotten when fine or gone."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core.warnonce import WarnOnce


class WarnOnceTests(SynchronousTestCase):
    def test_a_problem_is_news_once_while_it_stays(self):
        warned: WarnOnce[str] = WarnOnce()
        self.assertEqual([warned.new("a", "unreadable") for _ in range(3)], [True, False, False])

    def test_a_changed_problem_is_news_again(self):
        warned: WarnOnce[str] = WarnOnce()
        warned.new("a", "unreadable")
        self.assertTrue(warned.new("a", "not JSON"))
        self.assertTrue(warned.new("a", "unreadable"))

    def test_subjects_are_separate(self):
        warned: WarnOnce[str] = WarnOnce()
        warned.new("a", "unreadable")
        self.assertTrue(warned.new("b", "unreadable"))

    def test_cleared_says_whether_there_was_a_problem_and_a_return_is_news(self):
        warned: WarnOnce[str] = WarnOnce()
        self.assertFalse(warned.clear("a"))
        warned.new("a", "unreadable")
        self.assertEqual((warned.clear("a"), warned.clear("a")), (True, False))
        self.assertTrue(warned.new("a", "unreadable"))

    def test_retain_forgets_the_subjects_refused_and_keeps_the_rest(self):
        warned: WarnOnce[str] = WarnOnce()
        for subject in ("trusted/a", "trusted/b", "identity"):
            warned.new(subject, "unreadable")
        warned.retain(lambda subject: subject != "trusted/a")
        self.assertEqual(
            [warned.new(s, "unreadable") for s in ("trusted/a", "trusted/b", "identity")],
            [True, False, False],
        )
