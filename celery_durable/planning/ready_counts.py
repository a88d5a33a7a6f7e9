"""Pure: how long a probe of which queues hold ready messages may stand in for a fresh one.

On RabbitMQ a pass learns which of its queues hold work with one pipelined
passive declare per queue (~50 us per queue on a local RabbitMQ). A worker
draining one busy queue among many would otherwise probe every queue before
every claim: with 200 queues, 200 declares per task. A probe is reused while it
is young, less what the passes took since: for ten times as long as the probe
itself took, at least 5 ms and at most 10 ms. A queue found empty is asked
again within that age at the latest: the pickup bound for a message that
arrives on it while other queues keep the worker busy. Past 20 queues or so a
probe costs more than a tenth of the claim loop's time: on RabbitMQ a busy
worker among many empty queues pays for that bound in throughput (docs/claiming.md). A
probe that shows no work left on any queue asked is not reused: the worker then
waits on every queue at once (the claimer's idle wait), which takes a late
message at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: A probe stands in for a fresh one for this many times its own duration...
REUSE_PER_PROBE_SECOND = 10.0
#: ...but at least this long (a probe of a few queues is cheap: reusing it
#: briefly still saves one round trip per claim on a busy worker)...
MIN_AGE = 0.005
#: ...and at most this long: the wait a message on a queue found empty may
#: have while other queues keep the worker busy. Stock Celery's own wait there
#: is its prefetch buffer (~12 ms p50 for no-op tasks at -c2 on RabbitMQ,
#: benchmarks/worker_bench.py --scenarios late); 250 ms doubled the 50-queue
#: throughput again but made that wait 3x stock's.
MAX_AGE = 0.01


def reuse_age(probe_seconds: float) -> float:
    """How long a probe that took ``probe_seconds`` may stand in for a fresh one."""
    return min(max(REUSE_PER_PROBE_SECOND * probe_seconds, MIN_AGE), MAX_AGE)


@dataclass
class ReadyCounts:
    """The last probe's ready messages per queue, less what was taken since."""

    _taken_at: float | None = None
    _max_age: float = MIN_AGE
    _counts: dict[str, int] = field(default_factory=dict)

    def reusable(self, queues: Sequence[str], now: float) -> dict[str, int] | None:
        """The counts of ``queues`` if the last probe may stand in for a new one, else None."""
        if self._taken_at is None or now - self._taken_at > self._max_age or now < self._taken_at:
            return None
        if any(queue not in self._counts for queue in queues):
            return None
        counts = {queue: self._counts[queue] for queue in queues}
        if not any(counts.values()):
            return None
        return counts

    def probed(self, counts: Mapping[str, int], now: float, probe_seconds: float) -> None:
        """A fresh probe's answer, read at ``now`` after ``probe_seconds`` of asking."""
        self._counts = dict(counts)
        self._taken_at = now
        self._max_age = reuse_age(probe_seconds)

    def took(self, queue: str, asked: int, got: int) -> None:
        """An ask of ``queue`` for ``asked`` messages brought ``got`` since the probe.

        An ask that brought less than it asked found the queue drained (another
        worker took what the probe counted): it is not asked again on this probe.
        """
        if queue in self._counts:
            self._counts[queue] = 0 if got < asked else max(self._counts[queue] - got, 0)

    def forget(self) -> None:
        """Queues changed, or the worker went idle: the next pass probes afresh."""
        self._taken_at = None
        self._counts = {}
