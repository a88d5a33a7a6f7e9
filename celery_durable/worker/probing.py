"""What a probing fetcher's claim passes know of each queue's ready messages (RabbitMQ), and the probe it needs.

The rules are pure (planning/known_ready.py); this holds their state between passes and does the probe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from celery_durable.clock import Clock
from celery_durable.planning.known_ready import (
    NOTHING_READY_KNOWN,
    KnownReady,
    after_ask,
    after_probe,
    pass_queues,
    to_probe,
)
from celery_durable.worker.fetchers import ProbingFetcher


class QueueProber:
    """The queues a pass asks, capped by what is known of their ready messages, probing only the unknown."""

    def __init__(self, fetcher: ProbingFetcher, clock: Clock) -> None:
        self.fetcher = fetcher
        self.clock = clock
        self.known: KnownReady = NOTHING_READY_KNOWN

    def forget(self) -> None:
        """Nothing is known: the next pass probes every open queue (the queues changed; an idle wait armed)."""
        self.known = NOTHING_READY_KNOWN

    def probed(self, order: Sequence[str], cursor: str | None,
               free: Mapping[str, int]) -> tuple[tuple[str, ...], dict[str, int]]:
        """The pass's order less the queues trusted empty, and free slots capped by each queue's ready messages.

        Only queues whose count is unknown are probed: a queue an ask left holding work is known from
        its ``GetOk``, and one found empty is trusted empty for ``PROBED_EMPTY_FOR``. A message landing
        on it meanwhile is found by the probe after that, or at once by the idle wait armed when the
        worker has room.
        """
        now = self.clock.monotonic()
        unknown = to_probe(self.known, order, free, now)
        if unknown:
            ready = self.fetcher.ready_counts(unknown)
            now = self.clock.monotonic()
            self.known = after_probe(self.known, ready, now)
        return pass_queues(order, cursor, free, self.known, now)

    def asked(self, queue: str, asked: int, got: int) -> None:
        """An ask of ``queue`` for ``asked`` brought ``got`` (its ``GetOk`` said what remains)."""
        self.known = after_ask(self.known, queue, asked=asked, got=got, remaining=self.fetcher.remaining(),
                               now=self.clock.monotonic())
