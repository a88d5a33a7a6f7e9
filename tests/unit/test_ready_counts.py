"""How long a RabbitMQ ready-count probe may stand in for a fresh one (planning/ready_counts.py)."""

from __future__ import annotations

from celery_durable.planning.ready_counts import MAX_AGE, MIN_AGE, ReadyCounts, reuse_age


def test_a_young_probe_stands_in_for_a_new_one_less_what_was_taken():
    memory = ReadyCounts()
    memory.probed({"a": 0, "b": 5}, now=100.0, probe_seconds=0.001)
    memory.took("b", asked=2, got=2)
    assert memory.reusable(["a", "b"], now=100.005) == {"a": 0, "b": 3}


def test_an_old_probe_is_not_reused():
    memory = ReadyCounts()
    memory.probed({"a": 0, "b": 5}, now=100.0, probe_seconds=0.001)
    assert memory.reusable(["a", "b"], now=100.02) is None


def test_no_probe_yet_or_a_forgotten_one_is_not_reused():
    memory = ReadyCounts()
    assert memory.reusable(["a"], now=1.0) is None
    memory.probed({"a": 3}, now=1.0, probe_seconds=0.001)
    memory.forget()
    assert memory.reusable(["a"], now=1.0) is None


def test_a_probe_that_did_not_ask_a_queue_is_not_reused_for_it():
    memory = ReadyCounts()
    memory.probed({"a": 3}, now=1.0, probe_seconds=0.001)
    assert memory.reusable(["a", "added"], now=1.001) is None


def test_a_probe_with_no_work_left_is_not_reused():
    # The worker would otherwise skip every queue: a fresh probe, or the idle
    # wait on all of them, must see a message that came meanwhile.
    memory = ReadyCounts()
    memory.probed({"a": 1, "b": 0}, now=1.0, probe_seconds=0.001)
    memory.took("a", asked=1, got=1)
    assert memory.reusable(["a", "b"], now=1.001) is None


def test_an_ask_that_brought_less_than_it_asked_marks_the_queue_drained():
    # Another worker took what the probe counted: asking again would bring nothing.
    memory = ReadyCounts()
    memory.probed({"a": 10, "b": 4}, now=1.0, probe_seconds=0.001)
    memory.took("a", asked=2, got=1)
    assert memory.reusable(["a", "b"], now=1.001) == {"a": 0, "b": 4}


def test_a_clock_that_went_back_does_not_make_a_probe_young():
    memory = ReadyCounts()
    memory.probed({"a": 3}, now=5.0, probe_seconds=0.001)
    assert memory.reusable(["a"], now=4.0) is None


def test_a_probe_is_reused_for_ten_times_what_it_cost_within_bounds():
    assert reuse_age(0.0007) == 0.007
    assert reuse_age(0.0001) == MIN_AGE
    assert reuse_age(5.0) == MAX_AGE


def test_a_costly_probe_is_reused_longer():
    memory = ReadyCounts()
    memory.probed({"a": 0, "b": 5}, now=1.0, probe_seconds=0.0008)
    assert memory.reusable(["a", "b"], now=1.0075) == {"a": 0, "b": 5}
    assert memory.reusable(["a", "b"], now=1.0085) is None
