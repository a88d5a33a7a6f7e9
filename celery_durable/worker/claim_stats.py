"""What a claimer has done so far, as one record: the claim counts in ``celery inspect stats``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ClaimStats:
    """One claimer's counts; the zero record stands for a worker with no claimer yet."""

    #: Claim passes run.
    passes: int = 0
    #: Messages admitted from claim passes, and from the idle any-queue wait.
    claimed_by_passes: int = 0
    claimed_by_idle_wait: int = 0
    #: Messages RabbitMQ pushed while one queue was open (worker/push_consumer.py), and the queue it pushes.
    claimed_by_push: int = 0
    pushing: str | None = None
    #: Redis: the idle wait only watches, and each message it sees kicks a pass that takes it.
    idle_wakes: int = 0
    #: The queues the idle wait is armed on (empty when it is not armed).
    idle_waiting_on: frozenset[str] = field(default_factory=frozenset)
    #: Broker round trips the claim passes made (the idle wait's deliveries not included).
    round_trips: int = 0
    #: RabbitMQ's queue watch (worker/queue_watch.py): messages it was pushed that ran, that went back
    #: to the broker (not their turn, or no room), the times a pass gave it its credit, the queues it watches.
    claimed_by_watch: int = 0
    watch_given_back: int = 0
    watch_credits: int = 0
    watching: frozenset[str] = field(default_factory=frozenset)
    #: Messages a pass took beyond its slots (to park a busy key's flood at once) that could run:
    #: given back to the broker, ahead of what came after them.
    handed_back: int = 0

    def inspect_fields(self) -> dict[str, Any]:
        """The record under the names ``celery inspect stats`` has always shown them by."""
        return {
            "claim_passes": self.passes,
            "claimed_by_passes": self.claimed_by_passes,
            "claimed_by_idle_wait": self.claimed_by_idle_wait,
            "claimed_by_push": self.claimed_by_push,
            "claim_pushing": self.pushing,
            "idle_wakes": self.idle_wakes,
            "idle_waiting_on": sorted(self.idle_waiting_on),
            "claim_round_trips": self.round_trips,
            "claims_handed_back": self.handed_back,
            "claimed_by_watch": self.claimed_by_watch,
            "watch_given_back": self.watch_given_back,
            "watch_credits": self.watch_credits,
            "watching": sorted(self.watching),
        }
