"""``nvpair-proxy``: the existing implementation's command line, for a broker that spawns it.

The Go proxy took Go-style flags (``-ipc PATH``, ``--ipc=PATH``); a broker that spawns the
proxy as a child keeps passing them, so they are translated to ``twistd -n nvpair-proxy``.
"""

from __future__ import annotations

import sys
from typing import Sequence

VALUED = ("ipc", "cluster-dir", "log-level", "response-header-timeout", "admin", "log-format")
FLAGS = ("version", "access-log")


class CliError(ValueError):
    pass


def translate(argv: Sequence[str]) -> list[str]:
    """twistd arguments for Go-style ``argv`` (one or two dashes, ``=`` or a separate value)."""
    out = ["twistd", "-n", "--pidfile=", "nvpair-proxy"]
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("-") or arg in ("-", "--"):
            raise CliError(f"unexpected argument {arg!r}")
        name, eq, value = arg.lstrip("-").partition("=")
        if name in FLAGS and not eq:
            out.append(f"--{name}")
        elif name in VALUED:
            if not eq:
                if not args:
                    raise CliError(f"flag needs an argument: -{name}")
                value = args.pop(0)
            out.append(f"--{name}={value}")
        else:
            raise CliError(f"flag provided but not defined: -{name}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    try:
        sys.argv = translate(sys.argv[1:] if argv is None else argv)
    except CliError as exc:
        sys.stderr.write(f"nvpair-proxy: {exc}\n")
        raise SystemExit(2)
    from twisted.scripts.twistd import run

    run()


if __name__ == "__main__":
    main()
