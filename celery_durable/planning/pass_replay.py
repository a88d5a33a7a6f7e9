"""A claim pass the broker ran whole, checked against the planner: the pure replay.

A broker that runs a pass in one round trip (a Redis script, the rows broker's statement) reports
what each ask took, and only the asks that took something. The replay walks the planner's sweep
(planning/claim_sweep.py) through those answers: every answer must be the ask the planner would
have made there, or the two disagree on the turn and the pass is refused. It also collects what a
broker that notifies needs to know afterwards: the queues the pass proved empty. The executor
(worker/claimer.py) fetches and admits; this module only checks and counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from celery_durable.errors import InvariantBroken
from celery_durable.planning.claim_sweep import Sweep, next_ask, passed_over, record, skip_to, unanswered


class AskAnswer(Protocol):
    """One ask of a whole pass as the broker answered it (worker/fetchers.py's ``PassAsk``)."""

    @property
    def queue(self) -> str: ...

    @property
    def count(self) -> int: ...

    @property
    def taken(self) -> int: ...

    @property
    def messages(self) -> list[Any]: ...


class Replayed(NamedTuple):
    """The sweep after the pass, the messages to admit by queue, and what the pass learnt.

    A tuple, not a frozen dataclass: one is made on every pass a broker runs whole (Redis, the rows
    brokers), and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``.
    """

    sweep: Sweep
    taken: list[tuple[str, Any]]
    #: Messages the broker took but could not hand over readable (each took room, holds no slot).
    unreadable: int
    #: Queues the pass proved empty: asked and gave less, passed over, or never answered (if learning).
    emptied: tuple[str, ...]


def replay_pass(sweep: Sweep, answers: Sequence[AskAnswer], *, learning: bool) -> Replayed:
    """Walk ``sweep`` through the broker's ``answers``; raises ``InvariantBroken`` where the two disagree.

    ``learning``: collect the queues proven empty (only a broker that notifies uses them; the walk to
    find the ones passed over is left out of every other pass).
    """
    unreadable = 0
    taken: list[tuple[str, Any]] = []
    emptied: list[str] = []
    for answer in answers:
        if learning:
            emptied.extend(passed_over(sweep, answer.queue))
            if answer.taken < answer.count:
                emptied.append(answer.queue)
        # The broker reports only the asks that took messages; the ones
        # between took nothing and leave the sweep as it was.
        ask, sweep = next_ask(skip_to(sweep, answer.queue))
        if ask is None or (ask.queue, ask.count) != (answer.queue, answer.count):
            raise InvariantBroken(f"the broker's claim pass asked {answer.queue!r} for {answer.count}, "
                                  f"the planner {ask!r}")
        sweep = record(sweep, ask, answer.taken)
        taken.extend((answer.queue, message) for message in answer.messages)
        unreadable += answer.taken - len(answer.messages)
    if learning:
        emptied.extend(unanswered(sweep))
    return Replayed(sweep=sweep, taken=taken, unreadable=unreadable, emptied=tuple(emptied))
