"""The one file watch (files.FileWatch): read again only when a stamp changed, throttled on a
clock when asked with one, remembering the stamps taken before the read."""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core.files import FileWatch, stamp
from nvpair_proxy.test.support import rewrite


class FileWatchTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.folder = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.folder, True)
        self.main = self.file("main", "a")
        self.named: list[str] = []  # what the main file names, watched after a read
        self.watch = FileWatch(lambda: (self.main, *self.named))
        self.reads = 0

    def file(self, name: str, text: str) -> str:
        path = os.path.join(self.folder, name)
        with open(path, "w") as handle:
            handle.write(text)
        return path

    def read(self) -> int:
        self.reads += 1
        return self.reads

    def check(self, now: float | None = None) -> int:
        before = self.watch.changed(now, every=1.0)
        if before is not None:
            self.watch.read(before, self.read)
        return self.reads

    def test_never_read_is_a_change_then_only_an_edit_is(self):
        self.assertEqual([self.check(), self.check()], [1, 1])
        rewrite(self.main, "b")
        self.assertEqual([self.check(), self.check()], [2, 2])
        os.remove(self.main)  # a file that goes is a change too
        self.assertEqual(self.check(), 3)

    def test_with_a_clock_it_stats_at_most_once_per_interval(self):
        clock = Clock()
        self.check(clock.seconds())
        rewrite(self.main, "b")
        self.assertEqual(self.check(clock.seconds()), 1)  # within the interval: not asked
        clock.advance(0.5)
        self.assertEqual(self.check(clock.seconds()), 1)
        self.assertEqual(self.check(), 2)  # without a clock: always asked
        rewrite(self.main, "c")
        clock.advance(0.5)
        self.assertEqual(self.check(clock.seconds()), 3)

    def test_an_edit_saved_during_the_read_is_seen_by_the_next_check(self):
        def read_then_edit() -> None:
            rewrite(self.main, "edited while read")

        self.watch.read(None, read_then_edit)
        self.assertIsNotNone(self.watch.changed())

    def test_a_file_the_read_names_is_watched_from_that_read_on(self):
        other = self.file("other", "x")

        def read_naming_other() -> None:
            self.named = [other]

        self.watch.read(None, read_naming_other)
        self.assertIsNone(self.watch.changed())  # stamped after the read that named it
        rewrite(other, "y")
        self.assertEqual(self.watch.changed(), {self.main: stamp(self.main), other: stamp(other)})

    def test_a_read_that_raises_is_remembered_and_not_retried_until_a_change(self):
        def fails() -> None:
            raise ValueError("bad file")

        self.assertRaises(ValueError, self.watch.read, None, fails)
        self.assertIsNone(self.watch.changed())
        rewrite(self.main, "fixed")
        self.assertIsNotNone(self.watch.changed())
