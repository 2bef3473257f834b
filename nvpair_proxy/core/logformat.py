"""The process's log observer: where every record goes, in which format, above which level.

twistd picks its observer after ``makeService`` has run, from ``--logger``, else from the
application's ``ILogObserver`` component, else from ``--logfile``/``--syslog``. We offer the
component (``offer``, called as our root service joins twistd's application): the same
destination twistd would have chosen, written as text or as one JSON object per line
(``--log-format``), behind a ``FilteringLogObserver`` whose ``LogLevelFilterPredicate``
(logs.PREDICATE) ``--log-level`` and ``log/set-level`` move. So Twisted's own loggers and
legacy ``log.msg`` obey the level too. An explicit ``twistd --logger`` still wins.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Callable, Mapping

from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogObserver,
    LegacyLogObserverWrapper,
    LogEvent,
    formatEvent,
    textFileLogObserver,
)
from twisted.python.components import Componentized

from .logs import COMPONENT, PREDICATE


def json_line(event: LogEvent) -> str:
    """One record as one JSON line: time, level, logger, engine when facade-scoped, message,
    and the traceback of a logged failure. Only the message's own fields are formatted in;
    the rest of the event is not dumped (docs/references.md#no-content-logging: nothing but what the
    line says)."""
    at = event.get("log_time")
    level = event.get("log_level")
    record = {
        "time": (
            datetime.fromtimestamp(at, timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z")
            if at is not None
            else None
        ),
        "level": level.name if level is not None else "info",
        "logger": event.get("log_namespace") or "-",
        "component": COMPONENT,
    }
    engine = event.get("engine")
    if isinstance(engine, str):
        record["engine"] = engine
    record["message"] = formatEvent(event)
    failure = event.get("log_failure")
    if failure is not None:
        try:
            record["traceback"] = failure.getTraceback()
        except Exception:
            record["traceback"] = repr(failure)
    return json.dumps(record, ensure_ascii=False, default=str) + "\n"


def destination(twistd: Mapping, log_format: str) -> ILogObserver:
    """What twistd's own Unix logger would build (syslog, stdout or the log file), in our
    format."""
    if twistd.get("syslog"):
        from twisted.python.syslog import SyslogObserver

        # A legacy observer is any callable taking the event dict; Twisted types it as an
        # interface no bound method declares.
        emit = SyslogObserver(twistd.get("prefix") or "twisted").emit
        return LegacyLogObserverWrapper(emit)  # type: ignore[arg-type]
    path = twistd.get("logfile")
    if path == "-" and not twistd.get("nodaemon"):
        raise SystemExit("Daemons cannot log to stdout, exiting!")
    if path == "-" or (not path and twistd.get("nodaemon")):
        out = sys.stdout
    else:
        # Opened to append (O_APPEND), not as twistd's LogFile (which writes at its own offset
        # and rotates at 1 MB): a hot handoff's successor logs to the same file while its
        # predecessor drains, and each line must land after the other's
        # (docs/operations.md#restarts). Rotate with logrotate.
        out = open(path or "twistd.log", "a", buffering=1, encoding="utf-8")
    if log_format == "json":
        return FileLogObserver(out, json_line)
    return textFileLogObserver(out)


def observer(
    log_format: str, twistd: Mapping | None = None, sink: ILogObserver | None = None
) -> ILogObserver:
    """The filtered observer; ``sink`` overrides the destination (tests)."""
    if sink is None:
        sink = destination(twistd or {}, log_format)
    return FilteringLogObserver(sink, [PREDICATE])


def offer(application, make_observer: Callable[[], ILogObserver], twistd: Mapping) -> None:
    """Give twistd's application our observer, unless ``--logger`` chose another."""
    if twistd.get("logger") or not isinstance(application, Componentized):
        return
    if application.getComponent(ILogObserver) is None:
        application.setComponent(ILogObserver, make_observer())
