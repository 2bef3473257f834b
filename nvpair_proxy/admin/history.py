"""The last fifteen minutes, in process and bounded (docs/operations.md#history): one sample
every 10 s of requests a second, time to first byte (median and 90th percentile), requests
waiting in the queues, the share of prompt tokens the engines reused, and errors by kind.
``/status`` carries the series and the status page draws them. Plain bookkeeping: no Twisted
(the admin listener's timer calls ``take``)."""

from __future__ import annotations

from collections import Counter, deque

import attrs

from ..core.views import ProcessSnapshot
from ..request.events import ms
from .cachetruth import share
from .recorder import Recorder

#: Seconds between two samples, and how many are kept: fifteen minutes.
HISTORY_INTERVAL = 10.0
HISTORY_SAMPLES = 90


@attrs.frozen
class Sample:
    """One interval, ending ``at``."""

    at: float
    requests_per_s: float
    ttft_p50_ms: int | None
    ttft_p90_ms: int | None
    queued: int
    #: Prompt tokens the engines took from their caches over all their prompts' tokens, in
    #: this interval (cachetruth.py, exact and estimated together); None when none said.
    prompt_reused_share: float | None
    #: Requests answered with an error in this interval, by kind (the reasons of
    #: ``nvpair_proxy_request_errors_total``).
    errors: dict[str, int]


def percentile(values: list[float], share: float) -> float | None:
    """The nearest-rank percentile of ``values``, None without any."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


@attrs.define
class History:
    """The samples, oldest first, and the totals the next one is measured from."""

    samples: deque = attrs.Factory(lambda: deque(maxlen=HISTORY_SAMPLES))
    _at: float | None = None
    _requests: int = 0
    _errors: Counter = attrs.Factory(Counter)
    #: The cache truth's totals since start, reused and read, at the last sample.
    _prompt: tuple[int, int] = (0, 0)

    def take(self, now: float, recorder: Recorder, snapshot: ProcessSnapshot) -> Sample:
        """Sample the interval that ends ``now``."""
        requests = sum(recorder.requests.values())
        errors: Counter = Counter()
        for (_, reason), count in recorder.reasons.items():
            errors[reason] += count
        queued = sum(facade.routing.queued for facade in snapshot.facades)
        reused, read = recorder.cache.totals()
        ttfbs = recorder.take_ttfbs()
        elapsed = HISTORY_INTERVAL if self._at is None else max(now - self._at, 1e-9)
        sample = Sample(
            at=now,
            requests_per_s=round(max(0, requests - self._requests) / elapsed, 3),
            ttft_p50_ms=ms(percentile(ttfbs, 0.5)),
            ttft_p90_ms=ms(percentile(ttfbs, 0.9)),
            queued=queued,
            prompt_reused_share=share(reused - self._prompt[0], read - self._prompt[1]),
            errors={
                k: n - self._errors[k] for k, n in sorted(errors.items()) if n > self._errors[k]
            },
        )
        self._at, self._requests, self._errors, self._prompt = now, requests, errors, (reused, read)
        self.samples.append(sample)
        return sample

    def status(self) -> dict:
        """``/status``'s ``history``: the interval and the samples, oldest first."""
        return {
            "interval_s": HISTORY_INTERVAL,
            "samples": [attrs.asdict(sample) for sample in self.samples],
        }
