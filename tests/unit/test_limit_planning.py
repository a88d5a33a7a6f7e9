"""The fleet limits' pure rules: what a task declares, the rate's arithmetic, and a batch's decisions."""

from __future__ import annotations

import math
import sys
from datetime import datetime, timedelta, timezone

import pytest

from celery_durable.planning.limit_declarations import (
    OPTIONS,
    KeyFunctionFailed,
    LimitInvalid,
    Rate,
    Scope,
    TaskLimits,
    declared,
    of_app,
    of_task,
    parse_rate,
    unknown_option,
)
from celery_durable.planning.limits import (
    BACK,
    DROP,
    RUN,
    WAIT,
    LimitAsk,
    RunRoom,
    ScopeState,
    book_rate_turn,
    plan_batch,
    return_rate_turn,
)

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)


# -- declarations ------------------------------------------------------------------------
def test_a_task_without_limits_declares_none():
    assert declared("t", {"durable_concurrency": None}) is None


def test_concurrency_key_and_rate_are_read():
    limits = declared("t", {"durable_concurrency": 3, "durable_key": lambda org, **kw: f"org:{org}",
                            "durable_key_limit": 2, "durable_when_busy": "drop", "durable_rate_limit": "100/m"})
    assert limits is not None
    assert limits.scopes(["a"], {}) == (Scope("t", "task", "", 3), Scope("t", "key", "org:a", 2))
    assert limits.when_busy == DROP
    assert limits.rate == Rate(100, 60.0, 1)
    assert limits.rate.interval == pytest.approx(0.6)


@pytest.mark.parametrize("value", [0, -1, 2.5, 3.0, math.nan, True, "3", None.__class__])
@pytest.mark.parametrize("option", ["durable_concurrency", "durable_key_limit"])
def test_a_count_that_is_not_a_whole_number_of_at_least_one_is_refused_naming_task_and_option(option, value):
    options = {option: value, "durable_key": lambda *a, **k: "k"}
    with pytest.raises(LimitInvalid) as err:
        declared("tasks.export", options)
    assert "tasks.export" in str(err.value) and option in str(err.value)


@pytest.mark.parametrize("value", ["100/x", "0/m", "-1/m", "100", "m/100", "1.5/s", 100, "", "100/ m/"])
def test_a_rate_that_does_not_parse_is_refused_naming_task_and_option(value):
    with pytest.raises(LimitInvalid) as err:
        declared("tasks.call", {"durable_rate_limit": value})
    assert "tasks.call" in str(err.value) and "durable_rate_limit" in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize(("options", "named"), [
    ({"durable_key_limit": 2}, "durable_key_limit needs durable_key"),
    ({"durable_when_busy": "drop"}, "durable_when_busy needs durable_concurrency or durable_key"),
    ({"durable_key": "org"}, "durable_key must be a function"),
    ({"durable_key": lambda: "k", "durable_when_busy": "later"}, "durable_when_busy must be one of"),
    ({"durable_rate_burst": 5}, "durable_rate_burst needs durable_rate_limit"),
    ({"durable_rate_limit": "10/s", "durable_rate_burst": 0}, "durable_rate_burst must be a whole number"),
])
def test_inconsistent_options_are_refused_naming_what_is_wrong(options, named):
    with pytest.raises(LimitInvalid, match=named):
        declared("t", options)


def test_a_key_function_that_raises_or_returns_no_key_fails_naming_the_task_and_error():
    raising = declared("t", {"durable_key": lambda org: 1 / 0})
    assert raising is not None
    with pytest.raises(KeyFunctionFailed, match=r"task 't': durable_key raised ZeroDivisionError"):
        raising.scopes(["a"], {})
    for bad in (None, "", 7, "x" * 201):
        limits = declared("t", {"durable_key": lambda org, bad=bad: bad})
        assert limits is not None
        with pytest.raises(KeyFunctionFailed, match="durable_key"):
            limits.scopes(["a"], {})


def test_a_call_may_say_what_it_does_when_busy_and_a_bad_choice_fails_that_run_named():
    limits = declared("t", {"durable_key": lambda org: org, "durable_when_busy": "wait"})
    assert limits is not None
    assert limits.when_busy_of(None) == WAIT
    assert limits.when_busy_of("drop") == DROP
    with pytest.raises(KeyFunctionFailed, match=r"task 't': header durable_when_busy must be one of .* 'later'"):
        limits.when_busy_of("later")


def test_rate_units():
    assert parse_rate("t", "10/s") == Rate(10, 1.0)
    assert parse_rate("t", " 3 / h ") == Rate(3, 3600.0)
    assert parse_rate("t", "1/d", 4) == Rate(1, 86400.0, 4)


# -- the rate's arithmetic ------------------------------------------------------------------
def test_turns_are_an_interval_apart_however_many_book_at_once():
    tat = None
    starts = []
    for _ in range(5):
        turn = book_rate_turn(tat, T0, 0.6)
        starts.append((turn.start_at - T0).total_seconds())
        tat = turn.tat
    assert starts == pytest.approx([0.0, 0.6, 1.2, 1.8, 2.4])


def test_an_idle_limit_lets_the_next_run_start_at_once():
    turn = book_rate_turn(T0 - timedelta(seconds=10), T0, 0.6)
    assert turn.start_at == T0 and not turn.waits(T0)


def test_a_burst_starts_back_to_back_then_the_rate_holds():
    tat = None
    waits = []
    for _ in range(4):
        turn = book_rate_turn(tat, T0, 1.0, burst=3)
        waits.append((turn.start_at - T0).total_seconds())
        tat = turn.tat
    assert waits == [0.0, 0.0, 0.0, 1.0]


def test_a_turn_given_back_moves_the_next_start_one_interval_earlier():
    tat = book_rate_turn(book_rate_turn(None, T0, 1.0).tat, T0, 1.0).tat
    tat = return_rate_turn(tat, 1.0)
    assert book_rate_turn(tat, T0, 1.0).start_at == T0 + timedelta(seconds=1)


# -- a batch's decisions ------------------------------------------------------------------------
def _ask(task_id: str, *scopes: Scope, rate: Rate | None = None, when_busy: str = WAIT) -> LimitAsk:
    return LimitAsk("t", task_id, tuple(scopes), rate, when_busy)


def test_a_batch_fills_the_limit_then_parks_the_rest_in_order():
    scope = Scope("t", "task", "", 2)
    states = {scope: ScopeState(live=0)}
    plan = plan_batch([_ask(f"r{i}", scope) for i in range(4)], states, set(), set(), {}, T0)
    assert [d.verdict for d in plan.decisions] == [RUN, RUN, WAIT, WAIT]
    assert [(index, busy) for index, busy, _ in plan.parked] == [(2, scope), (3, scope)]
    assert states[scope].live == 2 and states[scope].waiting == 2


def test_waiters_go_before_a_new_message_when_a_lease_is_free():
    scope = Scope("t", "key", "org:a", 1)
    states = {scope: ScopeState(live=0, waiting=3)}
    plan = plan_batch([_ask("new", scope)], states, set(), set(), {}, T0)
    assert plan.decisions[0].verdict == WAIT
    assert plan.ready == {scope: 1}


def test_a_booked_message_takes_its_own_lease_and_frees_none_for_others():
    scope = Scope("t", "task", "", 2)
    states = {scope: ScopeState(live=2, booked={"b1", "b2"}, waiting=5)}
    plan = plan_batch([_ask("b1", scope), _ask("new", scope)], states, set(), set(), {}, T0)
    assert [d.verdict for d in plan.decisions] == [RUN, WAIT]
    assert plan.leases == [(scope, "b1", True)]
    assert plan.ready == {}


def test_a_copy_of_a_held_run_waits_rather_than_run_beside_it():
    scope = Scope("t", "task", "", 5)
    plan = plan_batch([_ask("x", scope)], {scope: ScopeState(live=1, held={"x"})}, set(), set(), {}, T0)
    assert plan.decisions[0].verdict == WAIT


def test_a_copy_of_a_parked_message_is_settled_without_a_second_row():
    scope = Scope("t", "task", "", 5)
    plan = plan_batch([_ask("x", scope)], {scope: ScopeState(live=0)}, {"x"}, set(), {}, T0)
    assert plan.decisions[0].verdict == WAIT and plan.parked == [] and plan.leases == []


def test_drop_when_busy_parks_nothing():
    scope = Scope("t", "key", "k", 1)
    plan = plan_batch([_ask("a", scope, when_busy=DROP), _ask("b", scope, when_busy=DROP)],
                      {scope: ScopeState(live=0)}, set(), set(), {}, T0)
    assert [d.verdict for d in plan.decisions] == [RUN, DROP]
    assert plan.parked == []


def test_an_early_message_books_its_turn_and_a_busy_one_gives_its_turn_back():
    rate = Rate(60, 60.0)
    scope = Scope("t", "task", "", 1)
    states = {scope: ScopeState(live=1, held={"other"})}
    plan = plan_batch([_ask("busy", scope, rate=rate), _ask("early", scope, rate=rate)], states, set(), set(),
                      {"t": None}, T0)
    # "busy" took the turn due now, found the scope busy and gave the turn back:
    # "early" then gets that same turn (now), and also finds the scope busy.
    assert [d.verdict for d in plan.decisions] == [WAIT, WAIT]
    assert plan.rate_bookings == []
    assert plan.tats["t"] == T0


def test_messages_over_the_rate_book_turns_an_interval_apart():
    rate = Rate(60, 60.0)
    plan = plan_batch([_ask(f"r{i}", rate=rate) for i in range(3)], {}, set(), set(), {"t": None}, T0)
    assert [d.verdict for d in plan.decisions] == [RUN, WAIT, WAIT]
    assert [start for _, _, start in plan.rate_bookings] == [T0 + timedelta(seconds=1), T0 + timedelta(seconds=2)]
    assert plan.decisions[0].holds_rate_turn


def test_a_message_back_with_its_booked_turn_runs_without_booking_another():
    rate = Rate(60, 60.0)
    plan = plan_batch([_ask("r1", rate=rate)], {}, set(), {("t", "r1")}, {"t": T0 + timedelta(seconds=5)}, T0)
    assert plan.decisions[0].verdict == RUN and plan.decisions[0].holds_rate_turn
    assert plan.used_rate_bookings == [("t", "r1")] and plan.tats == {}


# -- a pass that took more than its slots (the overdraw) ----------------------------------------
def _on(queue: str, task_id: str, *scopes: Scope, rate: Rate | None = None) -> LimitAsk:
    return LimitAsk("t", task_id, tuple(scopes), rate, WAIT, queue)


def test_runs_past_the_pass_room_go_back_while_busy_keys_still_park():
    a, b = Scope("t", "key", "org:a", 1), Scope("t", "key", "org:b", 1)
    states = {a: ScopeState(live=1, held={"other"}), b: ScopeState(live=0)}
    room = RunRoom(total=1, per_queue={"q": 1})
    plan = plan_batch([_on("q", "a1", a), _on("q", "c1"), _on("q", "a2", a), _on("q", "b1", b)],
                      states, set(), set(), {}, T0, room)
    # c1 (no scope) takes the one slot; a's are parked whatever the room; b1 could run but has no slot.
    assert [d.verdict for d in plan.decisions] == [WAIT, RUN, WAIT, BACK]
    assert plan.leases == [] and states[b].live == 0 and room.total == 0


def test_a_key_whose_first_message_goes_back_sends_its_later_ones_back_too():
    """Arrival order per key: b1 went back holding nothing, so b2 (finding the same lease free) must
    not run ahead of it."""
    b = Scope("t", "key", "org:b", 2)
    plan = plan_batch([_on("q", "b1", b), _on("q", "b2", b)], {b: ScopeState(live=0)}, set(), set(), {}, T0,
                      RunRoom(total=0, per_queue={"q": 0}))
    assert [d.verdict for d in plan.decisions] == [BACK, BACK]
    assert plan.leases == [] and plan.parked == []


def test_each_queue_spends_its_own_free_slots():
    scope = Scope("t", "task", "", 10)
    room = RunRoom(total=5, per_queue={"q1": 1, "q2": 5})
    plan = plan_batch([_on("q1", "x1", scope), _on("q1", "x2", scope), _on("q2", "y1", scope)],
                      {scope: ScopeState(live=0)}, set(), set(), {}, T0, room)
    assert [d.verdict for d in plan.decisions] == [RUN, BACK, RUN]
    assert room.per_queue == {"q1": 0, "q2": 4} and room.total == 3


def test_a_run_sent_back_returns_the_rate_turn_it_booked_and_keeps_one_it_came_with():
    rate = Rate(60, 60.0)
    no_room = RunRoom(total=0, per_queue={"q": 0})
    plan = plan_batch([_on("q", "new", rate=rate)], {}, set(), set(), {"t": None}, T0, no_room)
    assert plan.decisions[0].verdict == BACK
    assert plan.tats["t"] == T0 and plan.rate_bookings == []  # booked at T0 (TAT T0+1 s), given back
    booked = {("t", "r1")}
    plan = plan_batch([_on("q", "r1", rate=rate)], {}, set(), booked, {"t": T0 + timedelta(seconds=5)}, T0,
                      RunRoom(total=0, per_queue={"q": 0}))
    assert plan.decisions[0].verdict == BACK
    assert plan.used_rate_bookings == [] and booked == {("t", "r1")}, "its booking stays for when it comes back"


def test_run_room_fits_counts_each_queue():
    room = RunRoom(total=3, per_queue={"a": 1, "b": 2})
    assert room.fits(["a", "b", "b"]) and not room.fits(["a", "a"]) and not room.fits(["b"] * 4)
    assert room.total == 3, "fits spends nothing"


def test_a_key_named_by_the_message_replaces_the_functions_and_is_checked_the_same():
    limits = declared("t", {"durable_key": lambda org: f"org:{org}"})
    assert limits is not None
    assert limits.scopes(["a"], {}, "org:zz") == (Scope("t", "key", "org:zz", 1),)
    with pytest.raises(KeyFunctionFailed, match="non-empty string"):
        limits.scopes(["a"], {}, 7)


@pytest.mark.parametrize("bad", ["org:\x00", "\x00", "org:\udc80"])
def test_a_key_the_store_cannot_hold_fails_that_run_named_whether_the_function_or_a_header_gave_it(bad):
    limits = declared("t", {"durable_key": lambda org: org})
    assert limits is not None
    with pytest.raises(KeyFunctionFailed, match=r"task 't': durable_key returned .*(NUL|not valid Unicode)"):
        limits.scopes([bad], {})
    with pytest.raises(KeyFunctionFailed, match=r"task 't': durable_key returned .*(NUL|not valid Unicode)"):
        limits.scopes(["a"], {}, bad)
    assert limits.scopes(["org:é✓"], {}) == (Scope("t", "key", "org:é✓", 1),), "any other text is a key"


@pytest.mark.parametrize("option", ["durable_concurrency", "durable_key_limit", "durable_rate_burst"])
def test_a_count_past_the_stores_integer_is_refused_naming_task_and_option(option):
    options: dict[str, object] = {"durable_key": lambda *a, **k: "k", "durable_rate_limit": "1/s"}
    assert declared("tasks.export", {**options, option: 2**31 - 1}) is not None
    for value in (2**31, sys.maxsize):
        with pytest.raises(LimitInvalid, match=rf"task 'tasks.export': {option} must be at most 2147483647"):
            declared("tasks.export", {**options, option: value})


def test_a_rate_count_past_the_stores_integer_is_refused_naming_task_and_option():
    assert parse_rate("t", "2147483647/s").count == 2**31 - 1
    with pytest.raises(LimitInvalid, match=r"task 't': durable_rate_limit count must be at most 2147483647"):
        parse_rate("t", f"{sys.maxsize}/s")


def test_the_largest_burst_of_the_slowest_rate_starts_at_once_without_overflowing():
    rate = parse_rate("t", "1/d", 2**31 - 1)
    turn = book_rate_turn(T0 + timedelta(days=30), T0, rate.interval, rate.burst)
    assert turn.start_at == T0


@pytest.mark.parametrize(("typo", "near"), [("durable_concurency", "durable_concurrency"),
                                            ("durable_keylimit", "durable_key_limit"),
                                            ("durable_ratelimit", "durable_rate_limit"),
                                            ("durable_when_bussy", "durable_when_busy")])
def test_an_unknown_durable_task_option_is_refused_naming_task_option_and_the_near_name(typo, near):
    err = unknown_option("tasks.export", ["name", "acks_late", typo])
    assert isinstance(err, LimitInvalid)
    assert str(err).startswith(f"task 'tasks.export': {typo} is not a celery_durable task option")
    assert f"did you mean {near}?" in str(err)


def test_every_task_option_the_package_reads_is_accepted_and_an_unlike_one_lists_them():
    assert unknown_option("t", [*OPTIONS, "run", "name", "acks_late"]) is None
    far = unknown_option("t", ["durable_zzz"])
    assert far is not None and "the options are durable_concurrency" in str(far)


def test_a_task_class_declaring_a_typo_is_refused_when_its_limits_are_read():
    from celery import Celery

    app = Celery("t", set_as_current=False)

    @app.task(name="tasks.typo", durable_concurency=2, shared=False)  # not added to other tests' apps
    def typo() -> None: ...

    @app.task(name="tasks.fine", durable_concurrency=2, shared=False)
    def fine() -> None: ...

    with pytest.raises(LimitInvalid, match="'tasks.typo': durable_concurency .* did you mean durable_concurrency"):
        of_app(app)
    assert of_task(app.tasks["tasks.fine"]) == TaskLimits("tasks.fine", concurrency=2)
