"""Warn once per change: a problem is logged when it appears or changes, not on every re-check.

Watches re-check on a timer or per request: the cluster directory every 2 s, an engine's TLS
at every connection, the fleet at every reload of the nodes file. A problem that stays would
fill the log with one line per check, while a problem that changes, or comes back after it
went away, must still be seen. :class:`WarnOnce` remembers the last problem per subject and
says when a new one is worth a line; the caller logs it, in its own words.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

import attrs

S = TypeVar("S", bound=Hashable)


@attrs.define
class WarnOnce(Generic[S]):
    """The problem last warned about, per subject (a file, a node)."""

    _problems: dict[S, str] = attrs.Factory(dict)

    def new(self, subject: S, problem: str) -> bool:
        """Whether ``problem`` is news for ``subject`` (log it now); remembered either way."""
        if self._problems.get(subject) == problem:
            return False
        self._problems[subject] = problem
        return True

    def clear(self, subject: S) -> bool:
        """``subject`` is fine again: whether it had a problem (to say it recovered)."""
        return self._problems.pop(subject, None) is not None

    def retain(self, keep: Callable[[S], bool]) -> None:
        """Forget the subjects ``keep`` refuses (gone, not fine): back, they warn anew."""
        for subject in [s for s in self._problems if not keep(s)]:
            del self._problems[subject]
