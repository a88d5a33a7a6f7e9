"""The worker's command-line options: their text read into the settings they override, refusals naming them."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_durable.config import from_celery_conf
from celery_durable.errors import ConfigInvalid
from celery_durable.worker.cli_options import OPTIONS, add_worker_options, naming_the_option, overrides


@pytest.mark.parametrize(("given", "expected"), [
    ({}, {}),
    ({"max_in_flight": None, "autoscale": None}, {}),
    ({"max_in_flight": "4"}, {"durable_max_in_flight": 4}),
    ({"max_in_flight": "four"}, {"durable_max_in_flight": "four"}),   # refused by the setting's own check
    ({"max_in_flight": "1.5"}, {"durable_max_in_flight": 1.5}),
    ({"queue_concurrency": "3"}, {"durable_queue_concurrency": 3}),
    ({"queue_concurrency": "reports=2, emails = 4"}, {"durable_queue_concurrency": {"reports": 2, "emails": 4}}),
    ({"queue_concurrency": "a.b-c=1"}, {"durable_queue_concurrency": {"a.b-c": 1}}),
    ({"drain_timeout": "2.5"}, {"durable_drain_timeout": 2.5}),
    ({"metrics_port": "9100"}, {"durable_metrics_port": 9100}),
    ({"metrics_port": "9100-9109"}, {"durable_metrics_port": "9100-9109"}),
])
def test_an_options_text_is_read_as_the_type_its_setting_takes(given, expected):
    assert overrides(given) == expected


@pytest.mark.parametrize("text", ["reports", "a=1,=2", "a=1,,b=2", "a=1=2"])
def test_queue_concurrency_that_is_neither_a_count_nor_pairs_is_refused(text):
    with pytest.raises(ConfigInvalid) as caught:
        overrides({"queue_concurrency": text})
    refusal = naming_the_option(caught.value, {caught.value.setting: None})
    assert str(refusal).startswith("--queue-concurrency must be N (every queue) or queue=N,queue=N")


@pytest.mark.parametrize(("given", "named"), [
    ({"max_in_flight": "0"}, "--max-in-flight must be a whole number >= 1, got 0"),
    ({"queue_concurrency": "x=0"}, "--queue-concurrency['x'] must be a whole number >= 1, got 0"),
    ({"drain_timeout": "-1"}, "--drain-timeout must be >= 0 seconds, got -1"),
    ({"metrics_port": "99999"}, "--metrics-port must be a port 1..65535"),
])
def test_a_refused_override_names_the_option_not_the_setting(given, named):
    given_overrides = overrides(given)
    with pytest.raises(ConfigInvalid) as caught:
        from_celery_conf({}, given_overrides)
    assert str(naming_the_option(caught.value, given_overrides)).startswith(named)


def test_a_refusal_of_a_setting_no_option_gave_keeps_the_setting_name():
    with pytest.raises(ConfigInvalid) as caught:
        from_celery_conf({"durable_max_in_flight": 0}, overrides({"drain_timeout": "5"}))
    assert str(naming_the_option(caught.value, {"durable_drain_timeout": 5})).startswith("durable_max_in_flight")


def test_install_adds_each_option_to_the_worker_command_once():
    app = Celery("options", set_as_current=False)
    add_worker_options(app)
    add_worker_options(app)
    flags = [flag for option in app.user_options["worker"] for flag in option.opts]
    assert sorted(flags) == sorted(option.flag for option in OPTIONS)
    assert {option.keyword for option in OPTIONS} == {"max_in_flight", "queue_concurrency", "drain_timeout",
                                                      "metrics_port"}
