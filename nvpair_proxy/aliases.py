"""Loopback alias addresses for an engine with an inherited host variable (spec 7, protocol 3).

Clients already pointed at ``OLLAMA_HOST`` reach the same routing path through an alias.
Only literal loopback addresses qualify, at most one per family, all on one port: an alias is
a convenience for local clients and must never widen who can reach the proxy.
"""

from __future__ import annotations

import ipaddress

from .rpc import SERVER_ERROR, RpcError
from .validate import is_port


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
        for item in (["127.0.0.1", "::1"] if host == "localhost" else [host]):
            if item in hosts:
                raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: one per family")
            hosts.append(item)
    families = [":" in h for h in hosts]
    if len(ports) != 1 or len(set(families)) != len(families):
        raise RpcError(SERVER_ERROR, "alias addresses must share one port, one per address family")
    return hosts, ports.pop()


def _split(value: str) -> tuple[str, int]:
    host, sep, port_text = value.rpartition(":")
    # ASCII digits only: str.isdigit() also takes other scripts' digits (int() reads them)
    # and superscripts (int() raises on them).
    if not sep or not port_text or not all("0" <= c <= "9" for c in port_text):
        raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: want host:port")
    port = int(port_text)
    if not is_port(port):
        raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: brackets are for IPv6")
    elif ":" in host or "[" in host or "]" in host:
        # An IPv6 host needs brackets (``[::1]:11434``); ``::1:11434`` is ambiguous.
        raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: want host:port")
    if host == "localhost":
        return host, port
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: not a literal address") from None
    if not address.is_loopback or getattr(address, "scope_id", None):
        raise RpcError(SERVER_ERROR, f"invalid alias address {value!r}: not loopback")
    return str(address), port
