"""planning/pass_replay.py: a pass the broker ran whole must be the pass the planner would have run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from celery_durable.errors import InvariantBroken
from celery_durable.planning.claim_sweep import begin_sweep
from celery_durable.planning.pass_replay import replay_pass


@dataclass(frozen=True)
class Answer:
    queue: str
    count: int
    taken: int
    messages: list[Any] = field(default_factory=list)


def test_the_answers_advance_the_sweep_and_hand_over_the_readable_messages() -> None:
    sweep = begin_sweep(["a", "b", "c"], {"a": 2, "b": 2, "c": 2}, 3, cursor=None)
    # a was asked for ceil(3/3) = 1 and gave it; b gave nothing (not reported); c was asked for
    # ceil(2/1) = 2 and gave 2, one of them unreadable.
    replayed = replay_pass(sweep, [Answer("a", 1, 1, ["m1"]), Answer("c", 2, 2, ["m2"])], learning=True)
    assert replayed.taken == [("a", "m1"), ("c", "m2")]
    assert replayed.unreadable == 1
    assert replayed.sweep.claimed == 3
    assert replayed.sweep.cursor == "c"
    assert set(replayed.emptied) == {"b"}  # passed over: asked, answered nothing


def test_a_queue_asked_and_short_is_proven_empty_only_when_learning() -> None:
    sweep = begin_sweep(["a"], {"a": 4}, 4, cursor=None)
    assert replay_pass(sweep, [Answer("a", 4, 1, ["m"])], learning=True).emptied == ("a",)
    assert replay_pass(sweep, [Answer("a", 4, 1, ["m"])], learning=False).emptied == ()


def test_an_answer_the_planner_would_not_have_asked_is_refused_naming_both() -> None:
    sweep = begin_sweep(["a", "b"], {"a": 2, "b": 2}, 2, cursor=None)
    with pytest.raises(InvariantBroken, match=r"asked 'a' for 2, the planner Ask\(queue='a', count=1"):
        replay_pass(sweep, [Answer("a", 2, 2, ["m1", "m2"])], learning=False)
