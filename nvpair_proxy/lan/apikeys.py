"""Opt-in API keys for plaintext clients on the LAN (docs/references.md#lan-keys).

Without keys the listener serves plaintext to loopback only. With keys, a LAN client that
presents one (``Authorization: Bearer <key>`` or ``X-Api-Key: <key>``) is served as if it came
from loopback, with both headers removed so its key never travels further. Keys come from
``NVPAIR_PROXY_API_KEYS`` (comma-separated) and a keys file that is re-read, at most once a
second and only when a request needs it, so a key can be rotated without a restart.

The gate fails closed: a keys file others can read (or that someone else owns), one over
64 KiB, or any entry that is not a well-formed key turns the whole gate off, back to the
``loopback-only`` answer, because a half-read key list is a list nobody meant. Keys are
compared in constant time and never logged; the log names a line, never its content.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import os
import re
import stat
from typing import Iterable, Sequence

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.web.http_headers import Headers

from ..core.files import FileWatch
from ..core.logs import logger
from ..core.validate import ip_of
from ..http.answers import LOOPBACK_ONLY, SOURCE_NOT_ALLOWED, UNAUTHORIZED, Reason
from ..http.credentials import CREDENTIAL_HEADERS, presented

log = logger()

KEYS_FILE_NAME = "proxy-api-keys"
MAX_KEYS_FILE = 64 * 1024
RECHECK_INTERVAL = 1.0
KEY_SYNTAX = re.compile(r"[A-Za-z0-9\-._~+/=]{32,512}")

# Failed attempts from one source within this window make a burst once there are this many.
BURST_WINDOW = 60.0
BURST_SIZE = 5
# Sources remembered at most; past it, the one whose window began first is forgotten.
MAX_SOURCES = 4096

CHALLENGE = b'Bearer realm="nvpair-proxy"'
CHALLENGE_REJECTED = b'Bearer realm="nvpair-proxy", error="invalid_token"'


class KeysError(ValueError):
    """Keys that turn the gate off; the text names the source and line, never a key."""


def _digest(key: str | bytes) -> bytes:
    """Keys are compared as SHA-256 digests, so the comparison is constant-time whatever the
    presented key's length."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def parse_keys(entries: Iterable[tuple[int, str]], source: str) -> list[bytes]:
    """Digests of ``(line number, text)`` entries, comments and blanks skipped; raises
    KeysError naming the first bad line."""
    digests = []
    for number, text in entries:
        key = text.split("#", 1)[0].strip()
        if not key:
            continue
        if not KEY_SYNTAX.fullmatch(key):
            raise KeysError(
                f"{source} line {number}: not a valid API key (32 to 512 characters "
                f"of A-Z a-z 0-9 - . _ ~ + / =)"
            )
        digests.append(_digest(key))
    return digests


def env_entries(value: str) -> list[tuple[int, str]]:
    """``NVPAIR_PROXY_API_KEYS``: comma-separated; entry numbers count from 1."""
    return list(enumerate(value.split(","), start=1))


def check_file(path: str, st: os.stat_result, uid: int) -> None:
    """The keys file may be read by us alone, owned by us or root, and at most 64 KiB."""
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeysError(
            f"{path}: refused: group or others have access "
            f"(mode {stat.S_IMODE(st.st_mode):o}; use chmod 600)"
        )
    if st.st_uid not in (uid, 0):
        raise KeysError(f"{path}: refused: owned by uid {st.st_uid}, not by us or root")
    if st.st_size > MAX_KEYS_FILE:
        raise KeysError(f"{path}: refused: larger than 64 KiB")


@attrs.define(eq=False)
class KeyStore:
    """The configured key digests, the file re-read at most once a second when it changed.

    ``digests()`` is None while the gate is off: no key configured, or a bad source (logged at
    error once per change of the file).
    """

    clock: IReactorTime
    env: str | None = None
    path: str | None = None
    uid: int = attrs.Factory(os.geteuid)
    _env_digests: list[bytes] | None = None
    _env_error: str | None = None
    _file_digests: list[bytes] | None = None
    _file_error: str | None = None
    _watch: FileWatch = attrs.field(init=False)

    @_watch.default
    def _watch_the_file(self) -> FileWatch:
        return FileWatch(lambda: () if self.path is None else (self.path,))

    def __attrs_post_init__(self) -> None:
        """Read at start-up too, so a bad key source is reported before any client comes."""
        if self.env:
            try:
                self._env_digests = parse_keys(env_entries(self.env), "NVPAIR_PROXY_API_KEYS")
            except KeysError as exc:
                self._env_error = str(exc)
                log.error("API keys disabled: {why}", why=self._env_error)
        self._recheck()

    def digests(self) -> list[bytes] | None:
        if self._env_error is not None:
            return None
        self._recheck()
        if self._file_error is not None:
            return None
        keys = (self._env_digests or []) + (self._file_digests or [])
        return keys or None

    def _recheck(self) -> None:
        path = self.path
        if path is None:
            return
        before = self._watch.changed(self.clock.seconds(), RECHECK_INTERVAL)
        if before is not None:
            self._watch.read(before, lambda: self._load(path, before[path]))

    def _load(self, path: str, stamp: object) -> None:
        digests: list[bytes] | None = None
        error = None
        if stamp is not None:
            try:
                digests = self._read(path)
            except KeysError as exc:
                error = str(exc)
            except OSError as exc:
                error = f"{path}: cannot read: {exc.strerror or exc}"
        if error is not None:
            log.error("API keys disabled: {why}", why=error)
        elif self._file_error is not None or self._file_digests != digests:
            log.info("API keys file {path}: {n} key(s)", path=path, n=len(digests or ()))
        self._file_digests, self._file_error = digests, error

    def _read(self, path: str) -> list[bytes]:
        """Checked and read through one descriptor, so the file checked is the file read."""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeysError(f"{path}: refused: not a regular file")
            check_file(path, st, self.uid)
            data = os.read(fd, MAX_KEYS_FILE + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_KEYS_FILE:
            raise KeysError(f"{path}: refused: larger than 64 KiB")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise KeysError(f"{path}: not UTF-8 text") from None
        return parse_keys(enumerate(text.splitlines(), start=1), path)


class Verdict(enum.Enum):
    SERVE = "serve"  # a valid key: serve as loopback, credentials removed
    LOOPBACK_ONLY = "loopback-only"  # no keys (or a bad key source): the gate is off
    NOT_ALLOWED = "not-allowed"  # outside the source allowlist
    MISSING = "missing"  # no key presented
    REJECTED = "rejected"  # a key presented, none valid


def parse_cidrs(text: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """A comma-separated allowlist; raises ValueError naming the bad entry."""
    networks = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"not an address or CIDR: {entry!r}") from None
    return networks


@attrs.define(eq=False)
class LanGate:
    """The decision for one plaintext request from a non-loopback peer
    (docs/references.md#lan-keys).

    The listener asks ``decide``; on SERVE it removes the credential headers (``admit``)
    and serves the request as it serves loopback. Failures are counted per source and a
    burst is logged at warn once per window, with the address.
    """

    keys: KeyStore
    allowed: Sequence = ()
    _failures: dict[str, list] = attrs.Factory(dict)

    def decide(self, host: str, headers: Headers) -> Verdict:
        digests = self.keys.digests()
        if digests is None:
            return Verdict.LOOPBACK_ONLY
        if self.allowed:
            address = ip_of(host)
            if address is None or not any(address in network for network in self.allowed):
                self._failed(host, "source not in the allowlist")
                return Verdict.NOT_ALLOWED
        offered = presented(headers)
        if not offered:
            self._failed(host, "no API key")
            return Verdict.MISSING
        if _any_matches(offered, digests):
            return Verdict.SERVE
        self._failed(host, "wrong API key")
        return Verdict.REJECTED

    @staticmethod
    def admit(headers: Headers) -> None:
        for name in CREDENTIAL_HEADERS:
            headers.removeHeader(name)

    def _failed(self, host: str, why: str) -> None:
        log.debug("refused a request from {address}: {why}", address=host, why=why)
        now = self.keys.clock.seconds()
        entry = self._failures.get(host)
        if entry is None or now - entry[0] >= BURST_WINDOW:
            # Re-inserted last, so the map stays in the order the windows began.
            self._failures.pop(host, None)
            self._make_room()
            entry = self._failures[host] = [now, 0, False]
        entry[1] += 1
        if entry[1] >= BURST_SIZE and not entry[2]:
            entry[2] = True
            log.warn(
                "{n} refused LAN requests from {address} within a minute (last: {why})",
                n=entry[1],
                address=host,
                why=why,
            )

    def _make_room(self) -> None:
        """At MAX_SOURCES, the source whose window began first is forgotten (one whose window
        ended, if any has): many sources at once cannot grow the map past the bound."""
        while len(self._failures) >= MAX_SOURCES:
            del self._failures[next(iter(self._failures))]


def _any_matches(offered: list[bytes], digests: list[bytes]) -> bool:
    """Every presented key against every configured key, without stopping at a match."""
    matched = False
    for key in offered:
        digest = _digest(key)
        for known in digests:
            matched |= hmac.compare_digest(digest, known)
    return matched


def answer_for(verdict: Verdict) -> tuple[int, Reason, str, bytes | None] | None:
    """(status, reason, text, WWW-Authenticate) for a refused request; None for SERVE. The
    reason's text is the answer's ``code``."""
    if verdict is Verdict.SERVE:
        return None
    if verdict is Verdict.LOOPBACK_ONLY:
        return (403, Reason.LOOPBACK_ONLY, LOOPBACK_ONLY[1], None)
    if verdict is Verdict.NOT_ALLOWED:
        return (403, Reason.SOURCE_NOT_ALLOWED, SOURCE_NOT_ALLOWED[1], None)
    challenge = CHALLENGE_REJECTED if verdict is Verdict.REJECTED else CHALLENGE
    return (401, Reason.UNAUTHORIZED, UNAUTHORIZED[1], challenge)
