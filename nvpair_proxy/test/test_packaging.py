"""The systemd units in ``packaging/`` agree with the proxy they start
(docs/operations.md#restarts): a unit that names a port, a role or a stop time the proxy does
not share fails only on a real host, at the first reload or stop, so it is checked here."""

from __future__ import annotations

import os
import shlex

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.core import constants
from nvpair_proxy.process.options import Config, Options
from nvpair_proxy.testing.processes import nodes_toml

PACKAGING = os.path.join(os.path.dirname(__file__), "..", "..", "packaging")


def unit(name: str) -> dict[str, dict[str, str]]:
    """A unit file's sections and keys (a key given twice keeps its last value)."""
    sections: dict[str, dict[str, str]] = {}
    section: dict[str, str] = {}
    with open(os.path.join(PACKAGING, name)) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = sections.setdefault(line.strip("[]"), {})
            else:
                key, _, value = line.partition("=")
                section[key.strip()] = value.strip()
    return sections


def seconds(value: str) -> float:
    return float(value.removesuffix("s"))


class StandaloneUnitTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.service = unit("nvpair-proxy-standalone.service")["Service"]
        self.config = self.parsed(self.service["ExecStart"])

    def parsed(self, command: str) -> Config:
        """The unit's command line, read by the proxy's own option parser (the nodes file
        is one of ours: the unit's is on the host)."""
        argv = shlex.split(command)
        self.assertEqual(argv[1:4], ["-n", "--pidfile=", "nvpair-proxy"], "twistd, foreground")
        nodes = self.mktemp()
        with open(nodes, "w") as handle:
            handle.write(nodes_toml([("a", "ollama", 11434, ["llama3:latest"])]))
        args = argv[argv.index("nvpair-proxy") + 1 :]
        args[args.index("--nodes") + 1] = nodes
        options = Options()
        options.parseOptions(args)
        return options.config

    def test_each_socket_unit_names_a_role_the_command_line_serves_on_its_port(self):
        roles = dict(self.config.facades)
        self.assertIsNotNone(self.config.admin)
        roles["admin"] = self.config.admin[1]
        sockets = self.service["Sockets"].split()
        required = unit("nvpair-proxy-standalone.service")["Unit"]["Requires"].split()
        self.assertEqual(sorted(sockets), sorted(required))
        named = {}
        for name in sockets:
            socket = unit(name)["Socket"]
            self.assertEqual(socket["Service"], "nvpair-proxy-standalone.service", name)
            named[socket["FileDescriptorName"]] = int(socket["ListenStream"].rsplit(":", 1)[1])
        self.assertEqual(named, roles)

    def test_the_stop_outlasts_the_drain_and_a_reload_hands_over(self):
        self.assertGreater(self.config.drain_timeout, 0)
        self.assertGreater(
            seconds(self.service["TimeoutStopSec"]),
            self.config.drain_timeout + constants.FACADE_SHUTDOWN_GRACE,
        )
        self.assertEqual(self.service["ExecReload"], "/bin/kill -HUP $MAINPID")
        self.assertEqual(
            (self.service["Type"], self.service["NotifyAccess"], self.service["KillMode"]),
            ("notify", "main", "mixed"),
        )


class EveryServiceTests(SynchronousTestCase):
    def test_each_service_outlasts_the_default_drain_and_raises_its_descriptors(self):
        for name in ("nvpair-proxy.service", "nvpair-proxy-standalone.service"):
            service = unit(name)["Service"]
            self.assertGreater(
                seconds(service["TimeoutStopSec"]),
                constants.DRAIN_TIMEOUT + constants.FACADE_SHUTDOWN_GRACE,
                name,
            )
            self.assertGreaterEqual(int(service["LimitNOFILE"]), 65536, name)
