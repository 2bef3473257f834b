"""Logging for the whole process: one component name, one level that can change at runtime.

twistd owns the observer, so the level is applied where records are made: every module logs
through ``logger()``, whose records below the current level are dropped before formatting
(spec 9 keeps routing detail at debug, so dropping it cheaply matters on the request path).
"""

from __future__ import annotations

from twisted.logger import Logger, LogLevel

COMPONENT = "nvpair-proxy"
LEVELS = {"debug": LogLevel.debug, "info": LogLevel.info, "warn": LogLevel.warn,
          "error": LogLevel.error}

_level = {"current": LogLevel.info}


class LeveledLogger(Logger):
    def emit(self, level, format=None, **kwargs):
        if level < _level["current"]:
            return
        super().emit(level, format, **kwargs)


def logger() -> Logger:
    return LeveledLogger(namespace=COMPONENT)


def set_level(name: str) -> None:
    """Raises KeyError for an unknown level name."""
    _level["current"] = LEVELS[name]


def enabled(level: LogLevel) -> bool:
    """Whether a record at ``level`` would be kept: lets callers skip building it at all."""
    return level >= _level["current"]


def level_name() -> str:
    return next(name for name, level in LEVELS.items() if level == _level["current"])
