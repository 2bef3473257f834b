"""Crash-safe state (docs/decisions.md#crash-safe-state): the persisted-port files are written
atomically, so a writer killed at any point leaves the old file or the new one, never a torn
one.

The writer is a child process that ``SIGKILL``s itself at one of ``WRITE_STEPS`` (the seam
``write_atomically`` calls at each), so nothing of its own runs after the kill: no ``finally``,
no cleanup, exactly what a crash leaves. Every step is visited, with and without an old file.
In process, the system calls are recorded to show the order a power loss needs (the data
synced before the rename, the directory after it), and a failure raised at each step leaves
the old file and no temporary one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.broker.ports import read_port, write_port
from nvpair_proxy.core import files
from nvpair_proxy.core.files import WRITE_STEPS
from nvpair_proxy.nodes.engines import load_engines

OLLAMA = load_engines()["ollama"]
OLD, NEW = 12000, 13000

CHILD = """
import os, signal, sys
from nvpair_proxy.broker.ports import write_port
from nvpair_proxy.nodes.engines import load_engines

def step(name):
    if name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)

write_port(sys.argv[1], load_engines()["ollama"], int(sys.argv[3]), step)
"""


def written(port: int) -> bytes:
    return b'{"port":%d}' % port


class Injected(Exception):
    pass


class KilledWriterTests(SynchronousTestCase):
    def state_dir(self, old: int | None) -> str:
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        if old is not None:
            write_port(folder, OLLAMA, old)
        return folder

    def kill_at(self, folder: str, step: str, port: int) -> None:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, folder, step, str(port)], capture_output=True, timeout=60
        )
        self.assertEqual(child.returncode, -signal.SIGKILL, child.stderr[-2000:])

    def content(self, folder: str) -> bytes | None:
        try:
            with open(os.path.join(folder, OLLAMA.persisted_port_file), "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def test_a_writer_killed_at_each_step_leaves_the_old_file_or_the_new(self) -> None:
        for old in (OLD, None):
            for step in WRITE_STEPS:
                folder = self.state_dir(old)
                self.kill_at(folder, step, NEW)
                renamed = WRITE_STEPS.index(step) >= WRITE_STEPS.index("renamed")
                expected = written(NEW) if renamed else (None if old is None else written(old))
                self.assertEqual(self.content(folder), expected, (old, step))
                self.assertEqual(read_port(folder, OLLAMA), NEW if renamed else old, (old, step))
                # What the crash left (a temporary file at most) stops no later write.
                write_port(folder, OLLAMA, NEW + 1)
                self.assertEqual(read_port(folder, OLLAMA), NEW + 1, (old, step))

    def test_a_failure_at_each_step_leaves_the_old_file_and_no_temporary_one(self) -> None:
        for step in WRITE_STEPS[: WRITE_STEPS.index("renamed")]:
            folder = self.state_dir(OLD)

            def fail(name: str, at: str = step) -> None:
                if name == at:
                    raise Injected(at)

            self.assertRaises(Injected, write_port, folder, OLLAMA, NEW, fail)
            self.assertEqual(self.content(folder), written(OLD), step)
            self.assertEqual(os.listdir(folder), [OLLAMA.persisted_port_file], step)

    def test_the_data_is_synced_before_the_rename_and_the_directory_after(self) -> None:
        folder = self.state_dir(OLD)
        calls: list[tuple] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(source: str, target: str) -> None:
            calls.append(("replace", source, target))
            real_replace(source, target)

        self.patch(files.os, "fsync", fsync)
        self.patch(files.os, "replace", replace)
        write_port(folder, OLLAMA, NEW)
        path = os.path.join(folder, OLLAMA.persisted_port_file)
        self.assertEqual(len(calls), 3, calls)
        (_, synced), (_, source, target), (_, directory) = calls
        self.assertEqual((synced, target, directory), (source, path, folder))
        self.assertEqual(os.path.dirname(source), folder)  # a rename within one file system
        self.assertEqual(self.content(folder), written(NEW))
