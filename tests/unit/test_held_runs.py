"""HeldRuns: each run taken at claim is given back exactly once, per queue, from any thread."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator

import pytest

from celery_durable.errors import InvariantBroken
from celery_durable.worker.held_runs import HeldRun, HeldRuns


class Message:
    """Stands in for a kombu message: HeldRuns only needs its identity."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __repr__(self) -> str:
        return f"Message({self.tag!r})"


def test_take_then_give_back_returns_the_run_once():
    held = HeldRuns(4, {"a": 2})
    message = Message("m1")
    run = held.take("a", message)
    assert isinstance(run, HeldRun)
    assert (run.queue, run.message, run.handed_back) == ("a", message, False)
    assert held.find(message) is run
    assert held.held() == 1

    assert held.give_back(message) is run
    assert held.held() == 0
    assert held.find(message) is None

    # A second give_back (say, a revoke after the finish) must not count twice.
    assert held.give_back(message) is None
    assert held.held() == 0
    assert held.held_by_queue() == {"a": 0}
    assert held.room() == 4
    assert held.free_slots() == {"a": 2}


def test_give_back_of_a_message_never_taken_returns_none_and_changes_nothing():
    held = HeldRuns(2, {"a": 1})
    held.take("a", Message("kept"))
    assert held.give_back(Message("stranger")) is None
    assert held.held() == 1
    assert held.held_by_queue() == {"a": 1}


def test_taking_a_message_already_held_is_refused():
    held = HeldRuns(4, {"a": 2})
    message = Message("m1")
    held.take("a", message)
    with pytest.raises(InvariantBroken):
        held.take("a", message)
    assert held.held() == 1
    assert held.held_by_queue() == {"a": 1}


def test_a_message_given_back_may_be_taken_again():
    held = HeldRuns(1, {"a": 1})
    message = Message("m1")
    held.take("a", message)
    held.give_back(message)
    held.take("a", message)
    assert held.held() == 1


@pytest.mark.parametrize(
    "capacity, slots, takes, held_by_queue, room, free",
    [
        pytest.param(5, {"a": 2, "b": 3}, [], {"a": 0, "b": 0}, 5, {"a": 2, "b": 3}, id="empty"),
        pytest.param(5, {"a": 2, "b": 3}, ["a"], {"a": 1, "b": 0}, 4, {"a": 1, "b": 3}, id="one"),
        pytest.param(5, {"a": 2, "b": 3}, ["a", "a", "b"], {"a": 2, "b": 1}, 2, {"a": 0, "b": 2},
                     id="a-full"),
        pytest.param(3, {"a": 8, "b": 8}, ["a", "b", "b"], {"a": 1, "b": 2}, 0, {"a": 7, "b": 6},
                     id="at-the-cap"),
        # Runs past a limit (an ETA message counted late, a slot lowered) clamp at zero, never negative.
        pytest.param(2, {"a": 1}, ["a", "a", "a"], {"a": 3}, 0, {"a": 0}, id="over-both-limits"),
        pytest.param(4, {"a": 2}, ["x"], {"a": 0, "x": 1}, 3, {"a": 2}, id="unknown-queue-counts-in-room"),
    ],
)
def test_counts_room_and_free_slots(capacity, slots, takes, held_by_queue, room, free):
    held = HeldRuns(capacity, slots)
    for i, queue in enumerate(takes):
        held.take(queue, Message(f"m{i}"))
    assert held.held() == len(takes)
    assert held.held_by_queue() == held_by_queue
    assert held.room() == room
    assert held.free_slots() == free


def test_giving_back_frees_the_slot_of_the_runs_own_queue():
    held = HeldRuns(4, {"a": 2, "b": 2})
    ma, mb = Message("a1"), Message("b1")
    held.take("a", ma)
    held.take("b", mb)
    held.give_back(ma)
    assert held.held_by_queue() == {"a": 0, "b": 1}
    assert held.free_slots() == {"a": 2, "b": 1}
    assert held.room() == 3


def test_set_queue_adds_a_queue_and_changes_its_slots_without_losing_its_count():
    held = HeldRuns(8, {"a": 2})
    held.set_queue("b", 3)
    assert held.queues() == ("a", "b")
    assert held.free_slots() == {"a": 2, "b": 3}
    held.take("a", Message("m"))
    held.set_queue("a", 5)
    assert held.free_slots() == {"a": 4, "b": 3}
    assert held.held_by_queue() == {"a": 1, "b": 0}


def test_snapshot_and_give_back_all():
    held = HeldRuns(8, {"a": 4, "b": 4})
    messages = [Message(f"m{i}") for i in range(5)]
    for i, message in enumerate(messages):
        held.take("a" if i % 2 else "b", message)
    runs = held.snapshot()
    assert sorted(run.message.tag for run in runs) == [m.tag for m in messages]
    held.give_back(messages[0])
    # give_back_all over a stale snapshot must not count the one already returned twice.
    held.give_back_all(runs)
    assert held.held() == 0
    assert held.held_by_queue() == {"a": 0, "b": 0}
    assert held.room() == 8


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_below_one_is_refused(capacity):
    with pytest.raises(InvariantBroken) as err:
        HeldRuns(capacity, {"a": 1})
    assert repr(capacity) in str(err.value)


def test_the_callers_slots_dict_is_not_shared():
    slots = {"a": 2}
    held = HeldRuns(4, slots)
    slots["a"] = 0
    assert held.free_slots() == {"a": 2}


# -- threads ---------------------------------------------------------------------------------------

THREADS = 16
PER_THREAD = 500


@pytest.fixture(autouse=True)
def switch_often() -> Iterator[None]:
    # Switch threads far more often than the default 5 ms so an unlocked
    # read-modify-write of a count is caught, not just possible.
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def run_threads(target, count: int = THREADS) -> None:
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            target(index)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    assert errors == []


def test_many_threads_taking_and_giving_back_end_at_zero():
    queues = ["a", "b", "c"]
    held = HeldRuns(THREADS * PER_THREAD, {q: PER_THREAD * THREADS for q in queues})
    peak = {"seen": 0}

    def work(index: int) -> None:
        mine = [Message(f"{index}-{i}") for i in range(PER_THREAD)]
        for i, message in enumerate(mine):
            held.take(queues[(index + i) % 3], message)
        # All of this thread's runs are held now, whatever the others do.
        peak["seen"] = max(peak["seen"], held.held())
        for message in mine:
            assert held.give_back(message) is not None

    run_threads(work)
    assert held.held() == 0
    assert held.held_by_queue() == {"a": 0, "b": 0, "c": 0}
    assert held.room() == held.capacity
    assert peak["seen"] >= PER_THREAD


def test_a_message_given_back_from_many_threads_at_once_counts_once():
    held = HeldRuns(1000, {"a": 1000})
    messages = [Message(f"m{i}") for i in range(200)]
    for message in messages:
        held.take("a", message)
    returned = [0] * THREADS

    def race(index: int) -> None:
        # Every thread tries to give back every message (finish, revoke and reject racing).
        for message in messages:
            if held.give_back(message) is not None:
                returned[index] += 1

    run_threads(race)
    assert sum(returned) == len(messages)
    assert held.held() == 0
    assert held.held_by_queue() == {"a": 0}


# -- scheduled (ETA) runs: counted, holding no slot until due -------------------------------


def test_a_scheduled_run_frees_its_slot_and_keeps_its_count():
    held = HeldRuns(capacity=1, queue_slots={"q": 1})
    message = object()
    held.take("q", message)
    assert held.room() == 0
    assert held.schedule(message) is True
    assert (held.held(), held.scheduled(), held.total(), held.room()) == (0, 1, 1, 1)
    assert held.free_slots() == {"q": 1}
    assert held.schedule(message) is False  # already scheduled


def test_a_due_run_is_admitted_only_when_the_cap_and_its_queue_have_room():
    held = HeldRuns(capacity=1, queue_slots={"q": 1})
    eta, running = object(), object()
    held.take("q", eta)
    held.schedule(eta)
    held.take("q", running)
    assert held.try_admit(eta) is False  # the worker is full
    assert held.scheduled() == 1
    held.give_back(running)
    assert held.try_admit(eta) is True
    assert (held.held(), held.scheduled(), held.room()) == (1, 0, 0)
    assert held.try_admit(eta) is True  # not scheduled any more: nothing to do


def test_giving_back_a_scheduled_run_returns_the_scheduled_count_exactly_once():
    held = HeldRuns(capacity=2, queue_slots={"q": 2})
    message = object()
    held.take("q", message)
    held.schedule(message)
    assert held.give_back(message) is not None
    assert held.give_back(message) is None
    assert (held.held(), held.scheduled(), held.total(), held.room()) == (0, 0, 0, 2)


def test_too_many_scheduled_runs_stop_claiming_but_not_admission():
    held = HeldRuns(capacity=2, queue_slots={"q": 2}, max_scheduled=2)
    first, second = object(), object()
    for message in (first, second):
        held.take("q", message)
        held.schedule(message)
    assert held.room() == 0
    assert held.try_admit(first) is True
    assert held.room() == 1


def test_a_run_in_the_pool_is_never_scheduled():
    held = HeldRuns(capacity=1, queue_slots={"q": 1})
    message = object()
    run = held.take("q", message)
    run.in_pool = True
    assert held.schedule(message) is False
    assert held.held() == 1


@pytest.mark.parametrize("seed", range(20))
def test_free_slots_kept_as_runs_come_and_go_equal_a_recount(seed):
    """The free slots are kept as runs are taken, scheduled, admitted, given back and queues change;
    after every step they equal the slots less the runs holding one, counted afresh."""
    rng = random.Random(seed)
    slots = {"a": 2, "b": 1, "c": 3}
    held = HeldRuns(4, slots)
    messages: list[object] = []
    for _ in range(200):
        op = rng.choice(["take", "take", "give_back", "schedule", "try_admit", "set_queue"])
        if op == "take":
            message = object()
            held.take(rng.choice(sorted(slots)), message)
            messages.append(message)
        elif op == "set_queue":
            queue = rng.choice(["a", "b", "c", "d"])
            slots[queue] = rng.randint(0, 4)
            held.set_queue(queue, slots[queue])
        elif messages:
            message = rng.choice(messages)
            if op == "give_back":
                held.give_back(message)
                messages.remove(message)
            else:
                getattr(held, op)(message)
        holding = [run.queue for run in held.snapshot() if not run.scheduled]
        assert held.free_slots() == {q: max(n - holding.count(q), 0) for q, n in slots.items()}
