"""A ``durable+<database url>`` broker: its database is the store's unless the app names another."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_durable.config import from_celery_conf
from celery_durable.store.engine import store_url
from celery_durable.store.urls import broker_database


@pytest.mark.parametrize(("broker", "database"), [
    ("durable+postgresql://app@db/app", "postgresql://app@db/app"),
    ("durable+postgresql+psycopg2://app:pw@db:5433/app?sslmode=require",
     "postgresql+psycopg2://app:pw@db:5433/app?sslmode=require"),
    ("redis://localhost:6379/0", None),
    ("sqla+postgresql://app@db/app", None),
    (None, None),
])
def test_broker_database(broker: str | None, database: str | None) -> None:
    assert broker_database(broker) == database


def _app(**conf: object) -> SimpleNamespace:
    return SimpleNamespace(conf=conf)


def test_the_store_defaults_to_the_brokers_database() -> None:
    assert store_url(_app(broker_url="durable+postgresql://app@db/app")) == "postgresql://app@db/app"
    assert from_celery_conf({"broker_url": "durable+postgresql://app@db/app"}).database_url == \
        "postgresql://app@db/app"


def test_a_store_url_the_app_sets_wins_over_the_brokers() -> None:
    conf = {"broker_url": "durable+postgresql://app@db/app", "durable_database_url": "postgresql://other@db/x"}
    assert store_url(_app(**conf)) == "postgresql://other@db/x"
    assert from_celery_conf(conf).database_url == "postgresql://other@db/x"


def test_another_broker_leaves_the_default_store() -> None:
    assert from_celery_conf({"broker_url": "redis://localhost:6379/0"}).database_url is None

