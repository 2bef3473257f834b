"""The seams of the system: what the request path reports through, and to whom.

The core never imports the broker or the plugin; it holds an IEmitter, which is the broker
link in broker mode, the log in standalone mode, and a recording emitter in tests. Each
interface here is declared because more than one class stands on its side of the seam (a
real one and a fake or null one), and the contract test checks every one with
``verifyObject``. This module is a foundation: it names the values that cross a seam in
words, never by importing the modules that define them.
"""

from __future__ import annotations

from zope.interface import Attribute, Interface


class IEmitter(Interface):
    listening = Attribute(
        "Whether anything consumes notifications now. When False a producer may skip building "
        "them (docs/references.md#bare-proxy-cpu: no work for an event nobody reads); counters "
        "such as seq still count."
    )

    def notify(method: str, params: dict, engine: str | None = None) -> None:
        """Send one notification; ``engine`` addresses a facade-scoped one
        (docs/references.md#facade-addressing)."""

    def notify_json(method: str, params: str, engine: str | None = None) -> None:
        """The same, with ``params`` already compact JSON text (ASCII): the events sent for
        every request are encoded once, by their producer, straight into the link's line
        (docs/references.md#bare-proxy-cpu). A consumer that wants the object parses it."""


class ITruthSink(Interface):
    """Where the engine-truth poller (standalone mode) delivers what each engine reports, and
    what it reads to pace itself."""

    def routable() -> list:
        """The nodes to ask, in id order."""

    def set_truth(node_id: str, truth) -> None:
        """A node's latest EngineTruth; None when the engine reports nothing (unknown)."""

    def last_traffic() -> float | None:
        """Clock seconds of the facade's last admitted request, None before any."""


class IRouter(Interface):
    """One facade's routing state: the only way routing changes (docs/references.md#router-seam).

    What the request path and the prober are handed. The node set's owners (the broker and
    standalone mode) hold the concrete Router and also replace, add and admit nodes.
    """

    pin = Attribute('The node/select pin, or "".')

    def routable() -> list:
        """The nodes a request may go to now, in id order."""

    def set_models(node_id: str, models) -> None:
        """Replace a node's model inventory with a probe's answer
        (docs/references.md#probed-inventory)."""

    def candidates(model: str | None) -> list:
        """Owners of a normalized model (None: every routable node) in round order."""

    def is_routable(node_id: str) -> bool:
        """Whether the node is in the routable set now."""

    def busy_for(model: str) -> float | None:
        """Seconds of hold left when every owner of the model is busy-held, else None."""

    affinity = Attribute("The affinity table (routing/affinity.py), None when affinity is off.")

    def place(nodes: list, key: bytes | None = None) -> tuple:
        """Reserve the chosen candidate and move it first: (nodes, reservation or None);
        ``key``, a conversation's, may put its node first."""

    def affine(key: bytes | None) -> str | None:
        """The node that last committed the conversation ``key``, None when none."""

    def committed_key(key: bytes, node_id: str) -> None:
        """A request of the conversation ``key`` committed on the node."""

    def wants_rate(node_id: str) -> bool:
        """Whether a request that ended on the node should have its prompt rate read."""

    def served(node_id: str, seconds: float) -> None:
        """One request's time on the node, from its dispatch to its end."""

    def rate_read(node_id: str, reading) -> None:
        """The prompt figures a response's tail said (a routing.rates.PromptReading)."""

    def hold_offers() -> None:
        """A request's end begins: slots it frees wait for ``offer_held``."""

    def offer_held() -> None:
        """The request's end is done: free slots go to waiting requests now."""

    def affinity_wait(nodes: list, model: str | None, key: bytes | None, size: int):
        """(node, seconds) to wait for a full conversation's node, or None to go elsewhere."""

    def fail_over(remaining: list, model: str | None = None) -> list:
        """The remaining candidates for ``model`` with the next one to try first."""

    def admitted() -> None:
        """A request was admitted now (the engine-truth poller reads faster with traffic)."""

    def all_full(nodes: list, model: str | None) -> bool:
        """Whether a request for the model should wait for a slot instead of going to nodes
        (late binding: every owner full by its known slots)."""

    def refuses(nodes: list, model: str | None) -> bool:
        """Whether a new request would wait and the queue has no room for it."""

    def wait(
        model: str,
        deadline: float,
        wake,
        expire,
        ahead: bool = False,
        prefer: str | None = None,
        patience: float | None = None,
    ):
        """Queue a request until a slot frees (``wake``) or its deadline (``expire``)."""

    def unwait(waiter) -> None:
        """Take a waiting request out of the queue: it ended."""

    def answered(node_id: str, status: int) -> None:
        """An attempt got a status from the node."""

    def first_byte(node_id: str) -> None:
        """The node produced its first body byte for an attempt."""

    def stalled(node_id: str) -> None:
        """The node used up a whole first-content budget without a byte."""

    def set_pin(node_id: str) -> None:
        """Pin a known node ("" clears); KeyError for an unknown one."""

    def watch(attempt: "IWatchedAttempt") -> None:
        """Cancel the attempt if its target leaves the routable set
        (docs/references.md#target-left-discovery)."""

    def unwatch(attempt: "IWatchedAttempt") -> None:
        """Stop watching the attempt."""


class IWatchedAttempt(Interface):
    """What the target watch needs of an attempt."""

    node = Attribute("The Node the attempt targets.")

    def cancel(reason: str) -> bool:
        """Abandon the attempt unless it already committed or ended."""


class IBodySink(Interface):
    """Where a committed upstream body goes: what ``relay.BodyRelay`` calls once attached.

    The relay holds the body until a sink attaches (so the first byte can be peeked), then
    calls ``write`` for every chunk in order and ``upstream_done`` exactly once.
    """

    def write(data: bytes) -> None:
        """One non-empty chunk of the upstream body, in order."""

    def upstream_done(reason) -> None:
        """The upstream body ended; ``reason`` is the Failure its protocol lost the
        connection with (ResponseDone or PotentialDataLoss for a clean end)."""


class IDispatchObserver(Interface):
    """What the attempt loop (``dispatch.Dispatch``) tells its request: the workload events of
    placement and each attempt's outcome (docs/references.md#workload-lifecycle,
    #events-between-rounds)."""

    def dispatched(node) -> None:
        """An attempt is about to go to ``node`` (a Node)."""

    def cleared() -> None:
        """No candidate is left in this round: the request holds no node while the loop
        backs off."""

    def attempt_ended(outcome) -> None:
        """One attempt ended: ``attempt.Committed`` or ``attempt.Failed``."""


class IRequestRecorder(Interface):
    """Who is told of ended requests and dispatches besides the link: the admin listener's
    recorder, when there is one. Without one the request path does no more."""

    def request_ended(ended) -> None:
        """A finished request, as an ``events.RequestEnded`` (operational metadata only)."""

    def dispatch_ended(engine: str, outcome) -> None:
        """One dispatch of the facade ``engine`` ended: ``Committed`` or ``Failed``."""

    def queue_left(engine: str, waited: float) -> None:
        """A request left the facade ``engine``'s queue after ``waited`` seconds (late
        binding): dispatched, at its deadline, or gone."""


class IStatusSource(Interface):
    """What the admin listener reads of the process: the service tree in a real process, a
    World's facade in the tests. It answers with frozen values, so ``/status`` and ``/metrics``
    never walk the tree or touch a request in flight."""

    def snapshot():
        """The process now, as a ``views.ProcessSnapshot``: whether it serves, each facade's
        routing and requests in flight, the reservations, the last streamed bytes per node,
        the broker link and the cluster pins."""
