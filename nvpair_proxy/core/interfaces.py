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

    def is_routable(node_id: str) -> bool:
        """Whether the node is still one to ask (and to tell what it said)."""

    def wanted() -> frozenset:
        """The node ids whose reports placement needs at the active pace now: the owners of
        the models requests wait for, and the nodes lately running work we did not send."""


class IOwners(Interface):
    """Who may serve a request now, and in which order: one facade's node set as the request
    path reads it (docs/references.md#router-seam). The node set's owners (the broker, standalone
    mode, the prober) hold the concrete Router and change it."""

    pin = Attribute('The node/select pin, or "".')

    def routable() -> list:
        """The nodes a request may go to now, in id order."""

    def candidates(model: str | None) -> list:
        """Owners of a normalized model (None: every routable node) in round order."""

    def is_routable(node_id: str) -> bool:
        """Whether the node is in the routable set now."""

    def busy_for(model: str) -> float | None:
        """Seconds of hold left when every owner of the model is busy-held, else None."""


class IHealth(Interface):
    """What an inference dispatch learns of its node, and the watch on its target
    (docs/decisions.md#busy-hold, #stall-cooldown, docs/references.md#target-left-discovery)."""

    def answered(node_id: str, status: int) -> None:
        """An attempt got a status from the node."""

    def first_byte(node_id: str) -> None:
        """The node produced its first body byte for an attempt."""

    def stalled(node_id: str) -> None:
        """The node used up a whole first-content budget without a byte."""

    def watch(attempt: "IWatchedAttempt") -> None:
        """Cancel the attempt if its target leaves the routable set."""

    def unwatch(attempt: "IWatchedAttempt") -> None:
        """Stop watching the attempt."""


class IPlacement(Interface):
    """A facade's placement policy, chosen once when the facade is wired (routing/tickets.py):
    standalone ranking with its queue, rates and affinity, the broker's reservations, or none
    (the ingress). It gives each request its ticket; nothing on the request path asks which
    policy it is."""

    def refuses(nodes: list, model: str | None) -> bool:
        """Whether a new request would wait and the queue has no room for it (the busy 503)."""

    def ticket(model: str | None, size: int, request, body, reserve: bool):
        """An admitted request's ``ITicket``: ``model`` normalized (None: none named),
        ``size`` its body's bytes, ``request`` (its headers and path) and ``body`` (the parsed
        JSON, or None) what its conversation's key and its client are read from, ``reserve``
        whether it holds a claim on the nodes it goes to (a workload's inference request)."""

    def retry_after(nodes: list, model: str | None) -> int:
        """Seconds a refused request should wait before it comes back (its Retry-After)."""

    def hold_offers() -> None:
        """A request's end begins: slots it frees wait for ``offer_held``."""

    def offer_held() -> None:
        """The request's end is done: free slots go to waiting requests now."""


class ITicket(Interface):
    """One admitted request's routing, made at admission by the facade's placement: its
    conversation's key, its claim on a node, its place in the queue, what its end teaches.
    The dispatch loop asks it where to go; the exchange tells it how the request ended."""

    placed = Attribute(
        "How the request was placed (tickets.Placed): how affinity placed it (a metrics "
        "label, None when off), why it went where it did, and how long it waited."
    )

    def place(candidates: list, ahead: bool):
        """A round begins over ``candidates``: the nodes in the order to try them (the first
        claimed), or a ``tickets.Wait`` (``ahead``: it already spent a dispatch)."""

    def next(queue: list, failed: bool):
        """The node to dispatch to next, popped from the round's ``queue`` (after a failure
        in the round, ``failed``, the remaining owners ordered again), its claim moved there;
        or a ``tickets.Wait``."""

    def wait(plan, deadline: float, sink) -> None:
        """Wait in the facade's queue as ``plan`` (a ``Wait``) says, holding no claim, until
        a slot frees or ``deadline`` passes: ``sink`` (an ``IWaitSink``) is told which, once."""

    def release() -> None:
        """Hold nothing: the claim released, out of the queue (it backs off, waits or ends)."""

    def retry_after() -> int:
        """Seconds a request that waited out its deadline should wait before it comes back."""

    def committed(node_id: str, status: int, head: bytes):
        """The node committed with ``status`` and the answer's first bytes ``head`` (where a
        Responses answer names itself): the claim (a Reservation, or None) is handed over to
        the stream, which releases it at the end."""

    def measured(node_id: str, seconds: float, figures) -> None:
        """A committed request below 400 ended ``seconds`` after its dispatch to the node;
        ``figures()`` reads its response's prompt figures, if the placement wants them."""


class IWatchedAttempt(Interface):
    """What the target watch needs of an attempt."""

    node = Attribute("The Node the attempt targets.")

    def cancel(reason: str) -> bool:
        """Abandon the attempt unless it already committed or ended."""


class IPeek(Interface):
    """What a body relay (``relay.BodyRelay``) tells the attempt waiting for its first byte,
    until a sink attaches (docs/references.md#first-byte-commit)."""

    def first_data() -> None:
        """The first non-empty chunk arrived and is held."""

    def body_ended(reason) -> None:
        """The body ended (a Failure) before any sink attached."""


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


class IAttemptSink(Interface):
    """What one dispatch (``attempt.Attempt``) tells the loop that made it: the one seam between
    them, so the attempt holds no bare callback of its caller (docs/decisions.md#no-cycles)."""

    def is_final() -> bool:
        """Whether the attempt in flight is the request's last: its answer is then the
        client's whatever its status (docs/references.md#final-attempt-answers). Asked when the
        answer arrives."""

    def attempt_ended(outcome) -> None:
        """The attempt ended, once: ``attempt.Committed`` or ``attempt.Failed``."""


class IWaitSink(Interface):
    """What a request's ticket tells the loop that put it in the queue: the one seam between
    them, so the queue holds no bare callback of the loop (docs/decisions.md#no-cycles)."""

    def slot_freed() -> None:
        """A slot freed for the waiting request: the loop runs its next round."""

    def queue_deadline() -> None:
        """The request waited in the queue until its deadline: the loop answers 503."""


class IConductor(Interface):
    """What a request's parts below it tell the one object that conducts it
    (``exchange.Exchange``): the committed stream's events and the client request's end. The
    loop itself reports nothing upward: its ``run`` answers with a Deferred."""

    def streamed(event) -> None:
        """A ``stream.StreamEvent``: the body ended, went idle, the client stalled, or a bug."""

    def response_finished() -> None:
        """The client's response was finished (the backstop: it must have ended already)."""

    def client_gone() -> None:
        """The client's connection closed before its response was finished."""


class IRequestRecorder(Interface):
    """Who is told of ended requests and dispatches besides the link: the admin listener's
    recorder, when there is one. Without one the request path does no more."""

    def request_ended(ended) -> None:
        """A finished request, as an ``events.RequestEnded`` (operational metadata only)."""

    def dispatch_ended(engine: str, outcome) -> None:
        """One dispatch of the facade ``engine`` ended: ``Committed`` or ``Failed``."""

    def queue_left(engine: str, waited: float, priority: str) -> None:
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
