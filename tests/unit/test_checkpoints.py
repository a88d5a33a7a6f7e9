"""Step keys by call order, the JSON round-trip rule, and the durable errors' messages and pickling."""

from __future__ import annotations

import pickle

import pytest
from celery import Celery

import celery_durable
from celery_durable.checkpoints import Ledger, StepKey, encode, to_json
from celery_durable.errors import (
    DurableError,
    NotDurable,
    NotJSON,
    RunNotDead,
    RunNotFound,
    SchemaOutdated,
    StepNameInvalid,
    StoreUnavailable,
)


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


@pytest.mark.parametrize("value", [None, True, 0, 1.5, "s", [1, [2]], {"a": {"b": [None]}}])
def test_json_values_are_accepted(value):
    assert to_json("step 'x'", value)


@pytest.mark.parametrize(("value", "detail"), [
    ((1, 2), "is a tuple"),
    ({1: "a"}, "key 1 at top level is a int"),
    ({"when": {1, 2}}, "['when'] is a set"),
    ([float("nan")], "[0] is nan"),
    (object(), "is a object"),
    ({"a": [1, b"x"]}, "['a'][1] is a bytes"),
])
def test_a_value_that_does_not_round_trip_names_the_step_and_the_part(value, detail):
    with pytest.raises(NotJSON) as err:
        to_json("the result of step 'charge'", value)
    assert "step 'charge'" in str(err.value)
    assert detail in str(err.value)


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
                                 RunNotFound, RunNotDead])
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
