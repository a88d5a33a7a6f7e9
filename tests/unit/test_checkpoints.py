"""Step keys by call order, the JSON round-trip rule, and the durable errors' messages and pickling."""

from __future__ import annotations

import datetime as dt
import enum
import pickle
import uuid
from decimal import Decimal

import pytest
from celery import Celery

import celery_durable
from celery_durable.errors import (
    DurableError,
    NotDurable,
    NotJSON,
    RunIdInvalid,
    RunNotDead,
    RunNotFound,
    SchemaOutdated,
    StepNameInvalid,
    StoreUnavailable,
)
from celery_durable.planning.checkpoints import (
    MAX_RUN_ID,
    MAX_STEP_NAME,
    Ledger,
    StepKey,
    check_run_id,
    check_step_name,
)
from celery_durable.store.json_values import encode, from_json, to_json


def test_occurrences_count_by_call_order_per_name():
    ledger = Ledger()
    keys = [ledger.next_key(n) for n in ["charge", "reserve", "reserve", "charge", "reserve"]]
    assert keys == [StepKey("charge", 0), StepKey("reserve", 0), StepKey("reserve", 1),
                    StepKey("charge", 1), StepKey("reserve", 2)]


def test_a_replay_finds_what_the_first_execution_recorded():
    first = Ledger()
    first.record(first.next_key("reserve"), "1")
    first.record(first.next_key("reserve"), "2")
    replay = Ledger(stored=dict(first.stored))
    assert [replay.lookup(replay.next_key("reserve")) for _ in range(3)] == ["1", "2", None]


@pytest.mark.parametrize("name", ["", "   ", None, 3, b"charge", "x" * 201])
def test_a_step_name_must_be_a_non_empty_string(name):
    with pytest.raises(StepNameInvalid, match="step name"):
        Ledger().next_key(name)


# Names the steps table (durable_steps.name VARCHAR(200), PostgreSQL or SQLite) cannot hold,
# and what the error must say about each.
BAD_STEP_NAMES = [
    pytest.param("bad\x00name", r"'bad\\x00name' contains a NUL character \(\\x00\) at position 3", id="nul"),
    pytest.param("\x00", "contains a NUL character", id="only-nul"),
    pytest.param("charge\ud800", r"'charge\\ud800' is not encodable as UTF-8: a lone surrogate "
                 r"'\\ud800' at position 6", id="lone-high-surrogate"),
    pytest.param("\udc80x", "not encodable as UTF-8: a lone surrogate", id="lone-low-surrogate"),
    pytest.param("x" * (MAX_STEP_NAME + 1), r"'x{40}'\.\.\. is 201 characters; at most 200", id="201-chars"),
]


@pytest.mark.parametrize(("name", "problem"), BAD_STEP_NAMES)
def test_a_step_name_the_steps_table_cannot_hold_is_refused_naming_the_problem(name, problem):
    with pytest.raises(StepNameInvalid, match=problem) as err:
        Ledger().next_key(name)
    assert str(err.value).startswith("step name '"), str(err.value)
    # The message is stored as the dead run's last error: it must itself be storable.
    assert "\x00" not in str(err.value)
    str(err.value).encode("utf-8")
    assert len(str(err.value)) < 200


@pytest.mark.parametrize("name", [
    "charge", "x" * MAX_STEP_NAME, "\u20ac" * 66, "\u00e9" * 100,
    # PostgreSQL's VARCHAR(200) counts characters: 200 of them fit whatever their UTF-8 size.
    "\u20ac" * 200, "x" * 199 + "\u00e9", "reçu/émis #2", "\U0001f4e6 ship",
    " padded ", "tab\there", "line\nbreak",
])
def test_a_step_name_the_steps_table_can_hold_is_accepted(name):
    assert check_step_name(name) == name
    assert Ledger().next_key(name) == StepKey(name, 0)


@pytest.mark.parametrize("name", ["bad\x00name", "bad\ud800", "y" * 201])
def test_a_bad_step_name_is_refused_by_the_plain_step_function_before_the_missing_run(name):
    called = []
    with pytest.raises(StepNameInvalid, match="step name"):
        celery_durable.step(name, called.append, 1)
    assert called == []


def test_step_name_invalid_is_final_so_the_run_is_buried_without_a_retry():
    from celery_durable.tasks.durable import FINAL_ERRORS

    assert StepNameInvalid in FINAL_ERRORS


# -- run ids (Celery task ids) the runs table (durable_runs.id VARCHAR(255)) can and cannot hold -------

BAD_RUN_IDS = [
    pytest.param(None, "must be a non-empty string, got None", id="none"),
    pytest.param("", "must be a non-empty string, got ''", id="empty"),
    pytest.param(42, "must be a non-empty string, got 42", id="int"),
    pytest.param(b"abc", "must be a non-empty string, got b'abc'", id="bytes"),
    pytest.param(["a" * 500], r"got \['aaaa.*\.\.\.$", id="long-non-str-truncated"),
    pytest.param("abc\x00def", r"'abc\\x00def' contains a NUL character \(\\x00\) at position 3", id="nul"),
    pytest.param("id-\udfff", r"'id-\\udfff' is not encodable as UTF-8: a lone surrogate", id="lone-surrogate"),
    pytest.param("i" * (MAX_RUN_ID + 1), r"'i{40}'\.\.\. is 256 characters; at most 255", id="256-chars"),
]


@pytest.mark.parametrize(("value", "problem"), BAD_RUN_IDS)
def test_a_task_id_the_runs_table_cannot_hold_is_refused_naming_the_id(value, problem):
    with pytest.raises(RunIdInvalid, match=problem) as err:
        check_run_id(value)
    message = str(err.value)
    assert message.startswith(("run id (the Celery task id) ", "a run id (the Celery task id) ")), message
    assert err.value.code == "durable.run.id_invalid"
    assert isinstance(err.value, DurableError)
    # The id is shown cut short, never whole: a message stays a line.
    assert len(message) < 200, message
    assert "\x00" not in message
    message.encode("utf-8")


@pytest.mark.parametrize("value", [
    "d6f1c2f4-3c1e-4c53-9a55-1a2b3c4d5e6f", "a", "x" * MAX_RUN_ID, "\u00e9" * 127 + "x", "order:42/retry 1",
    "\u00e9" * MAX_RUN_ID,
])
def test_a_task_id_the_runs_table_can_hold_is_accepted(value):
    assert check_run_id(value) == value


@pytest.mark.parametrize("value", [None, True, 0, 1.5, "s", [1, [2]], {"a": {"b": [None]}}])
def test_json_values_are_accepted(value):
    assert to_json("step 'x'", value)


@pytest.mark.parametrize(("value", "detail"), [
    ((1, 2), "is a tuple"),
    ({1: "a"}, "key 1 at top level is a int"),
    ({"when": {1, 2}}, "['when'] is a set"),
    ([float("nan")], "[0] is nan"),
    (object(), "is a object"),
    ({"a": [1, frozenset({1})]}, "['a'][1] is a frozenset"),
    # A user's dict shaped like kombu's typed envelope would come back as a datetime.
    ({"__type__": "datetime", "__value__": "2026-12-03T10:00:00"}, "does not decode to an equal value"),
    ({"__type__": "no-such-type", "__value__": 1}, "does not decode to an equal value"),
    (Decimal("NaN"), "does not decode to an equal value"),
])
def test_a_value_that_does_not_round_trip_names_the_step_and_the_part(value, detail):
    with pytest.raises(NotJSON) as err:
        to_json("the result of step 'charge'", value)
    assert "step 'charge'" in str(err.value)
    assert detail in str(err.value)


KOMBU_TYPED_VALUES = [
    dt.datetime(2026, 12, 3, 10, 0, 0, 123456),
    dt.datetime(2026, 12, 3, 10, 0, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    dt.date(2026, 12, 3),
    dt.time(23, 59, 1),
    Decimal("10.10"),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    b"utf-8 bytes",
    b"\xff\x00 not utf-8",
    {"at": [dt.date(2026, 1, 1), {"amount": Decimal("0.1")}]},
]


@pytest.mark.parametrize("value", KOMBU_TYPED_VALUES, ids=repr)
def test_what_celerys_json_carries_comes_back_as_it_was(value):
    # Celery's json serializer (kombu's) sends these as task arguments, typed;
    # a step may return them and a replay hands back the same type and value.
    back = from_json(to_json("the result of step 'x'", value))
    assert back == value and type(back) is type(value)
    assert from_json(encode("the arguments of t", [value])) == [value]


def test_true_and_one_are_not_the_same_after_a_round_trip():
    # 1 == True in Python; the round trip must keep the type the step returned.
    assert to_json("s", [1, True]) == "[1,true]"
    assert to_json("s", 1.0) == "1.0"


def test_run_arguments_only_need_to_be_json():
    assert encode("the arguments of t", [(1, 2)]) == "[[1,2]]"
    with pytest.raises(NotJSON, match="the arguments of t must be JSON-serialisable to be stored: .*is a object"):
        encode("the arguments of t", [object()])


def test_step_outside_a_durable_run_says_where_to_call_it():
    with pytest.raises(NotDurable, match="only work inside a durable run"):
        celery_durable.step("charge", lambda: 1)


def test_a_bad_step_name_is_reported_before_the_missing_run():
    with pytest.raises(StepNameInvalid):
        celery_durable.step("", lambda: 1)


@pytest.mark.parametrize("cls", [NotDurable, NotJSON, StepNameInvalid, StoreUnavailable, SchemaOutdated,
                                 RunNotFound, RunNotDead, RunIdInvalid])
def test_errors_survive_pickling(cls):
    err = pickle.loads(pickle.dumps(cls("what went wrong")))
    assert type(err) is cls and isinstance(err, DurableError)
    assert str(err) == "what went wrong" and err.code == cls.code


def test_install_adds_durable_task_once_and_it_takes_task_options():
    app = Celery("unit", broker="memory://")
    assert celery_durable.install(app) is app
    first = app.durable_task
    celery_durable.install(app)
    assert app.durable_task is first

    @app.durable_task(shared=False, bind=True, max_retries=5, retry_backoff=True, rate_limit="5/s",
                      name="unit.fulfil")
    def fulfil(self, order_id):
        return order_id

    assert isinstance(fulfil, celery_durable.DurableTask)
    assert (fulfil.name, fulfil.max_retries, fulfil.retry_backoff, fulfil.rate_limit) == (
        "unit.fulfil", 5, True, "5/s")
    assert fulfil.acks_late is True and fulfil.reject_on_worker_lost is True


def test_calling_a_durable_task_directly_is_refused():
    app = Celery("unit2", broker="memory://")
    celery_durable.install(app)

    @app.durable_task(shared=False)
    def plain(x):
        return x

    with pytest.raises(NotDurable, match=r"\.delay\(\)"):
        plain(1)


class _Colour(enum.IntEnum):
    RED = 1


class _Tag(str):
    pass


@pytest.mark.parametrize("value", [_Colour.RED, _Tag("t"), float("inf"), float("nan")], ids=repr)
def test_a_scalar_that_would_not_come_back_as_it_was_is_refused_without_a_decode_to_catch_it(value):
    # Plain scalars skip the decode check; a subclass must not ride that shortcut (it comes back
    # as the plain type), and a non-finite float is refused by the encode itself.
    with pytest.raises(NotJSON, match="step 'x'"):
        to_json("the result of step 'x'", value)


@pytest.mark.parametrize("value", ["\ud800 lone surrogate", "", 2**100, -0.0, 1e-310, False, None], ids=repr)
def test_a_plain_scalar_comes_back_as_it_was(value):
    back = from_json(to_json("the result of step 'x'", value))
    assert back == value and type(back) is type(value)
