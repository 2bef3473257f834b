#!/usr/bin/env python3
"""Group a py-spy raw (collapsed) profile of the proxy into cost centres.

Usage: .venv/bin/python bench/profile_groups.py PROFILE.txt [--top 25]
(record one with: py-spy record -p PID -d 30 -r 250 -f raw -o PROFILE.txt)

Each sample goes to the first frame, from the leaf up, whose file or function names a group:
  events/logging        nvpair_proxy/request/events.py, core/logs.py, core/logformat.py,
                        broker/rpc.py, twisted/logger, twisted/python/log (not callWithLogger)
  stats observer        nvpair_proxy/body/frames.py, tokens.py
  our exchange/dispatch every other nvpair_proxy module (routing, request, http, facade, ...)
  twisted.web request   twisted/web/http.py, server.py, resource.py, http_headers.py, cgi/email
  Agent/pool            twisted/web/client.py, _newclient.py, _http2, iweb
  reactor, TCP, ...     twisted/internet (sockets, epoll, Deferreds), twisted/protocols, the
                        send/recv retry loop (twisted/python/util.py), wherever it is called from
  other                 anything else
Prints the groups (% of samples), and the top functions by self and by inclusive time.
"""

from __future__ import annotations

import collections
import re
import sys

OURS = re.compile(r"nvpair_proxy/[\w/]+\.py")
RULES = [
    (
        "events/logging",
        re.compile(
            r"nvpair_proxy/(request/events|core/logs|core/logformat|"
            r"broker/rpc)\.py|twisted/logger/|"
            r"twisted/python/log\.py:(?!98|82)|"
            r"twisted/python/(context|failure)\.py"
        ),
    ),
    ("stats observer", re.compile(r"nvpair_proxy/body/(frames|tokens)\.py")),
    ("our exchange/dispatch/attempt", OURS),
    (
        "twisted.web request parsing/serving",
        re.compile(
            r"twisted/web/(http|server|resource|http_headers|_abnf)\.py|email/|cgi\.py|"
            r"urllib/parse"
        ),
    ),
    ("Agent/pool", re.compile(r"twisted/web/(client|_newclient|iweb|_responses)\.py")),
    (
        "reactor, TCP, syscalls, Deferreds",
        re.compile(r"twisted/internet/|twisted/python/util\.py|twisted/protocols/"),
    ),
]
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*):(?P<line>\d+)\)$")


def group_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        if "callWithLogger" in frame or "callWithContext" in frame:
            continue
        for name, rule in RULES:
            if rule.search(frame):
                return name
    return "other"


def short(frame: str) -> str:
    match = FRAME.match(frame)
    if not match:
        return frame
    path = match["file"]
    for marker in ("site-packages/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{match['func']} ({path})"


def main() -> int:
    path = sys.argv[1]
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 25
    groups: collections.Counter = collections.Counter()
    self_time: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    with open(path) as handle:
        for line in handle:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            groups[group_of(frames)] += n
            self_time[short(frames[-1])] += n
            for frame in set(short(f) for f in frames):
                inclusive[frame] += n
    print(f"{total} samples (active only)\n")
    print("group                                       %")
    for name, n in groups.most_common():
        print(f"{name:40} {100 * n / total:5.1f}")
    print(f"\ntop {top} by self time")
    for name, n in self_time.most_common(top):
        print(f"{100 * n / total:5.1f}  {name}")
    print(f"\ntop {top * 2} by inclusive time (under the reactor loop)")
    skip = (
        "run (",
        "runApp",
        "Runner",
        "runReactor",
        "mainLoop",
        "doPoll",
        "callWith",
        "_doReadOrWrite",
        "<module>",
        "ReactorBase.run",
        "startReactor",
        "postApplication",
    )
    shown = 0
    for name, n in inclusive.most_common():
        if any(s in name for s in skip):
            continue
        print(f"{100 * n / total:5.1f}  {name}")
        shown += 1
        if shown >= top * 2:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
