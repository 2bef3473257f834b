"""Which candidates are this proxy itself (docs/references.md#self-by-address).

A node whose address is this machine and whose port is the facade's own port (or an alias
port the facade bound) is the facade: dialling it sends the request back to us, which would
dial it again, without end. The engine's port and the facade's port are often one digit apart,
so this is a mistake anyone makes in a nodes file or an ``add-manual``.

The check is by address, as the existing implementation does it: an address on one of this
host's interfaces counts as ``127.0.0.1`` (docs/references.md#self-detection: a UDP socket can bind
to it), and a loopback address on one of the facade's ports is self. It is asked again whenever the
node set or the facade's ports change (``NodeSet.recheck_self``), never per request.
"""

from __future__ import annotations

import socket
from typing import Callable, Collection

import attrs

from ..core.validate import is_loopback


def is_local_address(address: str) -> bool:
    """An address on one of this machine's interfaces: a UDP socket can bind to it
    (docs/references.md#self-detection)."""
    host = address.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        probe = socket.socket(family, socket.SOCK_DGRAM)
    except OSError:
        return False
    try:
        probe.bind((host, 0))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def never_self(node: object) -> bool:
    """The check of a node set no facade listens for (tests, and before a facade binds)."""
    return False


@attrs.frozen
class SelfCheck:
    """Whether a node is this facade: one of its addresses is this host, on one of ``ports``.

    ``ports`` is asked at every check, so a ``set-port`` or a new alias counts at the next
    re-check without building a new SelfCheck.
    """

    ports: Callable[[], Collection[int]]
    is_local: Callable[[str], bool] = is_local_address

    def __call__(self, node) -> bool:
        if node.port not in self.ports():
            return False  # the usual case, decided without touching a socket
        return any(
            is_loopback(address, name=True) or self.is_local(address) for address in node.addresses
        )


def self_reason(engine: str, port: int) -> str:
    """Why ``/status`` and the log say a node is left out."""
    return (
        f"it is this proxy's own {engine} facade (port {port}); "
        "a request sent there would come back here"
    )
