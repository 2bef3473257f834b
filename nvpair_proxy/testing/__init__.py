"""What tests, the demo and the benchmarks stand on, kept out of the product modules and out
of the test package (as ``twisted.internet.testing`` is out of Twisted's tests), so a script
never imports a test module.

``fakes``: fakes with the real APIs (an IAgent the test answers, a recording emitter, peer
addresses). ``simfleet``: the simulated fleet, which speaks all three dialects with fault
switches; tests serve it in memory, and ``processes`` runs it and the real proxy as processes
for ``bin/demo``, the benchmarks and the process tests. ``certs``: a test CA, pinned identities
and admissions. ``netns``: three hosts in network namespaces (``netns_tools`` runs inside
them). ``tinymodel`` and ``llamaserver``: a real llama-server and the model it serves.
"""

from .fakes import (
    FakeAgent,
    FakeBodyTransport,
    FakeRequest,
    FakeResponse,
    RecordingEmitter,
    lan,
    loopback,
    mapped_loopback,
)

__all__ = [
    "FakeAgent",
    "FakeBodyTransport",
    "FakeRequest",
    "FakeResponse",
    "RecordingEmitter",
    "lan",
    "loopback",
    "mapped_loopback",
]
