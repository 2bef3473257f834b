"""The commands in bin/: ``--help`` prints the usage and exits 0 without doing the command's
work, an unknown flag is one line on stderr naming it and a non-zero exit.

The Python scripts run under this interpreter (the project's .venv); the bash wrappers run
directly, as they check their flags before creating .venv, installing or building anything.
Each run gets an empty TMPDIR, which must still be empty afterwards: nothing was started
(bin/demo's work directory, pip's build directories).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SynchronousTestCase

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "bin")
# What bin/demo prints once it has started the fleet and the proxy.
DEMO_OUTPUT = ("simulated fleet:", "proxy facades:", "status page:", "served by")


class BinTests(SynchronousTestCase):
    def run_bin(self, *argv: str) -> subprocess.CompletedProcess:
        """``argv`` (a bin/ path first, or a Python script under this interpreter) with an
        empty TMPDIR; asserts that TMPDIR is still empty afterwards."""
        tmp = tempfile.mkdtemp(prefix="nvpair-test-bin-")
        self.addCleanup(shutil.rmtree, tmp, True)
        env = dict(os.environ, TMPDIR=tmp)
        env.pop("NOTIFY_SOCKET", None)
        result = subprocess.run(
            list(argv),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        self.assertEqual(os.listdir(tmp), [], f"{argv} left files in TMPDIR")
        return result

    def assertHelp(self, argv: list[str], usage: str) -> str:
        result = self.run_bin(*argv)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertTrue(result.stdout.startswith(usage), result.stdout)
        self.assertEqual(result.stderr, "")
        return result.stdout

    def assertRefused(self, argv: list[str], line: str) -> None:
        result = self.run_bin(*argv)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(result.stderr.splitlines(), [line])
        self.assertEqual(result.stdout, "")

    def script(self, name: str) -> list[str]:
        return [sys.executable, os.path.join(BIN, name)]

    def wrapper(self, name: str) -> list[str]:
        return [os.path.join(BIN, name)]

    # bin/demo, bin/demo.py

    def test_demo_help_prints_the_usage_and_starts_nothing(self):
        for flag in ("--help", "-h"):
            for argv in (self.script("demo.py"), self.wrapper("demo")):
                out = self.assertHelp(argv + [flag], "usage: bin/demo [-h] [--hold]")
                self.assertIn("--hold", out)
                for line in DEMO_OUTPUT:
                    self.assertNotIn(line, out)

    def test_demo_help_wins_over_other_arguments(self):
        self.assertHelp(self.script("demo.py") + ["--hold", "--help"], "usage: bin/demo")
        self.assertHelp(self.wrapper("demo") + ["--bogus", "--help"], "usage: bin/demo")

    def test_demo_refuses_an_unknown_flag(self):
        line = "bin/demo: unknown flag --bogus (see bin/demo --help)"
        for argv in (self.script("demo.py"), self.wrapper("demo")):
            self.assertRefused(argv + ["--bogus"], line)
            self.assertRefused(argv + ["--bogus=1"], line)
            self.assertRefused(argv + ["--hold", "--bogus"], line)
            self.assertRefused(argv + ["--ho"], "bin/demo: unknown flag --ho (see bin/demo --help)")
            self.assertRefused(
                argv + ["stray"], "bin/demo: unexpected argument 'stray' (see bin/demo --help)"
            )

    # bin/status-screenshot, bin/status_screenshot.py

    def test_status_screenshot_help_prints_the_usage_and_starts_nothing(self):
        for flag in ("--help", "-h"):
            for argv in (self.script("status_screenshot.py"), self.wrapper("status-screenshot")):
                out = self.assertHelp(
                    argv + [flag], "usage: bin/status-screenshot [-h] [--out OUT]"
                )
                self.assertNotIn("screenshot saved", out)
                for line in DEMO_OUTPUT:
                    self.assertNotIn(line, out)
        self.assertHelp(
            self.wrapper("status-screenshot") + ["--out", "x.png", "--help"],
            "usage: bin/status-screenshot",
        )

    def test_status_screenshot_refuses_an_unknown_flag(self):
        line = "bin/status-screenshot: unknown flag --bogus (see bin/status-screenshot --help)"
        for argv in (self.script("status_screenshot.py"), self.wrapper("status-screenshot")):
            self.assertRefused(argv + ["--bogus"], line)
            self.assertRefused(argv + ["--out=x.png", "--bogus"], line)
        self.assertRefused(
            self.wrapper("status-screenshot") + ["--out"],
            "bin/status-screenshot: --out needs a path (see bin/status-screenshot --help)",
        )

    # bin/test, bin/test-real-engine, bin/install-llama-server

    def test_test_help_prints_the_usage(self):
        for flag in ("--help", "-h"):
            self.assertHelp(self.wrapper("test") + [flag], "usage: bin/test [-h] [TEST ...]")

    def test_test_refuses_flags(self):
        line = (
            "bin/test: unknown flag --bogus; bin/test takes test names only (see bin/test --help)"
        )
        self.assertRefused(self.wrapper("test") + ["--bogus"], line)
        self.assertRefused(self.wrapper("test") + ["nvpair_proxy.test.test_cli", "--bogus"], line)

    def test_test_real_engine_help_prints_the_usage(self):
        for flag in ("--help", "-h"):
            self.assertHelp(
                self.wrapper("test-real-engine") + [flag],
                "usage: bin/test-real-engine [-h] [TEST ...]",
            )

    def test_test_real_engine_refuses_flags_before_building(self):
        self.assertRefused(
            self.wrapper("test-real-engine") + ["--bogus"],
            "bin/test-real-engine: unknown flag --bogus; it takes test names only "
            "(see bin/test-real-engine --help)",
        )

    def test_install_llama_server_help_prints_the_usage(self):
        for flag in ("--help", "-h"):
            out = self.assertHelp(
                self.wrapper("install-llama-server") + [flag],
                "usage: bin/install-llama-server [-h]",
            )
            self.assertIn("NVPAIR_LLAMA_SERVER", out)

    def test_install_llama_server_refuses_arguments_before_building(self):
        self.assertRefused(
            self.wrapper("install-llama-server") + ["--bogus"],
            "bin/install-llama-server: unknown flag --bogus; it takes no arguments (see --help)",
        )
        self.assertRefused(
            self.wrapper("install-llama-server") + ["stray"],
            "bin/install-llama-server: unexpected argument 'stray'; it takes no "
            "arguments (see --help)",
        )

    def test_install_agent_clients_helps_and_refuses_arguments_before_installing(self):
        for flag in ("--help", "-h"):
            out = self.assertHelp(
                self.wrapper("install-agent-clients") + [flag],
                "usage: bin/install-agent-clients [-h]",
            )
            self.assertIn("@anthropic-ai/claude-code@2.1.337", out)
        self.assertRefused(
            self.wrapper("install-agent-clients") + ["--bogus"],
            "bin/install-agent-clients: unknown flag --bogus; it takes no arguments (see --help)",
        )

    # bin/nvpair-proxy: the existing implementation's Go-style flags

    def test_nvpair_proxy_help_prints_the_usage(self):
        for flag in ("--help", "-help", "-h", "--h"):
            out = self.assertHelp(
                self.wrapper("nvpair-proxy") + [flag], "usage: bin/nvpair-proxy [-ipc PATH]"
            )
            for name in (
                "-ipc",
                "-cluster-dir",
                "-log-level",
                "-response-header-timeout",
                "-version",
            ):
                self.assertIn(f"  {name} ", out)
        self.assertHelp(
            self.wrapper("nvpair-proxy") + ["-log-level", "debug", "-help"],
            "usage: bin/nvpair-proxy",
        )

    def test_nvpair_proxy_refuses_an_unknown_flag(self):
        # As the Go proxy's flag package said it: one dash, whichever was given.
        line = "nvpair-proxy: flag provided but not defined: -bogus"
        self.assertRefused(self.wrapper("nvpair-proxy") + ["--bogus"], line)
        self.assertRefused(self.wrapper("nvpair-proxy") + ["-log-level=debug", "--bogus"], line)
