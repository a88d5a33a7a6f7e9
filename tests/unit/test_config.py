"""DurableConfig: every bad ``durable_*`` value is refused naming its setting; good ones are read."""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_durable.config import DEFAULT_QUEUE_SLOTS, DurableConfig, from_celery_conf
from celery_durable.errors import ConfigInvalid, DurableError, InvariantBroken

NAN = float("nan")
INF = float("inf")

# Values no count setting may hold.
BAD_COUNTS = [
    pytest.param(0, id="zero"),
    pytest.param(-1, id="negative"),
    pytest.param(-100, id="very-negative"),
    pytest.param(1.5, id="fractional"),
    pytest.param(NAN, id="nan"),
    pytest.param(INF, id="inf"),
    pytest.param(-INF, id="minus-inf"),
    pytest.param("4", id="string"),
    pytest.param(True, id="bool-true"),
    pytest.param(False, id="bool-false"),
    pytest.param([4], id="list"),
]

# Values no seconds setting may hold.
BAD_SECONDS = [
    pytest.param(NAN, id="nan"),
    pytest.param(INF, id="inf"),
    pytest.param(-INF, id="minus-inf"),
    pytest.param(-1, id="negative"),
    pytest.param(-0.5, id="negative-fraction"),
    pytest.param("1", id="string"),
    pytest.param(True, id="bool"),
    pytest.param([1.0], id="list"),
]

SECONDS_SETTINGS = [
    "durable_safety_interval",
    "durable_restore_interval",
    "durable_drain_timeout",
    "durable_idle_poll_interval",
    "durable_beat_lease_ttl",
    "durable_run_retention",
]


def refused(conf: dict[str, Any]) -> ConfigInvalid:
    with pytest.raises(ConfigInvalid) as caught:
        from_celery_conf(conf)
    return caught.value


def assert_names(err: ConfigInvalid, setting: str) -> None:
    assert err.setting is not None
    assert err.setting.startswith(setting), err.setting
    assert setting in str(err), str(err)
    assert err.code == "durable.config.invalid"


# -- counts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", BAD_COUNTS)
def test_bad_max_in_flight_is_refused(value):
    err = refused({"durable_max_in_flight": value})
    assert_names(err, "durable_max_in_flight")
    assert err.setting == "durable_max_in_flight"
    assert repr(value) in str(err)


@pytest.mark.parametrize("value", [*BAD_COUNTS, pytest.param(3 + 0j, id="complex")])
def test_bad_queue_concurrency_is_refused(value):
    err = refused({"durable_queue_concurrency": value})
    assert_names(err, "durable_queue_concurrency")
    assert err.setting == "durable_queue_concurrency"


@pytest.mark.parametrize("value", [*BAD_COUNTS, pytest.param(None, id="none")])
def test_bad_slots_for_one_queue_are_refused_naming_the_queue(value):
    err = refused({"durable_queue_concurrency": {"good": 2, "reports": value}})
    assert_names(err, "durable_queue_concurrency")
    assert "reports" in err.setting
    assert "reports" in str(err)


@pytest.mark.parametrize(
    "key", [pytest.param(1, id="int"), pytest.param(None, id="none"), pytest.param("", id="empty"),
            pytest.param(("a",), id="tuple")],
)
def test_a_queue_slots_key_that_is_not_a_queue_name_is_refused(key):
    err = refused({"durable_queue_concurrency": {key: 2}})
    assert_names(err, "durable_queue_concurrency")
    assert repr(key) in str(err)


# -- seconds ----------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", SECONDS_SETTINGS)
@pytest.mark.parametrize("value", BAD_SECONDS)
def test_bad_seconds_are_refused(setting, value):
    err = refused({setting: value})
    assert_names(err, setting)
    assert err.setting == setting


@pytest.mark.parametrize(
    "setting", [s for s in SECONDS_SETTINGS if s not in ("durable_drain_timeout", "durable_run_retention")]
)
def test_zero_seconds_is_refused_for_intervals(setting):
    err = refused({setting: 0})
    assert_names(err, setting)


def test_zero_drain_timeout_is_allowed():
    assert from_celery_conf({"durable_drain_timeout": 0}).drain_timeout == 0


def test_runs_are_kept_seven_days_unless_told_and_zero_keeps_them_forever():
    assert from_celery_conf({}).run_retention == 7 * 86400
    assert from_celery_conf({"durable_run_retention": 0}).run_retention == 0


# -- the other settings ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "setting, value",
    [
        ("durable_execution", "gevent"),
        ("durable_execution", "Threads"),
        ("durable_execution", 1),
        ("durable_metrics_port", 0),
        ("durable_metrics_port", 65536),
        ("durable_metrics_port", "9100"),
        ("durable_metrics_port", True),
        ("durable_metrics_port", NAN),
        ("durable_metrics_host", ""),
        ("durable_metrics_host", 127),
        ("durable_metrics_task_names_limit", 0),
        ("durable_metrics_task_names_limit", -5),
        ("durable_metrics_task_names_limit", "100"),
        ("durable_metrics_task_names_limit", True),
        ("durable_metrics_task_names_limit", 2.5),
        ("durable_metrics_task_names_limit", 10_001),
        ("durable_relay", "false"),
        ("durable_relay", 0),
        ("durable_relay_batch_size", 0),
        ("durable_relay_batch_size", 2.5),
        ("durable_relay_poll_interval", 0),
        ("durable_relay_poll_interval", NAN),
        ("durable_outbox_retention", -1),
    ],
)
def test_other_bad_settings_are_refused(setting, value):
    err = refused({setting: value})
    assert_names(err, setting)
    assert err.setting == setting


@pytest.mark.parametrize(
    "key", ["durable_max_inflight", "durable_queue_concurency", "durable_", "durable_MAX_IN_FLIGHT"]
)
def test_an_unknown_durable_setting_is_refused_naming_it(key):
    err = refused({key: 4, "durable_max_in_flight": 2})
    assert err.setting == key
    assert key in str(err)


def test_the_first_unknown_setting_is_named_when_there_are_several():
    err = refused({"durable_zzz": 1, "durable_aaa": 1})
    assert err.setting == "durable_aaa"


def test_settings_without_the_prefix_are_not_ours_to_refuse():
    assert from_celery_conf({"worker_prefetch_multiplier": 4, "broker_url": "x", 3: 4}) == DurableConfig()


# -- good values -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "conf, expected",
    [
        pytest.param({}, DurableConfig(), id="nothing-set"),
        pytest.param({"durable_max_in_flight": None}, DurableConfig(max_in_flight=None), id="no-cap"),
        pytest.param({"durable_max_in_flight": 1}, DurableConfig(max_in_flight=1), id="cap-1"),
        pytest.param({"durable_max_in_flight": 16}, DurableConfig(max_in_flight=16), id="cap-16"),
        pytest.param({"durable_queue_concurrency": 3}, DurableConfig(default_queue_slots=3),
                     id="slots-for-every-queue"),
        pytest.param({"durable_queue_concurrency": None}, DurableConfig(), id="slots-unset"),
        pytest.param({"durable_queue_concurrency": {"reports": 2}},
                     DurableConfig(queue_slots={"reports": 2}), id="slots-per-queue"),
        pytest.param({"durable_queue_concurrency": {}}, DurableConfig(), id="slots-empty-dict"),
        pytest.param({"durable_execution": "threads"}, DurableConfig(execution="threads"), id="threads"),
        pytest.param(
            {"durable_safety_interval": 2, "durable_restore_interval": 0.5,
             "durable_drain_timeout": 0, "durable_idle_poll_interval": 0.01},
            DurableConfig(safety_interval=2.0, restore_interval=0.5, drain_timeout=0.0,
                          idle_poll_interval=0.01),
            id="seconds",
        ),
        pytest.param({"durable_metrics_port": 9100, "durable_metrics_host": "0.0.0.0"},
                     DurableConfig(metrics_port=9100, metrics_host="0.0.0.0"), id="metrics"),
        pytest.param({"durable_metrics_port": 65535}, DurableConfig(metrics_port=65535), id="top-port"),
        pytest.param({"durable_database_url": "sqlite://"}, DurableConfig(database_url="sqlite://"),
                     id="database-url-accepted"),
    ],
)
def test_good_values_are_read(conf, expected):
    assert from_celery_conf(conf) == expected


def test_slots_for_uses_the_named_slots_then_the_default():
    config = from_celery_conf({"durable_queue_concurrency": {"reports": 2}})
    assert config.slots_for("reports") == 2
    assert config.slots_for("default") == DEFAULT_QUEUE_SLOTS
    config = from_celery_conf({"durable_queue_concurrency": 3})
    assert config.slots_for("anything") == 3


def test_read_from_a_real_celery_app_conf():
    app = Celery("config-test", set_as_current=False)
    app.conf.update(durable_max_in_flight=4, durable_queue_concurrency={"reports": 2},
                    durable_drain_timeout=5)
    config = from_celery_conf(app.conf)
    assert config == DurableConfig(max_in_flight=4, queue_slots={"reports": 2}, drain_timeout=5.0)


def test_a_real_celery_app_conf_with_a_typo_is_refused():
    app = Celery("config-test", set_as_current=False)
    app.conf.update(durable_max_inflight=4)
    with pytest.raises(ConfigInvalid) as caught:
        from_celery_conf(app.conf)
    assert caught.value.setting == "durable_max_inflight"


def test_the_queue_slots_read_do_not_follow_later_changes_to_the_conf():
    slots = {"reports": 2}
    config = from_celery_conf({"durable_queue_concurrency": slots})
    slots["reports"] = 0
    assert config.slots_for("reports") == 2


# -- unconsumed_queues ----------------------------------------------------------------------------------

def test_slots_for_a_queue_this_worker_does_not_consume_are_named_not_refused():
    # One settings module serves workers with different -Q: the others' queues are not an error.
    config = from_celery_conf({"durable_queue_concurrency": {"reports": 2, "nope": 1, "emails": 3}})
    assert config.unconsumed_queues(["default", "reports"]) == ["emails", "nope"]
    assert config.slots_for("nope") == 1  # kept for an add_consumer that adds it later


@pytest.mark.parametrize(
    "slots, consumed",
    [
        ({"reports": 2}, ["default", "reports"]),
        ({"reports": 2}, ("reports",)),
        ({}, ["default"]),
        ({}, []),
    ],
)
def test_slots_for_consumed_queues_leave_nothing_unconsumed(slots, consumed):
    assert DurableConfig(queue_slots=slots).unconsumed_queues(consumed) == []


def test_unconsumed_queues_accepts_a_generator():
    assert DurableConfig(queue_slots={"a": 1, "c": 1}).unconsumed_queues(q for q in ["a", "b"]) == ["c"]


# -- direct construction --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"max_in_flight": 0}, "durable_max_in_flight"),
        ({"max_in_flight": 2.5}, "durable_max_in_flight"),
        ({"max_in_flight": True}, "durable_max_in_flight"),
        ({"default_queue_slots": 0}, "durable_queue_concurrency"),
        ({"default_queue_slots": None}, "durable_queue_concurrency"),
        ({"queue_slots": {"a": -1}}, "durable_queue_concurrency"),
        ({"queue_slots": {2: 1}}, "durable_queue_concurrency"),
        ({"queue_slots": None}, "durable_queue_concurrency"),
        ({"queue_slots": [("a", 1)]}, "durable_queue_concurrency"),
        ({"execution": None}, "durable_execution"),
        ({"safety_interval": None}, "durable_safety_interval"),
        ({"restore_interval": 0}, "durable_restore_interval"),
        ({"drain_timeout": math.nan}, "durable_drain_timeout"),
        ({"idle_poll_interval": -0.1}, "durable_idle_poll_interval"),
        ({"metrics_port": -1}, "durable_metrics_port"),
        ({"metrics_host": None}, "durable_metrics_host"),
    ],
)
def test_direct_construction_with_a_broken_invariant_raises(kwargs, setting):
    with pytest.raises(ConfigInvalid) as caught:
        DurableConfig(**kwargs)
    assert_names(caught.value, setting)


def test_a_direct_config_does_not_follow_later_changes_to_the_dict_it_was_given():
    # Validated once at construction: the caller's dict must not be able to
    # put a 0 behind the validation's back.
    slots = {"reports": 2}
    config = DurableConfig(queue_slots=slots)
    slots["reports"] = 0
    slots["other"] = -1
    assert config.slots_for("reports") == 2
    assert dict(config.queue_slots) == {"reports": 2}


def test_config_is_frozen():
    config = DurableConfig()
    with pytest.raises(AttributeError):
        config.max_in_flight = 0  # type: ignore[misc]


# -- errors cross processes ------------------------------------------------------------------------------------

def test_config_invalid_survives_a_pickle_round_trip():
    err = refused({"durable_max_in_flight": 0})
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ConfigInvalid
    assert back.setting == err.setting == "durable_max_in_flight"
    assert back.problem == err.problem
    assert str(back) == str(err)
    assert back.code == "durable.config.invalid"
    assert isinstance(back, DurableError)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_config_invalid_pickles_under_every_protocol(protocol):
    err = ConfigInvalid("durable_queue_concurrency['a']", "must be a whole number >= 1, got 0")
    back = pickle.loads(pickle.dumps(err, protocol=protocol))
    assert (type(back), back.setting, back.problem, str(back)) == (
        ConfigInvalid, err.setting, err.problem, str(err))


def test_other_durable_errors_survive_a_pickle_round_trip():
    err = InvariantBroken("room must be >= 0 or None, got -1")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is InvariantBroken
    assert str(back) == str(err)
    assert back.setting is None


def test_relay_settings_are_read():
    config = from_celery_conf({"durable_relay": False, "durable_relay_batch_size": 100,
                               "durable_relay_poll_interval": 0.25, "durable_outbox_retention": 60})
    assert (config.relay, config.relay_batch_size, config.relay_poll_interval, config.outbox_retention) == (
        False, 100, 0.25, 60.0)
    assert from_celery_conf({}).relay is True


# -- durable_database_url ---------------------------------------------------------------------------------

SECRET = "s3cr3t-pw"

BAD_DATABASE_URLS = [
    pytest.param(f"mysql://app:{SECRET}@db/app", "got a mysql URL", id="mysql"),
    pytest.param(f"mysql+pymysql://app:{SECRET}@db/app", "got a mysql URL", id="mysql-pymysql"),
    pytest.param(f"mssql+pyodbc://app:{SECRET}@db/app", "got a mssql URL", id="mssql"),
    pytest.param(f"oracle://app:{SECRET}@db/app", "got a oracle URL", id="oracle"),
    pytest.param(f"postgres://app:{SECRET}@db/app", "must name the dialect postgresql", id="postgres-alias"),
    pytest.param(f"postgresql+nosuchdriver://app:{SECRET}@db/app", "names a driver SQLAlchemy does not have",
                 id="unknown-driver"),
    pytest.param("not a url", "is not a database URL", id="not-a-url"),
    pytest.param(f"postgresql//app:{SECRET}@db/app", "is not a database URL", id="missing-colon"),
    pytest.param(f"postgresql://app:{SECRET}@db:port/app", "is not a database URL", id="bad-port"),
    pytest.param(f"postgres ql://app:{SECRET}@with@at@db/app", "is not a database URL",
                 id="unparsed-password-with-at-signs"),
    pytest.param("", "leave it unset for the default", id="empty"),
    pytest.param("   ", "leave it unset for the default", id="blank"),
    pytest.param(5432, "got 5432", id="int"),
    pytest.param(b"sqlite://", "got b'sqlite://'", id="bytes"),
]


@pytest.mark.parametrize(("value", "problem"), BAD_DATABASE_URLS)
def test_a_bad_database_url_is_refused_naming_the_setting_never_the_password(value, problem):
    err = refused({"durable_database_url": value})
    assert_names(err, "durable_database_url")
    assert err.setting == "durable_database_url"
    assert problem in str(err), str(err)
    assert SECRET not in str(err) and SECRET not in repr(err)
    if isinstance(value, str) and "@" in value:
        assert "***@" in str(err), str(err)


def test_a_database_url_object_is_read_as_its_string():
    url = "postgresql+psycopg2://app:pw@db:5433/app"
    from sqlalchemy.engine import make_url

    assert from_celery_conf({"durable_database_url": make_url(url)}).database_url == url


@pytest.mark.parametrize("url", [
    "postgresql://app@db/app",
    "postgresql+psycopg2://app:pw@db:5433/app?sslmode=require",
    "sqlite://",
    "sqlite:///durable.sqlite",
    "sqlite:////var/lib/app/durable.sqlite",
    "sqlite+pysqlite:///durable.sqlite",
])
def test_postgresql_and_sqlite_urls_are_accepted(url):
    assert from_celery_conf({"durable_database_url": url}).database_url == url


def test_the_config_repr_does_not_show_the_database_password():
    config = from_celery_conf({"durable_database_url": f"postgresql://app:{SECRET}@db/app"})
    assert SECRET not in repr(config)


# -- durable_metrics_host / durable_metrics_port ----------------------------------------------------------

@pytest.mark.parametrize(("value", "problem"), [
    pytest.param(" ", "must be an IP address or a host name, got ' '", id="blank"),
    pytest.param("\t\n", "must be an IP address or a host name", id="whitespace"),
    pytest.param("0", "got '0' (shorthand for 0.0.0.0): write '0.0.0.0'", id="zero-shorthand"),
    pytest.param("127.1", "(shorthand for 127.0.0.1)", id="dotted-shorthand"),
    pytest.param("0x7f.1", "(shorthand for 127.0.0.1)", id="hex-shorthand"),
    pytest.param(" 127.0.0.1", "must be an IP address or a host name", id="leading-space"),
    pytest.param("127.0.0.1 ", "must be an IP address or a host name", id="trailing-space"),
    pytest.param("local host", "must be an IP address or a host name", id="space-inside"),
    pytest.param("[::1]", "without brackets", id="bracketed-ipv6"),
    pytest.param("http://localhost", "must be an IP address or a host name", id="a-url"),
    pytest.param("localhost:9100", "must be an IP address or a host name", id="host-with-port"),
    pytest.param("-bad.example", "must be an IP address or a host name", id="leading-hyphen"),
    pytest.param("a" * 64 + ".example", "must be an IP address or a host name", id="label-over-63"),
    pytest.param(None, "got None", id="none-direct"),
])
def test_a_bad_metrics_host_is_refused_naming_it(value, problem):
    with pytest.raises(ConfigInvalid) as caught:
        DurableConfig(metrics_host=value)
    assert_names(caught.value, "durable_metrics_host")
    assert problem in str(caught.value), str(caught.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "10.1.2.3", "fe80::1%lo", "localhost",
                                  "metrics.internal.example.com", "worker_1", "host-2."])
def test_good_metrics_hosts_are_accepted(host):
    assert from_celery_conf({"durable_metrics_host": host}).metrics_host == host


@pytest.mark.parametrize("value", [
    pytest.param("9100", id="string-port"),
    pytest.param("9100-", id="half-range"),
    pytest.param("9100..9109", id="dots"),
    pytest.param("9109-9100", id="reversed"),
    pytest.param("0-10", id="range-from-0"),
    pytest.param("65535-65536", id="range-past-65535"),
    pytest.param([9100], id="one-item-list"),
    pytest.param([9100, 9101, 9102], id="three-item-list"),
    pytest.param((9100, "9109"), id="string-in-tuple"),
    pytest.param((True, 9109), id="bool-in-tuple"),
    pytest.param((9100.0, 9109), id="float-in-tuple"),
    pytest.param({"first": 9100}, id="dict"),
    pytest.param(-9100, id="negative"),
])
def test_a_bad_metrics_port_or_range_is_refused_naming_it(value):
    err = refused({"durable_metrics_port": value})
    assert_names(err, "durable_metrics_port")
    assert repr(value) in str(err)


@pytest.mark.parametrize(("value", "port", "ports"), [
    pytest.param(9100, 9100, (9100, 9100), id="one-port"),
    pytest.param("9100-9109", (9100, 9109), (9100, 9109), id="range-string"),
    pytest.param(" 9100 - 9101 ", (9100, 9101), (9100, 9101), id="range-string-spaced"),
    pytest.param((9100, 9109), (9100, 9109), (9100, 9109), id="range-tuple"),
    pytest.param([9100, 9100], (9100, 9100), (9100, 9100), id="range-of-one"),
    pytest.param([1, 65535], (1, 65535), (1, 65535), id="every-port"),
])
def test_a_metrics_port_or_range_is_read(value, port, ports):
    config = from_celery_conf({"durable_metrics_port": value})
    assert config.metrics_port == port
    assert config.metrics_ports == ports
    assert from_celery_conf({}).metrics_ports is None


# -- a Celery namespace (Django's config_from_object(..., namespace="CELERY")) ---------------------------------


def _namespaced_app(**settings: Any) -> Celery:
    app = Celery("namespaced", set_as_current=False)
    app.config_from_object(SimpleNamespace(CELERY_BROKER_URL="memory://", **settings), namespace="CELERY")
    return app


def test_settings_under_a_namespace_are_read():
    config = from_celery_conf(_namespaced_app(CELERY_DURABLE_MAX_IN_FLIGHT=3).conf)
    assert config.max_in_flight == 3


@pytest.mark.parametrize("key", ["CELERY_DURABLE_MAX_INFLIGHT", "CELERY_Durable_max_in_flight",
                                 "CELERY_durable_max_in_flight"])
def test_a_misspelt_setting_under_a_namespace_is_refused_as_written(key):
    # Celery looks a namespaced setting up in the prefix's case only: the last two would be ignored too.
    with pytest.raises(ConfigInvalid) as caught:
        from_celery_conf(_namespaced_app(**{key: 4}).conf)
    assert caught.value.setting == key
    assert "is not a celery_durable setting" in str(caught.value)


def test_other_settings_under_a_namespace_are_not_ours_to_check():
    from_celery_conf(_namespaced_app(CELERY_TASK_ACKS_LATE=True, DURABLE_THING=1, CELERY_DURABLEX=2).conf)


# -- overrides (the worker's command-line options) -----------------------------------------------------------


def test_an_override_replaces_the_setting_and_is_checked_like_it():
    conf = {"durable_max_in_flight": 4, "durable_queue_concurrency": {"a": 1}}
    config = from_celery_conf(conf, {"durable_queue_concurrency": {"b": 2}})
    assert (config.max_in_flight, config.queue_slots) == (4, {"b": 2})
    with pytest.raises(ConfigInvalid, match="durable_max_in_flight must be a whole number >= 1, got 0"):
        from_celery_conf(conf, {"durable_max_in_flight": 0})


@pytest.mark.parametrize("value", [0, -1, 1.5, "100", True])
def test_the_beat_catch_up_bound_must_be_a_whole_number_of_at_least_one(value):
    assert_names(refused({"durable_beat_max_catch_up": value}), "durable_beat_max_catch_up")


@pytest.mark.parametrize("value", ["", 7, "x" * 201])
def test_the_beat_name_must_be_a_short_string(value):
    assert_names(refused({"durable_beat_name": value}), "durable_beat_name")


def test_the_beat_settings_default_to_a_ten_second_lease_and_a_hundred_catch_up_sends():
    config = from_celery_conf({})
    assert (config.beat_lease_ttl, config.beat_max_catch_up, config.beat_name) == (10.0, 100, None)



@pytest.mark.parametrize("token", ["short", 12345678, "  padded-token  ", ""])
def test_a_dashboard_token_that_is_no_secret_is_refused_without_echoing_it(token):
    with pytest.raises(ConfigInvalid, match="durable_dashboard_token") as refused:
        from_celery_conf({"durable_dashboard_token": token})
    assert str(token).strip() not in str(refused.value) or not str(token).strip()


def test_a_dashboard_token_is_kept_and_left_out_of_the_repr():
    config = from_celery_conf({"durable_dashboard_token": "a-long-enough-token"})
    assert config.dashboard_token == "a-long-enough-token" and "a-long-enough-token" not in repr(config)


@pytest.mark.parametrize("value", [-1, 1.5, "10000", True, None])
def test_the_broker_vacuum_threshold_must_be_a_whole_number_of_dead_rows(value):
    if value is None:
        assert from_celery_conf({}).broker_vacuum_dead_rows == 1_000  # unset: the default
        return
    assert_names(refused({"durable_broker_vacuum_dead_rows": value}), "durable_broker_vacuum_dead_rows")


def test_a_broker_vacuum_threshold_of_zero_leaves_the_table_to_autovacuum():
    assert from_celery_conf({"durable_broker_vacuum_dead_rows": 0}).broker_vacuum_dead_rows == 0


def test_the_task_names_limit_is_a_hundred_unless_told():
    assert from_celery_conf({}).metrics_task_names_limit == 100
    assert from_celery_conf({"durable_metrics_task_names_limit": 1}).metrics_task_names_limit == 1
    assert from_celery_conf({"durable_metrics_task_names_limit": 10_000}).metrics_task_names_limit == 10_000
