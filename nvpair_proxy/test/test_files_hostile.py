"""Hostile files: the nodes file, engine files and the cluster directory, each corrupt,
truncated, a directory where a file belongs, a symlink loop, not UTF-8, or a FIFO.

Each is refused with one clear line naming the file (logged once, not on every re-read of
a watch), and what was last read well stays in force until a good file replaces it. Engine
files are read once, at start-up, so there a bad one stops start-up with one line instead.
"""

from __future__ import annotations

import os
import shutil

from twisted.application.internet import TimerService
from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.cluster.trust import ClusterDirectory
from nvpair_proxy.core import logs
from nvpair_proxy.nodes.engines import EngineFileError, load_engines
from nvpair_proxy.process.options import Options
from nvpair_proxy.standalone.nodesfile import NodesFileError, NodesFileWatcher, load_nodes_file
from nvpair_proxy.test.support import ONE_NODE, TWO_NODES, LogCapture
from nvpair_proxy.testing.certs import make_certificate, write_admission, write_identity, write_pin

ENGINES = load_engines()
LOOP = "Too many levels of symbolic links"


def replace(path: str, how: str, good: bytes) -> str:
    """Put a hostile thing at ``path``; the reason a reader should give for it."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    if how == "directory":
        os.makedirs(path)
        return "Is a directory"
    if how == "symlink loop":
        os.symlink(os.path.basename(path), path)
        return LOOP
    if how == "fifo":
        os.mkfifo(path)
        return "not a regular file"
    content = {
        "corrupt": b"\x00\x01 }{ [[[ garbage \x7f",
        "truncated": good[: len(good) // 2],
        "not UTF-8": good[:10] + b"\xff\xfe\xc3\x28" + good[10:],
    }[how]
    with open(path, "wb") as handle:
        handle.write(content)
    return ""


HOSTILE = ("corrupt", "truncated", "directory", "symlink loop", "not UTF-8", "fifo")


class Warnings:
    """The component's warn lines, as an operator reads them."""

    def __init__(self, test: SynchronousTestCase) -> None:
        self.capture = LogCapture(test, level="info")

    def take(self) -> list[str]:
        return [
            formatEvent(e)
            for e in self.capture.take()
            if e.get("log_namespace") == logs.COMPONENT and e.get("log_level") == LogLevel.warn
        ]


class NodesFileTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.path = os.path.abspath(self.mktemp())
        with open(self.path, "w") as handle:
            handle.write(ONE_NODE)
        self.clock = Clock()
        self.applied = []
        self.watcher = NodesFileWatcher(self.path, ENGINES, self.clock, self.applied.append)
        self.addCleanup(lambda: self.watcher.running and self.watcher.stopService())
        self.warnings = Warnings(self)

    def test_at_start_up_each_is_one_line_naming_the_file(self) -> None:
        for how in HOSTILE:
            reason = replace(self.path, how, TWO_NODES.encode())
            with self.assertRaises(NodesFileError, msg=how) as caught:
                load_nodes_file(self.path, ENGINES)
            text = str(caught.exception)
            self.assertTrue(text.startswith(f"{self.path}: "), text)
            self.assertNotIn("\n", text)
            self.assertIn(reason or "", text, how)

    def test_on_reload_each_keeps_the_last_good_fleet_with_one_warning(self) -> None:
        self.watcher.load()
        self.watcher.startService()
        good = [n.id for n in self.applied[0].nodes["ollama"]]
        for how in HOSTILE:
            reason = replace(self.path, how, TWO_NODES.encode())
            for _ in range(3):
                self.clock.advance(2)
            self.assertEqual(len(self.applied), 1, how)
            (line,) = self.warnings.take()
            self.assertTrue(
                line.startswith(
                    f"nodes file not reloaded, keeping the last good one: {self.path}: "
                ),
                line,
            )
            self.assertIn(reason, line, how)
            self.assertNotIn("\n", line)
        self.assertEqual([n.id for n in self.applied[-1].nodes["ollama"]], good)
        replace(self.path, "directory", b"")
        os.rmdir(self.path)
        with open(self.path, "w") as handle:
            handle.write(TWO_NODES)
        self.clock.advance(2)
        self.assertEqual([n.id for n in self.applied[-1].nodes["ollama"]], ["gpu-a", "gpu-b"])
        self.assertEqual(self.warnings.take(), [])


class EngineFileTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.folder = os.path.abspath(self.mktemp())
        os.makedirs(self.folder)
        with open(
            os.path.join(
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                "engines",
                "ollama.toml",
            ),
            "rb",
        ) as handle:
            self.good = handle.read().replace(b'id = "ollama"', b'id = "extra"')

    def test_each_stops_start_up_with_one_line_naming_the_file(self) -> None:
        path = os.path.join(self.folder, "extra.toml")
        for how in HOSTILE:
            reason = replace(path, how, self.good)
            with self.assertRaises(EngineFileError, msg=how) as caught:
                load_engines([self.folder])
            text = str(caught.exception)
            self.assertTrue(text.startswith(f"{path}: "), text)
            self.assertIn(reason, text, how)
            self.assertNotIn("\n", text)
            with self.assertRaises(SystemExit) as stopped:
                Options().parseOptions(["--engines-dir", self.folder, "--engine", "ollama"])
            self.assertEqual(str(stopped.exception), f"nvpair-proxy: --engines-dir: {text}")

    def test_a_good_file_is_loaded(self) -> None:
        with open(os.path.join(self.folder, "extra.toml"), "wb") as handle:
            handle.write(self.good)
        self.assertIn("extra", load_engines([self.folder]))


class ClusterDirectoryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.folder = os.path.abspath(self.mktemp())
        os.makedirs(self.folder)
        self.own = make_certificate("node-a")
        self.peer = make_certificate("node-b")
        write_identity(self.folder, *self.own)
        write_admission(self.folder)
        self.pin_path = write_pin(self.folder, "node-b", self.peer[0])
        self.directory = ClusterDirectory(self.folder)
        self.directory.refresh()
        self.warnings = Warnings(self)
        self.assertTrue(self.directory.member)
        self.good_state = self.state()

    def state(self):
        d = self.directory
        return (d.identity, dict(d.admission), dict(d.pins), d.member)

    def original(self, name: str) -> bytes:
        if name == "node.crt":
            return self.own[0]
        if name == "node.key":
            return self.own[1]
        with open(os.path.join(self.folder, name), "rb") as handle:
            return handle.read()

    def restore(self, path: str, good: bytes) -> None:
        replace(path, "corrupt", good)
        with open(path, "wb") as handle:
            handle.write(good)

    def hostile_each(self, name: str, cases=HOSTILE) -> None:
        path = os.path.join(self.folder, name)
        good = self.original(name)
        for how in cases:
            replace(path, how, good)
            for _ in range(3):  # the 2 s watch re-reads; the line is logged once
                self.directory.refresh()
            self.assertEqual(self.state(), self.good_state, (name, how))
            lines = self.warnings.take()
            self.assertEqual(len(lines), 1, (name, how, lines))
            self.assertIn(name, lines[0])
            self.assertNotIn("\n", lines[0])
            # Put right, it is read again, without a line.
            self.restore(path, good)
            self.directory.refresh()
            self.assertEqual(self.state(), self.good_state)
            self.assertEqual(self.warnings.take(), [], (name, how))

    def test_node_certificate(self) -> None:
        self.hostile_each("node.crt")

    def test_node_key(self) -> None:
        self.hostile_each("node.key")

    def test_admission(self) -> None:
        self.hostile_each("admission.json")

    def test_pin_file(self) -> None:
        # A directory named like a pin is ignored (protocol 6), so that case is not here.
        self.hostile_each("trusted/node-b.json", [h for h in HOSTILE if h != "directory"])

    def test_a_pin_file_turned_into_a_directory_is_ignored(self) -> None:
        replace(self.pin_path, "directory", b"")
        self.directory.refresh()
        self.assertEqual(self.directory.pins, {})
        self.assertTrue(self.directory.member)  # the admission still makes it a member

    def test_trusted_folder_that_is_not_a_folder_keeps_the_pins(self) -> None:
        folder = os.path.join(self.folder, "trusted")
        for how, reason in (("corrupt", "Not a directory"), ("symlink loop", LOOP)):
            replace(folder, how, b"")
            for _ in range(3):
                self.directory.refresh()
            self.assertEqual(self.state(), self.good_state, how)
            (line,) = self.warnings.take()
            self.assertIn(f"cannot list trusted: {reason}", line)

    def test_the_watch_logs_one_line_while_a_file_stays_bad(self) -> None:
        clock = Clock()
        watch = TimerService(2, self.directory.refresh)  # as the process's trust watch runs
        watch.clock = clock
        watch.startService()
        self.addCleanup(watch.stopService)
        replace(
            os.path.join(self.folder, "admission.json"),
            "truncated",
            self.original("admission.json"),
        )
        for _ in range(10):
            clock.advance(2)
        self.assertEqual(len(self.warnings.take()), 1)
        self.assertEqual(self.state(), self.good_state)
