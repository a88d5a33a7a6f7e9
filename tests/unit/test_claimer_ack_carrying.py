"""The claimer's hook for a fetcher that carries acks: every ack waiting for a pass goes with it or right after."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
from kombu import Connection, Queue

from celery_durable.testing.clock import FakeClock
from celery_durable.worker.claimer import Claimer
from celery_durable.worker.fetchers import PassAsk
from celery_durable.worker.held_runs import HeldRuns


class CarryingFetcher:
    """Records what the claimer asks of an ack carrier; its passes claim nothing."""

    def __init__(self) -> None:
        self.round_trips = 0
        self.calls: list[str] = []
        self.pass_coming: Callable[[], bool] = lambda: False

    def fetch(self, queue: Any, count: int, keep_going: Callable[[], bool]) -> Iterator[Any]:
        return iter(())

    def claim_pass(self, order: Sequence[str], free: Mapping[str, int], room: int | None) -> list[PassAsk]:
        self.calls.append("pass")
        return []

    def carry_acks(self, pass_coming: Callable[[], bool]) -> None:
        self.calls.append("carry")
        self.pass_coming = pass_coming

    def send_acks(self) -> None:
        self.calls.append("send")


@pytest.fixture
def claimer() -> Iterator[tuple[Claimer, CarryingFetcher, list[Callable[[], None]], dict[str, bool]]]:
    fetcher = CarryingFetcher()
    scheduled: list[Callable[[], None]] = []
    stopping = {"requested": False}
    with Connection("memory://") as connection:
        made = Claimer(connection=connection, queues=lambda: [Queue("q")], held=HeldRuns(2, {"q": 2}),
                       accept=["json"], schedule=scheduled.append, clock=FakeClock(),
                       stop_requested=lambda: stopping["requested"], new_fetcher=lambda channel, accept: fetcher)
        made.handler = lambda message: None
        yield made, fetcher, scheduled, stopping
        made.close()


def test_acks_ride_only_while_a_kicked_pass_is_coming_and_what_it_left_goes_right_after(claimer):
    made, fetcher, scheduled, _ = claimer
    made.start()
    # The first pass runs in start; whatever it did not carry goes right after it.
    assert fetcher.calls == ["carry", "pass", "send"]
    assert not fetcher.pass_coming()  # no pass kicked: an ack now goes at once
    made.kick()  # a run finished
    assert fetcher.pass_coming()
    assert len(scheduled) == 1
    scheduled.pop()()
    assert fetcher.calls[3:] == ["pass", "send"]
    assert not fetcher.pass_coming()


def test_a_pass_that_does_not_claim_still_sends_the_acks_waiting_for_it(claimer):
    made, fetcher, scheduled, stopping = claimer
    made.start()
    fetcher.calls.clear()
    made.kick()
    stopping["requested"] = True  # a SIGTERM: passes claim nothing from now on
    assert not fetcher.pass_coming()
    scheduled.pop()()
    assert fetcher.calls == ["send"]


def test_a_stop_sends_the_acks_waiting_for_a_pass_that_will_not_come(claimer):
    made, fetcher, _, _ = claimer
    made.start()
    fetcher.calls.clear()
    made.kick()
    made.stop()
    assert fetcher.calls == ["send"]
    assert not fetcher.pass_coming()
