"""Loopback alias addresses for an engine with an inherited host variable
(docs/references.md#host-aliases).

Clients already pointed at ``OLLAMA_HOST`` reach the same routing path through an alias.
Only literal loopback addresses qualify, at most one per family, all on one port: an alias is
a convenience for local clients and must never widen who can reach the proxy.
"""

from __future__ import annotations

from ..core.validate import ip_of, split_host_port
from .rpc import SERVER_ERROR, RpcError


def parse_aliases(values, primary_port: int) -> tuple[list[str], int] | None:
    """(hosts, port) to bind, or None for no aliases; RpcError -32000 on a bad value."""
    if not values:
        return None
    if not isinstance(values, list) or len(values) > 2:
        raise RpcError(SERVER_ERROR, "aliasAddresses takes at most two host:port values")
    hosts: list[str] = []
    ports = set()
    for value in values:
        if not isinstance(value, str):
            raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}")
        host, port = _split(value)
        if port == primary_port:
            raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: the primary port")
        ports.add(port)
        for item in ["127.0.0.1", "::1"] if host == "localhost" else [host]:
            if item in hosts:
                raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: one per family")
            hosts.append(item)
    families = [":" in h for h in hosts]
    if len(ports) != 1 or len(set(families)) != len(families):
        raise RpcError(SERVER_ERROR, "alias addresses must share one port, one per address family")
    return hosts, ports.pop()


def _split(value: str) -> tuple[str, int]:
    """A loopback literal and its port; a mapped ``::ffff:127.x`` is bound as the IPv4 inside
    it, so it counts in the IPv4 family (validate's rule)."""
    try:
        host, port = split_host_port(value)
    except ValueError as exc:
        raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: {exc}") from None
    if host == "localhost":
        return host, port
    address = ip_of(host)
    if address is None:
        raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: not a literal address")
    if "%" in host or not address.is_loopback:  # validate.is_loopback(host, scoped=False)
        raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: not loopback")
    return str(address), port
