"""compat.pool_alias: ``-P durable`` and ``worker_pool = "durable"`` resolve through Celery's own pool table."""

from __future__ import annotations

from types import SimpleNamespace

import click
import pytest
from celery import concurrency
from celery.bin import worker as worker_cli

from celery_durable.compat.pool_alias import register_pool_alias
from celery_durable.worker.boot import POOL_ALIAS, POOL_PATH
from celery_durable.worker.prefork import DurablePool

#: An alias of the tests' own, so registering it leaves "durable" as the package set it.
ALIAS = "durable-compat-test"


@pytest.fixture(autouse=True)
def restored_pool_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's pool table and ``-P`` choices come back as they were after each test."""
    monkeypatch.setattr(concurrency, "ALIASES", dict(concurrency.ALIASES))
    monkeypatch.setattr(worker_cli.WORKERS_POOL, "choices", tuple(worker_cli.WORKERS_POOL.choices))


def _cli_context(worker_pool: str | None = None) -> click.Context:
    # WorkersPool.convert reads ctx.obj.app.conf.worker_pool (Celery's CLIContext holds the app).
    app = SimpleNamespace(conf=SimpleNamespace(worker_pool=worker_pool))
    return click.Context(click.Command("worker"), obj=SimpleNamespace(app=app))


def test_celery_concurrency_aliases_resolve_a_registered_alias() -> None:
    register_pool_alias(ALIAS, POOL_PATH)
    assert concurrency.get_implementation(ALIAS) is DurablePool
    assert ALIAS in concurrency.get_available_pool_names()


def test_celery_concurrency_aliases_resolve_durable_once_the_package_is_imported() -> None:
    register_pool_alias(POOL_ALIAS, POOL_PATH)
    assert concurrency.get_implementation("durable") is DurablePool


def test_workers_pool_choices_take_an_alias_registered_after_the_worker_command_was_imported() -> None:
    assert ALIAS not in worker_cli.WORKERS_POOL.choices
    register_pool_alias(ALIAS, POOL_PATH)
    assert ALIAS in worker_cli.WORKERS_POOL.choices
    # What `celery worker -P <alias>` does with the option's value.
    assert worker_cli.WORKERS_POOL.convert(ALIAS, None, _cli_context()) is DurablePool


def test_workers_pool_choices_refuse_an_alias_never_registered() -> None:
    with pytest.raises(click.BadParameter):
        worker_cli.WORKERS_POOL.convert(ALIAS, None, _cli_context())


def test_workers_pool_choices_come_from_the_aliases_when_the_worker_command_is_imported() -> None:
    # The other order: a WorkersPool made after the alias was added lists it by itself.
    register_pool_alias(ALIAS, POOL_PATH)
    assert ALIAS in worker_cli.WorkersPool().choices


def test_workers_pool_resolves_worker_pool_setting_durable() -> None:
    register_pool_alias(POOL_ALIAS, POOL_PATH)
    # `celery worker` without -P gets "prefork" and then follows the worker_pool setting.
    assert worker_cli.WORKERS_POOL.convert("prefork", None, _cli_context("durable")) is DurablePool
