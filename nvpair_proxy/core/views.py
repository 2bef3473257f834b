"""What the admin listener is shown of the process: frozen values, each built by its owner.

``/status`` and ``/metrics`` read only these (status.py, metrics.py), never the live objects:
the router answers for its nodes and holds, a request in flight for the node serving it, a
facade service for its port and slots, the service tree for the link and the reservations.
So the request path and the tree can change shape without the admin listener following their
attributes, and one read of ``/status`` or one scrape sees the process once, so its numbers
agree with each other.

Nothing here runs on the request path: a view is built when a scrape or ``/status`` asks.
Plain values that import nothing of the proxy; the seam that hands them out is
``interfaces.IStatusSource``.
"""

from __future__ import annotations

from typing import Mapping

import attrs


@attrs.frozen
class NodeView:
    """One known node as ``/status`` shows it (discovery.py): operational metadata only,
    never its TLS or key settings. ``models`` as the node advertised them, else the normalized
    ids it is known to own, None while its inventory is unknown; ``local`` when the node is
    this facade itself."""

    id: str
    name: str
    port: int
    addresses: tuple[str, ...]
    models: tuple[str, ...] | None
    local: bool


@attrs.frozen
class RoutingView:
    """One facade's routing now (router.py): the ``node/select`` pin ("" for none), every
    known node in id order whether routable or not, and the ids routable, busy-held and
    cooling now, each in id order."""

    pin: str
    nodes: tuple[NodeView, ...]
    routable: tuple[str, ...]
    held: tuple[str, ...]
    cooling: tuple[str, ...]
    #: Standalone placement: what each routable node's engine reported, in id order.
    engines: tuple["EngineView", ...] = ()
    #: Late binding: the requests waiting for a free slot, and the longest wait's seconds.
    queued: int = 0
    oldest_wait: float | None = None
    #: Fair share: how many clients have a request waiting (never who), and how many
    #: waiting requests are batch work still yielding to the rest.
    clients_waiting: int = 0
    batch_waiting: int = 0
    #: Affinity: the conversations remembered per node (None: affinity is off).
    affinity_keys: tuple[tuple[str, int], ...] | None = None


@attrs.frozen
class EngineView:
    """What one node's engine said it is doing (placement.py), and our own share of it:
    ``slots_total`` as placement counts it (the engine's, capped by a nodes file's ``slots``;
    None unknown), ``busy`` the larger of ``ours`` and ``reported_busy``, the warm models
    (None: the engine does not say) and the seconds since the last read (None: never read)."""

    node: str
    slots_total: int | None
    busy: int
    ours: int
    reported_busy: int | None
    warm: tuple[str, ...] | None
    read_age: float | None
    #: What the node's recent requests measured (affinity's spill rule): seconds to serve
    #: one, prompt tokens per second its engine reported, and request-body bytes per prompt
    #: token; None until measured.
    service: float | None = None
    prompt_rate: float | None = None
    bytes_per_token: float | None = None


@attrs.frozen
class InFlightView:
    """One request in flight (exchange.py): the node serving it, which is its committed
    node, else its attempt's (None between attempts), and whether it is backing off until a
    node advertises its model."""

    node: str | None
    waiting_for_owner: bool
    #: Waiting in the facade's queue for a free slot (late binding).
    queued: bool = False


@attrs.frozen
class FacadeView:
    """One facade (facadeservice.py): its engine, the port it listens on as bound, its routing,
    its requests in flight, and the local engine's slots as ``nodes/list`` describes them
    (broker mode; None when none are known)."""

    engine: str
    port: int
    routing: RoutingView
    in_flight: tuple[InFlightView, ...]
    slots: Mapping[str, object] | None = None


@attrs.frozen
class ProcessSnapshot:
    """The process (service.py): whether it serves, its facades in the order they were
    opened, the process-wide reservations per node, when each node last streamed bytes,
    whether the broker link is open (None: the tree has no link) and how many cluster peers
    have a live pin (None: no cluster directory)."""

    running: bool
    facades: tuple[FacadeView, ...]
    reservations: Mapping[str, int]
    streamed: Mapping[str, float]
    link_up: bool | None = None
    cluster_pins: int | None = None
    #: A graceful stop is under way (docs/operations.md#restarts): /healthz answers 503.
    draining: bool = False
