"""A durable sleep's hand-off: control flow a task body's ``except Exception`` cannot swallow."""

from __future__ import annotations

import pickle

from celery_durable.errors import SleepHandOff


def test_the_hand_off_is_no_exception_so_a_broad_except_lets_it_through():
    assert issubclass(SleepHandOff, BaseException)
    assert not issubclass(SleepHandOff, Exception)


def test_the_hand_off_survives_pickling_and_names_its_step_and_wait():
    back = pickle.loads(pickle.dumps(SleepHandOff("nap", 2.5)))
    assert (back.step, back.wake_in) == ("nap", 2.5)
    assert str(back) == "durable sleep 'nap': woken again in 2.500s"
