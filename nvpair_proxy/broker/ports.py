"""Persisted per-engine ports (docs/references.md#persisted-port): the port a user chose through
set-port.

The files keep the existing implementation's names and ``{"port": N}`` shape, so a node that
switches to this proxy keeps its ports. A corrupt or out-of-range file counts as none.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from ..core.files import no_step, write_atomically
from ..core.logs import logger
from ..core.validate import is_port
from ..nodes.engines import Engine

log = logger()


def read_port(state_dir: str, engine: Engine) -> int | None:
    """The persisted port, or None (absent, unreadable, corrupt, out of range or reserved)."""
    path = os.path.join(state_dir, engine.persisted_port_file)
    try:
        with open(path, "rb") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warn(
            "ignoring persisted port file {path}: {why}", path=path, why=str(exc), engine=engine.id
        )
        return None
    port = data.get("port") if isinstance(data, dict) else None
    if not is_port(port):
        log.warn("ignoring persisted port file {path}: no valid port", path=path, engine=engine.id)
        return None
    if port in engine.ports.reserved:
        return None
    return port


def write_port(
    state_dir: str, engine: Engine, port: int, step: Callable[[str], None] = no_step
) -> None:
    """Write atomically: a crash at any point leaves the old file or the new one
    (``write_atomically``, whose ``step`` seam this passes on); raises OSError on failure."""
    os.makedirs(state_dir, exist_ok=True)
    # Compact, exactly ``{"port":N}`` like the existing implementation's files.
    data = json.dumps({"port": port}, separators=(",", ":")).encode()
    write_atomically(os.path.join(state_dir, engine.persisted_port_file), data, step)
