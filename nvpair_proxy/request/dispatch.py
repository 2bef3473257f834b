"""The attempt loop: resolve, order, reserve, dispatch, fail over, back off
(docs/references.md#request-path, #retry-bounds, #final-attempt-answers).

A caller is promised a persistent, bounded attempt to *start* its request: failures before
the first body byte are absorbed while budget remains, and the budget is two bounds that
each end a different kind of job (five dispatches for fast failures, the ten-minute
"no new attempts after" line for slow failures and for waiting on an owner). Both are checked
before each dispatch and neither ever cuts an attempt in flight.
"""

from __future__ import annotations

import enum
from typing import Callable

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure
from twisted.web.iweb import IAgent
from zope.interface import implementer

from ..core import constants
from ..core.interfaces import IAttemptSink, IHealth, IOwners, ITicket, IWaitSink
from ..core.logs import logger
from ..core.timers import cancel_pending
from ..http.answers import Reason
from ..http.loopguard import LoopGuard
from ..nodes.discovery import Node
from ..routing.router import BUSY_STATUSES
from ..routing.tickets import PASS, Wait
from .attempt import NO_CONTENT, STATUS, AddressMemory, Attempt, Committed, Failed, UpstreamRequest
from .events import Reporter, Workload

log = logger()


@attrs.frozen
class Bounds:
    """The bounds of docs/references.md#retry-bounds and #attempt-caps. ``response_timeout`` 0
    disables both the header and first-content caps.

    ``stream_idle`` closes the spec's known gap (docs/references.md#silent-upstream-gap) opt-in:
    after commit, an upstream silent that long is closed; 0 (the default) keeps the spec's
    behaviour.
    """

    max_attempts: int = constants.MAX_DISPATCH_ATTEMPTS
    deadline: float = constants.JOB_DEADLINE
    response_timeout: float = constants.DEFAULT_RESPONSE_TIMEOUT
    backoff: tuple[float, ...] = constants.BACKOFF_SCHEDULE
    jitter: float = constants.BACKOFF_JITTER
    stream_idle: float = 0.0


@attrs.define(eq=False)
class Upstreams:
    """How one facade reaches its nodes: the agent per node (pinned TLS for peers), the
    address that last answered, the bounds of docs/references.md#retry-bounds, time and chance."""

    clock: IReactorTime
    agent: IAgent
    random: Callable[[], float]
    bounds: Bounds = Bounds()
    addresses: AddressMemory = attrs.Factory(AddressMemory)
    agent_for_node: Callable[[Node], IAgent] | None = None
    # The process's Via hop: on every request sent to a node, and how a loop is recognised.
    loop_guard: LoopGuard = attrs.Factory(LoopGuard)

    def agent_for(self, node: Node) -> IAgent:
        if self.agent_for_node is not None:
            return self.agent_for_node(node)
        return self.agent


@attrs.frozen
class Answer:
    """An answer the proxy generates itself (docs/references.md#proxy-answers): nothing upstream is
    relayed."""

    status: int
    reason: Reason
    detail: str = ""
    retry_after: int = 0
    code: str | None = None

    @property
    def text(self) -> str:
        return self.reason.says(self.detail)


@attrs.frozen
class Gone:
    """The loop stopped: the requester left, we are shutting down, or the request ended
    otherwise (``reason`` says which; its owner already answered or will)."""

    reason: Reason


# A loop is configuration (docs/references.md#forwarding-loop); another node or another try cannot
# fix it.
LOOP_DETECTED = 508


def retryable_status(inference: bool) -> Callable[[int], bool]:
    """408, 429 and 5xx always (but 508, a forwarding loop); 404 only where inventory may be stale
    (inference): docs/references.md#status-handling."""

    def retryable(status: int) -> bool:
        return (
            status in (408, 429)
            or (status >= 500 and status != LOOP_DETECTED)
            or (inference and status == 404)
        )

    return retryable


def final_answer(failure: Failed) -> Answer:
    """The final permitted attempt answers for itself (docs/references.md#final-attempt-answers)."""
    if failure.kind == NO_CONTENT:
        return Answer(504, Reason.NO_CONTENT)
    return Answer(502, Reason.TRANSPORT, failure.reason)


@attrs.frozen
class Job:
    """What is fixed for one request at admission: what it sends, what it routes on, the
    facade's collaborators the loop works with and where its progress is told. Built once;
    every dispatch reads it."""

    request: UpstreamRequest
    owners: IOwners
    upstreams: Upstreams
    #: The normalized model routed on; None routes to every routable node.
    model: str | None
    created_at: float
    #: What an empty first round answers: the body named no model, or one nobody serves.
    no_candidate: Reason
    #: The facade's voice: each dispatch's outcome goes to its recorder.
    reporter: Reporter
    #: The request's id, for the log.
    id: str = ""
    #: The request's routing (routing/tickets.py): where each round and dispatch goes, its
    #: claim on the node, its place in the queue.
    ticket: ITicket = PASS
    #: What an inference dispatch tells of its node, and the target watch; None for a
    #: request that tells nothing (not inference, or the ingress's).
    health: IHealth | None = None
    #: The broker's view of the request (docs/references.md#workload-lifecycle): told of each
    #: dispatch and each empty round; None without a model.
    workload: Workload | None = None

    @property
    def inference(self) -> bool:
        return self.request.inference


class Loop(enum.Enum):
    """Where the loop stands: dispatching or backing off, waiting for an owner, waiting in
    the queue, or done (its answer given or about to be: an attempt it cancels on the way out
    then changes nothing)."""

    RUNNING = "running"
    #: Backing off because no node advertises the model now.
    NO_OWNER = "no owner"
    #: Waiting in the facade's queue for a free slot (late binding).
    QUEUED = "queued"
    DONE = "done"


@implementer(IAttemptSink, IWaitSink)
class Dispatch:
    """One request's loop. ``run`` answers with a Deferred of Committed, Answer or Gone, fired
    once; a bug in the loop fails it.

    ``inference`` selects the full budget (re-resolve, back off, deadline, discovery watch);
    otherwise a single pass over the candidates resolved once, each tried at most once,
    because non-inference routes can change state (``POST /api/pull``) and must not repeat.

    It points at nothing above it: its progress goes to the request's workload and the
    facade's reporter, which the job names, and its result through the Deferred, which holds
    its caller's callbacks only until it fires (docs/decisions.md#no-cycles).
    """

    def __init__(self, job: Job):
        self.job = job
        self.deadline = job.created_at + job.upstreams.bounds.deadline
        self.result: Deferred[Committed | Answer | Gone] = Deferred()
        self.dispatches = 0
        #: The node of the latest dispatch, and when it went (for status and rates).
        self.node: Node | None = None
        self.dispatched_at: float | None = None
        self.attempt: Attempt | None = None
        self._queue: list[Node] = []
        self._timer: IDelayedCall | None = None
        self._state = Loop.RUNNING
        self._failed_in_round = False

    @property
    def done(self) -> bool:
        return self._state is Loop.DONE

    @property
    def waiting_for_owner(self) -> bool:
        """Backing off because no node advertises the model now
        (docs/references.md#backoff-schedule), for status."""
        return self._state is Loop.NO_OWNER

    @property
    def queued(self) -> bool:
        """Waiting in the facade's queue for a free slot (late binding), for status."""
        return self._state is Loop.QUEUED

    def attempting(self) -> str | None:
        """The node the attempt in flight targets, None between attempts (for status)."""
        return self.attempt.node.id if self.attempt is not None else None

    def run(self, candidates: list[Node] | None = None) -> Deferred[Committed | Answer | Gone]:
        """Start; the answer fires once. ``candidates``: the first round's, when the caller
        just resolved them."""
        self._guarded(self._round, candidates)
        return self.result

    def _guarded(self, step: Callable[..., None], *args: object) -> None:
        """Run one step of the loop; a bug ends this request only
        (docs/references.md#request-containment), never the reactor's other work, and leaves no
        timer or attempt behind."""
        try:
            step(*args)
        except Exception:
            if self.done:
                raise
            failure = Failure()
            self._cleanup()
            self.result.errback(failure)

    def stop(self, reason: Reason) -> None:
        """The requester left (or we shut down): end at once, no further dispatch."""
        if not self.done:
            self._finish(Gone(reason))

    # The loop, in the spec's order.

    def _round(self, candidates: list[Node] | None = None) -> None:
        job = self.job
        if candidates is None:
            candidates = job.owners.candidates(job.model)
        if not candidates:
            if self.dispatches == 0:
                self._finish(Answer(502, job.no_candidate))
            else:
                self._state = Loop.NO_OWNER
                self._back_off()
            return
        self._state = Loop.RUNNING
        plan = job.ticket.place(candidates, self.dispatches > 0)
        if isinstance(plan, Wait):
            self._wait(plan)
            return
        self._queue = list(plan)
        self._failed_in_round = False
        self._dispatch_next()

    def _dispatch_next(self) -> None:
        job = self.job
        owners, inference = job.owners, job.inference
        while self._queue and not owners.is_routable(self._queue[0].id):
            self._queue.pop(0)
        if not self._queue:
            self._clear()
            self._back_off()
            return
        if inference and self.dispatches >= job.upstreams.bounds.max_attempts:
            self._finish(Answer(503, Reason.EVERY_ATTEMPT_FAILED, retry_after=1))
            return
        clock = job.upstreams.clock
        if inference and clock.seconds() >= self.deadline:
            self._finish(Answer(503, Reason.DEADLINE_PASSED, retry_after=1))
            return
        if self._failed_in_round:
            # A failover weighs the round's remaining owners again: only those still
            # routable. Not at a round's first dispatch, whose plan is fresh: a filter there
            # cost a lookup per owner per request (a third of a request's CPU at 1,000 nodes).
            self._queue = [n for n in self._queue if owners.is_routable(n.id)]
        node = job.ticket.next(self._queue, self._failed_in_round)
        if isinstance(node, Wait):
            self._wait(node)  # a failover that finds every owner full waits, ahead
            return
        self._failed_in_round = True
        self.dispatches += 1
        self._dispatched(node, clock.seconds())
        upstreams = job.upstreams
        attempt = self.attempt = Attempt(
            agent=upstreams.agent_for(node),
            clock=clock,
            addresses=upstreams.addresses,
            node=node,
            request=job.request,
            sink=self,
        )
        if job.health is not None:
            job.health.watch(attempt)
        attempt.start()

    def _dispatched(self, node: Node, now: float) -> None:
        """Workload events, docs/references.md#workload-lifecycle."""
        self.node, self.dispatched_at = node, now
        job = self.job
        log.debug(
            "request {id} dispatch {n} to node {node}",
            id=job.id,
            n=self.dispatches,
            node=node.id,
            engine=job.reporter.engine,
        )
        if job.workload is not None:
            job.workload.dispatched(node.id)

    def _clear(self) -> None:
        """The request holds no node until its next dispatch
        (docs/references.md#events-between-rounds)."""
        job = self.job
        job.ticket.release()
        if job.workload is not None:
            job.workload.cleared()

    def is_final(self) -> bool:
        """Whether the attempt in flight is the last this request may make
        (docs/references.md#final-attempt-answers): its answer is then the client's whatever its
        status. Asked when the answer arrives: for a single pass the other candidates may have left
        meanwhile."""
        job = self.job
        if job.inference:
            return self.dispatches >= job.upstreams.bounds.max_attempts
        return not any(job.owners.is_routable(n.id) for n in self._queue)

    def attempt_ended(self, outcome: Committed | Failed) -> None:
        self._guarded(self._attempt_ended, outcome, self.is_final())

    def _attempt_ended(self, outcome: Committed | Failed, final: bool) -> None:
        job = self.job
        job.reporter.dispatch_ended(outcome)
        attempt, self.attempt = self.attempt, None  # an ended attempt is let go of
        if job.health is not None:
            if attempt is not None:
                job.health.unwatch(attempt)
            _tell(job.health, outcome)
        if self.done:
            return
        if isinstance(outcome, Committed):
            self._finish(outcome)
        elif final:
            self._finish(final_answer(outcome))
        elif not job.inference:
            self._dispatch_next()
        elif job.upstreams.clock.seconds() >= self.deadline:
            self._finish(Answer(503, Reason.DEADLINE_PASSED, retry_after=1))
        else:
            self._dispatch_next()

    def _wait(self, plan: Wait) -> None:
        """Every owner is full (or the conversation's node is worth waiting for): wait in the
        facade's queue, costing no attempt and holding no reservation, until a slot frees or
        the deadline passes (docs/decisions.md#late-binding, #affinity)."""
        self._queue = []
        self._clear()
        self._state = Loop.QUEUED
        self.job.ticket.wait(plan, self.deadline, self)

    def slot_freed(self) -> None:
        """IWaitSink: a slot freed for this request while it waited in the queue."""
        self._state = Loop.RUNNING
        self._guarded(self._round)

    def queue_deadline(self) -> None:
        """IWaitSink: its deadline passed while it waited in the queue."""
        self._state = Loop.RUNNING
        retry = self.job.ticket.retry_after()
        self._guarded(self._finish, Answer(503, Reason.NO_FREE_SLOT, retry_after=retry))

    def _back_off(self) -> None:
        """Wait before the next round; also paces the wait for an owner
        (docs/references.md#backoff-schedule)."""
        job = self.job
        if not job.inference:
            self._finish(Answer(503, Reason.EVERY_ATTEMPT_FAILED, retry_after=1))
            return
        upstreams = job.upstreams
        remaining = self.deadline - upstreams.clock.seconds()
        if remaining <= 0:
            self._finish_deadline()
            return
        bounds = upstreams.bounds
        schedule = bounds.backoff
        base = schedule[min(self.dispatches, len(schedule)) - 1]
        delay = base * (1 + bounds.jitter * (2 * upstreams.random() - 1))
        self._timer = upstreams.clock.callLater(min(delay, remaining), self._guarded, self._wake)

    def _wake(self) -> None:
        self._timer = None
        if self.job.upstreams.clock.seconds() >= self.deadline:
            self._finish_deadline()
        else:
            self._round()

    def _finish_deadline(self) -> None:
        owner_missing = self._state is Loop.NO_OWNER
        reason = Reason.NO_OWNER_RETURNED if owner_missing else Reason.DEADLINE_PASSED
        self._finish(Answer(503, reason, retry_after=1))

    def _finish(self, result: Committed | Answer | Gone) -> None:
        if isinstance(result, Committed):
            # The claim goes with the commit: the stream holds the node until it ends.
            try:
                reservation = self.job.ticket.committed(
                    result.node.id, result.response.code, result.relay.head()
                )
            except Exception:
                result.relay.abort()  # a bug: nobody will read the body (request-containment)
                raise
            if reservation is not None:
                result = Committed(
                    result.node, result.address, result.response, result.relay, reservation
                )  # what attrs.evolve does, cheaper
        self._cleanup()
        self.result.callback(result)

    def _cleanup(self) -> None:
        cancel_pending(self._timer)
        self._timer = None
        self._state = Loop.DONE
        job = self.job
        if self.attempt is not None:
            attempt, self.attempt = self.attempt, None
            if job.health is not None:
                job.health.unwatch(attempt)
            attempt.cancel("request ended")
        job.ticket.release()


def _tell(health: IHealth, outcome: Committed | Failed) -> None:
    """What the node's answer says about it: busy (429/503), stalled, or serving.

    Any commit but a busy one (the last attempt's 429 or 503, passed through) is a first
    byte: the node answered, so it is neither full nor stalled. A node that ran out a
    whole cap, for its headers or for its first byte, cools: either way it took a budget
    and gave nothing for it.
    """
    node_id = outcome.node.id
    if isinstance(outcome, Committed):
        if outcome.response.code in BUSY_STATUSES:
            health.answered(node_id, outcome.response.code)
        else:
            health.first_byte(node_id)
    elif outcome.kind == STATUS and outcome.status is not None:
        health.answered(node_id, outcome.status)
    elif outcome.spent:
        health.stalled(node_id)
