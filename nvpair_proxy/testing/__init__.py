"""What tests and the demo stand on, kept out of the product modules (issue 9).

``fakes``: fakes with the real APIs (an IAgent the test answers, a recording emitter, peer
addresses). ``simfleet``: the simulated fleet, which speaks all three dialects with fault
switches; ``bin/demo`` and the process tests run it, and tests serve it in memory.
"""

from .fakes import (FakeAgent, FakeBodyTransport, FakeRequest, FakeResponse, RecordingEmitter,
                    lan, loopback, mapped_loopback)

__all__ = ["FakeAgent", "FakeBodyTransport", "FakeRequest", "FakeResponse", "RecordingEmitter",
           "lan", "loopback", "mapped_loopback"]
