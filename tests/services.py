"""Real-service fixtures: skip on a laptop without the service, FAIL under CI=true."""

from __future__ import annotations

import os

import pytest


def _own_redis_database() -> int:
    """One Redis database per pytest-xdist process (gw0 → 1, gw1 → 2, …; 0 without xdist).

    Redis keeps one ``unacked`` hash per database, shared by every worker on it, and a worker
    restores any unacked message older than its own ``visibility_timeout``, stock kombu's rule.
    Tests of that timeout set it to seconds: run beside them on one database, a stock worker's
    prefetched messages went back to the queue while it still held them and ran twice (the CI run
    of 10d149b: ``test_stock_prefetch_makes_a_short_task_wait_behind_the_long_one[redis]``, 13
    runs of 12). Tests in one process run one after another, so a database each keeps them apart.
    Databases 14 and 15 belong to the benchmarks and to the observation channel.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return 0
    database = int(worker[2:]) + 1
    if database >= 14:
        raise RuntimeError(f"pytest-xdist process {worker} has no Redis database of its own (1..13)")
    return database


REDIS_URL = os.environ.get("DURABLE_TEST_REDIS_URL", f"redis://127.0.0.1:6379/{_own_redis_database()}")
AMQP_URL = os.environ.get("DURABLE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
OBSERVE_URL = os.environ.get("DURABLE_TEST_OBSERVE_URL", "redis://127.0.0.1:6379/15")
POSTGRES_URL = os.environ.get("DURABLE_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require(service: str, problem: str | None) -> None:
    if problem is None:
        return
    message = f"{service} is not reachable: {problem}"
    if in_ci():
        pytest.fail(f"{message} (under CI=true a missing service is a failure)")
    pytest.skip(message)


def redis_problem(url: str = REDIS_URL) -> str | None:
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        return repr(exc)
    return None


def amqp_problem(url: str = AMQP_URL) -> str | None:
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the reason the service is missing
        return repr(exc)
    return None


def broker_url(kind: str) -> str:
    if kind == "redis":
        require("Redis", redis_problem())
        require("Redis (observation)", redis_problem(OBSERVE_URL))
        return REDIS_URL
    if kind == "rabbitmq":
        require("RabbitMQ", amqp_problem())
        require("Redis (observation)", redis_problem(OBSERVE_URL))
        return AMQP_URL
    raise ValueError(kind)


def postgres_problem(url: str = POSTGRES_URL) -> str | None:
    import sqlalchemy as sa

    engine = sa.create_engine(url, connect_args={"connect_timeout": 2})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the reason the service is missing
        return repr(exc)
    finally:
        engine.dispose()
    return None


def postgres_url() -> str:
    require("PostgreSQL", postgres_problem())
    return POSTGRES_URL
