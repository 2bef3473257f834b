"""The seams of the system: what the request path reports through, and to whom.

The core never imports the broker or the plugin; it holds an IEmitter, which is the broker
link in broker mode, the log in standalone mode, and a recorder in tests.
"""

from __future__ import annotations

from zope.interface import Attribute, Interface


class IEmitter(Interface):
    listening = Attribute(
        "Whether anything consumes notifications now. When False a producer may skip building "
        "them (issue 10: no work for an event nobody reads); counters such as seq still count.")

    def notify(method: str, params: dict, engine: str | None = None) -> None:
        """Send one notification; ``engine`` addresses a facade-scoped one (spec 4)."""


class IRouter(Interface):
    """One facade's routing state: the only way routing changes (issue 9).

    What the request path and the prober are handed. The node set's owners (the broker and
    standalone mode) hold the concrete Router and also replace, add and admit nodes.
    """

    pin = Attribute("The node/select pin, or \"\".")

    def routable() -> list:
        """The nodes a request may go to now, in id order."""

    def set_models(node_id: str, models) -> None:
        """Replace a node's model inventory with a probe's answer (design 4)."""

    def candidates(model: str | None) -> list:
        """Owners of a normalized model (None: every routable node) in round order."""

    def is_routable(node_id: str) -> bool:
        """Whether the node is in the routable set now."""

    def busy_for(model: str) -> float | None:
        """Seconds of hold left when every owner of the model is busy-held, else None."""

    def place(nodes: list) -> tuple:
        """Reserve the chosen candidate and move it first: (nodes, reservation or None)."""

    def fail_over(remaining: list) -> list:
        """The remaining candidates with the next one to try first."""

    def answered(node_id: str, status: int) -> None:
        """An attempt got a status from the node."""

    def first_byte(node_id: str) -> None:
        """The node produced its first body byte for an attempt."""

    def stalled(node_id: str) -> None:
        """The node used up a whole first-content budget without a byte."""

    def set_pin(node_id: str) -> None:
        """Pin a known node ("" clears); KeyError for an unknown one."""

    def watch(attempt: "IWatchedAttempt") -> None:
        """Cancel the attempt if its target leaves the routable set (spec 5.3)."""

    def unwatch(attempt: "IWatchedAttempt") -> None:
        """Stop watching the attempt."""


class IWatchedAttempt(Interface):
    """What the target watch needs of an attempt."""

    node = Attribute("The Node the attempt targets.")

    def cancel(reason: str) -> bool:
        """Abandon the attempt unless it already committed or ended."""
