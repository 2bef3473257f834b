"""Logging an operator can steer (issue 12): one level for every logger, JSON lines, access log."""

from __future__ import annotations

import io
import json
import os
import urllib.request

from twisted.application.service import Application
from twisted.internet.testing import StringTransport
from twisted.logger import FileLogObserver, ILogObserver, Logger, LogPublisher
from twisted.python import log as legacy
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from nvpair_proxy.core import logs
from nvpair_proxy.core.logformat import json_line, observer, offer
from nvpair_proxy.http.server import BoundedSite
from nvpair_proxy.test.support import LogCapture, start_standalone
from nvpair_proxy.test.world import request_bytes
from nvpair_proxy.testing import loopback
from nvpair_proxy.testing.processes import free_port, stop


class Captured:
    """Our observer over an in-memory sink, and Twisted-style loggers publishing to it."""

    def __init__(self, log_format: str) -> None:
        self.out = io.StringIO()
        sink = (
            FileLogObserver(self.out, json_line)
            if log_format == "json"
            else FileLogObserver(
                self.out,
                lambda e: "{} {}\n".format(
                    e.get("log_namespace", "-"), getattr(e.get("log_level"), "name", "none")
                ),
            )
        )
        self.publisher = LogPublisher(observer(log_format, sink=sink))
        self.legacy = legacy.LogPublisher(self.publisher, self.publisher)

    def logger(self, namespace: str) -> Logger:
        return Logger(namespace=namespace, observer=self.publisher)

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()


class LevelTests(SynchronousTestCase):
    def setUp(self):
        self.addCleanup(logs.set_level, logs.level_name())

    def test_the_level_governs_twisteds_own_loggers_and_legacy_log_msg(self):
        captured = Captured("text")
        logs.set_level("warn")
        captured.logger("twisted.web.server").info("Starting factory")
        captured.logger("twisted.internet.base").debug("a delayed call")
        captured.legacy.msg("Site starting on 11435")
        captured.logger("twisted.internet.tcp").warn("accept failed")
        captured.legacy.msg("legacy error", isError=1)
        self.assertEqual(captured.lines(), ["twisted.internet.tcp warn", "log_legacy critical"])

    def test_log_set_level_moves_it_at_runtime(self):
        captured = Captured("text")
        logs.set_level("error")
        captured.logger("twisted.web.http").info("dropped")
        logs.set_level("debug")
        captured.logger("twisted.web.http").debug("kept")
        captured.logger("nvpair-proxy").debug("kept too")
        self.assertEqual(captured.lines(), ["twisted.web.http debug", "nvpair-proxy debug"])

    def test_our_records_are_dropped_at_the_source_below_the_level(self):
        emitted: list[dict] = []
        ours = logs.LeveledLogger(namespace="nvpair-proxy", observer=emitted.append)
        for name, level in logs.LEVELS.items():
            logs.set_level(name)
            self.assertEqual(
                {each: logs.enabled(each) for each in logs.LEVELS.values()},
                {each: each >= level for each in logs.LEVELS.values()},
                name,
            )
            del emitted[:]
            ours.debug("d")
            ours.info("i")
            ours.warn("w")
            ours.error("e")
            self.assertEqual(
                [event["log_format"] for event in emitted],
                [
                    each[0]
                    for each in ("debug", "info", "warn", "error")
                    if logs.LEVELS[each] >= level
                ],
                name,
            )

    def test_an_event_without_a_namespace_or_level_is_judged_as_info(self):
        captured = Captured("text")
        logs.set_level("info")
        captured.publisher({"log_format": "bare", "log_time": 0})
        logs.set_level("warn")
        captured.publisher({"log_format": "bare again", "log_time": 0})
        self.assertEqual(captured.lines(), ["- none"])

    def test_the_broker_method_sets_the_same_level(self):
        from nvpair_proxy.broker.broker import Broker

        captured = Captured("text")
        Broker.set_level(None, {"level": "error"})
        captured.logger("twisted.web.server").warn("dropped")
        self.assertEqual((logs.level_name(), captured.lines()), ("error", []))


class JsonTests(SynchronousTestCase):
    def setUp(self):
        self.addCleanup(logs.set_level, logs.level_name())
        logs.set_level("info")

    def test_one_json_object_per_line(self):
        captured = Captured("json")
        captured.logger("nvpair-proxy").info(
            "{engine} facade listening on port {port}", engine="ollama", port=11435
        )
        captured.legacy.msg("Site starting on 8080")
        try:
            1 / 0
        except ZeroDivisionError:
            captured.logger("nvpair-proxy").failure(
                "unexpected error handling {method} {path}", method="POST", path="/api/chat"
            )
        lines = captured.lines()
        self.assertEqual(len(lines), 3)
        records = [json.loads(line) for line in lines]
        first = records[0]
        self.assertEqual(set(first), {"time", "level", "logger", "component", "engine", "message"})
        self.assertEqual(
            (first["level"], first["logger"], first["engine"], first["message"]),
            ("info", "nvpair-proxy", "ollama", "ollama facade listening on port 11435"),
        )
        self.assertRegex(first["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
        self.assertEqual(
            (records[1]["logger"], records[1]["message"]), ("log_legacy", "Site starting on 8080")
        )
        self.assertEqual(
            (records[2]["level"], records[2]["message"]),
            ("critical", "unexpected error handling POST /api/chat"),
        )
        self.assertIn("ZeroDivisionError", records[2]["traceback"])

    def test_fields_the_message_does_not_name_are_not_written(self):
        captured = Captured("json")
        captured.logger("nvpair-proxy").info("request ended", body="PROMPT-MARKER")
        self.assertNotIn("PROMPT-MARKER", captured.out.getvalue())


class OfferTests(SynchronousTestCase):
    def test_twistd_is_offered_our_observer_unless_logger_names_one(self):
        application = Application("nvpair-proxy")
        made = []
        offer(application, lambda: made.append(1) or (lambda event: None), {"logger": "x.y"})
        self.assertEqual((made, application.getComponent(ILogObserver)), ([], None))
        offer(application, lambda: made.append(1) or (lambda event: None), {})
        self.assertEqual(made, [1])
        self.assertIsNotNone(application.getComponent(ILogObserver))


class AccessLogTests(SynchronousTestCase):
    def setUp(self):
        self.events = LogCapture(self).events
        self.addCleanup(logs.set_access_log, False)
        self.addCleanup(logs.set_level, logs.level_name())
        logs.set_level("info")

    def request(self, target: str) -> None:
        root = Resource()
        root.putChild(b"ok", Resource())
        site = BoundedSite(root, reactor=None, timeout=None)
        protocol = site.buildProtocol(loopback())
        protocol.makeConnection(StringTransport(peerAddress=loopback()))
        protocol.dataReceived(request_bytes("POST", target, b'{"prompt":"PROMPT-MARKER"}'))

    def access(self) -> list[dict]:
        return [e for e in self.events if e.get("log_namespace") == "nvpair-proxy.access"]

    def test_off_by_default(self):
        self.request("/ok")
        self.assertEqual(self.access(), [])

    def test_on_it_names_the_request_without_query_or_body(self):
        logs.set_access_log(True)
        self.request("/ok?key=SECRET")
        (event,) = self.access()
        from twisted.logger import formatEvent

        self.assertEqual(formatEvent(event), '127.0.0.1 "POST /ok" 405 ' + str(event["size"]))
        self.assertNotIn("SECRET", repr(event))
        self.assertNotIn("PROMPT-MARKER", repr(event))


class TwistdTests(SynchronousTestCase):
    """The observer twistd really starts, end to end."""

    def run_proxy(self, *args: str) -> list[str]:
        logfile = os.path.abspath(self.mktemp())
        admin = free_port()
        proc = start_standalone(
            self,
            ["--engine", f"ollama:{free_port()}", "--admin", f"127.0.0.1:{admin}"] + list(args),
            logfile,
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{admin}/status?key=SECRET", timeout=10) as response:
            self.assertEqual(json.load(response)["mode"], "standalone")
        stop(proc)
        with open(logfile, encoding="utf-8") as handle:
            return handle.read().splitlines()

    def test_json_lines_and_the_access_log(self):
        lines = self.run_proxy("--log-format", "json", "--log-level", "info", "--access-log")
        records = [json.loads(line) for line in lines]
        messages = [r["message"] for r in records]
        self.assertTrue(any(m.startswith("admin listener on http://127.0.0.1:") for m in messages))
        self.assertTrue(any(r["logger"].startswith("twisted.") for r in records))
        access = [r for r in records if r["logger"] == "nvpair-proxy.access"]
        self.assertEqual(
            [r["message"].rsplit(" ", 1)[0] for r in access], ['127.0.0.1 "GET /status" 200']
        )
        self.assertNotIn("SECRET", "\n".join(lines))

    def test_warn_silences_twisteds_own_info_lines(self):
        lines = self.run_proxy("--log-level", "warn")
        self.assertEqual(
            [
                line
                for line in lines
                if "starting up" in line or "starting on" in line or "HTTP/1.1" in line
            ],
            [],
        )
