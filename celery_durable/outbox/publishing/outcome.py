"""What publishing a batch of outbox rows came to, shared by every transport's publisher."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPublished:
    """How far a batch got: ``rows[:sent]`` are on the broker, in id order.

    ``error`` says why ``rows[sent]`` is not; the rows after it may or may not
    have reached the broker (see each transport's module) and stay unpublished,
    so a later pass republishes them under the same task ids.
    """

    sent: int
    error: BaseException | None = None
    #: Of the sent rows: how many went out in batches (one MULTI/EXEC, one confirm wait)...
    batched: int = 0
    #: ... and how many took kombu's per-message path.
    one_by_one: int = 0

