"""The checks every input shares, whether it came over the broker link or from a file.

One definition each of "an integer" (JSON's ``true`` is not 1), "a port", "host:port" and "a
loopback host", so the RPC methods, the command line, the nodes file, the engine files and the
persisted ports cannot drift apart on what they accept.

An IPv4-mapped IPv6 address (``::ffff:127.0.0.1``) is the IPv4 address inside it everywhere:
a dual-stack listener reports IPv4 clients so, a socket connected to it talks IPv4, and a
listener asked for it is bound to the IPv4 address (``ip_of``).
"""

from __future__ import annotations

import ipaddress
from typing import Literal, TypeGuard, overload

PORT_MIN, PORT_MAX = 1, 65535


def is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a bool (``isinstance(True, int)`` holds in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_port(value: object, *, zero: bool = False) -> TypeGuard[int]:
    """1-65535; with ``zero``, 0 too (where 0 means "default" or "none")."""
    return is_int(value) and (PORT_MIN - zero) <= value <= PORT_MAX


# The reasons ``split_host_port`` gives; callers put them into their own messages.
WANT_HOST_PORT = "want host:port"
PORT_OUT_OF_RANGE = "port out of range"
BRACKETS_FOR_IPV6 = "brackets are for IPv6"


def parse_port(text: str, *, zero: bool = False) -> int:
    """A port written in ASCII digits; ValueError (``WANT_HOST_PORT`` or ``PORT_OUT_OF_RANGE``)
    otherwise. ASCII only: ``str.isdigit()`` also takes other scripts' digits (``int()`` reads
    them) and superscripts (``int()`` refuses them); a sign or a space is no port either."""
    if not text or not all("0" <= c <= "9" for c in text):
        raise ValueError(WANT_HOST_PORT)
    # Length first: int() refuses thousands of digits with a message of its own.
    if len(text) > 5 or not is_port(int(text), zero=zero):
        raise ValueError(PORT_OUT_OF_RANGE)
    return int(text)


@overload
def split_host_port(
    text: str, *, zero: bool = ..., port_required: Literal[True] = ...
) -> tuple[str, int]: ...
@overload
def split_host_port(
    text: str, *, zero: bool = ..., port_required: bool
) -> tuple[str, int | None]: ...
def split_host_port(
    text: str, *, zero: bool = False, port_required: bool = True
) -> tuple[str, int | None]:
    """``host:port``, an IPv6 host in brackets (``[::1]:11434``); the host comes back without
    them, and the port is None when ``port_required`` is False and none is written.

    Raises ValueError with one of the reasons above. Only the syntax is judged here: whether
    the host is a literal, or loopback, is the caller's rule. ``::1:11434`` is refused, not
    guessed at: it could be the host ``::1`` or ``::1:11434`` with no port.
    """
    if port_required or not (text.endswith("]") or ":" not in text):
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise ValueError(WANT_HOST_PORT)
        port: int | None = parse_port(port_text, zero=zero)
    else:
        host, port = text, None
    if not host:
        raise ValueError(WANT_HOST_PORT)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise ValueError(BRACKETS_FOR_IPV6)
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(WANT_HOST_PORT)
    return host, port


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
