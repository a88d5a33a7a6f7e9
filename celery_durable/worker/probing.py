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
    after_delivery,
    after_probe,
    pass_queues,
    to_probe,
    trusted_empty,
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

    def probed(self, order: Sequence[str], cursor: str | None, free: Mapping[str, int],
               watched: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], dict[str, int]]:
        """The pass's order less the queues trusted empty, and free slots capped by each queue's ready messages.

        Only queues whose count is unknown are probed: a queue an ask left holding work is known from
        its ``GetOk``, and one found empty is trusted empty for ``PROBED_EMPTY_FOR``. A message landing
        on it meanwhile is found by the probe after that, or at once by the idle wait armed when the
        worker has room. A ``watched`` queue (worker/queue_watch.py) is never probed: the broker pushes
        what lands on it.
        """
        now = self.clock.monotonic()
        unknown = to_probe(self.known, order, free, now, watched)
        if unknown:
            ready = self.fetcher.ready_counts(unknown)
            now = self.clock.monotonic()
            self.known = after_probe(self.known, ready, now)
        return pass_queues(order, cursor, free, self.known, now, watched)

    def proven_empty(self) -> frozenset[str]:
        """The queues proven empty and still trusted so: the ones the queue watch may take over."""
        return trusted_empty(self.known, self.clock.monotonic())

    def holding_work(self) -> frozenset[str]:
        """The queues known to hold ready messages (the turn a watch delivery must not jump)."""
        return frozenset(self.known.counts)

    def delivered(self, queue: str) -> None:
        """The queue watch was pushed a message from ``queue``: the passes ask it in turn from now on."""
        self.known = after_delivery(self.known, queue)

    def asked(self, queue: str, asked: int, got: int) -> None:
        """An ask of ``queue`` for ``asked`` brought ``got`` (its ``GetOk`` said what remains)."""
        self.known = after_ask(self.known, queue, asked=asked, got=got, remaining=self.fetcher.remaining(),
                               now=self.clock.monotonic())
