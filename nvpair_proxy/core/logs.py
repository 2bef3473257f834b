"""Logging for the whole process: one component name, one level that can change at runtime.

The level (``--log-level``, ``log/set-level``) is applied twice: where our records are made
(every module logs through ``logger()``, whose records below the level are dropped before
formatting: routing detail is kept at debug (docs/references.md#routing-detail-debug), so
dropping it cheaply matters on the request path), and by the process's observer (logformat.py),
whose ``FilteringLogObserver`` asks ``PREDICATE``, so Twisted's own loggers and legacy ``log.msg``
obey it too.
"""

from __future__ import annotations

from typing import Callable

from twisted.logger import Logger, LogLevel, LogLevelFilterPredicate

COMPONENT = "nvpair-proxy"
LEVELS = {
    "debug": LogLevel.debug,
    "info": LogLevel.info,
    "warn": LogLevel.warn,
    "error": LogLevel.error,
}
LOG_FORMATS = ("text", "json")

_level = {"current": LogLevel.info}
_access = {"on": False}
# Whether a record at each level is kept, for the current level: the request path asks several
# times per request, and ordering LogLevel constants runs Python code each time.
_KEPT = {level: level >= LogLevel.info for level in LogLevel.iterconstants()}


class LevelPredicate(LogLevelFilterPredicate):
    """The process level for every namespace; an event without a level reads as info and
    one without a namespace is judged like any other (Twisted's predicate drops both)."""

    def __call__(self, event):
        if event.get("log_level") is None or not event.get("log_namespace"):
            event = dict(
                event,
                log_level=event.get("log_level") or LogLevel.info,
                log_namespace=event.get("log_namespace") or "-",
            )
        return super().__call__(event)


PREDICATE = LevelPredicate(LogLevel.info)


class LeveledLogger(Logger):
    def emit(self, level, format=None, **kwargs):
        if not _KEPT[level]:
            return
        super().emit(level, format, **kwargs)

    def debug(self, format=None, **kwargs):
        # The request path logs at debug (docs/references.md#routing-detail-debug); dropped here,
        # before Logger.debug's frame.
        if not _KEPT[LogLevel.debug]:
            return
        self.emit(LogLevel.debug, format, **kwargs)


def logger(namespace: str = COMPONENT) -> Logger:
    return LeveledLogger(namespace=namespace)


def set_level(name: str) -> None:
    """Raises KeyError for an unknown level name."""
    level = LEVELS[name]
    _level["current"] = level
    _KEPT.update({each: each >= level for each in _KEPT})
    PREDICATE.setLogLevelForNamespace("", level)


def at_level(name: str) -> Callable[[], None]:
    """Set the process level to ``name``; returns what puts the previous one back (a test's
    ``addCleanup``), so no caller reaches into the level's storage."""
    previous = level_name()
    set_level(name)
    return lambda: set_level(previous)


def enabled(level: LogLevel) -> bool:
    """Whether a record at ``level`` would be kept: lets callers skip building it at all."""
    return _KEPT[level]


def level_name() -> str:
    return next(name for name, level in LEVELS.items() if level == _level["current"])


# twisted.web's access log: one line per request, off unless --access-log
# (docs/references.md#access-log).

_access_log = logger(COMPONENT + ".access")


def set_access_log(on: bool) -> None:
    _access["on"] = bool(on)


def log_access(request) -> None:
    """The request line without its query (which may carry a key), status and size: never
    a header value or a body (docs/references.md#no-content-logging)."""
    if not _access["on"]:
        return
    client = request.getClientAddress()
    _access_log.info(
        '{client} "{method} {path}" {status} {size}',
        client=getattr(client, "host", "-"),
        method=request.method.decode("latin-1"),
        path=request.path.decode("latin-1"),
        status=request.code,
        size=request.sentLength,
    )
