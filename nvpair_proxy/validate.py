"""The checks every input shares, whether it came over the broker link or from a file.

One definition each of "an integer" (JSON's ``true`` is not 1), "a port" and "a loopback
host", so the RPC methods, the nodes file, the engine files and the persisted ports cannot
drift apart on what they accept.
"""

from __future__ import annotations

import ipaddress

PORT_MIN, PORT_MAX = 1, 65535


def is_int(value: object) -> bool:
    """An integer that is not a bool (``isinstance(True, int)`` holds in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_port(value: object, *, zero: bool = False) -> bool:
    """1-65535; with ``zero``, 0 too (where 0 means "default" or "none")."""
    return is_int(value) and (PORT_MIN - zero) <= value <= PORT_MAX


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host literal names, or None: brackets and a ``%scope`` stripped, and an
    IPv4-mapped address read as the IPv4 inside it (a dual-stack listener reports IPv4
    clients so)."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback(host: str, *, name: bool = False, scoped: bool = True) -> bool:
    """A loopback address (twisted-notes): brackets and a ``%scope`` are stripped (unless
    ``scoped`` is False, which refuses a scoped address), an IPv4-mapped address is judged by
    the IPv4 inside it (a dual-stack listener reports IPv4 clients so; ``::ffff:`` of a LAN
    address is not loopback), and ``localhost`` counts only when ``name`` allows it."""
    if name and host == "localhost":
        return True
    if not scoped and "%" in host:
        return False
    address = ip_of(host)
    return address is not None and address.is_loopback
