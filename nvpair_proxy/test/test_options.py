"""Tests for the command line (design 3, decisions 18-19) and the twistd dropin."""

from __future__ import annotations

import io
import os
import sys

import attrs
from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins
from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.process import options as options_module
from nvpair_proxy.process.options import DEFAULT_STATE_DIR, Config, Options, parse_duration
from nvpair_proxy.test.support import VLLM

HOME = "/home/tester"
DEFAULT_STATE = "/home/tester/.config/Nvidia Corporation/Personal AI Router"


class OptionsCase(SynchronousTestCase):
    """Each test sees only the environment it sets."""

    def setUp(self) -> None:
        self.environ = {"HOME": HOME}
        self.patch(os, "environ", self.environ)

    def parse(self, *argv: str) -> Config:
        """What the process runs with, from ``argv``."""
        options = Options()
        options.parseOptions(list(argv))
        return options.config

    def refused(self, *argv: str) -> str:
        """The one line start-up stops with."""
        with self.assertRaises(SystemExit) as caught:
            self.parse(*argv)
        message = caught.exception.code
        self.assertIsInstance(message, str)
        self.assertNotIn("\n", message)
        self.assertTrue(message.startswith("nvpair-proxy: "), message)
        return message

    def existing_file(self) -> str:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write("")
        return path


class DefaultsTests(OptionsCase):
    def test_defaults(self) -> None:
        options = self.parse()
        self.assertEqual(
            (
                options.response_timeout,
                options.log_level,
                options.state_dir,
                options.facades,
                options.ipc,
                options.nodes,
                options.standalone,
            ),
            (1800.0, "info", DEFAULT_STATE, (), None, None, False),
        )

    def test_the_options_keep_only_their_flags_and_the_config_is_frozen(self) -> None:
        options = Options()
        options.parseOptions(
            ["--engine", "ollama", "--response-header-timeout", "90s", "--log-level", "warn"]
        )
        flags = {name for name, *_ in options.optParameters + options.optFlags} | {"engine"}
        self.assertEqual(set(options) - flags, set())
        self.assertEqual(
            (options["response-header-timeout"], options["log-level"]), ("90s", "warn")
        )
        with self.assertRaises(attrs.exceptions.FrozenInstanceError):
            options.config.response_timeout = 1.0  # type: ignore[misc]

    def test_default_state_dir_is_the_existing_implementations(self) -> None:
        self.assertEqual(
            DEFAULT_STATE_DIR,
            os.path.join("~", ".config", "Nvidia Corporation", "Personal AI Router"),
        )

    def test_state_dir_from_systemd(self) -> None:
        self.environ["STATE_DIRECTORY"] = "/var/lib/nvpair-proxy"
        self.assertEqual(self.parse().state_dir, "/var/lib/nvpair-proxy")

    def test_state_dir_flag_wins_over_systemd(self) -> None:
        self.environ["STATE_DIRECTORY"] = "/var/lib/nvpair-proxy"
        self.assertEqual(self.parse("--state-dir", "/srv/ports").state_dir, "/srv/ports")

    def test_state_dir_flag_expands_home(self) -> None:
        self.assertEqual(self.parse("--state-dir", "~/ports").state_dir, "/home/tester/ports")

    def test_log_level_from_environment(self) -> None:
        self.environ["NVPAIR_LOG_LEVEL"] = "debug"
        self.assertEqual(self.parse().log_level, "debug")

    def test_log_level_flag_wins_over_environment(self) -> None:
        self.environ["NVPAIR_LOG_LEVEL"] = "debug"
        self.assertEqual(self.parse("--log-level", "warn").log_level, "warn")

    def test_every_log_level_is_accepted(self) -> None:
        self.assertEqual(
            [
                self.parse("--log-level", level).log_level
                for level in ("debug", "info", "warn", "error")
            ],
            ["debug", "info", "warn", "error"],
        )

    def test_response_timeout_from_environment(self) -> None:
        self.environ["NVPAIR_PROXY_RESPONSE_HEADER_TIMEOUT"] = "90s"
        self.assertEqual(self.parse().response_timeout, 90.0)

    def test_response_timeout_flag_wins_over_environment(self) -> None:
        self.environ["NVPAIR_PROXY_RESPONSE_HEADER_TIMEOUT"] = "90s"
        self.assertEqual(self.parse("--response-header-timeout", "1h30m").response_timeout, 5400.0)

    def test_zero_response_timeout_disables(self) -> None:
        self.assertEqual(self.parse("--response-header-timeout", "0").response_timeout, 0.0)

    def test_stream_idle_timeout_is_off_by_default(self) -> None:
        self.assertEqual(self.parse().stream_idle, 0.0)

    def test_stream_idle_timeout_from_flag_and_environment(self) -> None:
        self.environ["NVPAIR_PROXY_STREAM_IDLE_TIMEOUT"] = "2m"
        self.assertEqual(self.parse().stream_idle, 120.0)
        self.assertEqual(self.parse("--stream-idle-timeout", "90s").stream_idle, 90.0)

    def test_bad_stream_idle_timeout(self) -> None:
        self.assertEqual(
            self.refused("--stream-idle-timeout", "later"),
            "nvpair-proxy: --stream-idle-timeout: not a duration: 'later' "
            "(use seconds or e.g. 90s, 30m, 1h30m)",
        )

    def test_upstream_keepalive_defaults_to_15s_and_0_turns_it_off(self) -> None:
        self.assertEqual(self.parse().upstream_keepalive, 15.0)
        self.assertEqual(self.parse("--upstream-keepalive", "0").upstream_keepalive, 0.0)
        self.environ["NVPAIR_PROXY_UPSTREAM_KEEPALIVE"] = "1m"
        self.assertEqual(self.parse().upstream_keepalive, 60.0)
        self.assertEqual(self.parse("--upstream-keepalive", "5").upstream_keepalive, 5.0)

    def test_bad_upstream_keepalive(self) -> None:
        self.assertEqual(
            self.refused("--upstream-keepalive", "2h"),
            "nvpair-proxy: --upstream-keepalive: at most 1h (got '2h')",
        )
        self.environ["NVPAIR_PROXY_UPSTREAM_KEEPALIVE"] = "often"
        self.assertEqual(
            self.refused(),
            "nvpair-proxy: NVPAIR_PROXY_UPSTREAM_KEEPALIVE: not a duration: 'often' "
            "(use seconds or e.g. 90s, 30m, 1h30m)",
        )

    def test_ipc_and_cluster_dir(self) -> None:
        cluster = self.mktemp()
        os.mkdir(cluster)
        options = self.parse("--ipc", "/run/broker.sock", "--cluster-dir", cluster)
        self.assertEqual(
            (options.ipc, options.cluster_dir, options.standalone),
            ("/run/broker.sock", cluster, False),
        )


class DurationTests(SynchronousTestCase):
    """Seconds or a Go-style duration (design 3)."""

    GOOD = [
        ("90", 90.0),
        ("1.5", 1.5),
        ("90s", 90.0),
        ("30m", 1800.0),
        ("1h30m", 5400.0),
        ("500ms", 0.5),
        ("1h", 3600.0),
        ("2m30s", 150.0),
        ("0", 0.0),
        ("0s", 0.0),
        (" 45s ", 45.0),
    ]

    BAD = ["abc", "-1", "1x", "", "-5s", "30M", "1h-30m", "s", "1.5.5s", "nan", "inf"]

    def test_good_durations(self) -> None:
        self.assertEqual([(text, parse_duration(text)) for text, _ in self.GOOD], self.GOOD)

    def test_bad_durations(self) -> None:
        for text in self.BAD:
            with self.assertRaises(ValueError, msg=repr(text)) as caught:
                parse_duration(text)
            self.assertEqual(
                str(caught.exception),
                f"not a duration: {text.strip()!r} (use seconds or e.g. 90s, 30m, 1h30m)",
            )


class EngineFlagTests(OptionsCase):
    """Any --engine switches to standalone mode; port per engine when omitted or 0."""

    def test_engine_without_port_uses_its_standalone_port(self) -> None:
        options = self.parse("--engine", "ollama")
        self.assertEqual(options.facades, (("ollama", 11435),))
        self.assertTrue(options.standalone)

    def test_engine_port_zero_uses_its_standalone_port(self) -> None:
        self.assertEqual(self.parse("--engine", "ollama:0").facades, (("ollama", 11435),))

    def test_engine_with_a_port(self) -> None:
        self.assertEqual(self.parse("--engine", "lmstudio:1300").facades, (("lmstudio", 1300),))

    def test_every_engine_at_once(self) -> None:
        options = self.parse("--engine", "llamacpp", "--engine", "ollama", "--engine", "lmstudio")
        self.assertEqual(
            options.facades, (("llamacpp", 8080), ("ollama", 11435), ("lmstudio", 1234))
        )

    def test_nodes_file_with_an_engine(self) -> None:
        path = self.existing_file()
        self.assertEqual(self.parse("--engine", "ollama", "--nodes", path).nodes, path)

    def test_engine_from_an_extra_engines_dir(self) -> None:
        directory = self.mktemp()
        os.mkdir(directory)
        with open(os.path.join(directory, "vllm.toml"), "w") as handle:
            handle.write(VLLM)
        options = self.parse("--engines-dir", directory, "--engine", "vllm")
        self.assertEqual(options.facades, (("vllm", 8000),))
        self.assertEqual(sorted(options.engines), ["llamacpp", "lmstudio", "ollama", "vllm"])


class RefusalTests(OptionsCase):
    """Bad values stop start-up with one line naming what to fix."""

    def test_unknown_engine(self) -> None:
        self.assertEqual(
            self.refused("--engine", "vllm"),
            "nvpair-proxy: --engine: unknown engine 'vllm'; want one of llamacpp, lmstudio, ollama",
        )

    def test_port_out_of_range(self) -> None:
        self.assertEqual(
            self.refused("--engine", "ollama:70000"),
            "nvpair-proxy: --engine ollama:70000: port must be between 1 and 65535",
        )

    def test_port_that_is_not_a_number(self) -> None:
        for spec in ("ollama:-1", "ollama:", "ollama:\u0661", "ollama:" + "9" * 5000):
            self.assertEqual(
                self.refused("--engine", spec),
                f"nvpair-proxy: --engine {spec}: port must be between 1 and 65535",
            )

    def test_engine_given_twice(self) -> None:
        self.assertEqual(
            self.refused("--engine", "ollama", "--engine", "ollama:11500"),
            "nvpair-proxy: --engine: ollama is given twice",
        )

    def test_bad_duration_flag(self) -> None:
        self.assertEqual(
            self.refused("--response-header-timeout", "soon"),
            "nvpair-proxy: --response-header-timeout: not a duration: 'soon' "
            "(use seconds or e.g. 90s, 30m, 1h30m)",
        )

    def test_bad_duration_from_environment_names_the_variable(self) -> None:
        self.environ["NVPAIR_PROXY_RESPONSE_HEADER_TIMEOUT"] = "-1"
        self.assertEqual(
            self.refused(),
            "nvpair-proxy: NVPAIR_PROXY_RESPONSE_HEADER_TIMEOUT: not a duration: "
            "'-1' (use seconds or e.g. 90s, 30m, 1h30m)",
        )

    def test_bad_log_level(self) -> None:
        self.assertEqual(
            self.refused("--log-level", "loud"),
            "nvpair-proxy: --log-level must be one of debug, info, warn, error (got 'loud')",
        )

    def test_bad_log_level_from_environment(self) -> None:
        self.environ["NVPAIR_LOG_LEVEL"] = "trace"
        self.assertTrue(
            self.refused().endswith("must be one of debug, info, warn, error (got 'trace')")
        )

    def test_nodes_file_missing(self) -> None:
        path = os.path.join(self.mktemp(), "nodes.toml")
        self.assertEqual(
            self.refused("--engine", "ollama", "--nodes", path),
            f"nvpair-proxy: --nodes: no such file: {path}",
        )

    def test_nodes_without_engine(self) -> None:
        self.assertEqual(
            self.refused("--nodes", self.existing_file()),
            "nvpair-proxy: --nodes needs at least one --engine (standalone mode)",
        )

    def test_ipc_with_engine(self) -> None:
        self.assertEqual(
            self.refused("--ipc", "/run/broker.sock", "--engine", "ollama"),
            "nvpair-proxy: --ipc is for broker mode; it cannot be combined with --engine",
        )

    def test_cluster_dir_missing(self) -> None:
        path = self.mktemp()
        self.assertEqual(
            self.refused("--cluster-dir", path),
            f"nvpair-proxy: --cluster-dir: no such directory: {path}",
        )

    def test_engines_dir_missing(self) -> None:
        path = self.mktemp()
        message = self.refused("--engines-dir", path)
        self.assertTrue(message.startswith("nvpair-proxy: --engines-dir: "), message)
        self.assertIn(path, message)

    def test_bad_engine_file_in_engines_dir_names_the_file(self) -> None:
        directory = self.mktemp()
        os.mkdir(directory)
        path = os.path.join(directory, "vllm.toml")
        with open(path, "w") as handle:
            handle.write(VLLM.replace('class = "inference"', 'class = "chat"'))
        self.assertEqual(
            self.refused("--engines-dir", directory),
            f"nvpair-proxy: --engines-dir: {path}: routes[0]: field 'class' must be "
            "one of inference, models (got 'chat')",
        )


class VersionTests(OptionsCase):
    def test_version_prints_and_exits_zero(self) -> None:
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        with self.assertRaises(SystemExit) as caught:
            self.parse("--version")
        self.assertEqual(caught.exception.code, 0)
        self.assertEqual(out.getvalue(), "nvpair-proxy 0.1.0\n")


class PluginTests(SynchronousTestCase):
    """``twistd nvpair-proxy`` finds the dropin, and it parses with our Options."""

    def test_dropin_is_discoverable(self) -> None:
        makers = [maker for maker in getPlugins(IServiceMaker) if maker.tapname == "nvpair-proxy"]
        self.assertEqual(len(makers), 1)
        (maker,) = makers
        self.assertIs(maker.options, options_module.Options)
        self.patch(os, "environ", {"HOME": HOME})
        parsed = maker.options()
        parsed.parseOptions(["--engine", "ollama"])
        self.assertEqual(parsed.config.facades, (("ollama", 11435),))

    def test_dropin_makes_services_with_the_tap_module(self) -> None:
        from nvpair_proxy.process import tap

        (maker,) = [m for m in getPlugins(IServiceMaker) if m.tapname == "nvpair-proxy"]
        self.assertIs(maker.options, tap.Options)
        self.assertEqual(maker.module, "nvpair_proxy.process.tap")


class LanKeyOptionsTests(OptionsCase):
    """Issue 11: the keys file, the env keys and the allowlist."""

    def test_defaults_are_the_state_dir_file_no_env_keys_and_no_allowlist(self):
        options = self.parse("--engine", "ollama")
        self.assertEqual(options.api_keys_file, os.path.join(DEFAULT_STATE, "proxy-api-keys"))
        self.assertIsNone(options.api_keys)
        self.assertEqual(options.allowed_cidrs, ())

    def test_env_then_flag(self):
        self.environ.update(
            NVPAIR_PROXY_API_KEYS_FILE="/etc/env-keys",
            NVPAIR_PROXY_API_KEYS="k" * 32,
            NVPAIR_PROXY_ALLOWED_CIDRS="10.0.0.0/8, 192.168.1.7",
        )
        options = self.parse()
        self.assertEqual(options.api_keys_file, "/etc/env-keys")
        self.assertEqual(options.api_keys, "k" * 32)
        self.assertEqual([str(n) for n in options.allowed_cidrs], ["10.0.0.0/8", "192.168.1.7/32"])
        options = self.parse("--api-keys-file", "/etc/flag-keys", "--allowed-cidrs", "fd00::/8")
        self.assertEqual(options.api_keys_file, "/etc/flag-keys")
        self.assertEqual([str(n) for n in options.allowed_cidrs], ["fd00::/8"])

    def test_a_bad_cidr_stops_start_up_naming_the_flag(self):
        self.assertIn(
            "--allowed-cidrs: not an address or CIDR: '10.0.0.0/33'",
            self.refused("--allowed-cidrs", "10.0.0.0/33"),
        )
        self.environ["NVPAIR_PROXY_ALLOWED_CIDRS"] = "lan"
        self.assertIn("NVPAIR_PROXY_ALLOWED_CIDRS", self.refused())


class SchedulerFlagTests(SynchronousTestCase):
    """Late binding is on by default in standalone mode; --queue-depth bounds it."""

    def config(self, *args: str):
        options = Options()
        options.parseOptions(["--engine", "ollama", *args])
        return options.config

    def test_defaults_and_flags(self) -> None:
        self.assertEqual((self.config().late_binding, self.config().queue_depth), (True, 1000))
        self.assertFalse(self.config("--no-late-binding").late_binding)
        self.assertEqual(self.config("--queue-depth", "3").queue_depth, 3)

    def test_a_bad_queue_depth_stops_start_up_with_one_line(self) -> None:
        for bad in ("0", "-1", "x", "2.5"):
            with self.assertRaises(SystemExit) as raised:
                self.config("--queue-depth", bad)
            self.assertEqual(
                str(raised.exception),
                f"nvpair-proxy: --queue-depth must be a whole number of at least 1 (got {bad!r})",
            )


class SpillFlagTests(SynchronousTestCase):
    """--affinity-spill: a spilled conversation moves its binding (default) or keeps it."""

    def config(self, *args: str):
        options = Options()
        options.parseOptions(["--engine", "ollama", *args])
        return options.config

    def test_move_or_keep_and_one_line_otherwise(self) -> None:
        self.assertEqual(self.config().affinity_spill, "move")
        self.assertEqual(self.config("--affinity-spill", "keep").affinity_spill, "keep")
        with self.assertRaises(SystemExit) as raised:
            self.config("--affinity-spill", "stay")
        self.assertEqual(
            str(raised.exception),
            "nvpair-proxy: --affinity-spill must be move or keep (got 'stay')",
        )


class AffinityFlagTests(SynchronousTestCase):
    """Affinity: on in standalone mode unless --no-affinity; opt-in under the broker."""

    def config(self, *args: str):
        options = Options()
        options.parseOptions(list(args))
        return options.config

    def test_defaults_and_flags_per_mode(self) -> None:
        self.assertTrue(self.config("--engine", "ollama").affinity)
        self.assertFalse(self.config("--engine", "ollama", "--no-affinity").affinity)
        self.assertFalse(self.config().affinity)
        self.assertTrue(self.config("--affinity").affinity)

    def test_a_flag_of_the_other_mode_stops_start_up_with_one_line(self) -> None:
        for args, line in (
            (
                ("--engine", "ollama", "--affinity"),
                "nvpair-proxy: --affinity is for broker "
                "mode (standalone mode has it on; --no-affinity turns it off)",
            ),
            (
                ("--no-affinity",),
                "nvpair-proxy: --no-affinity is for standalone mode "
                "(broker mode has it off; --affinity turns it on)",
            ),
        ):
            with self.assertRaises(SystemExit) as raised:
                self.config(*args)
            self.assertEqual(str(raised.exception), line)


class DrainFlagTests(SynchronousTestCase):
    """--drain-timeout: 60 s in standalone mode, 0 under the broker unless given."""

    def config(self, *args: str):
        options = Options()
        options.parseOptions(list(args))
        return options.config

    def test_defaults_by_mode_and_one_line_for_a_bad_value(self) -> None:
        self.assertEqual(self.config("--engine", "ollama").drain_timeout, 60.0)
        self.assertEqual(self.config().drain_timeout, 0.0)
        self.assertEqual(self.config("--drain-timeout", "2m").drain_timeout, 120.0)
        self.assertEqual(self.config("--engine", "ollama", "--drain-timeout", "0").drain_timeout, 0)
        for bad, why in (("soon", "not a duration: 'soon'"), ("2h", "at most 1h (got '2h')")):
            with self.assertRaises(SystemExit) as raised:
                self.config("--drain-timeout", bad)
            self.assertIn(f"nvpair-proxy: --drain-timeout: {why}", str(raised.exception))
