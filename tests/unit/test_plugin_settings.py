"""The pytest plugin's plan of a test's settings, and putting the app back after the test."""

from __future__ import annotations

from celery import Celery

from celery_durable.testing.app_settings import DEFAULT_RESULT_BACKEND, TestAppSettings, settings_for_test

BROKER = "durable+sqlite:///t/store.sqlite"
STORE = "sqlite:///t/store.sqlite"


def test_an_app_without_a_result_backend_gets_one_and_an_app_with_one_keeps_it() -> None:
    bare = settings_for_test({"result_backend": None}, broker_url=BROKER, store_url=STORE, conf={}, in_process=False)
    assert bare == {"broker_url": BROKER, "durable_database_url": STORE, "result_backend": DEFAULT_RESULT_BACKEND}
    own = settings_for_test({"result_backend": "redis://"}, broker_url=BROKER, store_url=STORE, conf={},
                            in_process=False)
    assert "result_backend" not in own


def test_in_process_runs_on_threads_and_leaves_the_root_logger_alone_unless_the_test_says() -> None:
    plan = settings_for_test({}, broker_url=BROKER, store_url=STORE, conf={}, in_process=True)
    assert plan["durable_execution"] == "threads" and plan["worker_hijack_root_logger"] is False
    told = settings_for_test({}, broker_url=BROKER, store_url=STORE,
                             conf={"durable_execution": "prefork", "result_backend": "db+sqlite:///r"},
                             in_process=True)
    assert told["durable_execution"] == "prefork" and told["result_backend"] == "db+sqlite:///r"


def test_restore_gives_the_app_its_settings_back_and_drops_what_it_cached_for_the_test() -> None:
    app = Celery("plugin-settings", broker="memory://first/", backend="cache+memory://")
    first_pool = app.pool
    first_backend = app.backend
    applied = TestAppSettings(app, {"broker_url": "memory://second/", "durable_database_url": STORE,
                                    "result_backend": "rpc://"})
    assert app.pool is not first_pool and app.pool.connection.hostname == "second"
    assert type(app.backend).__name__ == "RPCBackend"
    assert app.conf.durable_database_url == STORE

    applied.restore()

    assert app.conf.broker_url == "memory://first/" and "durable_database_url" not in app.conf
    assert app.backend is not first_backend and type(app.backend).__name__ == "CacheBackend"
    assert app.pool.connection.hostname == "first"


def test_a_broker_used_by_an_earlier_test_can_be_used_again() -> None:
    app = Celery("plugin-settings-again", broker="memory://first/")
    for _ in range(2):
        applied = TestAppSettings(app, {"broker_url": "memory://again/"})
        with app.pool.acquire(block=True, timeout=1) as connection:
            connection.default_channel.queue_declare("again")
        applied.restore()
