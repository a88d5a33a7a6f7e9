"""What the durable end-to-end tests share: a scenario on a fresh store, and readers of runs, effects and metrics."""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_durable.broker import register
from celery_durable.store.engine import engine_for, ensure_schema
from tests.e2e.durableapp import EFFECTS_DDL
from tests.e2e.harness import Scenario
from tests.services import broker_url
from tests.stores import fresh_store

APP = "tests.e2e.durableapp"

MakeScenario = Callable[..., tuple[Scenario, str]]


@pytest.fixture
def durable_scenario(tmp_path: Path) -> Iterator[MakeScenario]:
    """make(store_kind, broker_kind="redis") -> (Scenario with one queue "q", store URL); cleaned up after.

    ``broker_kind="postgresql"`` or ``"sqlite"``: the broker that claims rows (``durable+<store URL>``) on the
    store's database (of the same kind)."""
    made: list[Scenario] = []
    stores: list[Any] = []

    def make(kind: str, broker_kind: str = "redis") -> tuple[Scenario, str]:
        store = fresh_store(kind, tmp_path)
        url = store.__enter__()
        stores.append(store)
        ensure_schema(url)
        with engine_for(url).begin() as conn:
            conn.exec_driver_sql(EFFECTS_DDL)
        if broker_kind in ("postgresql", "sqlite"):
            # The broker that claims rows, on the store's own database.
            assert kind == broker_kind, f"the {broker_kind} broker runs on a {broker_kind} store, not {kind}"
            register()
            s = Scenario(broker_kind, f"durable+{url}", ["q"])
        else:
            s = Scenario(broker_kind, broker_url(broker_kind), ["q"])
        made.append(s)
        return s, url

    yield make
    for s in made:
        s.cleanup()
    for store in stores:
        store.__exit__(None, None, None)


def conf(url: str, **extra: object) -> dict[str, Any]:
    return {"durable_database_url": url, **extra}


def effects(url: str, run_id: str) -> dict[str, int]:
    """How many times each step's fn ran for ``run_id`` (rows in e2e_effects)."""
    with engine_for(url).connect() as conn:
        rows = conn.execute(sa.text("SELECT step, count(*) FROM e2e_effects WHERE run_id = :r GROUP BY step"),
                            {"r": run_id})
        return {step: int(n) for step, n in rows}


def run_state(url: str, run_id: str) -> str | None:
    with engine_for(url).connect() as conn:
        return conn.execute(sa.text("SELECT state FROM durable_runs WHERE id = :r"), {"r": run_id}).scalar()


def run_row(url: str, run_id: str) -> Any:
    with engine_for(url).connect() as conn:
        return conn.execute(sa.text("SELECT * FROM durable_runs WHERE id = :r"), {"r": run_id}).one_or_none()


def free_port() -> int:
    """A port nothing listens on now, for a worker's metrics endpoint."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def jobs_total(port: int, queue: str, outcome: str) -> float:
    """``jobs_total{queue,outcome}`` as the worker's metrics endpoint serves it over HTTP (0 if absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf'^jobs_total\{{outcome="{outcome}",queue="{re.escape(queue)}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def operator_app(s: Scenario, url: str) -> Any:
    """An app as an operator's shell would have it: the scenario's broker, the durable store."""
    from celery import Celery

    import celery_durable

    operator = Celery("operator", broker=s.broker_url)
    celery_durable.install(operator)
    operator.conf.durable_database_url = url
    return operator
